"""What the pages promise about themselves: the README's jobs and its view, the install page's
tables, ``scripts/check_docs``'s HTML and its message when Sphinx is missing, and the autoscaling
page's SQL, KEDA queries and metric names."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.apps import apps
from django.db import transaction
from django.test import RequestFactory
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from django_dbqueue import history, metrics, registry, scaling
from django_dbqueue.models import Job
from django_dbqueue.operations import QueueStats
from tests.test_docs import FENCE, python_blocks

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
INSTALL = ROOT / "docs" / "howto" / "install.md"


def _readme_block(first_line: str) -> str:
    blocks = [code for _, code, _ in python_blocks(README) if code.startswith(first_line)]
    assert len(blocks) == 1, f"README.md has {len(blocks)} ```python blocks starting with {first_line!r}"
    return blocks[0]


@pytest.fixture
def shop(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """The README's ``shop/jobs.py`` and ``shop/views.py`` as the modules ``shop.jobs`` and ``shop.views``."""
    known = set(registry.all_definitions())
    package = types.ModuleType("shop")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "shop", package)
    for name, first_line in (("jobs", "# shop/jobs.py"), ("views", "# shop/views.py")):
        module = types.ModuleType(f"shop.{name}")
        monkeypatch.setitem(sys.modules, module.__name__, module)
        setattr(package, name, module)
        exec(compile(_readme_block(first_line), f"README.md: shop/{name}.py", "exec"), module.__dict__)
    yield package
    for name in set(registry.all_definitions()) - known:
        registry.unregister(name)


@pytest.mark.django_db
def test_the_readme_jobs_module_enqueues_nothing_at_import(shop: types.ModuleType) -> None:
    # Issue 28: a jobs.py that enqueued at import made `migrate` fail with "no such table".
    assert {"shop.jobs.send_receipt", "shop.jobs.import_catalog"} <= set(registry.all_definitions())
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_the_readme_view_enqueues_in_its_transaction(shop: types.ModuleType) -> None:
    response = shop.views.pay(RequestFactory().post("/orders/42/pay/"), 42)

    job = Job.objects.get()
    assert json.loads(response.content) == {"job": job.pk, "status": "waiting"}
    assert (job.name, job.queue, job.max_tries) == ("shop.jobs.send_receipt", "emails", 5)
    # An exception after the view rolls its job back with the rest of the transaction.
    with pytest.raises(RuntimeError), transaction.atomic():
        shop.views.pay(RequestFactory().post("/orders/43/pay/"), 43)
        raise RuntimeError("the order could not be saved")
    assert list(Job.objects.values_list("pk", flat=True)) == [job.pk]


@pytest.mark.django_db
def test_the_readme_import_view_enqueues_a_delayed_job(shop: types.ModuleType) -> None:
    response = shop.views.start_import(RequestFactory().post("/import/"))

    job = Job.objects.get(name="shop.jobs.import_catalog")
    assert json.loads(response.content) == {"progress": str(job.pk)}
    assert job.available_at > timezone.now()


def test_the_install_page_lists_every_table_the_app_creates() -> None:
    rows = re.findall(r"^\| `(dbqueue_\w+)` \| `(\w+)` \|", INSTALL.read_text(), re.MULTILINE)
    models = apps.get_app_config("django_dbqueue").get_models()
    assert sorted(rows) == sorted((model._meta.db_table, model.__name__) for model in models)


CHECK_DOCS = ROOT / "scripts" / "check_docs"


def _check_docs_in(tmp_path: Path, python: Path) -> subprocess.CompletedProcess[str]:
    """Run a copy of scripts/check_docs in ``tmp_path``, with ``python`` as its Python."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "docs").mkdir(exist_ok=True)
    shutil.copy(CHECK_DOCS, tmp_path / "scripts" / "check_docs")
    env = {key: value for key, value in os.environ.items() if key != "DBQUEUE_DOCS_PYTHON"}
    return subprocess.run(
        ["bash", str(tmp_path / "scripts" / "check_docs"), str(python)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_check_docs_keeps_the_html_and_says_where_to_open_it(tmp_path: Path) -> None:
    # This Python has the docs extra; its Sphinx writes an index.html, and the links check passes.
    python = _script(
        tmp_path / "python",
        "#!/bin/sh\n"
        'if [ "$1 $2" = "-m sphinx" ]; then for last; do :; done; mkdir -p "$last"; echo built > "$last/index.html"; '
        "exit 0; fi\n"
        'if [ "$1" = docs/_ext/readme_links.py ]; then exit 0; fi\n'
        f'exec {sys.executable} "$@"\n',
    )
    stale = tmp_path / "docs" / "_build" / "html" / "removed-page.html"
    stale.parent.mkdir(parents=True)
    stale.write_text("a page removed since the last build")

    result = _check_docs_in(tmp_path, python)

    assert result.returncode == 0, result.stdout + result.stderr
    index = tmp_path / "docs" / "_build" / "html" / "index.html"
    assert index.read_text() == "built\n"
    assert f"Documentation OK: open {index}" in result.stdout
    assert not stale.exists()


def test_check_docs_names_the_extra_to_install_when_sphinx_is_missing(tmp_path: Path) -> None:
    # -S: no site-packages, so neither Sphinx nor MyST, furo or Django.
    python = _script(tmp_path / "python", f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')

    result = _check_docs_in(tmp_path, python)

    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{python} lacks Sphinx, myst-parser, furo, Django" in result.stderr
    assert f'{python} -m pip install -e ".[docs]"' in result.stderr
    assert not (tmp_path / "docs" / "_build").exists()


def test_check_docs_says_how_to_make_the_environment_when_its_python_is_absent(tmp_path: Path) -> None:
    result = _check_docs_in(tmp_path, tmp_path / "no-such-venv" / "bin" / "python")

    assert result.returncode == 2
    assert "No Python at" in result.stderr
    assert 'pip install -e ".[docs]"' in result.stderr


AUTOSCALING = ROOT / "docs" / "howto" / "autoscaling.md"


def code_blocks(path: Path, language: str) -> list[str]:
    """The code of each fenced block of ``language`` in a Markdown file, in order."""
    lines = path.read_text().splitlines()
    blocks: list[str] = []
    index = 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        index += 1
        if not match:
            continue
        body = []
        while index < len(lines) and lines[index].strip() != match["fence"]:
            body.append(lines[index])
            index += 1
        index += 1
        if match["info"].strip().split(" ")[0] == language:
            blocks.append(textwrap.dedent("\n".join(body)))
    return blocks


def keda_triggers(kind: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(spec, trigger) for each KEDA trigger of type ``kind`` in the autoscaling page's ScaledObjects."""
    documents = [doc for block in code_blocks(AUTOSCALING, "yaml") for doc in yaml.safe_load_all(block) if doc]
    return [
        (doc["spec"], trigger)
        for doc in documents
        if doc.get("kind") == "ScaledObject"
        for trigger in doc["spec"]["triggers"]
        if trigger["type"] == kind
    ]


def test_the_autoscaling_page_shows_the_sql_of_the_code() -> None:
    counts = [block for block in code_blocks(AUTOSCALING, "postgresql") if block.startswith("SELECT")]
    assert counts == [scaling.WAITING_SQL, scaling.IN_FLIGHT_SQL]


def test_the_keda_queries_of_the_autoscaling_page_are_the_code_s_sql_filled_in() -> None:
    triggers = keda_triggers("postgresql")
    assert triggers, "the autoscaling page has no ScaledObject with a postgresql trigger"
    for spec, trigger in triggers:
        query, target = trigger["metadata"]["query"], float(trigger["metadata"]["targetQueryValue"])
        sql = {"waiting": scaling.WAITING_SQL, "in-flight": scaling.IN_FLIGHT_SQL}[trigger["name"]]
        limit = int(re.findall(r"LIMIT (\d+)", query)[-1])
        queues = re.findall(r"'([^']+)'", query.split("ARRAY[", 1)[1].split("]", 1)[0])
        assert query == scaling.scaler_query(sql, queues, limit=limit), trigger["name"]
        # The page's rules: the backlog counts up to what the most replicas need; the work in
        # flight up to its target, so that it asks for one replica at most.
        cap = target * spec["maxReplicaCount"] if trigger["name"] == "waiting" else target
        assert limit == cap, trigger["name"]


def test_the_autoscaling_page_names_only_metrics_the_view_exposes() -> None:
    figures = metrics.Snapshot([QueueStats("default")], metrics.WorkerCounts(), {("default", "job"): history.Totals()})
    body, _ = metrics.render(figures)
    exposed = {sample.name for family in text_string_to_metric_families(body.decode()) for sample in family.samples}
    queries = [trigger["metadata"]["query"] for _, trigger in keda_triggers("prometheus")]
    adapter = [doc for block in code_blocks(AUTOSCALING, "yaml") for doc in yaml.safe_load_all(block) if doc]
    queries += [
        rule[key] for doc in adapter for rule in doc.get("externalRules", []) for key in ("seriesQuery", "metricsQuery")
    ]
    named = {name for query in queries for name in re.findall(r"\bdbqueue_\w+", query)}
    assert len(queries) >= 3 and named
    assert named <= exposed, f"not exposed by the metrics view: {sorted(named - exposed)}"
