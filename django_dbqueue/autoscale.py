"""``queue_work --autoscale MIN,MAX``: how many thread slots a worker process runs now, decided
from what it observes (a pure decision: no thread, no database, no clock of its own; ``pool``
starts and ends the threads).

It grows while the queue holds more work than the slots: every slot holds a job and the last
claim came back full (it asked for N jobs and got N, so more are waiting). It doubles, at most
once per ``GROW_INTERVAL``: from 2 to 16 slots in about 3 s under a step load, never to more than
twice the slots it saw full. It shrinks by windows of ``Bounds.idle`` seconds
(``--autoscale-idle``) from the last change: at each window's end the slots go down to the most
jobs held at once in it, never below MIN. A load that comes back within a window keeps its slots
(hysteresis), so a bursty queue does not start and end threads at every burst.
"""

from __future__ import annotations

import dataclasses

# Seconds between two growths: long enough for the slots added to be filled by the next claims
# (and shown full or not), short enough to reach MAX in a few seconds.
GROW_INTERVAL = 1.0
# queue_work --autoscale-idle: the windows' length. Celery's autoscaler waits as long before it
# shrinks (its keepalive); a load that pauses for less, such as bursts every few seconds, keeps
# its threads, and a thread kept idle costs its stack and no database connection.
IDLE_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class Bounds:
    """``queue_work --autoscale MIN,MAX --autoscale-idle SECONDS``: the range of a process's
    thread slots, and the length of the windows at whose end unused slots go."""

    minimum: int
    maximum: int
    idle: float = IDLE_SECONDS

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(f"autoscale needs 1 <= MIN <= MAX, not MIN={self.minimum} MAX={self.maximum}")
        if not self.idle > 0:
            raise ValueError(f"autoscale's idle seconds must be more than 0, not {self.idle!r}")

    def __str__(self) -> str:
        return f"{self.minimum},{self.maximum}"


@dataclasses.dataclass(frozen=True)
class Resize:
    """A change of the slot count, and why: ``backlog`` (grow) or ``idle`` (shrink)."""

    before: int
    after: int
    reason: str


class Autoscaler:
    """The slot count of one process (``slots``), from MIN at ``now``; feed it each claim
    (``claimed``) and the jobs held (``decide``), with a monotonic clock."""

    def __init__(self, bounds: Bounds, now: float) -> None:
        self.bounds = bounds
        self.slots = bounds.minimum
        self._changed_at = now
        # The last claim got all it asked for: more jobs were waiting.
        self._full = False
        # The idle window under way: since when (the last change, or the end of the last
        # window), and the most jobs held at once in it.
        self._window_start = now
        self._peak = 0

    def claimed(self, asked: int, got: int) -> None:
        """A claim asked for ``asked`` jobs and got ``got``."""
        self._full = asked > 0 and got >= asked

    def decide(self, busy: int, now: float) -> Resize | None:
        """Observe ``busy`` jobs held (running, or waiting for a slot) and return the change of
        ``slots`` to make now, if any. Jobs are added where they are observed: between two
        observations the count may only have fallen, so the most held is the most observed."""
        self._peak = max(self._peak, busy)
        bounds, slots = self.bounds, self.slots
        if self._full and busy >= slots and slots < bounds.maximum and now - self._changed_at >= GROW_INTERVAL:
            # Doubling reaches MAX in log2(MAX/MIN) steps, and runs at most twice the slots
            # that were full.
            resize = Resize(slots, min(bounds.maximum, slots * 2), "backlog")
        elif now - self._window_start >= bounds.idle:
            # A window ended: the slots go down to the most it held at once. A new one starts
            # with the jobs held now.
            target = max(bounds.minimum, min(self._peak, slots))
            self._window_start, self._peak = now, busy
            if target == slots:
                return None
            resize = Resize(slots, target, "idle")
        else:
            return None
        self.slots, self._changed_at, self._full = resize.after, now, False
        self._window_start, self._peak = now, busy
        return resize
