"""Chains: steps that run one after another, each enqueued in the transaction that ends the one before.

``chain(resize.bind(pk), publish.bind(pk)).then(notify.bind(pk)).enqueue()``
stores the first step's row, whose envelope carries the rest (``rows``); the
worker inserts each next step with the outcome of the one before. With
``pipe=True`` each step's return value is the next one's first argument
(Celery's ``chain(a.s(1), b.s())``): ``chain(fetch.bind(url), parse, store, pipe=True)``.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from . import validation
from .enqueue import store
from .registry import Handle, JobCall, JobDefinition
from .rows import NewJob, prepare
from .unique import Window


def _as_call(item: JobCall | JobDefinition[..., Any]) -> JobCall:
    if isinstance(item, JobDefinition):
        return item.bind()
    if isinstance(item, JobCall):
        return item
    raise TypeError(f"a chain step must be a job call such as my_job.bind(...), not {item!r}")


def _piped_call(number: int, item: JobCall | JobDefinition[..., Any]) -> JobCall:
    """Step ``number`` of a piped chain (2 or later): a call whose function takes the step before's
    return value first, then its own arguments; TypeError naming the step if it cannot."""
    # A definition alone: its arguments are the result alone (``bind()`` would miss it).
    call = JobCall(item, (), {}) if isinstance(item, JobDefinition) else _as_call(item)
    definition = call.definition
    # Only the number of positional arguments counts: any value stands for the result.
    error = validation.call_error(
        definition.func, (None, *call.args), call.kwargs, takes_context=definition.takes_context
    )
    if error is not None:
        raise TypeError(
            f"Cannot chain {definition.name} as step {number} with pipe=True: it must take the return value "
            f"of step {number - 1} as its first argument, then the arguments bound to it: {error}"
        )
    return call


@dataclasses.dataclass(frozen=True)
class Chain:
    """Steps that run one after another; build it with ``chain(...)``."""

    steps: tuple[JobCall, ...]
    callbacks: tuple[JobCall, ...] = ()
    failure_callback: JobCall | None = None
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    # Each step's return value is the next one's first argument.
    pipe: bool = False

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

    def prepared(self) -> tuple[NewJob, Window | None]:
        """The first step's row values, carrying the rest, and its ``unique_for`` window."""
        first = dataclasses.replace(self.steps[0], callbacks=self.callbacks, failure_callback=self.failure_callback)
        info: dict[str, Any] = {"id": self.id, "step": 1, "total": len(self.steps)}
        if self.pipe:
            info["pipe"] = True
        return prepare(first, rest=self.steps[1:], chain=info)

    def enqueue(self) -> Handle:
        """Store the first step and return its handle; each next one is enqueued when the one before succeeds."""
        # As the first step's own enqueue: if its unique key is held, nothing (no chain) is stored.
        return store(*self.prepared())


def chain(*calls: JobCall | JobDefinition[..., Any], pipe: bool = False) -> Chain:
    """Return a chain of job calls, e.g. ``chain(resize.bind(pk), publish.bind(pk)).enqueue()``;
    ``pipe``: each step's return value is the next one's first argument, before those bound to it
    (a later step given as its definition alone takes the value alone)."""
    if not calls:
        raise TypeError("chain() needs at least one step")
    if not pipe:
        return Chain(tuple(_as_call(call) for call in calls))
    steps = (_as_call(calls[0]), *(_piped_call(number, call) for number, call in enumerate(calls[1:], start=2)))
    return Chain(steps, pipe=True)
