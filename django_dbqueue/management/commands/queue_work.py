import logging
import sys
from typing import Any

from django.core.management.base import CommandError

from django_dbqueue import conf, registry, schema
from django_dbqueue.autoscale import GROW_INTERVAL, IDLE_SECONDS, Bounds
from django_dbqueue.checks import (
    check_sqlite,
    check_worker,
    check_worker_connections,
    check_worker_queues,
    check_worker_queues_used,
)
from django_dbqueue.db import alias
from django_dbqueue.execution import Defaults
from django_dbqueue.management.base import QueueCommand
from django_dbqueue.management.options import (
    backoff,
    number,
    queue_list,
    seconds,
    tries,
    whole_number,
    whole_number_range,
)
from django_dbqueue.supervisor import Supervisor
from django_dbqueue.worker import BATCH_WINDOW, DEFAULT_BATCH, MAX_ASYNC, MAX_THREADS, StopReason, Worker, WorkerOptions

# Laravel's queue:work exits with 12 when it stops for memory.
EXIT_MEMORY = 12
# Options that, when not given, take the setting of their name.
FROM_SETTINGS = ("sleep", "tries", "timeout", "backoff")


class Command(QueueCommand):
    help = "Run jobs from the queue until stopped (SIGTERM or SIGINT finish the current job first)."

    def add_arguments(self, parser: Any) -> None:
        settings = conf.get_settings()
        add = parser.add_argument
        add(
            "--queue",
            type=queue_list,
            help=f"Queues to serve, comma-separated, highest priority first (default: {settings['QUEUE']}).",
        )
        add("--sleep", type=seconds(), help=f"Seconds to wait when no job is available (default: {settings['SLEEP']}).")
        add("--tries", type=tries, help=f"Tries for jobs that set none (default: {settings['TRIES']}).")
        add(
            "--timeout",
            type=seconds(whole=True),
            help=f"Seconds a job may run, for jobs that set none; 0 for no limit (default: {settings['TIMEOUT']}).",
        )
        add(
            "--backoff",
            type=backoff,
            help=f"Seconds before a failed job runs again, one per attempt as '10,60,300', or "
            f"'exponential' (1, 2, 4 ... s up to 600, jittered), for jobs that set none "
            f"(default: {settings['BACKOFF']}).",
        )
        add("--max-jobs", type=whole_number(1), help="Stop after this many jobs (default: no limit).")
        add("--max-time", type=seconds(0.001), help="Stop after this many seconds (default: no limit).")
        add(
            "--memory",
            type=number(int, 1, "whole megabytes"),
            help="Stop after a job once resident memory passes this many MB (default: no limit).",
        )
        stopping = parser.add_mutually_exclusive_group()
        stopping.add_argument(
            "--stop-when-empty",
            action="store_true",
            help="Stop when no job is available now (delayed jobs, such as retries in their backoff, do not count).",
        )
        stopping.add_argument(
            "--until-done",
            action="store_true",
            help="Stop once the queues hold no job at all: none waiting, delayed (retries, rate-limited jobs) "
            "or running; jobs of a paused queue do not count.",
        )
        add("--once", action="store_true", help="Process at most one job, then stop.")
        add("--rest", type=seconds(), default=0.0, help="Seconds to rest after each job (default: 0).")
        add(
            "--batch",
            type=whole_number(1),
            default=DEFAULT_BATCH,
            help="Most jobs to claim per round trip for each slot (with --threads or --async: "
            "per thread or task), and to delete per statement once done, when jobs are "
            "quick: the worker claims about as many as its free slots run in "
            f"{BATCH_WINDOW * 1000:g} ms, so slow jobs are claimed one at a time "
            f"(default: {DEFAULT_BATCH}; 1 claims one job at a time).",
        )
        add(
            "--concurrency",
            type=whole_number(1),
            help="Run N worker processes under a supervisor that restarts any that "
            "die (default: one worker in this process).",
        )
        add(
            "--threads",
            type=whole_number(1, MAX_THREADS),
            help="Run up to N sync jobs at once in this process, each in its own thread "
            "with its own database connection; for jobs that wait on the network "
            "(default: 1, jobs run one at a time in the main thread).",
        )
        add(
            "--autoscale",
            type=whole_number_range(1, MAX_THREADS),
            metavar="MIN,MAX",
            help="Run from MIN to MAX sync jobs at once in this process, in threads that follow the "
            f"queue: MIN at the start, twice as many (at most every {GROW_INTERVAL:g} s, up to MAX) while every "
            "thread is busy and more jobs wait, back toward MIN when threads stay unused "
            "(--autoscale-idle); a thread ends between two jobs, never during one. The numbers "
            "may come in either order (Celery writes MAX,MIN). Not with --threads; with "
            "--async-concurrency the async slots stay fixed; with --concurrency each process "
            "scales its own threads (default: a fixed number of threads, --threads).",
        )
        add(
            "--autoscale-idle",
            type=seconds(1),
            metavar="SECONDS",
            help="With --autoscale: the threads go down every SECONDS from the last change, to the "
            "most jobs held at once in those seconds, never below MIN; a load that comes back "
            f"sooner keeps its threads (default: {IDLE_SECONDS:g}).",
        )
        add(
            "--async-concurrency",
            type=whole_number(0, MAX_ASYNC),
            default=0,
            help="Run up to N 'async def' jobs at once on one event loop in this process "
            "(default: 0, an async job runs like a sync one).",
        )
        add(
            "--no-schedule",
            action="store_true",
            help="Do not tick the periodic schedules (default: every worker ticks them; each tick runs once).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["concurrency"] and options["once"]:
            raise CommandError("--once and --concurrency cannot be combined")
        autoscale = self._autoscale(options)
        threads = options["threads"] or 1
        self._configure_logging(options["verbosity"])
        # An option not given takes its setting.
        settings = conf.get_settings()
        given = {key: settings[key.upper()] if options[key] is None else options[key] for key in FROM_SETTINGS}
        timeout = given["timeout"] or None
        queues = options["queue"] or [settings["QUEUE"]]
        # Before anything reads a table: a worker started before migrate would retry for ever.
        with self.refusing(schema.NotMigrated):
            schema.require_migrated(alias())
        for message in [
            *check_worker_queues(queues),
            *check_worker_queues_used(queues),
            *check_sqlite(databases=[alias()]),
            *check_worker(options["concurrency"], timeout),
            *check_worker_connections(
                options["concurrency"] or 1, autoscale.maximum if autoscale else threads, options["async_concurrency"]
            ),
        ]:
            self.stderr.write(self.style.WARNING(str(message)))
        if not registry.all_definitions():
            self.stderr.write(
                self.style.WARNING("No jobs are registered: put @job functions in an installed app's jobs.py.")
            )
        worker_options = WorkerOptions(
            queues=queues,
            defaults=Defaults(
                tries=given["tries"], timeout=timeout, backoff=given["backoff"], timeout_grace=settings["TIMEOUT_GRACE"]
            ),
            sleep=given["sleep"],
            rest=options["rest"],
            max_jobs=options["max_jobs"],
            max_time=options["max_time"],
            memory=options["memory"],
            stop_when_empty=options["stop_when_empty"],
            until_done=options["until_done"],
            once=options["once"],
            batch=options["batch"],
            threads=threads,
            async_concurrency=options["async_concurrency"],
            autoscale=autoscale,
            schedule=not options["no_schedule"],
        )
        if options["concurrency"]:
            sys.exit(Supervisor(worker_options, options["concurrency"]).run())
        with self.refusing(schema.NotMigrated):
            reason = Worker(worker_options).run()
        if reason is StopReason.MEMORY:
            sys.exit(EXIT_MEMORY)

    def _autoscale(self, options: dict[str, Any]) -> Bounds | None:
        """The bounds of ``--autoscale`` and ``--autoscale-idle``, or None; refuse them with ``--threads``."""
        if options["autoscale"] is None:
            if options["autoscale_idle"] is not None:
                raise CommandError("--autoscale-idle needs --autoscale MIN,MAX")
            return None
        if options["threads"] is not None:
            raise CommandError(
                "--autoscale and --threads cannot be combined: --autoscale MIN,MAX runs from MIN to MAX threads"
            )
        low, high = options["autoscale"]
        return Bounds(low, high, idle=options["autoscale_idle"] or IDLE_SECONDS)

    def _configure_logging(self, verbosity: int) -> None:
        """Show one line per job on stderr, unless the project configured our logger."""
        logger = logging.getLogger("django_dbqueue")
        if logger.handlers or verbosity == 0:
            return
        handler = logging.StreamHandler(self.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(process)d] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG if verbosity >= 3 else logging.INFO)
