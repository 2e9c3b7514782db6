"""The context a job receives: who it is, its progress, durable steps, snooze, cancel checks and its batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from .batches import BatchHandle, get_batch
from .exceptions import JobCancelled, Snooze
from .steps import Steps

if TYPE_CHECKING:
    from .progress import Tracker

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class JobContext:
    """What a job defined with ``takes_context=True`` receives as its first argument,
    and what every middleware receives."""

    job_id: int
    name: str
    queue: str
    # Reservations of the job so far, this one included: every run, snoozed ones too.
    attempt: int
    tries: int
    worker_id: str = ""
    # For a job of a chain: the chain's id, this job's number in it (from 1) and the chain's length.
    chain_id: str | None = None
    chain_step: int = 1
    chain_steps: int = 1
    tracker: Tracker | None = dataclasses.field(default=None, repr=False, compare=False)
    # Earlier reservations that spent no try (snoozes, lost connections).
    given_back: int = 0
    # The call's arguments (without the context), for middleware; read-only.
    args: tuple[Any, ...] = dataclasses.field(default=(), repr=False, compare=False)
    kwargs: Mapping[str, Any] = dataclasses.field(default=MappingProxyType({}), repr=False, compare=False)
    # The level of a cancel request the worker has seen for this run (0: none).
    cancel_probe: Callable[[], int] | None = dataclasses.field(default=None, repr=False, compare=False)
    # The batch this job is a member of, or whose callback it is (batches.py).
    batch_id: int | None = None
    # The durable steps of this run (steps.py): their stored results, read at the first step.
    durable: Steps = dataclasses.field(default_factory=Steps, repr=False, compare=False)

    @property
    def batch(self) -> BatchHandle | None:
        """The job's batch, read now (``batch.is_cancelled``, ``batch.add(...)``); None outside a batch."""
        return None if self.batch_id is None else get_batch(self.batch_id)

    @property
    def cancel_requested(self) -> bool:
        """Tell whether the job was asked to stop (cancelled, past its timeout, its worker stopped twice),
        as the worker learnt within about a second; nothing is raised into a job from outside."""
        return bool(self.cancel_probe is not None and self.cancel_probe())

    def check_cancelled(self) -> None:
        """Raise ``JobCancelled`` if the job was asked to stop; call it where stopping is safe."""
        if self.cancel_requested:
            raise JobCancelled(f"{self.name} (job {self.job_id}) was cancelled while it ran")

    @property
    def is_last_attempt(self) -> bool:
        """Tell whether a failure of this run uses the job's last try."""
        return self.attempt - self.given_back >= self.tries

    def step(self, name: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` as the durable step ``name`` and return its result; if an
        earlier run of this job stored it, return the stored result without running ``fn``.

        ``fn`` runs in a transaction on the queue's database with the INSERT of its result, so its
        writes there and the record of the step commit together: once per job, even under kill -9.
        A name identifies a step: a second step of the same name in one run raises ``ValueError``,
        a step inside a step ``RuntimeError``, a result that cannot be stored ``TypeError``.
        """
        result: T = self.durable.run(self.job_id, name, fn, args, kwargs)
        return result

    async def astep(self, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``step`` for an async job: await ``fn`` (a coroutine function) and store its result once it
        returns, at-least-once (a process that dies between the two runs it again); a plain
        function runs in a thread, with ``step``'s transaction."""
        return await self.durable.arun(self.job_id, name, fn, args, kwargs)

    def snooze(self, seconds: float | timedelta) -> NoReturn:
        """Stop this run and run the job again after ``seconds``, without spending a try."""
        raise Snooze(seconds)

    @property
    def progress_key(self) -> str:
        """Where progress is stored: ``chain:<id>`` for a chain step, else the job's id."""
        return f"chain:{self.chain_id}" if self.chain_id else str(self.job_id)

    def progress(self, percent: float, stage: str = "") -> None:
        """Report progress (0-100, clamped) and a stage; never rolled back; raises only ``JobCancelled``,
        and ``TypeError`` / ``ValueError`` for a percent that is not a number."""
        self.check_cancelled()
        if self.tracker is not None:
            self.tracker.report(percent, stage)
