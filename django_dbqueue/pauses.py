"""Paused queues: workers claim no job of a paused queue until it is resumed.

A pause is a ``PausedQueue`` row on the queue's database. Every claim skips the
queues that have one, as its process read them at most ``claims.PAUSE_CHECK``
(0.5) seconds earlier, so a pause holds for every claim of every worker, on
every host, that starts half a second after it committed (in the process that
paused: at once); no worker process is told anything. Enqueueing into a
paused queue works as before, and jobs already reserved (running, or claimed
ahead by a worker's ``--batch`` or ``--threads``) run to their end.

Only a known queue can be paused: one that ``DBQUEUE["QUEUES"]`` lists, or,
without that setting, one that something uses (see ``is_known``), so a typo
in ``queue_pause emials`` is an error rather than a pause of nothing. Pass
``force=True`` to pause a queue nothing uses yet, such as before a deploy that
adds it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from django.db import connections, transaction

from . import conf, registry, schedules
from .claims import forget_paused
from .db import DbNow, alias
from .exceptions import UnknownQueue
from .listener import CHANNEL
from .models import FailedJob, Job, PausedQueue
from .operations import served_queues
from .signals import queue_paused, queue_resumed
from .validation import check_queue_name

logger = logging.getLogger("django_dbqueue")


def pause(queue: str, *, force: bool = False) -> bool:
    """Pause ``queue``; return True if it was not paused already.

    Raise ValueError for an invalid name, and ``UnknownQueue`` (a ValueError)
    for a queue nothing uses, unless ``force``.
    """
    return pause_many([queue], force=force)[queue]


def pause_many(queues: Iterable[str], *, force: bool = False) -> dict[str, bool]:
    """Pause each of ``queues``; return, per queue, whether it was not paused already.

    Every name is checked before anything is paused: one invalid or unknown name
    raises and pauses none of them.
    """
    names = _checked(queues)
    if not force:
        unknown = [queue for queue in names if not is_known(queue)]
        if unknown:
            raise UnknownQueue(_unknown_message(unknown))
    changed: dict[str, bool] = {}
    with transaction.atomic(using=alias()):
        for queue in names:
            # get_or_create: a pause racing this one makes the INSERT fail, and the row is read instead.
            _, created = PausedQueue.objects.get_or_create(queue=queue, defaults={"paused_at": DbNow()})
            changed[queue] = created
        # At once, for claims on this connection, and again when the change is visible to others.
        forget_paused()
        transaction.on_commit(forget_paused, using=alias())
    for queue, created in changed.items():
        if created:
            logger.info("queue paused queue=%s", queue)
            _send(queue_paused, queue)
    return changed


def resume(queue: str) -> bool:
    """Resume ``queue``; return True if it was paused. Raise ValueError for an invalid name."""
    return resume_many([queue])[queue]


def resume_many(queues: Iterable[str]) -> dict[str, bool]:
    """Resume each of ``queues``; return, per queue, whether it was paused.

    On PostgreSQL, idle workers listening for new jobs are woken as the resume
    commits; elsewhere they find the jobs at their next poll.
    """
    names = _checked(queues)
    changed: dict[str, bool] = {}
    using = alias()
    with transaction.atomic(using=using):
        for queue in names:
            deleted, _ = PausedQueue.objects.filter(queue=queue).delete()
            changed[queue] = bool(deleted)
        # At once, for claims on this connection, and again when the change is visible to others.
        forget_paused()
        transaction.on_commit(forget_paused, using=using)
        resumed = [queue for queue, was_paused in changed.items() if was_paused]
        if resumed and connections[using].vendor == "postgresql":
            with connections[using].cursor() as cursor:
                for queue in resumed:
                    # Delivered when the transaction commits, as the enqueue trigger's NOTIFY is.
                    cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, queue])
    for queue in resumed:
        logger.info("queue resumed queue=%s", queue)
        _send(queue_resumed, queue)
    return changed


def resume_all() -> list[str]:
    """Resume every paused queue; return the queues resumed, sorted."""
    return sorted(queue for queue, was_paused in resume_many(paused_queues()).items() if was_paused)


def paused_queues() -> list[str]:
    """The paused queues, sorted."""
    return sorted(PausedQueue.objects.values_list("queue", flat=True))


def is_paused(queue: str) -> bool:
    return PausedQueue.objects.filter(queue=queue).exists()


def known_queues() -> set[str]:
    """The queues named where it is cheap to look: ``DBQUEUE["QUEUES"]`` if set; else
    ``DBQUEUE["QUEUE"]``, the job definitions, the periodic schedules, the
    ``django.tasks`` backends of this package, the queues live workers serve;
    and the paused queues. ``is_known`` also accepts a queue that holds jobs or failed jobs."""
    allowed = conf.get("QUEUES")
    known = set(PausedQueue.objects.values_list("queue", flat=True))
    if allowed is not None:
        return known | set(allowed)
    known.add(str(conf.get("QUEUE")))
    known.update(definition.effective_queue for definition in registry.all_definitions().values())
    for schedule in schedules.all_schedules().values():
        definition = schedule.definition or registry.find(schedule.job_name)
        if definition is not None:
            known.add(definition.effective_queue)
    known.update(_task_queues())
    known.update(served_queues())
    return known


def is_known(queue: str) -> bool:
    """Tell whether ``queue`` may be paused without ``force``: see ``known_queues``, and
    without ``DBQUEUE["QUEUES"]`` a queue that holds jobs or failed jobs."""
    if queue in known_queues():
        return True
    if conf.get("QUEUES") is not None:
        return False
    return Job.objects.filter(queue=queue).exists() or FailedJob.objects.filter(queue=queue).exists()


def _checked(queues: Iterable[str]) -> list[str]:
    """The names, each checked (ValueError for an invalid one), without repeats, in order."""
    return list(dict.fromkeys(check_queue_name(queue) for queue in queues))


def _unknown_message(unknown: list[str]) -> str:
    names = ", ".join(repr(queue) for queue in unknown)
    which = f"unknown queue {names}" if len(unknown) == 1 else f"unknown queues {names}"
    known = ", ".join(sorted(known_queues())) or "none"
    if conf.get("QUEUES") is not None:
        why = f"DBQUEUE['QUEUES'] lists {known}"
    else:
        why = (
            "no job definition, schedule, live worker, job or failed job uses it, and it is not "
            f"DBQUEUE['QUEUE'] (known queues: {known})"
        )
    return f"{which}: {why}; pass force=True (queue_pause --force) to pause a queue before anything uses it"


def _task_queues() -> set[str]:
    """The queues declared by the ``TASKS`` backends that are this package's (Django 6.0 and later)."""
    return conf.task_backend_queues() or set()


def _send(signal: Any, queue: str) -> None:
    """Send a pause signal; a receiver that raises is logged and changes nothing."""
    for receiver, response in signal.send_robust(sender=PausedQueue, queue=queue):
        if isinstance(response, Exception):
            logger.error("queue signal receiver %r raised", receiver, exc_info=response)


# The names the package root exports.
pause_queue = pause
resume_queue = resume
