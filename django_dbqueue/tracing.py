"""Traces (OpenTelemetry): a producer span for each job enqueued, a consumer span for each run.

Active only with the ``otel`` extra (``enabled``, checked by every hook first); with the API but
no SDK no span is made, and a context the caller has is passed on. ``enqueue_context`` gives the
envelope's ``trace`` key; ``start_run``/``end_run`` wrap a run in a span whose parent (and link)
is that context; ``continued`` makes the run's context current while its follow-ups are built.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from .errors import clean

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer, TracerProvider

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
except ImportError:  # the otel extra is not installed: every hook is skipped
    enabled = False
else:
    enabled = True


class Job(Protocol):
    """What a span reads of a ``models.Job`` row."""

    name: str
    queue: str
    attempts: int
    payload: str

    @property
    def pk(self) -> Any: ...


class Prepared(Protocol):
    """What a run's span reads of ``execution.Prepared``."""

    @property
    def job(self) -> Job: ...
    @property
    def envelope(self) -> dict[str, Any]: ...
    @property
    def worker_id(self) -> str: ...


class Outcome(Protocol):
    """What a run's span reads of ``execution.Outcome``."""

    @property
    def status(self) -> str: ...
    @property
    def exception(self) -> BaseException | None: ...
    @property
    def error(self) -> str: ...
    @property
    def snoozed(self) -> bool: ...
    @property
    def exception_class(self) -> str: ...


ENVELOPE_KEY = "trace"  # the envelope key of the enqueue span's context
SYSTEM = "django_dbqueue"
_RUN_CONTEXT = "_dbqueue_trace_context"

_tracer: Tracer | None = None
_provider: TracerProvider | None = None


def use_tracer_provider(provider: TracerProvider | None) -> None:
    """Make dbqueue's spans with ``provider`` instead of the global tracer provider (None: the global one again)."""
    global _tracer, _provider
    _provider = provider
    _tracer = None


def _get_tracer() -> Tracer | None:
    """The tracer to make spans with; None while its spans would be no-ops (no SDK)."""
    global _tracer
    if _tracer is None:
        # Else the global one's proxy tracer, which follows a provider set later.
        provider = _provider if _provider is not None else trace.get_tracer_provider()
        _tracer = provider.get_tracer("django_dbqueue")
    # A proxy delegates to a NoOpTracer until a provider is set: its private ``_tracer`` tells
    # so far faster than a no-op span (without it, spans are started and found invalid).
    if isinstance(getattr(_tracer, "_tracer", _tracer), trace.NoOpTracer):
        return None
    return _tracer


def carries() -> bool:
    """Tell whether ``enqueue_context`` may return something now (asked once for many enqueues)."""
    return _get_tracer() is not None or trace.get_current_span().get_span_context().is_valid


def enqueue_context(step: dict[str, Any]) -> dict[str, str] | None:
    """Record the enqueue of ``step`` as a span; return the trace context to store, or None."""
    tracer = _get_tracer()
    if tracer is None:
        # No SDK: no span, and the caller's own context, if it has one, is passed on.
        if not trace.get_current_span().get_span_context().is_valid:
            return None
        context = None
    else:
        queue = step["queue"]
        span = tracer.start_span(
            f"enqueue {queue}",
            kind=trace.SpanKind.PRODUCER,
            attributes={
                "messaging.system": SYSTEM,
                "messaging.operation.type": "create",
                "messaging.operation.name": "enqueue",
                "messaging.destination.name": queue,
                "dbqueue.job.name": step["name"],
            },
        )
        span.end()
        if not span.get_span_context().is_valid:
            return None
        context = trace.set_span_in_context(span)
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier or None


def _stored_context(envelope: dict[str, Any]) -> Context | None:
    """The context extracted from an envelope's trace key; None without a valid one."""
    carrier = envelope.get(ENVELOPE_KEY)
    if not isinstance(carrier, dict):
        return None
    try:
        context = propagate.extract({key: value for key, value in carrier.items() if isinstance(value, str)})
    except Exception:  # noqa: BLE001 - a propagator's fault with a damaged carrier must not fail the job
        return None
    return context if trace.get_current_span(context).get_span_context().is_valid else None


class Run:
    """The consumer span of one run (None without an SDK), and the context it made current."""

    __slots__ = ("context", "span", "token")

    def __init__(self, span: Span | None, context: Context) -> None:
        self.span = span
        self.context = context
        self.token = otel_context.attach(context)


def start_run(prepared: Prepared) -> Run | None:
    """Start the consumer span of a prepared job's run and make it current here; None: nothing to carry."""
    parent = _stored_context(prepared.envelope)
    tracer = _get_tracer()
    if tracer is None:
        # No SDK: the stored context is current while the job runs, so its own calls pass it on.
        return Run(None, parent) if parent is not None else None
    span = _start_run_span(tracer, prepared.job, prepared.worker_id, parent)
    return Run(span, trace.set_span_in_context(span, parent))


def end_run(run: Run | None, job: Job, outcome: Outcome | None) -> None:
    """End a run's span with its outcome (None: the run's own code failed) and restore the context."""
    if run is None:
        return
    otel_context.detach(run.token)
    if run.span is not None:
        _finish(run.span, outcome)
    # Read by ``continued`` when the worker builds what follows the job.
    job.__dict__[_RUN_CONTEXT] = run.context


def unrunnable(job: Job, outcome: Outcome, worker_id: str) -> None:
    """Record a claimed job that could not become a call (unknown name, bad payload) as a run span."""
    tracer = _get_tracer()
    if tracer is None:
        return
    try:
        envelope = json.loads(job.payload)
    except (ValueError, RecursionError):
        envelope = None
    parent = _stored_context(envelope) if isinstance(envelope, dict) else None
    _finish(_start_run_span(tracer, job, worker_id, parent), outcome)


def _start_run_span(tracer: Tracer, job: Job, worker_id: str, parent: Context | None) -> Span:
    # The stored context is the parent and also a link (docs/observability.md).
    return tracer.start_span(
        f"run {job.queue}",
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        attributes=_run_attributes(job, worker_id),
        links=[trace.Link(trace.get_current_span(parent).get_span_context())] if parent is not None else None,
    )


def _run_attributes(job: Job, worker_id: str) -> dict[str, Any]:
    attributes = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "process",
        "messaging.operation.name": "run",
        "messaging.destination.name": job.queue,
        "messaging.message.id": str(job.pk),
        "dbqueue.job.name": job.name,
        "dbqueue.job.attempt": job.attempts,
    }
    if worker_id:
        attributes["messaging.client.id"] = worker_id
    return attributes


def _finish(span: Span, outcome: Outcome | None) -> None:
    if span.is_recording():
        if outcome is None:
            span.set_status(trace.StatusCode.ERROR, "the worker failed to run the job")
        elif outcome.snoozed:
            # Not an error: the job put itself back.
            span.set_attribute("dbqueue.job.outcome", "snoozed")
        else:
            span.set_attribute("dbqueue.job.outcome", outcome.status)
            if outcome.exception is not None:
                _record_error(span, outcome)
    span.end()


def _record_error(span: Span, outcome: Outcome) -> None:
    """Record a run's exception and the span's ERROR status, the text cleaned as for ``FailedJob``."""
    exception = outcome.exception
    assert exception is not None
    message = clean(str(exception))
    span.set_attribute("error.type", outcome.exception_class)
    span.record_exception(
        exception,
        # Not the SDK's own uncleaned traceback: the outcome's error, cleaned.
        attributes={"exception.message": message, "exception.stacktrace": outcome.error},
    )
    span.set_status(trace.StatusCode.ERROR, f"{type(exception).__name__}: {message}")


@contextmanager
def continued(job: Job, envelope: dict[str, Any]) -> Iterator[None]:
    """Make the context of ``job``'s finished run (else the one its ``envelope`` stores) current inside
    ``with``, so the jobs enqueued inside carry it on."""
    context = job.__dict__.get(_RUN_CONTEXT) or _stored_context(envelope)
    token = otel_context.attach(context) if context is not None else None
    try:
        yield
    finally:
        if token is not None:
            otel_context.detach(token)
