"""Traces (OpenTelemetry): a producer span for each job enqueued, a consumer span for each run.

Active only when the ``opentelemetry-api`` package can be imported (the
``otel`` extra); ``enabled`` says so, decided once when this module is
imported, and every hook in the rest of the package checks it first, so
without the package nothing here runs. With the API but no SDK (no tracer
provider set), no span is made: a context the caller already has is passed on,
else nothing is written into payloads.

- ``enqueue_context`` (called by ``rows.new_job`` for every row built) starts
  and ends an ``enqueue <queue>`` span (kind PRODUCER, operation type
  ``create``: it gives the one job its creation context) and returns the trace
  context to store in the envelope's ``trace`` key, through the configured
  propagators (W3C ``traceparent``/``tracestate`` by default).
- ``start_run``/``end_run`` (called by ``execution``) wrap one run in a
  ``run <queue>`` span (kind CONSUMER, operation type ``process``) whose parent
  is the stored context and which also links to it; the span is the current one
  while the job runs, so the job's own spans are its children.
- ``continued`` makes the finished run's span current while what follows a job
  (a chain's next step, callbacks) is built, so those carry it on.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Protocol

from .errors import clean

if TYPE_CHECKING:
    from contextvars import Token
    from types import TracebackType

    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from .models import Job

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
except ImportError:  # the otel extra is not installed: every hook is skipped
    enabled = False
else:
    enabled = True


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


# The envelope key that holds the trace context of the job's enqueue span.
ENVELOPE_KEY = "trace"
SYSTEM = "django_dbqueue"
# Where a run keeps its span's context on the job instance, for ``continued``.
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
        # Without a provider of our own: the global one's proxy tracer, which follows
        # a provider set later (``trace.set_tracer_provider``).
        provider = _provider if _provider is not None else trace.get_tracer_provider()
        _tracer = provider.get_tracer("django_dbqueue")
    # A proxy tracer delegates to a NoOpTracer until a provider is set. Its private
    # ``_tracer`` tells so in 0.1 µs, where a no-op span with its attributes costs
    # 2 to 4; if the attribute ever goes, spans are simply started and found invalid.
    if isinstance(getattr(_tracer, "_tracer", _tracer), trace.NoOpTracer):
        return None
    return _tracer


def carries() -> bool:
    """Tell whether ``enqueue_context`` may return something now: a span would be
    recorded, or the caller's context passed on (asked once for many enqueues)."""
    return _get_tracer() is not None or trace.get_current_span().get_span_context().is_valid


def enqueue_context(step: dict[str, Any]) -> dict[str, str] | None:
    """Record the enqueue of ``step`` as a span; return the trace context to store with the
    job, or None when there is none to carry."""
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
    """Start the consumer span of a prepared job's run and make it current in this thread
    (or task); None when there is nothing to record or carry (no SDK, no stored context)."""
    parent = _stored_context(prepared.envelope)
    tracer = _get_tracer()
    if tracer is None:
        # No SDK: the stored context is current while the job runs, so the job's own
        # calls pass it on.
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
    """Record a run's exception and set the span's status to ERROR, with the error
    text cleaned as it is for ``FailedJob`` (spans leave for another system)."""
    exception = outcome.exception
    assert exception is not None
    message = clean(str(exception))
    span.set_attribute("error.type", outcome.exception_class)
    span.record_exception(
        exception,
        # The SDK would format the traceback itself, uncleaned; the outcome's error is
        # the traceback cleaned (or why the job could not run).
        attributes={"exception.message": message, "exception.stacktrace": outcome.error},
    )
    span.set_status(trace.StatusCode.ERROR, f"{type(exception).__name__}: {message}")


def continued(job: Job, envelope: dict[str, Any]) -> Continued:
    """Make the context of ``job``'s finished run current inside ``with`` (else, for a job
    this process did not run, the context stored in its ``envelope``), so the jobs
    enqueued inside carry it on."""
    return Continued(job.__dict__.get(_RUN_CONTEXT) or _stored_context(envelope))


class Continued:
    """A context made current inside ``with`` (see ``continued``)."""

    __slots__ = ("context", "token")

    def __init__(self, context: Context | None) -> None:
        self.context = context
        self.token: Token[Context] | None = None

    def __enter__(self) -> None:
        if self.context is not None:
            self.token = otel_context.attach(self.context)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.token is not None:
            otel_context.detach(self.token)
