"""OpenTelemetry traces: an enqueue span per job, a run span per run, linked (docs/observability.md)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk", reason="needs the opentelemetry-sdk package (the dev extra)")

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracerProvider, SpanKind, StatusCode

from django_dbqueue import JobContext, chain, enqueue_many, job, lifecycle, tracing
from django_dbqueue.models import FailedJob, Job
from tests.conftest import run_worker
from tests.testapp import jobs
from tests.testapp.models import Run

# Spans do not depend on Django's version: scripts/test runs these with one.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.one_django]

# One provider for the module, given to dbqueue alone: the process's global
# provider (settable once) is left alone.
EXPORTER = InMemorySpanExporter()
PROVIDER = TracerProvider()
PROVIDER.add_span_processor(SimpleSpanProcessor(EXPORTER))
TRACER = PROVIDER.get_tracer("tests")


@pytest.fixture(autouse=True)
def spans() -> Iterator[InMemorySpanExporter]:
    tracing.use_tracer_provider(PROVIDER)
    EXPORTER.clear()
    yield EXPORTER
    tracing.use_tracer_provider(None)
    EXPORTER.clear()


# What the jobs below saw as the current span while they ran.
seen: list[trace.SpanContext] = []


@job(name="tests.tracing.note_span")
def note_span() -> None:
    with TRACER.start_as_current_span("inside the job"):
        seen.append(trace.get_current_span().get_span_context())


@job(name="tests.tracing.anote_span")
async def anote_span() -> None:
    seen.append(trace.get_current_span().get_span_context())


@job(name="tests.tracing.snooze_once", takes_context=True)
def snooze_once(context: JobContext) -> None:
    if context.attempt == 1:
        context.snooze(0)


def of_kind(exporter: InMemorySpanExporter, kind: SpanKind) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.kind is kind]


def traceparent(span: ReadableSpan) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def ids(context: trace.SpanContext) -> tuple[int, int]:
    return context.trace_id, context.span_id


def linked(span: ReadableSpan) -> list[tuple[int, int]]:
    return [ids(link.context) for link in span.links]


def stored_trace(job: Job) -> dict[str, str] | None:
    return json.loads(job.payload).get("trace")


def test_an_enqueue_makes_a_producer_span_and_stores_its_context_in_the_payload(spans):
    handle = jobs.record.using(queue="emails").enqueue("a")
    (enqueue,) = spans.get_finished_spans()
    assert (enqueue.name, enqueue.kind) == ("enqueue emails", SpanKind.PRODUCER)
    assert dict(enqueue.attributes) == {
        "messaging.system": "django_dbqueue",
        "messaging.operation.type": "create",
        "messaging.operation.name": "enqueue",
        "messaging.destination.name": "emails",
        "dbqueue.job.name": jobs.record.name,
    }
    assert stored_trace(Job.objects.get(pk=handle.id)) == {"traceparent": traceparent(enqueue)}
    Job.objects.all().delete()


def test_an_enqueue_inside_a_span_is_its_child(spans):
    with TRACER.start_as_current_span("request") as request:
        jobs.record.enqueue("a")
    (enqueue,) = of_kind(spans, SpanKind.PRODUCER)
    assert enqueue.parent is not None and enqueue.parent.span_id == request.get_span_context().span_id
    assert enqueue.context.trace_id == request.get_span_context().trace_id
    Job.objects.all().delete()


def test_a_run_is_a_consumer_span_child_of_and_linked_to_the_enqueue(spans):
    handle = jobs.record.enqueue("a")
    worker, _ = run_worker()
    (enqueue,) = of_kind(spans, SpanKind.PRODUCER)
    (run,) = of_kind(spans, SpanKind.CONSUMER)
    assert run.name == "run default"
    assert run.parent is not None and run.parent.span_id == enqueue.context.span_id
    assert run.context.trace_id == enqueue.context.trace_id
    assert linked(run) == [ids(enqueue.context)]
    assert dict(run.attributes) == {
        "messaging.system": "django_dbqueue",
        "messaging.operation.type": "process",
        "messaging.operation.name": "run",
        "messaging.destination.name": "default",
        "messaging.message.id": str(handle.id),
        "messaging.client.id": worker.worker_id,
        "dbqueue.job.name": jobs.record.name,
        "dbqueue.job.attempt": 1,
        "dbqueue.job.outcome": "succeeded",
    }
    assert run.status.status_code is StatusCode.UNSET and not run.events


def test_a_failing_job_records_its_exception_and_an_error_status_on_each_run(spans):
    jobs.always_fail.enqueue("boom")
    run_worker()
    runs = of_kind(spans, SpanKind.CONSUMER)
    assert [(run.attributes["dbqueue.job.attempt"], run.attributes["dbqueue.job.outcome"]) for run in runs] == [
        (1, "released"),
        (2, "failed"),
    ]
    (enqueue,) = of_kind(spans, SpanKind.PRODUCER)
    for run in runs:
        assert run.parent is not None and run.parent.span_id == enqueue.context.span_id
        assert run.status.status_code is StatusCode.ERROR
        assert run.status.description == "ValueError: boom always fails"
        assert run.attributes["error.type"] == "builtins.ValueError"
        (event,) = run.events
        assert event.name == "exception"
        assert event.attributes["exception.type"] == "ValueError"
        assert event.attributes["exception.message"] == "boom always fails"
        assert "Traceback (most recent call last)" in event.attributes["exception.stacktrace"]
        assert 'raise ValueError(f"{key} always fails")' in event.attributes["exception.stacktrace"]
    FailedJob.objects.all().delete()


def test_exception_text_in_spans_is_scrubbed_like_stored_errors(spans):
    jobs.always_fail.using(tries=1).enqueue("password=hunter2")
    run_worker()
    (run,) = of_kind(spans, SpanKind.CONSUMER)
    (event,) = run.events
    text = [run.status.description, event.attributes["exception.message"], event.attributes["exception.stacktrace"]]
    assert not any("hunter2" in part for part in text)
    assert "password=[scrubbed]" in event.attributes["exception.message"]
    FailedJob.objects.all().delete()


def test_a_snooze_is_recorded_as_snoozed_not_as_an_error(spans):
    snooze_once.enqueue()
    run_worker()
    runs = of_kind(spans, SpanKind.CONSUMER)
    assert [run.attributes["dbqueue.job.outcome"] for run in runs] == ["snoozed", "succeeded"]
    assert all(run.status.status_code is StatusCode.UNSET and not run.events for run in runs)


def test_a_job_that_cannot_run_still_gets_a_failed_run_span_linked_to_its_enqueue(spans):
    handle = jobs.record.enqueue("a")
    Job.objects.filter(pk=handle.id).update(name="tests.tracing.no_such_job")
    run_worker()
    (enqueue,) = of_kind(spans, SpanKind.PRODUCER)
    (run,) = of_kind(spans, SpanKind.CONSUMER)
    assert run.attributes["dbqueue.job.outcome"] == "failed"
    assert run.attributes["dbqueue.job.name"] == "tests.tracing.no_such_job"
    assert run.status.status_code is StatusCode.ERROR
    assert linked(run) == [ids(enqueue.context)]
    FailedJob.objects.all().delete()


@pytest.mark.parametrize("options", [{}, {"threads": 2}], ids=["main thread", "threads"])
def test_the_run_span_is_current_while_the_job_runs(spans, options):
    seen.clear()
    note_span.enqueue()
    run_worker(**options)
    (run,) = of_kind(spans, SpanKind.CONSUMER)
    (inner,) = of_kind(spans, SpanKind.INTERNAL)
    assert inner.parent is not None and inner.parent.span_id == run.context.span_id
    assert seen == [inner.context]


@pytest.mark.parametrize(
    "options", [{}, {"async_concurrency": 4}], ids=["async_to_sync in a slot", "on the event loop"]
)
def test_an_async_job_runs_inside_its_span(spans, options):
    seen.clear()
    anote_span.enqueue()
    anote_span.enqueue()
    run_worker(**options)
    runs = of_kind(spans, SpanKind.CONSUMER)
    assert len(runs) == 2 and all(run.attributes["dbqueue.job.outcome"] == "succeeded" for run in runs)
    assert sorted(context.span_id for context in seen) == sorted(run.context.span_id for run in runs)


def test_a_chains_next_step_is_enqueued_in_the_context_of_the_step_before(spans):
    with TRACER.start_as_current_span("request") as request:
        chain(jobs.step.bind("c", 1), jobs.step.bind("c", 2)).then(jobs.record.bind("done")).enqueue()
    run_worker()
    assert list(Run.objects.order_by("id").values_list("key", flat=True)) == ["c-1", "c-2", "done"]
    finished = spans.get_finished_spans()
    by_id = {span.context.span_id: span for span in finished}

    def parent_of(span: ReadableSpan) -> ReadableSpan | None:
        return by_id.get(span.parent.span_id) if span.parent is not None else None

    runs = of_kind(spans, SpanKind.CONSUMER)
    assert [run.attributes["dbqueue.job.name"] for run in runs] == [jobs.step.name, jobs.step.name, jobs.record.name]
    # request -> enqueue c-1 -> run c-1 -> enqueue c-2 -> run c-2 -> enqueue done -> run done
    path = []
    span: ReadableSpan | None = runs[-1]
    while span is not None:
        path.append((span.kind, span.name))
        span = parent_of(span)
    assert path == [
        (SpanKind.CONSUMER, "run default"),
        (SpanKind.PRODUCER, "enqueue default"),
        (SpanKind.CONSUMER, "run default"),
        (SpanKind.PRODUCER, "enqueue default"),
        (SpanKind.CONSUMER, "run default"),
        (SpanKind.PRODUCER, "enqueue default"),
        (SpanKind.INTERNAL, "request"),
    ]
    assert {span.context.trace_id for span in finished} == {request.get_span_context().trace_id}
    for run in runs:
        assert linked(run) == [ids(parent_of(run).context)]


def test_a_failure_callback_continues_the_trace_of_the_failed_run(spans):
    jobs.always_fail.using(tries=1).bind("x").on_failure(jobs.record.bind("cleanup")).enqueue()
    run_worker()
    failed_run, callback_run = of_kind(spans, SpanKind.CONSUMER)
    callback_enqueue = of_kind(spans, SpanKind.PRODUCER)[-1]
    assert callback_enqueue.parent.span_id == failed_run.context.span_id
    assert callback_run.parent.span_id == callback_enqueue.context.span_id
    FailedJob.objects.all().delete()


def test_enqueue_many_gives_each_row_its_own_enqueue_span(spans):
    with TRACER.start_as_current_span("import"):
        enqueue_many(jobs.record.bind(str(n)) for n in range(3))
    enqueues = of_kind(spans, SpanKind.PRODUCER)
    assert len(enqueues) == 3
    stored = sorted(stored_trace(row)["traceparent"] for row in Job.objects.all())
    assert stored == sorted(traceparent(span) for span in enqueues)
    run_worker()
    runs = of_kind(spans, SpanKind.CONSUMER)
    assert sorted(run.parent.span_id for run in runs) == sorted(span.context.span_id for span in enqueues)


def test_a_retried_failed_job_runs_again_in_the_trace_of_its_first_enqueue(spans):
    jobs.always_fail.using(tries=1).enqueue("again")
    run_worker()
    lifecycle.retry(FailedJob.objects.all())
    run_worker()
    (enqueue,) = of_kind(spans, SpanKind.PRODUCER)
    runs = of_kind(spans, SpanKind.CONSUMER)
    assert len(runs) == 2 and all(run.parent.span_id == enqueue.context.span_id for run in runs)
    FailedJob.objects.all().delete()


def test_without_opentelemetry_nothing_is_added_to_the_payload_and_no_span_is_made(spans, monkeypatch):
    monkeypatch.setattr(tracing, "enabled", False)
    with TRACER.start_as_current_span("request"):
        handle = jobs.record.enqueue("a")
        chain(jobs.step.bind("n", 1), jobs.step.bind("n", 2)).enqueue()
    assert all(stored_trace(row) is None for row in Job.objects.all())
    EXPORTER.clear()
    run_worker()
    assert Run.objects.count() == 3 and not spans.get_finished_spans()
    assert handle.id is not None


def test_with_the_api_alone_no_trace_context_is_stored(spans):
    tracing.use_tracer_provider(NoOpTracerProvider())
    jobs.record.enqueue("a")
    assert stored_trace(Job.objects.get()) is None
    run_worker()
    assert Run.objects.filter(key="a").exists() and not spans.get_finished_spans()


def test_with_no_provider_set_the_global_proxy_makes_no_span(spans):
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        pytest.skip("a global tracer provider was set in this process")
    tracing.use_tracer_provider(None)
    assert tracing._get_tracer() is None  # the proxy's no-op state is seen, spans are skipped
    jobs.record.enqueue("a")
    assert stored_trace(Job.objects.get()) is None
    run_worker()
    assert Run.objects.filter(key="a").exists()


def test_with_the_api_alone_a_callers_context_is_passed_on(spans):
    tracing.use_tracer_provider(NoOpTracerProvider())
    with TRACER.start_as_current_span("request") as request:
        jobs.record.enqueue("a")
    assert stored_trace(Job.objects.get()) == {"traceparent": traceparent(request)}
    Job.objects.all().delete()


def test_with_the_api_alone_a_stored_context_is_current_while_the_job_runs(spans):
    seen.clear()
    note_span.enqueue()
    (enqueue,) = spans.get_finished_spans()
    tracing.use_tracer_provider(NoOpTracerProvider())
    run_worker()
    (inner,) = spans.get_finished_spans()[1:]
    assert inner.name == "inside the job" and inner.parent.span_id == enqueue.context.span_id


def test_a_damaged_trace_context_is_ignored(spans):
    handle = jobs.record.enqueue("a")
    row = Job.objects.get(pk=handle.id)
    envelope = json.loads(row.payload)
    envelope["trace"] = {"traceparent": "not a traceparent", "tracestate": 42}
    Job.objects.filter(pk=row.pk).update(payload=json.dumps(envelope))
    run_worker()
    (run,) = of_kind(spans, SpanKind.CONSUMER)
    assert run.parent is None and not run.links
    assert run.attributes["dbqueue.job.outcome"] == "succeeded"


@pytest.mark.skipif(not hasattr(sys.modules.get("django"), "tasks"), reason="django.tasks needs Django 6")
def test_a_django_task_enqueue_stores_its_trace_context(spans):
    from tests.testapp import tasks

    tasks.add_numbers.enqueue(1, 2)
    (enqueue,) = of_kind(spans, SpanKind.PRODUCER)
    assert stored_trace(Job.objects.get()) == {"traceparent": traceparent(enqueue)}
    Job.objects.all().delete()


SITECUSTOMIZE = """
import os

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

provider = TracerProvider()
exporter = ConsoleSpanExporter(
    out=open(os.environ["DBQUEUE_TEST_SPANS"], "a"), formatter=lambda span: span.to_json(indent=None) + "\\n"
)
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
"""


@pytest.mark.acceptance
def test_a_queue_work_process_with_a_global_provider_continues_the_enqueue_trace(spans, worker_process, tmp_path):
    # As opentelemetry-instrument does: a sitecustomize on PYTHONPATH sets the global
    # provider before Django starts; this one writes the spans to a file.
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    output = tmp_path / "spans.jsonl"
    with TRACER.start_as_current_span("request") as request:
        jobs.record.enqueue("a")
        jobs.always_fail.using(tries=1).enqueue("b")
    process = worker_process(
        "--stop-when-empty",
        "--sleep",
        "0.05",
        env={
            "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parent.parent)]),
            "DBQUEUE_TEST_SPANS": str(output),
        },
    )
    assert process.wait(timeout=60) == 0, process.output()
    exported = [json.loads(line) for line in output.read_text().splitlines()]
    runs = {span["attributes"]["dbqueue.job.name"]: span for span in exported if span["kind"] == "SpanKind.CONSUMER"}
    enqueues = {span.attributes["dbqueue.job.name"]: span for span in of_kind(spans, SpanKind.PRODUCER)}
    assert set(runs) == {jobs.record.name, jobs.always_fail.name}
    for name, run in runs.items():
        assert run["context"]["trace_id"] == f"0x{request.get_span_context().trace_id:032x}"
        assert run["parent_id"] == f"0x{enqueues[name].context.span_id:016x}"
        assert [link["context"]["span_id"] for link in run["links"]] == [f"0x{enqueues[name].context.span_id:016x}"]
    assert runs[jobs.record.name]["attributes"]["dbqueue.job.outcome"] == "succeeded"
    assert runs[jobs.always_fail.name]["attributes"]["dbqueue.job.outcome"] == "failed"
    assert runs[jobs.always_fail.name]["status"]["status_code"] == "ERROR"
    assert [event["name"] for event in runs[jobs.always_fail.name]["events"]] == ["exception"]
    FailedJob.objects.all().delete()
