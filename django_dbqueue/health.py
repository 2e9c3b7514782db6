"""Health checks for probes: ``queue_health`` (exit 0, 1 or 2) and ``health_view`` (JSON, 200 or 503).

The checks, in order: the queue's databases answer ``SELECT 1`` (else the status is *unknown*);
the app's tables and latest migration are there (else *unhealthy*: run ``manage.py migrate
django_dbqueue``); enough live workers (of a host, or of any); no queue that is not paused holds more than
``max_depth`` waiting jobs or one waiting longer than ``max_age``; no transaction open on the server
for longer than ``max_transaction_age`` (while one is, vacuum cannot remove the rows of finished jobs
and every claim reads past them). The status is the worst of them.
A database error is named by its driver's first line on the command line and by its class alone in
the view: the driver's text names hosts, ports and users, which a token holder has no need to learn.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

from django.db import DatabaseError, connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_safe

from . import operations, schema, workers
from .db import alias, oldest_transaction
from .management import options
from .metrics import HEALTH_PERMISSIONS, no_store, refusal, refused
from .models import QueueWorker


class Status(enum.IntEnum):
    """A check's outcome; the value is ``queue_health``'s exit code."""

    HEALTHY = 0
    UNHEALTHY = 1
    # The database cannot be read: whether the queue is healthy cannot be told.
    UNKNOWN = 2

    @property
    def word(self) -> str:
        return self.name.lower()


@dataclasses.dataclass(frozen=True)
class Finding:
    check: str
    status: Status
    reason: str


@dataclasses.dataclass(frozen=True)
class Report:
    findings: tuple[Finding, ...]

    @property
    def status(self) -> Status:
        return max((finding.status for finding in self.findings), default=Status.HEALTHY)

    @property
    def reason(self) -> str:
        """One line: the reasons of the worst findings, or of every finding when all are healthy."""
        worst = [finding.reason for finding in self.findings if finding.status == self.status]
        return f"{self.status.word}: {'; '.join(worst)}"

    def as_dict(self) -> dict[str, Any]:
        checks = [dataclasses.asdict(finding) | {"status": finding.status.word} for finding in self.findings]
        return {"status": self.status.word, "reason": self.reason, "checks": checks}


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """What a probe asks for; None and 0 leave a check out."""

    # Live workers needed, and on which host (None: any host).
    workers: int = 1
    host: str | None = None
    # Most waiting jobs a queue may hold, and most seconds its oldest may have waited.
    max_depth: int | None = None
    max_age: float | None = None
    # The queues to judge; None: every queue with jobs.
    queues: Sequence[str] | None = None
    # Most seconds a transaction may stay open on the queue's database server.
    max_transaction_age: float | None = None


def this_host() -> str:
    """This machine's name as worker rows store it (``workers.register``)."""
    return workers.hostname()


def _error(exc: DatabaseError, details: bool) -> str:
    """The driver's first line with ``details``, else the exception's class only."""
    lines = str(exc).strip().splitlines() if details else []
    return lines[0] if lines else type(exc).__name__


def check_database(*, details: bool = True) -> Finding:
    aliases = list(dict.fromkeys([alias(), operations.read_alias()]))
    for name in aliases:
        try:
            with connections[name].cursor() as cursor:
                cursor.execute("SELECT 1")
                cursor.fetchone()
        except DatabaseError as exc:
            return Finding("database", Status.UNKNOWN, f"database {name!r} unreachable: {_error(exc, details)}")
    return Finding("database", Status.HEALTHY, f"database {' and '.join(map(repr, aliases))} reachable")


def check_workers(needed: int, host: str | None) -> Finding:
    rows = QueueWorker.objects.exclude(workers.dead_rows())
    if host is not None:
        rows = rows.filter(hostname=host)
    live = rows.count()
    where = f"on host {host!r}" if host is not None else "on any host"
    found = f"{_jobs(live, 'live worker')} {where}"
    if live < needed:
        found += f", {needed} needed (a worker is live if it beat within {workers.dead_after():g} s)"
    return Finding("workers", Status.HEALTHY if live >= needed else Status.UNHEALTHY, found)


def check_queues(max_depth: int | None, max_age: float | None, queues: Sequence[str] | None) -> list[Finding]:
    stats = operations.queue_overview_of(queues) if queues else operations.queue_overview()
    reasons = []
    for item in (item for item in stats if not item.paused):
        if max_depth is not None and item.waiting > max_depth:
            reasons.append(f"queue {item.queue!r} has {_jobs(item.waiting, 'waiting job')} (max {max_depth})")
        age = item.oldest_waiting_seconds
        if max_age is not None and age is not None and age > max_age:
            reasons.append(f"queue {item.queue!r} has a job waiting for {age:.0f} s (max {max_age:g} s)")
    if reasons:
        return [Finding("queues", Status.UNHEALTHY, reason) for reason in reasons]
    limits = [_jobs(max_depth, "waiting job")] if max_depth is not None else []
    if max_age is not None:
        limits.append(f"a wait of {max_age:g} s")
    return [Finding("queues", Status.HEALTHY, f"no queue over {' or '.join(limits)}")]


def check_transactions(max_age: float) -> Finding:
    oldest = oldest_transaction()
    if oldest is not None and oldest.seconds > max_age:
        return Finding(
            "transactions",
            Status.UNHEALTHY,
            f"a transaction has been {oldest}, max {max_age:g} s: until it ends, vacuum cannot "
            "remove the rows of finished jobs and claims slow down (PostgreSQL's "
            "idle_in_transaction_session_timeout ends sessions left idle in one)",
        )
    return Finding("transactions", Status.HEALTHY, f"no transaction open longer than {max_age:g} s")


def _jobs(count: int, what: str) -> str:
    return f"{count} {what}{'' if count == 1 else 's'}"


def probe(thresholds: Thresholds, *, details: bool = True) -> Report:
    """Run the checks ``thresholds`` ask for; the database's first, and nothing else if it cannot be
    read or lacks the app's tables or latest migration.
    Without ``details`` a database error is named by its class, not by the driver's text."""
    database = check_database(details=details)
    if database.status != Status.HEALTHY:
        return Report((database,))
    missing = schema.problem(alias())
    if missing is not None:
        return Report((database, Finding("migrations", Status.UNHEALTHY, missing)))
    findings = [database]
    try:
        if thresholds.workers:
            findings.append(check_workers(thresholds.workers, thresholds.host))
        if thresholds.max_depth is not None or thresholds.max_age is not None:
            findings.extend(check_queues(thresholds.max_depth, thresholds.max_age, thresholds.queues))
        if thresholds.max_transaction_age is not None:
            findings.append(check_transactions(thresholds.max_transaction_age))
    except DatabaseError as exc:
        # Reachable, but the tables cannot be read (not migrated, no privilege, a lost connection).
        findings.append(
            Finding("database", Status.UNKNOWN, f"the queue's tables cannot be read: {_error(exc, details)}")
        )
    return Report(tuple(findings))


def thresholds_from(query: Any) -> Thresholds:
    """Read ``?workers=&host=&max_depth=&max_age=&max_transaction_age=&queue=`` (``queue`` repeated or comma-separated);
    raise ``argparse.ArgumentTypeError`` naming a bad value."""

    def one(name: str, parse: Any, default: Any, text: str | None = None) -> Any:
        text = query.get(name) if text is None else text
        if not text:
            return default
        try:
            return parse(text)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{name}: {exc}") from None

    names = [name for text in query.getlist("queue") for name in text.split(",") if name]
    queues = [one("queue", options.queue_name, None, name) for name in names]
    return Thresholds(
        workers=one("workers", options.whole_number(0), 1),
        host=query.get("host") or None,
        max_depth=one("max_depth", options.whole_number(0), None),
        max_age=one("max_age", options.seconds(0), None),
        queues=queues or None,
        max_transaction_age=one("max_transaction_age", options.seconds(0), None),
    )


@require_safe
def health_view(request: HttpRequest) -> HttpResponse:
    """Answer 200 with the checks when the queue is healthy, 503 when it is not or cannot be told.
    Without ``?host=`` the workers of any host count: the web process is seldom where they run."""
    reason = refusal(request, HEALTH_PERMISSIONS)
    if reason is not None:
        return refused(reason, json=True)
    try:
        thresholds = thresholds_from(request.GET)
    except argparse.ArgumentTypeError as exc:
        return refused((400, str(exc)), json=True)
    report = probe(thresholds, details=False)
    return no_store(JsonResponse(report.as_dict(), status=200 if report.status == Status.HEALTHY else 503))
