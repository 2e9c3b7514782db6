"""``queue_work --concurrency N``: N worker processes under one supervisor, which forwards SIGTERM
and SIGINT, starts a new one when one dies or recycles, and reclaims a dead one's jobs at once.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time
from collections.abc import Callable
from types import FrameType

from django.db import DatabaseError, connections

from .db import close_before_fork
from .lifecycle import reclaim_worker
from .worker import EXIT_TIMED_OUT, StopReason, Worker, WorkerOptions
from .workers import new_worker_id

logger = logging.getLogger("django_dbqueue")

# A child exits with this code to be replaced by a fresh process.
EXIT_RECYCLE = 75
# A child exits with this code after queue_restart: the supervisor exits too,
# so its process manager starts it again on the new code.
EXIT_RESTART = 76
RECYCLE_REASONS = {StopReason.MAX_JOBS, StopReason.MEMORY}
# A child that dies sooner than this after its start is restarted after a pause.
CRASH_LOOP_SECONDS = 1.0

LOST_ERROR = (
    "The worker process {worker_id} that ran this job ended unexpectedly ({how}) after "
    "running it for about {elapsed:.0f} s. If the job ran past its timeout and did not "
    "stop, the process was ended by force; otherwise it crashed or was killed (look at "
    "the worker's log and the system's OOM killer)."
)


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


class Supervisor:
    def __init__(
        self, options: WorkerOptions, concurrency: int, run_child: Callable[[WorkerOptions, str], int] | None = None
    ) -> None:
        self.options = options
        self.concurrency = concurrency
        self.children: dict[int, tuple[str, float]] = {}
        self.stopping = False
        self._run_child = run_child or _run_child

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for _ in range(self.concurrency):
                self._spawn()
            while self.children:
                try:
                    pid, status = os.wait()
                except ChildProcessError:
                    break
                self._reap(pid, status)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        logger.info("supervisor stopped pid=%s", os.getpid())
        return 0

    def _spawn(self) -> None:
        token = secrets.token_hex(3)
        close_before_fork()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(signum, signal.SIG_DFL)
                # Own process group: a terminal's Ctrl-C reaches the supervisor only,
                # which forwards it once.
                os.setpgid(0, 0)
                code = self._run_child(self.options, new_worker_id(token=token))
            except BaseException:
                logger.exception("worker process crashed")
            finally:
                os._exit(code)
        self.children[pid] = (new_worker_id(pid=pid, token=token), time.monotonic())
        logger.info("worker process started pid=%s", pid)

    def _reap(self, pid: int, status: int) -> None:
        worker_id, started = self.children.pop(pid, ("", 0.0))
        if not worker_id:
            return
        code = os.waitstatus_to_exitcode(status)
        if code == 0:
            logger.info("worker process exited pid=%s", pid)
            return
        if code == EXIT_RESTART:
            logger.info("worker process exited for a restart pid=%s; the supervisor exits when all have", pid)
            self.stopping = True
            return
        if code == EXIT_RECYCLE:
            logger.info("worker process recycled pid=%s", pid)
        elif code == EXIT_TIMED_OUT:
            # A job it asked to stop (timeout, hard cancel) ran on: it recorded that job and
            # gave back the others; reclaim what it could not.
            logger.warning("worker process ended after a job that did not stop pid=%s; starting another", pid)
            self._reclaim(worker_id, "ended after a job did not stop at its timeout or a hard cancel")
        else:
            how = describe_status(status)
            logger.error("worker process died pid=%s %s", pid, how)
            self._reclaim(worker_id, how)
            if time.monotonic() - started < CRASH_LOOP_SECONDS:
                time.sleep(CRASH_LOOP_SECONDS)
        if not self.stopping:
            self._spawn()

    def _reclaim(self, worker_id: str, how: str) -> None:
        try:
            count = reclaim_worker(
                worker_id,
                default_tries=self.options.defaults.tries,
                error_for=lambda elapsed: LOST_ERROR.format(worker_id=worker_id, how=how, elapsed=elapsed),
            )
        except DatabaseError:
            logger.exception("could not reclaim the jobs of %s; they are reclaimed after retry_after", worker_id)
            return
        finally:
            connections.close_all()
        if count:
            logger.warning("reclaimed jobs=%s of dead worker_id=%s", count, worker_id)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        logger.info(
            "supervisor forwarding %s to %s worker process(es)", signal.Signals(signum).name, len(self.children)
        )
        for pid in list(self.children):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def _run_child(options: WorkerOptions, worker_id: str) -> int:
    child_options = WorkerOptions(**{**options.__dict__, "parent_pid": os.getppid()})
    reason = Worker(child_options, worker_id=worker_id).run()
    if reason is StopReason.RESTART:
        return EXIT_RESTART
    return EXIT_RECYCLE if reason in RECYCLE_REASONS else 0
