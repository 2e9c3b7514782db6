"""Durable steps inside a job: run each named step once, store its result, give it back on a later run.

``context.step(name, fn, ...)`` runs ``fn`` in a transaction on the queue's database together with
the INSERT of its ``JobStep`` row, so the step's writes there and its recorded result commit
together or not at all; a run that finds the row (a retry, a reclaim) skips ``fn`` and returns the
stored result. ``context.astep`` awaits ``fn`` and stores the result after it: at-least-once.
The rows belong to the job: deleted with it when it succeeds (``outcomes``), kept in ``FailedJob``
(``move`` gives them to a retried job's new row), pruned once their job is gone (``prune``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from datetime import timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.db import IntegrityError, models, transaction
from django.db.models import Case, Value, When

from . import payload
from .db import DbNow, alias
from .models import FailedJob, Job, JobStep

# Characters of a step's name (JobStep.name).
MAX_NAME_LENGTH = 200
# Job ids per statement of ``move`` and ``prune``.
CHUNK = 500

# The step running now in this thread or asyncio task: (its run's Steps, its name).
_inside: ContextVar[tuple[Steps, str] | None] = ContextVar("dbqueue_step", default=None)


class StepConflict(RuntimeError):
    """Another run of the same job stored this step first (it was reclaimed while this run went on)."""


class Steps:
    """The durable steps of one run of a job, held by its ``JobContext``: the results stored by
    earlier runs (read at the first step, in one query) and the names this run used."""

    __slots__ = ("names", "stored")

    def __init__(self) -> None:
        self.stored: dict[str, str] | None = None
        # Steps of this run that finished, were skipped or are running (one that raised is not).
        self.names: set[str] = set()

    @property
    def used(self) -> bool:
        """Tell whether this run asked for a step (its job's step rows are deleted when it succeeds)."""
        return self.stored is not None

    def run(self, job_id: int, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Return the stored result of step ``name``, or run ``fn`` and store its result in its transaction."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(f"step {name!r} runs in an event loop: in an async job, await context.astep(...)")
        self._begin(name, fn)
        try:
            using = alias()
            if self.stored is None:
                self.stored = load(using, job_id)
            if name in self.stored:
                return decode(self.stored[name], fn)
            token = _inside.set((self, name))
            try:
                with transaction.atomic(using=using):
                    value = fn(*args, **kwargs)
                    _insert(using, job_id, name, encode(name, fn, value))
            finally:
                _inside.reset(token)
        except BaseException:
            self.names.discard(name)  # it stored nothing: this run may call it again
            raise
        return value

    async def arun(
        self, job_id: int, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``run`` for an async job: await ``fn`` (a coroutine function), then store its result
        (at-least-once); a plain function runs in a thread with ``run``'s transaction."""
        if not inspect.iscoroutinefunction(fn):
            return await sync_to_async(self.run)(job_id, name, fn, args, kwargs)
        self._begin(name, fn)
        try:
            using = alias()
            if self.stored is None:
                self.stored = await sync_to_async(load)(using, job_id)
            if name in self.stored:
                return await sync_to_async(decode)(self.stored[name], fn)
            token = _inside.set((self, name))
            try:
                value = await fn(*args, **kwargs)
            finally:
                _inside.reset(token)
            await sync_to_async(_insert_alone)(using, job_id, name, encode(name, fn, value))
        except BaseException:
            self.names.discard(name)
            raise
        return value

    def _begin(self, name: str, fn: Callable[..., Any]) -> None:
        """Refuse a bad name, a name this run used already and a step inside a step; note the name."""
        if not isinstance(name, str):
            raise TypeError(f"a step's name must be a str, not {type(name).__qualname__}")
        if not 1 <= len(name) <= MAX_NAME_LENGTH:
            raise ValueError(f"a step's name must be 1 to {MAX_NAME_LENGTH} characters long, not {len(name)}")
        if not callable(fn):
            raise TypeError(f"step {name!r} needs a function to run, not {type(fn).__qualname__}")
        inside = _inside.get()
        if inside is not None and inside[0] is self:
            raise RuntimeError(
                f"step {name!r} was started inside step {inside[1]!r}: steps do not nest; "
                "call context.step from the job's own code, one after another"
            )
        if name in self.names:
            raise ValueError(
                f"step {name!r} was already run in this run of the job: a name identifies one step, "
                "give each step its own name (in a loop: f'charge-{item.pk}')"
            )
        self.names.add(name)


def load(using: str, job_id: int) -> dict[str, str]:
    """The stored results of ``job_id``'s steps, by name, as JSON text."""
    return dict(JobStep.objects.using(using).filter(job_id=job_id).values_list("name", "result"))


def encode(name: str, fn: Callable[..., Any], value: Any) -> str:
    """Return the JSON text step ``name`` stores ``value`` as; raise TypeError naming the step if it cannot."""
    data = payload.encode_value(value, f"the result of step {name!r}")
    found = list(_instances(value))
    if found:
        declared = payload.declared_models(fn, result=True)
        for instance in found:
            if not declared.admits(type(instance)):
                raise TypeError(
                    f"the result of step {name!r} holds a {instance._meta.label_lower} instance, which "
                    f"{declared.owner} does not declare as its return ({declared.describe()}): annotate the "
                    "step function's return with its model (-> Order), or return the pk"
                )
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def decode(text: str, fn: Callable[..., Any]) -> Any:
    """A stored result, decoded (model instances fetched for the models ``fn``'s return annotation names)."""
    envelope = payload.decode(f'{{"args":[{text}],"kwargs":{{}}}}')
    return payload.arguments(envelope, fn, result=True)[0][0]


def _instances(value: Any) -> Iterator[models.Model]:
    if isinstance(value, models.Model):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _instances(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _instances(item)


def _insert(using: str, job_id: int, name: str, text: str) -> None:
    try:
        JobStep.objects.using(using).create(job_id=job_id, name=name, result=text, finished_at=DbNow())
    except IntegrityError as exc:
        # The unique (job_id, name): the transaction, with the step's writes, rolls back.
        raise StepConflict(
            f"step {name!r} of job {job_id} was stored by another run of the job meanwhile (it was "
            "reclaimed while this run went on); this run's writes in the step are rolled back"
        ) from exc


def _insert_alone(using: str, job_id: int, name: str, text: str) -> None:
    with transaction.atomic(using=using):
        _insert(using, job_id, name, text)


def delete(using: str, job_ids: Sequence[int]) -> int:
    """Delete the step rows of ``job_ids`` (jobs that succeeded); return how many."""
    if not job_ids:
        return 0
    deleted, _ = JobStep.objects.using(using).filter(job_id__in=list(job_ids)).delete()
    return deleted


def move(using: str, pairs: Sequence[tuple[int, int]]) -> int:
    """Give the step rows of old job ids to new ones (``(old, new)`` pairs: a retry from
    ``FailedJob``), one statement per ``CHUNK`` pairs; return how many rows moved."""
    moved = 0
    pairs = list(pairs)
    for start in range(0, len(pairs), CHUNK):
        chunk = pairs[start : start + CHUNK]
        rows = JobStep.objects.using(using).filter(job_id__in=[old for old, _ in chunk])
        # Most retried jobs used no steps: one read, and the UPDATE names only those that did.
        having = set(rows.values_list("job_id", flat=True).distinct())
        if having:
            moves = [When(job_id=old, then=Value(new)) for old, new in chunk if old in having]
            moved += rows.filter(job_id__in=having).update(job_id=Case(*moves))
    return moved


def prune(hours: float) -> int:
    """Delete the step rows finished more than ``hours`` ago whose job is gone (neither queued nor
    in ``FailedJob``: it was deleted by hand, forgotten, or its row's delete left them); return how many."""
    using = alias()
    old = JobStep.objects.using(using).filter(finished_at__lt=DbNow() - timedelta(hours=hours))
    deleted, after = 0, -1
    while True:
        ids = list(old.filter(job_id__gt=after).order_by("job_id").values_list("job_id", flat=True).distinct()[:CHUNK])
        if not ids:
            return deleted
        after = ids[-1]
        kept = set(Job.objects.using(using).filter(pk__in=ids).values_list("pk", flat=True))
        kept |= set(FailedJob.objects.using(using).filter(job_id__in=ids).values_list("job_id", flat=True))
        gone = [job_id for job_id in ids if job_id not in kept]
        if gone:
            count, _ = old.filter(job_id__in=gone).delete()
            deleted += count
        if len(ids) < CHUNK:
            return deleted
