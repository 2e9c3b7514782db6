"""The JSON envelope (unit tests, no database), and model references a job may fetch."""

import datetime as dt
import decimal
import json
import uuid

import pytest
from django.contrib.auth.models import User
from django.db import models

from django_dbqueue import chain, enqueue_many, payload
from django_dbqueue.exceptions import PayloadError
from django_dbqueue.models import FailedJob, Job
from tests.conftest import run_worker
from tests.testapp import jobs
from tests.testapp.models import Order, Run


def roundtrip(*args, **kwargs):
    envelope = payload.decode(payload.encode(args, kwargs))
    return tuple(envelope["args"]), envelope["kwargs"]


def test_plain_json_values_are_stored_as_they_are():
    stored = json.loads(payload.encode((1, "a", None, True, 1.5, [1, 2], {"k": "v"}), {}))
    assert stored["args"] == [1, "a", None, True, 1.5, [1, 2], {"k": "v"}]


@pytest.mark.parametrize(
    "value",
    [
        dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC),
        dt.datetime(2026, 1, 2, 3, 4, 5),
        dt.datetime(2026, 1, 2, 3, 4, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30))),
        dt.date(2026, 2, 28),
        dt.time(23, 59, 1, 5),
        dt.timedelta(days=-1, seconds=5, microseconds=7),
        decimal.Decimal("1.10"),
        decimal.Decimal("-0.000000001"),
        uuid.UUID("12345678-1234-5678-1234-567812345678"),
        (1, (2, "x")),
        {"nested": [dt.date(2026, 1, 1), {"d": decimal.Decimal("2.5")}]},
    ],
)
def test_typed_values_round_trip_with_their_type(value):
    args, kwargs = roundtrip(value, key=value)
    assert args == (value,) and type(args[0]) is type(value)
    assert kwargs == {"key": value}


def test_a_dict_using_the_marker_key_round_trips():
    value = {"__dbq__": "datetime", "v": "not a date", "other": [1]}
    assert roundtrip(value)[0] == (value,)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((object(),), {}, "argument 0 (args[0]) is of type object"),
        ((), {"when": {1, 2}}, "argument 'when' is of type set"),
        ((), {"data": {"items": [1, b"raw"]}}, "argument 'data'['items'][1] is of type bytes"),
        ((), {"data": {1: "x"}}, "argument 'data' has the key 1 of type int"),
        ((float("nan"),), {}, "argument 0 (args[0]) is nan"),
    ],
)
def test_an_argument_that_cannot_be_stored_raises_a_type_error_naming_it(args, kwargs, message):
    with pytest.raises(TypeError) as info:
        payload.encode(args, kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("stored", "message"),
    [
        ("{not json", "the payload is not valid JSON"),
        ("[1, 2]", "the payload is not a job envelope"),
        ('{"args": {}, "kwargs": {}}', "the payload is not a job envelope"),
        ('{"args": [{"__dbq__": "decimal", "v": "abc"}], "kwargs": {}}', "the stored decimal value 'abc' is malformed"),
        ('{"args": [{"__dbq__": "pickle", "v": "x"}], "kwargs": {}}', "unknown value tag 'pickle'"),
    ],
)
def test_a_corrupt_payload_raises_a_payload_error_that_says_what_is_wrong(stored, message):
    with pytest.raises(PayloadError) as info:
        payload.decode(stored)
    assert message in str(info.value)


def test_options_are_stored_beside_the_arguments_and_none_is_left_out():
    stored = json.loads(payload.encode((), {}, backoff=[1, 2], other=None))
    assert stored == {"v": 1, "args": [], "kwargs": {}, "backoff": [1, 2]}


def test_pretty_indents_json_and_leaves_other_text_alone():
    assert payload.pretty('{"b":1,"a":2}') == '{\n  "a": 2,\n  "b": 1\n}'
    assert payload.pretty("{broken") == "{broken"


# -- model references: fetched only for a model the job declares -------------------------------


def _declared(source: str, *, result: bool = False) -> payload.Declared:
    """The models a function written in ``source`` (as ``f``) declares; ``Order`` and ``models`` in scope."""
    namespace: dict[str, object] = {"Order": Order, "models": models}
    exec(source, namespace)
    return payload.declared_models(namespace["f"], result=result)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "source",
    [
        "def f(order: Order): ...",
        "def f(order: Order | None = None): ...",
        "def f(orders: list[Order], note: str = ''): ...",
        "def f(*orders: Order): ...",
        "def f(**by_name: dict[str, tuple[Order, int]]): ...",
        "def f(order: 'Order'): ...",
    ],
)
def test_a_model_named_in_a_parameters_annotation_is_declared(source):
    declared = _declared(source)
    assert declared.admits(Order)
    assert not declared.admits(User)


@pytest.mark.parametrize(
    "source",
    [
        "def f(order): ...",
        "def f(order: object, other: 'typing.Any' = None): ...",
        "def f(order_id: int) -> Order: ...",
    ],
)
def test_a_job_whose_parameters_name_no_model_declares_none(source):
    declared = _declared(source)
    assert not declared.admits(Order) and declared.describe() == "it declares no model"


def test_the_return_annotation_declares_the_models_of_a_result():
    declared = _declared("def f(order_id: int) -> Order | None: ...", result=True)
    assert declared.admits(Order) and not declared.admits(User)


def test_models_model_declares_every_model():
    assert _declared("def f(instance: models.Model): ...").admits(User)


def test_an_annotation_that_does_not_resolve_declares_the_model_class_it_names():
    # ``Missing`` fails get_type_hints (a model imported under ``if TYPE_CHECKING``).
    declared = _declared("def f(order: 'Order', other: 'Missing | None' = None): ...")
    assert declared.admits(Order) and not declared.admits(User)
    assert declared.describe() == "it declares Order"


@pytest.mark.django_db
def test_a_reference_to_a_model_the_job_does_not_declare_is_refused_before_any_query(django_assert_num_queries):
    envelope = payload.decode('{"args": [{"__dbq__": "model", "v": ["auth.user", 1]}], "kwargs": {}}')
    with django_assert_num_queries(0), pytest.raises(PayloadError) as info:
        payload.arguments(envelope, jobs.touch_order.func)
    assert str(info.value).startswith(
        "a stored argument refers to the model auth.user, which touch_order() does not declare "
        "(it declares testapp.order): a model instance is fetched only for a model"
    )
    with django_assert_num_queries(0), pytest.raises(PayloadError, match=r"auth\.user, which this job does not"):
        payload.arguments(envelope)


@pytest.mark.django_db(transaction=True)
def test_a_forged_reference_fails_that_job_for_good_and_the_worker_goes_on():
    """A row written by hand (the admin, a database user) that names ``auth.User`` pk 1 for a
    job that takes an ``Order``: the user is never fetched nor passed to the job."""
    user = User.objects.create(username="admin", is_superuser=True)
    order = Order.objects.create(number="F-1")
    forged = jobs.touch_order.enqueue(order)
    Job.objects.filter(pk=forged.id).update(
        payload=json.dumps({"v": 1, "args": [{"__dbq__": "model", "v": ["auth.user", user.pk]}], "kwargs": {}})
    )
    jobs.touch_order.enqueue(order)
    run_worker()
    failed = FailedJob.objects.get()
    assert (failed.job_id, failed.attempts) == (forged.id, 1)
    assert failed.exception_class == "django_dbqueue.exceptions.PayloadError"
    assert "refers to the model auth.user, which touch_order() does not declare (it declares testapp.order)" in (
        failed.error
    )
    # The honest job ran; the forged one never did.
    assert list(Run.objects.values_list("key", "note")) == [(f"order-{order.pk}", "F-1")]


def test_with_its_job_an_enqueue_refuses_a_model_instance_the_job_does_not_declare():
    order = Order(pk=7, number="E-1")
    assert payload.encode_arguments((order,), {}, jobs.touch_order.func)["args"] == [
        {"__dbq__": "model", "v": ["testapp.order", 7]}
    ]
    with pytest.raises(TypeError) as info:
        payload.encode_arguments((), {"items": [order]}, jobs.echo.func)
    assert str(info.value) == (
        "argument 'items'[0] is a testapp.order instance, which echo() does not declare (it declares no model); "
        "annotate the parameter with its model (order: Order), or pass the pk"
    )
    # Without the job, as before: the worker refuses it when it runs.
    assert payload.encode_arguments((order,), {})["args"][0]["v"] == ["testapp.order", 7]


@pytest.mark.django_db
def test_enqueue_enqueue_many_and_a_chain_refuse_a_model_instance_the_job_does_not_declare():
    order = Order.objects.create(number="E-2")
    message = r"Cannot enqueue .*echo: argument 0 \(args\[0\]\) is a testapp.order instance, which echo\(\) does not"
    with pytest.raises(TypeError, match=message):
        jobs.echo.enqueue(order)
    with pytest.raises(TypeError, match=message):
        enqueue_many([jobs.echo.bind(order)])
    with pytest.raises(TypeError, match=message):
        chain(jobs.touch_order.bind(order), jobs.echo.bind(order)).enqueue()
    assert not Job.objects.exists()
    assert jobs.touch_order.enqueue(order).id
