"""New job rows and their envelopes: the one place a job row is built.

A ``NewJob`` holds a row's values with a delay instead of times (the database's clock sets them).
Its payload, the envelope, holds the encoded arguments and: ``next`` (the chain's remaining steps),
``then`` and ``on_failure`` (jobs to enqueue after it), ``chain`` (``{"id", "step", "total"}``, and
``"pipe": true`` if each step's return value is the next one's first argument),
``batch_of`` (a batch callback's batch), ``flow`` (its flow columns, for a retry) and ``trace``.
Each step is JSON data, so a ``FailedJob`` shows the steps that did not run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, NamedTuple

from django.db import models
from django.db.models.base import ModelState

from . import concurrency, conf, payload, rates, registry, tracing, unique, validation
from .db import DbNow, alias
from .exceptions import PayloadError, PayloadTooLarge, UnknownQueue
from .models import Job
from .registry import JobCall, JobDefinition, backoff_json, retry_deadline

logger = logging.getLogger("django_dbqueue")


class Flow(NamedTuple):
    """The flow-control columns of a job row (unique.py, concurrency.py, rates.py)."""

    unique_key: str | None = None
    unique_until_start: bool = False
    concurrency_key: str | None = None
    concurrency_limit: int | None = None
    rate_key: str | None = None
    rate_limit: str | None = None


NO_FLOW = Flow()


class NewJob(NamedTuple):
    """The values of a job row about to be inserted."""

    queue: str
    name: str
    payload: str
    priority: int
    max_tries: int | None
    retry_after: int
    timeout: int | None
    # Seconds after the insert at which the job becomes available.
    delay: float
    # None: the job uses no flow control (its flow columns are NULL).
    flow: Flow | None = None
    # The batch the job is a member of (batches.py), or None.
    batch_id: int | None = None

    def to_job(self) -> Job:
        """Return an unsaved ``Job`` whose times are the database's clock when it is saved."""
        now = DbNow()
        own = dict(zip(self._fields[: self._fields.index("delay")], self, strict=False))
        job = Job(
            **own,
            available_at=now + timedelta(seconds=self.delay) if self.delay > 0 else now,
            created_at=now,
            batch_id=self.batch_id,
            **(self.flow._asdict() if self.flow else {}),
        )
        job._state.db = alias()
        return job

    @property
    def unique_key(self) -> str | None:
        return self.flow.unique_key if self.flow else None


# -- a new row's columns, from the model ------------------------------------------

FIELDS = {field.attname: field for field in Job._meta.concrete_fields}
# The NewJob fields stored as they are (``delay`` becomes available_at, ``flow`` its columns).
OWN = NewJob._fields[: NewJob._fields.index("delay")]
TIMES = ("available_at", "created_at")
# Every other column starts at its field's default (attempts 0, reserved_at NULL, ...).
START = {
    name: field.get_default()
    for name, field in FIELDS.items()
    if not field.primary_key and name not in (*OWN, "batch_id", *Flow._fields, *TIMES)
}
# A new row's columns in the order of ``_values``: nothing but the id, which the table gives.
COLUMNS = (*OWN, "batch_id", *Flow._fields, *TIMES, *START)
_START_VALUES = tuple(START.values())
PK = Job._meta.pk.attname if Job._meta.pk else "id"
_ATTRS = (PK, *COLUMNS)


def row_values(new: NewJob, available: Any, created: Any) -> tuple[Any, ...]:
    return (*new[: len(OWN)], new.batch_id, *(new.flow or NO_FLOW), available, created, *_START_VALUES)


def saved_job(using: str, new: NewJob, pk: int | None, available_at: Any, created_at: Any) -> Job:
    """The saved ``Job`` of ``new``, its attributes set without ``Model.__init__`` (most of a bulk
    enqueue's cost); through ``from_db`` if ``Job`` has a ``pre_init`` or ``post_init`` receiver."""
    values = (pk, *row_values(new, available_at, created_at))
    if models.signals.pre_init.has_listeners(Job) or models.signals.post_init.has_listeners(Job):
        by_name = dict(zip(_ATTRS, values, strict=True))
        return Job.from_db(using, list(FIELDS), [by_name[name] for name in FIELDS])
    job = Job.__new__(Job)
    job.__dict__.update(zip(_ATTRS, values, strict=True))
    state = job._state = ModelState()
    state.adding = False
    state.db = using
    return job


def _arguments(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], func: Callable[..., Any]) -> dict[str, Any]:
    try:
        # With the function: an undeclared model instance is refused here, not by the worker.
        return payload.encode_arguments(args, kwargs, func)
    except TypeError as exc:
        raise TypeError(f"Cannot enqueue {name}: {exc}") from None


def step(call: JobCall) -> dict[str, Any]:
    """Return a call as JSON data: name, options and encoded arguments."""
    definition = call.definition
    args = _arguments(definition.name, call.args, call.kwargs, definition.func)
    values: dict[str, Any] = {
        "name": definition.name,
        "queue": definition.effective_queue,
        "priority": definition.priority,
        "tries": definition.tries,
        "retry_after": definition.retry_after or int(conf.get("RETRY_AFTER")),
        "timeout": definition.timeout,
        "delay": definition.delay,
        "backoff": backoff_json(definition.backoff),
        **args,
    }
    if definition.retry_until is not None:
        values["retry_until"] = retry_deadline(definition.name, definition.retry_until)
    if definition.max_exceptions is not None:
        values["max_exceptions"] = definition.max_exceptions
    flow = {
        **unique.step_values(definition, call.args, call.kwargs),
        **concurrency.step_values(definition, call.args, call.kwargs),
        **rates.step_values(definition, call.args, call.kwargs),
    }
    if flow:
        values["flow"] = flow
    return values


def prepare(
    call: JobCall,
    *,
    rest: Sequence[JobCall] = (),
    chain: dict[str, Any] | None = None,
    trace: bool = True,
    checked: set[tuple[str, str]] | None = None,
) -> tuple[NewJob, unique.Window | None]:
    """The row of a call with its callbacks (and a chain's ``rest``), and its ``unique_for`` window (key
    callables called once, here)."""
    first = step(call)
    new = new_job(
        first,
        next_steps=[step(later) for later in rest],
        then=[step(callback) for callback in call.callbacks],
        on_failure=step(call.failure_callback) if call.failure_callback else None,
        chain=chain,
        trace=trace,
        checked=checked,
    )
    return new, unique.window_of(call.definition, first.get("flow"), call.args, call.kwargs)


def new_job(
    step: dict[str, Any],
    *,
    next_steps: Sequence[dict[str, Any]] = (),
    then: Sequence[dict[str, Any]] = (),
    on_failure: dict[str, Any] | None = None,
    chain: dict[str, Any] | None = None,
    check: bool = True,
    batch_id: int | None = None,
    batch_of: int | None = None,
    trace: bool = True,
    checked: set[tuple[str, str]] | None = None,
) -> NewJob:
    """Return the row values of a job that runs ``step``, carrying what follows it.

    Every enqueue path builds its rows here, so the queue names and the payload size are checked
    here (``check=False``: a follow-up, checked at its enqueue); ``trace=False``: no trace to carry;
    ``checked``: (name, queue) pairs found good already, added to.
    """
    if check:
        # The steps that follow too: a follow-up is enqueued when the job ends, where an error is only logged.
        for item in (step, *next_steps, *then, *([on_failure] if on_failure else [])):
            name, queue = item["name"], item.get("queue")
            if checked is None or not isinstance(queue, str):
                check_queue(name, queue)
            elif (name, queue) not in checked:
                check_queue(name, queue)
                checked.add((name, queue))
    envelope: dict[str, Any] = {"v": payload.VERSION, "args": step["args"], "kwargs": step["kwargs"]}
    optional = {
        # As JSON: the tasks backend passes its task's or OPTIONS' backoff as given (an Exponential).
        "backoff": backoff_json(step.get("backoff")),
        "next": list(next_steps),
        "then": list(then),
        "on_failure": on_failure,
        "chain": chain,
        "batch_of": batch_of,
        "retry_until": step.get("retry_until"),
        "max_exceptions": step.get("max_exceptions"),
    }
    envelope.update({key: value for key, value in optional.items() if value})
    flow = flow_of(step)
    if flow is not None:
        envelope["flow"] = {name: value for name, value in flow._asdict().items() if value}
    if trace and tracing.enabled:
        # The enqueue's span context (docs/observability.md), when there is one to carry.
        carrier = tracing.enqueue_context(step)
        if carrier:
            envelope[tracing.ENVELOPE_KEY] = carrier
    text = payload.dumps(envelope)
    if check:
        payload.check_size(step["name"], text)
    new = NewJob(
        queue=step["queue"],
        name=step["name"],
        payload=text,
        priority=int(step.get("priority") or 0),
        max_tries=step.get("tries"),
        retry_after=int(step.get("retry_after") or conf.get("RETRY_AFTER")),
        timeout=step.get("timeout"),
        delay=float(step.get("delay") or 0),
        flow=flow,
        batch_id=batch_id,
    )
    # Always: a step read back from a stored envelope may hold what no enqueue would let through.
    error = validation.row_error({**new._asdict(), **(flow._asdict() if flow else {})})
    if error is not None:
        raise ValueError(f"Cannot enqueue {step['name']}: {error}")
    return new


def flow_of(step: dict[str, Any]) -> Flow | None:
    """The flow-control columns of a step (its ``flow`` dict), or None; ValueError if it holds anything else."""
    values = step.get("flow")
    if not values:
        return None
    if not isinstance(values, dict) or not set(values) <= set(Flow._fields):
        raise ValueError(f"a step's flow must be a dict of {', '.join(Flow._fields)}, not {values!r}")
    return Flow(**values)


def check_queue(name: str, queue: Any) -> None:
    """Raise ValueError if job ``name`` cannot be enqueued into ``queue``: a bad name, or one not in ``QUEUES``."""
    error = validation.queue_name_error(queue)
    if error is not None:
        raise ValueError(f"Cannot enqueue {name}: {error}")
    known = conf.get("QUEUES")
    if known is not None and queue not in known:
        raise UnknownQueue(
            f"Cannot enqueue {name} into the queue {queue!r}: it is not in DBQUEUE['QUEUES'] "
            f"({', '.join(map(repr, known))}), so no worker is meant to serve it. "
            "Add it to QUEUES, or pick one of those queues."
        )


class Plain(NamedTuple):
    """What the rows of a definition's plain calls (no key, limit, deadline, follow-up or trace)
    share: ``new_job``'s row without the step dict (tests/test_enqueue_stream.py compares them)."""

    row: NewJob  # its payload empty
    options: dict[str, Any]  # envelope keys after the arguments, in ``new_job``'s order
    func: Callable[..., Any]  # whose annotations say which models the arguments may be

    @classmethod
    def of(cls, definition: JobDefinition[..., Any]) -> Plain | None:
        """The shared values, or None if a call of ``definition`` needs more than its arguments."""
        if (
            unique.scope(definition) is not None
            or definition.unique_for is not None
            or definition.uses_limits
            or definition.retry_until is not None
        ):
            return None
        queue = definition.effective_queue
        check_queue(definition.name, queue)
        options = {"backoff": backoff_json(definition.backoff), "max_exceptions": definition.max_exceptions}
        row = NewJob(
            queue,
            definition.name,
            "",
            int(definition.priority or 0),
            definition.tries,
            int(definition.retry_after or conf.get("RETRY_AFTER")),
            definition.timeout,
            float(definition.delay or 0),
        )
        return cls(row, {key: value for key, value in options.items() if value}, definition.func)

    @classmethod
    def cached(cls, definition: JobDefinition[..., Any]) -> Plain | None:
        """``of``, kept on the definition while the settings stay the same."""
        settings = conf.get_settings()
        kept = definition.__dict__.get("_plain")
        if kept is not None and kept[0] is settings:
            plain: Plain | None = kept[1]
            return plain
        plain = cls.of(definition)
        # Not a field: invisible to equality, repr and dataclasses.replace (``using`` makes a new one).
        object.__setattr__(definition, "_plain", (settings, plain))
        return plain

    def new_job(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> NewJob:
        row = self.row
        text = payload.dumps({"v": payload.VERSION, **_arguments(row.name, args, kwargs, self.func), **self.options})
        payload.check_size(row.name, text)
        return NewJob(row.queue, row.name, text, *row[3:])


# -- what follows a job that ended ------------------------------------------------


def chain_of(envelope: dict[str, Any]) -> dict[str, Any] | None:
    """The ``{"id", "step", "total"}`` of a job that is a chain step, else None."""
    info = envelope.get("chain")
    if isinstance(info, dict) and {"id", "step", "total"} <= set(info):
        return info
    return None


def pipes(chain: dict[str, Any] | None) -> bool:
    """Whether a chain step's return value is passed on as the next step's first argument."""
    return chain is not None and chain.get("pipe") is True


def follow_ups(job: Job, *, succeeded: bool, result: Any = None) -> list[Job]:
    """The rows to insert with ``job``'s outcome: its next step (in a piped chain, with ``result``,
    its return value, first) or callbacks, or its failure callback."""
    keys = ('"next"', '"then"') if succeeded else ('"on_failure"',)
    if not any(key in job.payload for key in keys):
        return []  # (a string holding such a key only costs the full parse below)
    try:
        data = payload.raw(job.payload)
        # Built in the context of the run that just ended: the next step continues its trace.
        with tracing.continued(job, data) if tracing.enabled else nullcontext():
            return [new.to_job() for new in _follow_ups(job, data, succeeded=succeeded, result=result)]
    except (ValueError, KeyError, TypeError, RecursionError, PayloadError) as exc:
        # The job ran; a malformed follow-up must not undo that (a message of ours or the parser's, no row).
        # (A piped result that cannot pass was refused before, by ``pipe_refusal``: the step failed.)
        logger.error("cannot enqueue what follows job=%s id=%s: %s", job.name, job.pk, exc)
        return []


def pipe_refusal(job: Job, result: Any) -> PayloadError | PayloadTooLarge | None:
    """Why ``result``, returned by ``job`` (a step of a piped chain), cannot be passed on to the next
    step, or None: it cannot be encoded (for the next step's function), or makes its payload too large."""
    data = payload.raw(job.payload)
    next_steps = data.get("next") or []
    if not next_steps or not isinstance(next_steps[0], dict):
        return None  # the last step: nothing to pass on to
    later = str(next_steps[0].get("name"))
    try:
        new = _follow_ups(job, data, succeeded=True, result=result)[0]
    except TypeError as exc:
        return PayloadError(f"the return value of {job.name} (job {job.pk}) cannot be passed on to {later}: {exc}")
    except (ValueError, KeyError, RecursionError):
        return None  # a malformed next step: ``follow_ups`` logs it, as for any chain
    found, limit = payload.size(new.payload), conf.get("MAX_PAYLOAD_SIZE")
    if limit is not None and found > limit:
        return PayloadTooLarge(
            f"the return value of {job.name} (job {job.pk}) cannot be passed on to {later}: with it, {later}'s "
            f"payload is {found:,} bytes, over DBQUEUE['MAX_PAYLOAD_SIZE'] ({limit:,} bytes). Return a "
            "reference (a model instance, a file path) instead of the data.",
            name=job.name,
            size=found,
            limit=limit,
        )
    return None


def _piped(step: dict[str, Any], result: Any) -> dict[str, Any]:
    """``step`` (a piped chain's next one) with ``result`` first in its arguments, encoded for its function."""
    definition = registry.find(str(step.get("name")))
    try:
        # With the function: a model instance passes only to a step whose annotations name its model.
        value = payload.encode_value(result, "the return value", definition.func if definition else None)
    except RecursionError as exc:
        raise TypeError(f"the return value is nested too deeply to be stored ({exc})") from None
    return {**step, "args": [value, *step["args"]]}


def _follow_ups(job: Job, data: dict[str, Any], *, succeeded: bool, result: Any = None) -> list[NewJob]:
    if not succeeded:
        on_failure = data.get("on_failure")
        return [new_job(on_failure, check=False)] if on_failure else []
    next_steps = data.get("next") or []
    if not next_steps:
        return [new_job(then, check=False) for then in data.get("then") or []]
    info = chain_of(data)
    return [
        new_job(
            _piped(next_steps[0], result) if pipes(info) else next_steps[0],
            next_steps=next_steps[1:],
            then=data.get("then") or [],
            on_failure=data.get("on_failure"),
            chain={**info, "step": int(info["step"]) + 1} if info else None,
            check=False,
            # The next step is the same batch member.
            batch_id=job.batch_id,
        )
    ]
