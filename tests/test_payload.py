"""Unit tests of the JSON envelope: no database."""

import datetime as dt
import decimal
import json
import uuid

import pytest

from django_dbqueue import payload
from django_dbqueue.exceptions import PayloadError


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
