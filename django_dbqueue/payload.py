"""JSON encoding of job arguments and the envelope stored in ``Job.payload``.

Values JSON has no type for are stored as ``{"__dbq__": <tag>, "v": <value>}``: datetimes,
dates, times, timedeltas, decimals, UUIDs, tuples, and model instances (a reference, fetched when
the job runs, and only for a model the job declares: anyone who can write the table writes rows).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import functools
import inspect
import json
import re
import typing
import uuid
from collections.abc import Callable
from typing import Any

from django.apps import apps
from django.db import models

from . import conf
from .exceptions import ModelReferenceMissing, PayloadError, PayloadTooLarge

TAG = "__dbq__"
VERSION = 1


def _describe(value: Any) -> str:
    return type(value).__qualname__


def encode_value(value: Any, path: str, owner: Callable[..., Any] | None = None) -> Any:
    """Return ``value`` as JSON-ready data; raise TypeError naming ``path`` if it cannot be (with
    ``owner``, the job's function, also for an instance of a model it does not declare)."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise TypeError(f"{path} is {value!r}, which JSON cannot store")
        return value
    if isinstance(value, list):
        return [encode_value(item, f"{path}[{i}]", owner) for i, item in enumerate(value)]
    if isinstance(value, tuple):
        return {TAG: "tuple", "v": [encode_value(item, f"{path}[{i}]", owner) for i, item in enumerate(value)]}
    if isinstance(value, dict):
        encoded = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{path} has the key {key!r} of type {_describe(key)}; JSON objects only have string keys"
                )
            encoded[key] = encode_value(item, f"{path}[{key!r}]", owner)
        if TAG in encoded:
            # A dict with our marker key: stored as pairs, which the decoder does not mistake for a tag.
            return {TAG: "dict", "v": [[key, item] for key, item in encoded.items()]}
        return encoded
    # datetime before date: a datetime is a date.
    for kind, tag in ((dt.datetime, "datetime"), (dt.date, "date"), (dt.time, "time")):
        if isinstance(value, kind):
            return {TAG: tag, "v": value.isoformat()}
    if isinstance(value, dt.timedelta):
        return {TAG: "timedelta", "v": [value.days, value.seconds, value.microseconds]}
    if isinstance(value, decimal.Decimal):
        return {TAG: "decimal", "v": str(value)}
    if isinstance(value, uuid.UUID):
        return {TAG: "uuid", "v": str(value)}
    if isinstance(value, models.Model):
        if value.pk is None:
            raise TypeError(f"{path} is an unsaved {value._meta.label} instance; save it before enqueueing")
        if owner is not None:
            declared = declared_models(owner)
            if not declared.admits(type(value)):
                raise TypeError(
                    f"{path} is a {value._meta.label_lower} instance, which {declared.owner} does not declare "
                    f"({declared.describe()}); annotate the parameter with its model (order: Order), or pass the pk"
                )
        return {TAG: "model", "v": [value._meta.label_lower, encode_value(value.pk, f"{path}.pk")]}
    raise TypeError(
        f"{path} is of type {_describe(value)}, which cannot be stored as JSON; "
        "pass JSON values, dates, decimals, UUIDs or saved model instances"
    )


def _decode_tagged(obj: dict[str, Any]) -> Any:
    tag = obj.get(TAG)
    if tag is None:
        return obj
    value: Any = obj.get("v")
    try:
        if tag in ("datetime", "date", "time"):
            return getattr(dt, tag).fromisoformat(value)
        if tag == "timedelta":
            days, seconds, micro = value
            return dt.timedelta(days=days, seconds=seconds, microseconds=micro)
        if tag == "decimal":
            return decimal.Decimal(value)
        if tag == "uuid":
            return uuid.UUID(value)
        if tag == "tuple":
            return tuple(value)
        if tag == "dict":
            return dict(value)
        if tag == "model":
            label, pk = value
            return ModelRef(label, pk)
    except (TypeError, ValueError, decimal.InvalidOperation) as exc:
        raise PayloadError(f"the stored {tag} value {value!r} is malformed: {exc}") from exc
    raise PayloadError(f"unknown value tag {tag!r}; was the job enqueued by a newer version?")


@dataclasses.dataclass(frozen=True, slots=True)
class Declared:
    """The models a job declares: what a stored model reference may name for it."""

    classes: tuple[type[models.Model], ...] = ()  # subclasses (proxies, children) admitted too
    names: frozenset[str] = frozenset()  # class names of annotations that did not resolve
    owner: str = "this job"  # for the error message

    def admits(self, model: type[models.Model]) -> bool:
        return model.__name__ in self.names or any(issubclass(model, declared) for declared in self.classes)

    def describe(self) -> str:
        found = sorted({_label(declared) for declared in self.classes} | self.names)
        return f"it declares {', '.join(found)}" if found else "it declares no model"


NOTHING = Declared()


def _label(model: type[models.Model]) -> str:
    meta = getattr(model, "_meta", None)
    return str(meta.label_lower) if meta is not None else f"{model.__module__}.{model.__qualname__}"


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _collect(annotation: Any, found: set[type[models.Model]], names: set[str]) -> None:
    """Add the models an annotation names (``Order``, ``Order | None``, ``list[Order]``)."""
    if isinstance(annotation, str):
        names.update(_IDENTIFIER.findall(annotation))
        return
    if isinstance(annotation, typing.ForwardRef):
        names.update(_IDENTIFIER.findall(annotation.__forward_arg__))
        return
    if isinstance(annotation, type) and issubclass(annotation, models.Model):
        found.add(annotation)
        return
    for inner in typing.get_args(annotation):
        _collect(inner, found, names)


@functools.lru_cache(maxsize=1024)
def declared_models(func: Callable[..., Any], *, result: bool = False) -> Declared:
    """The models ``func``'s parameter annotations name (its return annotation, with ``result``); an
    annotation that does not resolve declares the names it is written with."""
    owner = f"{getattr(func, '__qualname__', repr(func))}()"
    try:
        hints: dict[str, Any] = typing.get_type_hints(func)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: read them as written
        try:
            hints = dict(inspect.get_annotations(func))
        except TypeError:  # not a function, class or module (a functools.partial): nothing declared
            hints = {}
    found: set[type[models.Model]] = set()
    names: set[str] = set()
    for key, annotation in hints.items():
        if (key == "return") == result:
            _collect(annotation, found, names)
    if names:
        names &= {model.__name__ for model in apps.get_models(include_auto_created=True)}
    return Declared(tuple(sorted(found, key=_label)), frozenset(names), owner)


class ModelRef:
    """A model instance stored by reference, fetched when the job runs."""

    __slots__ = ("label", "pk")

    def __init__(self, label: str, pk: Any) -> None:
        self.label = label
        self.pk = pk

    def fetch(self, declared: Declared = NOTHING) -> models.Model:
        """Fetch the instance; raise ``PayloadError`` if it names a model ``declared`` does not admit."""
        try:
            model = apps.get_model(self.label)
        except (LookupError, ValueError) as exc:
            raise PayloadError(f"the argument refers to the model {self.label!r}, which is not installed") from exc
        if not declared.admits(model):
            raise PayloadError(
                f"a stored argument refers to the model {model._meta.label_lower}, which {declared.owner} does "
                f"not declare ({declared.describe()}): a model instance is fetched only for a model the job's "
                "annotations name (order: Order)"
            )
        try:
            instance: models.Model = model._default_manager.get(pk=self.pk)
            return instance
        except model.DoesNotExist as exc:
            raise ModelReferenceMissing(
                f"{model._meta.label} with pk={self.pk!r} no longer exists; it was deleted after "
                "the job was enqueued. Enqueue jobs with transaction.on_commit() or after the "
                "row is saved, and forget this failed job if the row is gone for good."
            ) from exc


def _resolve(value: Any, owner: Callable[..., Any] | None, result: bool) -> Any:
    if isinstance(value, ModelRef):
        return value.fetch(NOTHING if owner is None else declared_models(owner, result=result))
    if isinstance(value, list):
        return [_resolve(item, owner, result) for item in value]
    if isinstance(value, tuple):
        return tuple(_resolve(item, owner, result) for item in value)
    if isinstance(value, dict):
        return {key: _resolve(item, owner, result) for key, item in value.items()}
    return value


# Exact types stored as they are, whose path is not worth formatting (subclasses take the full check).
_PLAIN = frozenset({str, int, bool, type(None)})


def encode_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], owner: Callable[..., Any] | None = None
) -> dict[str, Any]:
    """Return ``{"args": [...], "kwargs": {...}}`` as JSON data; raise TypeError naming a bad argument."""
    plain = _PLAIN
    return {
        "args": [
            arg if type(arg) in plain else encode_value(arg, f"argument {i} (args[{i}])", owner)
            for i, arg in enumerate(args)
        ],
        "kwargs": {
            key: arg if type(arg) in plain else encode_value(arg, f"argument {key!r}", owner)
            for key, arg in kwargs.items()
        },
    }


def _refuse(value: Any) -> Any:
    raise TypeError(f"Object of type {_describe(value)} is not JSON serializable")


def _c_encoder() -> Any:
    """CPython's C encoder with ``dumps``'s options, built once (``json.dumps`` builds one per call);
    None where there is none. No circular-reference check: envelopes are fresh lists and dicts."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    try:
        return make(None, _refuse, json.encoder.encode_basestring, None, ":", ",", False, False, True)
    except TypeError:
        return None


_ITERENCODE = _c_encoder()


def dumps(envelope: dict[str, Any]) -> str:
    """Return an envelope as compact JSON, non-ASCII characters kept."""
    if _ITERENCODE is not None:
        return "".join(_ITERENCODE(envelope, 0))
    return json.dumps(envelope, separators=(",", ":"), ensure_ascii=False)


def size(text: str) -> int:
    """Return the length of ``text`` in UTF-8 bytes, as the database stores it."""
    # isascii() is O(1) on CPython: most payloads skip the copy that encode() makes.
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def check_size(name: str, text: str) -> None:
    """Raise ``PayloadTooLarge`` if ``text``, the payload of job ``name``, is over ``MAX_PAYLOAD_SIZE``."""
    limit = conf.get("MAX_PAYLOAD_SIZE")
    # A character is at most 4 bytes in UTF-8: short text needs no count.
    if limit is None or len(text) * 4 <= limit:
        return
    found = size(text)
    if found > limit:
        raise PayloadTooLarge(
            f"Cannot enqueue {name}: its payload is {found:,} bytes, over DBQUEUE['MAX_PAYLOAD_SIZE'] "
            f"({limit:,} bytes). Keep large data out of the queue: store it elsewhere and pass a "
            "reference (a model instance, a file path) instead.",
            name=name,
            size=found,
            limit=limit,
        )


def encode(args: tuple[Any, ...], kwargs: dict[str, Any], **options: Any) -> str:
    """Return the JSON envelope for a call; raise TypeError naming a bad argument."""
    envelope: dict[str, Any] = {"v": VERSION, **encode_arguments(args, kwargs)}
    envelope.update({key: value for key, value in options.items() if value is not None})
    return dumps(envelope)


def raw(payload: str) -> dict[str, Any]:
    """Return a stored envelope as plain JSON data, tags kept, for building follow-up jobs."""
    data = json.loads(payload)
    if not isinstance(data, dict):
        raise PayloadError("the payload is not a job envelope")
    return data


def decode(payload: str) -> dict[str, Any]:
    """Return the envelope of a stored payload, model references not yet fetched."""
    try:
        envelope = json.loads(payload, object_hook=_decode_tagged)
    except json.JSONDecodeError as exc:
        raise PayloadError(f"the payload is not valid JSON ({exc}); it was changed or truncated") from exc
    if (
        not isinstance(envelope, dict)
        or not isinstance(envelope.get("args"), (list, tuple))
        or not isinstance(envelope.get("kwargs"), dict)
    ):
        raise PayloadError(
            f'the payload is not a job envelope: expected {{"args": [...], "kwargs": {{...}}}}, got {payload[:200]!r}'
        )
    return envelope


def arguments(
    envelope: dict[str, Any], owner: Callable[..., Any] | None = None, *, result: bool = False
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Return the call's arguments, with the model references ``owner`` declares fetched (others raise
    ``PayloadError``; ``result``: declared by its return annotation)."""
    return tuple(_resolve(list(envelope["args"]), owner, result)), _resolve(envelope["kwargs"], owner, result)


def pretty(payload: str) -> str:
    """Return a stored payload as indented JSON, or as it is if it is not JSON."""
    try:
        return json.dumps(json.loads(payload), indent=2, ensure_ascii=False, sort_keys=True)
    except ValueError:
        return payload


# -- the objects a job is about (``about``, ``JobReference``) ---------------------------------

# In an envelope's text wherever it holds a model instance: the one test a job without one pays.
MODEL_TEXT = f'"{TAG}":"model"'
# Objects recorded per job at most (the first met), and the longest reference a row holds.
MAX_REFERENCES = 100
REFERENCE_LENGTH = 255


def reference(model: type[models.Model], pk: Any) -> str:
    """The text that names one object among jobs' arguments, ``demo.order:42``: the label of its
    concrete model (a proxy's instance names its concrete model's row) and its primary key."""
    concrete = model._meta.concrete_model or model
    return f"{concrete._meta.label_lower}:{pk}"


def references(text: str) -> list[str]:
    """The objects (``reference``) that the arguments of the envelope ``text`` hold, each once, at
    most ``MAX_REFERENCES``; [] for one without a model instance (found without reading it), or unreadable."""
    if MODEL_TEXT not in text:
        return []
    found: dict[str, None] = {}
    try:
        envelope = raw(text)
        _find_models([envelope.get("args"), envelope.get("kwargs")], found)
    except (ValueError, PayloadError, RecursionError):  # a row written by hand: nothing to record
        return []
    return [ref for ref in found if len(ref) <= REFERENCE_LENGTH][:MAX_REFERENCES]


def _find_models(value: Any, found: dict[str, None]) -> None:
    """Add the references among ``value``, JSON data with its tags (the next steps' arguments are not read)."""
    if isinstance(value, list):
        for item in value:
            _find_models(item, found)
    elif isinstance(value, dict):
        tag = value.get(TAG)
        if tag is None:
            for item in value.values():
                _find_models(item, found)
        elif tag in ("tuple", "dict"):
            _find_models(value.get("v"), found)
        elif tag == "model":
            ref = _reference_of(value.get("v"))
            if ref is not None:
                found[ref] = None


def _reference_of(stored: Any) -> str | None:
    """The reference of a stored ``[label, pk]``, None if it is malformed (a model not installed: as stored)."""
    if not (isinstance(stored, list) and len(stored) == 2 and isinstance(stored[0], str)):
        return None
    label, pk = stored
    try:
        pk = _decode_tagged(pk) if isinstance(pk, dict) else pk
        model = apps.get_model(label)
    except PayloadError:
        return None
    except (LookupError, ValueError):
        return f"{label}:{pk}"
    return reference(model, pk)
