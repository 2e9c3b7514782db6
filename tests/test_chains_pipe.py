"""Chains whose steps pass their return values on (``chain(..., pipe=True)``), with a worker in this process."""

from __future__ import annotations

import datetime as dt
import decimal
import json

import pytest
from django.test import override_settings

from django_dbqueue import chain, job
from django_dbqueue.models import FailedJob, Job
from django_dbqueue.registry import JobCall
from tests.conftest import run_worker
from tests.testapp.models import Order, Run

pytestmark = pytest.mark.django_db(transaction=True)


@job(name="tests.pipe.start")
def start(number: str) -> dict[str, object]:
    return {"number": number, "due": dt.date(2031, 5, 6), "total": decimal.Decimal("12.50")}


@job(name="tests.pipe.make_order")
def make_order(data: dict[str, object], suffix: str = "") -> Order:
    assert data["due"] == dt.date(2031, 5, 6) and data["total"] == decimal.Decimal("12.50")
    return Order.objects.create(number=f"{data['number']}{suffix}")


@job(name="tests.pipe.note_order")
def note_order(order: Order) -> None:
    Run.objects.create(key=f"pipe-{order.number}", note=type(order).__name__)


@job(name="tests.pipe.no_argument")
def no_argument() -> None:
    """Takes nothing: it cannot follow a step in a piped chain."""


@job(name="tests.pipe.big")
def big(size: int) -> str:
    return "x" * size


@job(name="tests.pipe.repeat")
def repeat(text: str, times: int = 50) -> str:
    Run.objects.create(key=f"repeat-{len(text)}")
    return text * times


@job(name="tests.pipe.to_set")
def to_set(text: str) -> set[str]:
    return {text}


@job(name="tests.pipe.takes_text")
def takes_text(text: str) -> None:
    Run.objects.create(key=f"text-{len(text)}")


@job(name="tests.pipe.returns_a_set")
def returns_a_set() -> set[int]:
    return {1, 2}


def test_each_step_of_a_piped_chain_receives_the_return_value_of_the_one_before():
    pipeline = chain(start.bind("P-1"), make_order, note_order, pipe=True)
    pipeline.enqueue()
    run_worker()
    # The date and decimal of step 1 reached step 2; step 2's Order reached step 3 as an instance.
    assert Run.objects.get(key="pipe-P-1").note == "Order"
    assert Order.objects.filter(number="P-1").count() == 1
    assert not Job.objects.exists() and not FailedJob.objects.exists()


def test_a_piped_steps_bound_arguments_follow_the_passed_value():
    # A call built without bind's check, as a partial one: the chain checks it with the value.
    pipeline = chain(start.bind("P-2"), JobCall(make_order, ("-b",), {}), note_order, pipe=True)
    pipeline.enqueue()
    run_worker(once=True)
    second = Job.objects.get()
    envelope = json.loads(second.payload)
    assert envelope["args"][1] == "-b" and envelope["args"][0]["number"] == "P-2"
    assert envelope["chain"] == {"id": pipeline.id, "step": 2, "total": 3, "pipe": True}
    run_worker()
    assert Run.objects.filter(key="pipe-P-2-b").exists()


def test_a_chain_without_pipe_passes_nothing_on():
    pipeline = chain(start.bind("P-3"), no_argument)
    assert not pipeline.pipe
    pipeline.enqueue()
    run_worker()
    assert not Job.objects.exists() and not FailedJob.objects.exists()


def test_a_piped_step_whose_function_cannot_take_the_value_is_refused_when_the_chain_is_built():
    with pytest.raises(TypeError) as refused:
        chain(start.bind("P-4"), make_order, no_argument, pipe=True)
    message = str(refused.value)
    assert "Cannot chain tests.pipe.no_argument as step 3 with pipe=True" in message
    assert "return value of step 2" in message and "too many positional arguments" in message
    assert not Job.objects.exists()


def test_a_piped_result_that_cannot_be_encoded_fails_the_step_that_returned_it():
    chain(returns_a_set, takes_text, pipe=True).enqueue()
    run_worker()
    failed = FailedJob.objects.get()
    assert failed.name == "tests.pipe.returns_a_set"
    assert failed.exception_class == "django_dbqueue.exceptions.PayloadError"
    assert "cannot be passed on to tests.pipe.takes_text" in failed.error
    assert "the return value is of type set" in failed.error
    # The rest of the chain stays visible in the failed step's envelope.
    assert [step["name"] for step in json.loads(failed.payload)["next"]] == ["tests.pipe.takes_text"]
    assert not Job.objects.exists() and not Run.objects.exists()


@override_settings(DBQUEUE={"MAX_PAYLOAD_SIZE": 4096})
def test_a_piped_result_too_large_for_the_next_steps_payload_fails_the_step_that_returned_it():
    chain(big.bind(100), repeat, takes_text, pipe=True).enqueue()
    run_worker()
    # Step 1's 100 characters passed on; step 2's 5,000 did not.
    assert Run.objects.filter(key="repeat-100").exists()
    failed = FailedJob.objects.get()
    assert failed.name == "tests.pipe.repeat" and json.loads(failed.payload)["args"] == ["x" * 100]
    assert failed.exception_class == "django_dbqueue.exceptions.PayloadTooLarge"
    assert "the return value of tests.pipe.repeat" in failed.error
    assert "cannot be passed on to tests.pipe.takes_text" in failed.error
    assert "over DBQUEUE['MAX_PAYLOAD_SIZE'] (4,096 bytes)" in failed.error
    assert not Job.objects.exists() and not Run.objects.filter(key="text-5000").exists()


def test_the_last_step_of_a_piped_chain_returns_what_it_likes():
    chain(big.bind(3), to_set, pipe=True).enqueue()
    run_worker()
    assert not FailedJob.objects.exists() and not Job.objects.exists()
