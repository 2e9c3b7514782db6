"""Paused queues: workers claim no job of a paused queue (a ``PausedQueue`` row) until it is resumed.

Claims skip the paused queues read at most ``claims.PAUSE_CHECK`` seconds earlier; enqueueing
goes on, and reserved jobs run to their end. Only a known queue can be paused (``is_known``),
so a typo is an error, unless ``force=True``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from django.db import transaction

from . import conf, registry, schedules
from .claims import forget_paused
from .db import DbNow, alias, notify_queues
from .exceptions import UnknownQueue
from .models import FailedJob, Job, PausedQueue
from .operations import served_queues
from .signals import queue_paused, queue_resumed
from .validation import check_queue_name

logger = logging.getLogger("django_dbqueue")


def pause(queue: str, *, force: bool = False) -> bool:
    """Pause ``queue``; return True if it was not paused already. Raise ValueError for an invalid
    name, and ``UnknownQueue`` (a ValueError) for a queue nothing uses, unless ``force``."""
    return pause_many([queue], force=force)[queue]


def pause_many(queues: Iterable[str], *, force: bool = False) -> dict[str, bool]:
    """``pause`` each of ``queues``; return, per queue, whether it was not paused already. One
    invalid or unknown name raises and pauses none of them."""
    names = _checked(queues)
    if not force:
        unknown = [queue for queue in names if not is_known(queue)]
        if unknown:
            raise UnknownQueue(_unknown_message(unknown))
    changed: dict[str, bool] = {}
    with transaction.atomic(using=alias()):
        for queue in names:
            _, created = PausedQueue.objects.get_or_create(queue=queue, defaults={"paused_at": DbNow()})
            changed[queue] = created
        _forget_paused(alias())
    _announce(queue_paused, "paused", changed)
    return changed


def resume(queue: str) -> bool:
    """Resume ``queue``; return True if it was paused. Raise ValueError for an invalid name."""
    return resume_many([queue])[queue]


def resume_many(queues: Iterable[str]) -> dict[str, bool]:
    """``resume`` each of ``queues``; return, per queue, whether it was paused (on PostgreSQL,
    listening workers are woken as the resume commits)."""
    names = _checked(queues)
    changed: dict[str, bool] = {}
    using = alias()
    with transaction.atomic(using=using):
        for queue in names:
            deleted, _ = PausedQueue.objects.filter(queue=queue).delete()
            changed[queue] = bool(deleted)
        _forget_paused(using)
        resumed = [queue for queue, was_paused in changed.items() if was_paused]
        notify_queues(using, resumed)
    _announce(queue_resumed, "resumed", changed)
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
    """The paused queues and ``DBQUEUE["QUEUES"]`` if set; else ``DBQUEUE["QUEUE"]`` and the queues
    of the job definitions, schedules, ``django.tasks`` backends and live workers."""
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
    known.update(conf.task_backend_queues() or set())
    known.update(served_queues())
    return known


def is_known(queue: str) -> bool:
    """Whether ``queue`` may be paused without ``force``: ``known_queues``, or without
    ``DBQUEUE["QUEUES"]`` a queue that holds jobs or failed jobs."""
    if queue in known_queues():
        return True
    if conf.get("QUEUES") is not None:
        return False
    return Job.objects.filter(queue=queue).exists() or FailedJob.objects.filter(queue=queue).exists()


def _checked(queues: Iterable[str]) -> list[str]:
    """The names, each checked (ValueError for an invalid one), without repeats."""
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


def _forget_paused(using: str) -> None:
    """Forget the paused queues at once, for claims on this connection, and again at commit, for others."""
    forget_paused()
    transaction.on_commit(forget_paused, using=using)


def _announce(signal: Any, done: str, changed: dict[str, bool]) -> None:
    """Log and signal each queue ``changed`` (paused or resumed); a receiver that raises is logged."""
    for queue in (queue for queue, was_changed in changed.items() if was_changed):
        logger.info("queue %s queue=%s", done, queue)
        for receiver, response in signal.send_robust(sender=PausedQueue, queue=queue):
            if isinstance(response, Exception):
                logger.error("queue signal receiver %r raised", receiver, exc_info=response)


# The names the package root exports.
pause_queue = pause
resume_queue = resume
