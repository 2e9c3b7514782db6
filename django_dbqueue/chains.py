"""Chains and callbacks: jobs that follow a job, enqueued in the transaction that ends it.

A job row's envelope may carry, beside its arguments:

- ``next``: the remaining steps of its chain, run one after another;
- ``then``: jobs to enqueue once the last step succeeds;
- ``on_failure``: a job to enqueue if a step fails for good;
- ``chain``: ``{"id", "step", "total"}``, for progress;
- ``batch_of``: for a batch's callback, the batch's id (``JobContext.batch``);
- ``trace``: the trace context of its enqueue, with OpenTelemetry (``tracing``).

A chain that is a batch member carries the batch on each step's row
(``Job.batch_id``): the member ends when its last step does.

Each step is JSON data (name, options, encoded arguments), so a ``FailedJob``
row shows the steps that did not run, and retrying it resumes the chain.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import conf, payload, tracing, unique, validation
from .bulk import Flow, NewJob
from .exceptions import PayloadError, UnknownQueue
from .models import Job
from .registry import JobCall, JobDefinition, store

if TYPE_CHECKING:
    from .handles import JobHandle

logger = logging.getLogger("django_dbqueue")


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

    Every enqueue path (``enqueue``, ``enqueue_many``, chains, the ``django.tasks``
    backend) builds its rows here, so this is where the queue name and the
    payload size are checked; ``check=False`` skips that for follow-ups of a job
    that was checked when it was enqueued. ``trace=False``: the caller knows
    there is no trace to record or carry (``tracing.carries``). ``checked``:
    the (name, queue) pairs found good by earlier calls, added to here (one
    ``enqueue_many`` checks each pair once).
    """
    envelope: dict[str, Any] = {"v": payload.VERSION, "args": step["args"], "kwargs": step["kwargs"]}
    backoff = step.get("backoff")
    if backoff:
        envelope["backoff"] = backoff
    if next_steps:
        envelope["next"] = list(next_steps)
    if then:
        envelope["then"] = list(then)
    if on_failure:
        envelope["on_failure"] = on_failure
    if chain:
        envelope["chain"] = chain
    if batch_of is not None:
        envelope["batch_of"] = batch_of
    for key in ("retry_until", "max_exceptions"):
        if step.get(key) is not None:
            envelope[key] = step[key]
    flow = flow_of(step)
    if flow is not None:
        # Kept in the envelope too, so a retry from FailedJob takes the same keys.
        envelope["flow"] = {name: value for name, value in flow._asdict().items() if value}
    if trace and tracing.enabled:
        # The enqueue's span context (docs/observability.md), when there is one to carry.
        carrier = tracing.enqueue_context(step)
        if carrier:
            envelope[tracing.ENVELOPE_KEY] = carrier
    text = payload.dumps(envelope)
    if check:
        # The steps that follow are checked now too: a follow-up is enqueued when
        # the job ends, where an error could only be logged.
        for item in (step, *next_steps, *then, *([on_failure] if on_failure else [])):
            name, queue = item["name"], item.get("queue")
            if checked is None or not isinstance(queue, str):
                check_queue(name, queue)
            elif (name, queue) not in checked:
                check_queue(name, queue)
                checked.add((name, queue))
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
    # Always, ``check`` or not: a step read back from a stored envelope (a chain's
    # next step, a callback) may hold what no enqueue would have let through.
    error = validation.row_error({**new._asdict(), **(flow._asdict() if flow else {})})
    if error is not None:
        raise ValueError(f"Cannot enqueue {step['name']}: {error}")
    return new


def flow_of(step: dict[str, Any]) -> Flow | None:
    """The flow-control columns of a step (its ``flow`` dict), or None if it uses none."""
    values = step.get("flow")
    if not values:
        return None
    return flow_from(values)


def flow_from(values: Any) -> Flow:
    """The ``Flow`` a stored ``flow`` dict names; raise ValueError if it holds anything else."""
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


def build_row(
    step: dict[str, Any],
    *,
    next_steps: Sequence[dict[str, Any]] = (),
    then: Sequence[dict[str, Any]] = (),
    on_failure: dict[str, Any] | None = None,
    chain: dict[str, Any] | None = None,
    check: bool = True,
    batch_id: int | None = None,
    batch_of: int | None = None,
) -> Job:
    """Return an unsaved ``Job`` row that runs ``step``, carrying what follows it."""
    return new_job(
        step,
        next_steps=next_steps,
        then=then,
        on_failure=on_failure,
        chain=chain,
        check=check,
        batch_id=batch_id,
        batch_of=batch_of,
    ).to_job()


def _as_call(item: JobCall | JobDefinition[..., Any]) -> JobCall:
    if isinstance(item, JobDefinition):
        return item.bind()
    if isinstance(item, JobCall):
        return item
    raise TypeError(f"a chain step must be a job call such as my_job.bind(...), not {item!r}")


@dataclasses.dataclass(frozen=True)
class Chain:
    """Steps that run one after another; build it with ``chain(...)``."""

    steps: tuple[JobCall, ...]
    callbacks: tuple[JobCall, ...] = ()
    failure_callback: JobCall | None = None
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def progress_key(self) -> str:
        """The key under which the chain's progress is stored: ``chain:<id>``."""
        return f"chain:{self.id}"

    def then(self, *calls: JobCall) -> Chain:
        """Return this chain with jobs to enqueue once its last step succeeds."""
        return dataclasses.replace(self, callbacks=(*self.callbacks, *map(_as_call, calls)))

    def on_failure(self, call: JobCall) -> Chain:
        """Return this chain with a job to enqueue if a step fails for good."""
        return dataclasses.replace(self, failure_callback=_as_call(call))

    def prepared(self) -> tuple[NewJob, unique.Window | None]:
        """The first step's row values, carrying the rest, and its ``unique_for`` window."""
        steps = [call.to_step() for call in self.steps]
        new = new_job(
            steps[0],
            next_steps=steps[1:],
            then=[call.to_step() for call in self.callbacks],
            on_failure=self.failure_callback.to_step() if self.failure_callback else None,
            chain={"id": self.id, "step": 1, "total": len(steps)},
        )
        first = self.steps[0]
        return new, unique.window_of(first.definition, steps[0].get("flow"), first.args, first.kwargs)

    def enqueue(self) -> JobHandle:
        """Store the first step and return its handle; each next one is enqueued when the one before succeeds."""
        # As the first step's own enqueue: a unique first step whose key is held
        # stores nothing (the chain with it), and the handle is the holder's.
        return store(*self.prepared())


def chain(*calls: JobCall | JobDefinition[..., Any]) -> Chain:
    """Return a chain of job calls, e.g. ``chain(resize.bind(pk), publish.bind(pk)).enqueue()``."""
    if not calls:
        raise TypeError("chain() needs at least one step")
    return Chain(tuple(_as_call(call) for call in calls))


def chain_of(envelope: dict[str, Any]) -> dict[str, Any] | None:
    """The ``{"id", "step", "total"}`` of a job that is a chain step, else None."""
    info = envelope.get("chain")
    if isinstance(info, dict) and {"id", "step", "total"} <= set(info):
        return info
    return None


def follow_ups(job: Job, *, succeeded: bool) -> list[Job]:
    """The rows to insert with ``job``'s outcome: its next step or callbacks, or its failure callback."""
    keys = ('"next"', '"then"') if succeeded else ('"on_failure"',)
    if not any(key in job.payload for key in keys):
        # No such key in the envelope (a string containing one only costs the full parse below).
        return []
    try:
        data = payload.raw(job.payload)
        if tracing.enabled:
            # Built in the context of the run that just ended: the next step continues its trace.
            with tracing.continued(job, data):
                return _build_follow_ups(job, data, succeeded=succeeded)
        return _build_follow_ups(job, data, succeeded=succeeded)
    except (ValueError, KeyError, TypeError, RecursionError, PayloadError) as exc:
        # The job itself ran; a malformed follow-up must not undo that.
        # Not a database error (whose text could quote the row): a message of ours or of the JSON parser.
        logger.error("cannot enqueue what follows job=%s id=%s: %s", job.name, job.pk, exc)
        return []


def _build_follow_ups(job: Job, data: dict[str, Any], *, succeeded: bool) -> list[Job]:
    """What follows a job, from its envelope ``data`` (see ``follow_ups``)."""
    if not succeeded:
        on_failure = data.get("on_failure")
        return [build_row(on_failure, check=False)] if on_failure else []
    next_steps = data.get("next") or []
    if next_steps:
        info = chain_of(data)
        step_info = {**info, "step": int(info["step"]) + 1} if info else None
        return [
            build_row(
                next_steps[0],
                next_steps=next_steps[1:],
                then=data.get("then") or [],
                on_failure=data.get("on_failure"),
                chain=step_info,
                check=False,
                # The next step is the same batch member.
                batch_id=job.batch_id,
            )
        ]
    return [build_row(step, check=False) for step in data.get("then") or []]
