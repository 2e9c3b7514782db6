"""Arguments a job's function cannot take are refused at enqueue, naming the job and the parameter."""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import inspect
import itertools
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_dbqueue import JobContext, batch, chain, enqueue_many, job, registry, validation
from django_dbqueue.exceptions import PayloadError
from django_dbqueue.execution import check_signature
from django_dbqueue.models import Job
from django_dbqueue.schedules import all_schedules, periodic, unschedule, usable
from tests.testapp import jobs


def send_receipt(order_id: int, *, resend: bool = False) -> None:
    """A job's function, registered per test by ``receipt``."""


def greet(context: JobContext, name: str, /, greeting: str = "Hello") -> str:
    return f"{greeting}, {name}"


@pytest.fixture
def receipt():
    definition = job(name="tests.enqueue_errors.send_receipt")(send_receipt)
    yield definition
    registry.unregister(definition.name)


@pytest.fixture
def greeter():
    definition = job(name="tests.enqueue_errors.greet", takes_context=True)(greet)
    yield definition
    registry.unregister(definition.name)


PARAMETERS = "its parameters are (order_id, *, resend=False)"


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {}, f"missing the required argument 'order_id'; {PARAMETERS}"),
        ((1, 2), {}, f"too many positional arguments: 2 given, it takes 1; {PARAMETERS}"),
        ((1,), {"resnd": True}, f"an unexpected keyword argument 'resnd' (did you mean 'resend'?); {PARAMETERS}"),
        ((1,), {"colour": "red"}, f"an unexpected keyword argument 'colour'; {PARAMETERS}"),
        (
            (1,),
            {"order_id": 2},
            f"multiple values for the argument 'order_id', by position and by keyword; {PARAMETERS}",
        ),
    ],
)
def test_enqueue_refuses_arguments_the_function_cannot_take(receipt, args, kwargs, message):
    with pytest.raises(TypeError) as info:
        receipt.enqueue(*args, **kwargs)
    assert str(info.value) == f"Cannot enqueue tests.enqueue_errors.send_receipt: {message}"


@pytest.mark.django_db
def test_nothing_is_stored_when_the_arguments_are_refused(receipt):
    with pytest.raises(TypeError, match="missing the required argument 'order_id'"):
        receipt.enqueue(resend=True)
    receipt.enqueue(order_id=7, resend=True)  # by keyword: fine
    assert Job.objects.count() == 1


def test_every_path_to_a_row_checks_the_arguments(receipt):
    paths = {
        "enqueue": lambda: receipt.enqueue(1, 2),
        "using": lambda: receipt.using(queue="emails", priority=5).enqueue(1, 2),
        "aenqueue": lambda: asyncio.run(receipt.aenqueue(1, 2)),
        "bind": lambda: receipt.bind(1, 2),
        "enqueue_many": lambda: enqueue_many([receipt.bind(1), receipt.bind(1, 2)]),
        "enqueue_many of a generator": lambda: enqueue_many(receipt.bind(*([1] * n)) for n in (1, 2)),
        "chain step": lambda: chain(jobs.record.bind("first"), receipt.bind(1, 2)),
        "chain of a bare definition": lambda: chain(jobs.record.bind("first"), receipt),
        "then": lambda: jobs.record.bind("first").then(receipt.bind(1, 2)),
        "on_failure": lambda: jobs.record.bind("first").on_failure(receipt.bind(1, 2)),
        "batch member": lambda: batch(receipt.bind(1), receipt.bind(1, 2)),
        "batch callback": lambda: batch(receipt.bind(1)).then(receipt.bind()),
    }
    for path, attempt in paths.items():
        with pytest.raises(TypeError, match=r"^Cannot enqueue tests\.enqueue_errors\.send_receipt: ") as info:
            attempt()
        assert "order_id" in str(info.value), path


def test_a_schedule_whose_arguments_do_not_fit_is_refused_where_it_is_declared(receipt):
    with pytest.raises(ImproperlyConfigured, match=r"send_receipt: too many positional"):
        periodic(receipt, every=60, args=(1, 2), name="tests.enqueue_errors.hourly")
    assert "tests.enqueue_errors.hourly" not in all_schedules()


def test_a_schedule_declared_by_name_whose_arguments_do_not_fit_is_not_ticked(receipt, caplog):
    schedule = periodic(receipt.name, every=60, args=(1, 2), name="tests.enqueue_errors.by_name")
    try:
        with pytest.raises(TypeError, match=r"Cannot enqueue tests\.enqueue_errors\.send_receipt: too many positional"):
            schedule.call(dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
        assert usable({schedule.name: schedule}) == {}
        assert "schedule not ticked schedule=tests.enqueue_errors.by_name" in caplog.text
    finally:
        unschedule(schedule.name)


def test_a_schedules_tick_argument_counts_as_a_keyword(receipt):
    schedule = periodic(receipt, every=60, args=(1,), tick_argument="resend", name="tests.enqueue_errors.tick")
    try:
        call = schedule.call(dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
        assert call.args == (1,) and isinstance(call.kwargs["resend"], dt.datetime)
    finally:
        unschedule(schedule.name)


def test_a_context_job_is_bound_without_its_context(greeter):
    assert greeter.bind("Ada").args == ("Ada",)
    assert greeter.bind("Ada", greeting="Hi").kwargs == {"greeting": "Hi"}
    parameters = "its parameters are (name, /, greeting='Hello')"
    with pytest.raises(TypeError) as info:
        greeter.bind()
    assert (
        str(info.value)
        == f"Cannot enqueue tests.enqueue_errors.greet: missing the required argument 'name'; {parameters}"
    )
    with pytest.raises(TypeError, match=r"the argument 'name' is positional-only, but was passed by keyword"):
        greeter.bind(name="Ada")
    with pytest.raises(TypeError, match=r"too many positional arguments: 3 given, it takes 2"):
        greeter.bind(JobContext, "Ada", "Hi")  # as if passing the context


def test_a_function_with_star_args_and_star_kwargs_takes_anything():
    assert jobs.echo.bind(1, 2, 3, flag=True, other=None).kwargs == {"flag": True, "other": None}


def test_several_missing_arguments_are_named_together():
    with pytest.raises(TypeError, match=r"missing the required arguments 'a' and 'b'; its parameters are \(a, b\)"):
        jobs.add.bind()


def test_a_decorated_function_is_checked_against_the_signature_it_wraps():
    def logged(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            return func(*args, **kwargs)

        return wrapper

    definition = registry.JobDefinition(func=logged(send_receipt), name="tests.enqueue_errors.logged")
    with pytest.raises(TypeError, match="missing the required argument 'order_id'"):
        definition.bind()


def test_a_callable_without_a_readable_signature_is_not_checked():
    class Opaque:
        __signature__ = "unreadable"  # inspect.signature raises, as for some C functions

        def __call__(self, *args: Any) -> None: ...

    registry.JobDefinition(func=Opaque(), name="tests.enqueue_errors.opaque").bind(1, 2, anything=3)


def test_an_unhashable_callable_is_checked_all_the_same():
    class Unhashable:
        __hash__ = None

        def __call__(self, value: int) -> None: ...

    odd = registry.JobDefinition(func=Unhashable(), name="tests.enqueue_errors.unhashable")
    odd.bind(1)
    with pytest.raises(TypeError, match="missing the required argument 'value'"):
        odd.bind()


def test_a_stored_row_that_no_longer_fits_still_fails_when_it_runs(greeter):
    # Enqueue refuses such calls; a row written by older code or by hand meets the worker's check.
    with pytest.raises(PayloadError) as info:
        check_signature(greeter, ("Ada", "Hi", "extra"), {})
    assert "the stored arguments no longer match tests.enqueue_errors.greet(): too many positional" in str(info.value)
    check_signature(greeter, ("Ada",), {"greeting": "Hi"})  # the context is not among the stored arguments


# -- the check agrees with Python's own binding ------------------------------------


def _p(name: str, kind: inspect._ParameterKind, default: Any = inspect.Parameter.empty) -> inspect.Parameter:
    return inspect.Parameter(name, kind, default=default)


K = inspect.Parameter
SIGNATURES = [
    inspect.Signature([]),
    inspect.Signature([_p("a", K.POSITIONAL_OR_KEYWORD), _p("b", K.POSITIONAL_OR_KEYWORD, 1)]),
    inspect.Signature([_p("a", K.POSITIONAL_ONLY), _p("b", K.POSITIONAL_OR_KEYWORD), _p("c", K.KEYWORD_ONLY)]),
    inspect.Signature([_p("a", K.POSITIONAL_ONLY, 0), _p("kw", K.VAR_KEYWORD)]),
    inspect.Signature([_p("a", K.POSITIONAL_OR_KEYWORD), _p("rest", K.VAR_POSITIONAL), _p("c", K.KEYWORD_ONLY, 2)]),
    inspect.Signature([_p("a", K.POSITIONAL_ONLY), _p("b", K.POSITIONAL_ONLY, 1), _p("c", K.KEYWORD_ONLY)]),
]
CALLS = [
    (args, dict(kwargs))
    for args in ((), (1,), (1, 2), (1, 2, 3))
    for kwargs in itertools.chain.from_iterable(
        itertools.combinations([("a", 0), ("b", 0), ("c", 0), ("d", 0)], n) for n in range(5)
    )
]


@pytest.mark.parametrize("signature", SIGNATURES, ids=str)
def test_the_check_accepts_exactly_the_calls_python_accepts(signature):
    shape = validation.CallShape(signature)
    for args, kwargs in CALLS:
        try:
            signature.bind(*args, **kwargs)
        except TypeError:
            accepted = False
        else:
            accepted = True
        assert (shape.error(args, kwargs) is None) == accepted, (args, kwargs)
