"""The package's shape (docs/explanation/architecture.md): imports point down, one home per concept.

Read from the source with ``ast``, so each test names the module and line that breaks a rule.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "django_dbqueue"
MAX_LINES = 600
# Imports of the package's own modules made inside a function: the one lazy call from JobCall
# into ``enqueue`` (as Django's Task.enqueue finds its backend) and Django's ``ready()`` ones.
MAX_LOCAL_IMPORTS = 6
# The one deliberate upward import (function-local): a call stores itself through ``enqueue``.
UPWARD = {("django_dbqueue.registry", "django_dbqueue.enqueue")}
WRITES = {"update", "delete", "bulk_create", "bulk_update", "create", "get_or_create", "update_or_create"}
# The modules that write Job rows (every INSERT, every claim, every state change after it),
# and the manager's documented ``Job.objects.bulk_enqueue``.
JOB_WRITERS = {"insert": WRITES, "claims": WRITES, "lifecycle": WRITES, "models": {"bulk_create"}}


def modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def own_module(name: str | None, level: int, importer: str, is_package: bool) -> str | None:
    """The package module an ``import`` names, or None for another package."""
    if level == 0:
        return name if name and name.split(".")[0] == "django_dbqueue" else None
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(tree: ast.Module) -> Iterator[ast.ImportFrom | ast.Import]:
    """Every import that can run: at module level or in a function, not under TYPE_CHECKING."""
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not _type_checking(node):
            stack.extend(ast.iter_child_nodes(node))


def targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    base = own_module(node.module, node.level, importer, is_package)
    if base is None:
        return set()
    found = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known}
    return found or ({base} if base in known else set())


def test_no_module_is_over_600_lines() -> None:
    long = {name: n for name, path in modules() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_few_imports_of_the_package_hide_inside_functions() -> None:
    known = {name for name, _ in modules()}
    local = []
    for name, path in modules():
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and targets(
                    node, name, path.name == "__init__.py", known
                ):
                    local.append(f"{name}:{node.lineno}")
    assert len(local) <= MAX_LOCAL_IMPORTS, f"{len(local)} function-local imports of the package: {sorted(local)}"


def test_no_import_circle() -> None:
    known = {name for name, _ in modules()}
    graph: dict[str, set[str]] = {}
    for name, path in modules():
        tree = ast.parse(path.read_text())
        package = path.name == "__init__.py"
        graph[name] = set().union(*(targets(node, name, package, known) for node in imports(tree))) - {name}
        graph[name] -= {upper for lower, upper in UPWARD if lower == name}
    circles = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert not circles, f"import circles: {circles}"


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _rooted_at_job(node: ast.AST) -> bool:
    """Whether a call's receiver is a chain that starts at the name ``Job`` (Job.objects...)."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return isinstance(node, ast.Name) and node.id == "Job"


def test_job_rows_are_written_only_by_insert_claims_and_lifecycle() -> None:
    writes = []
    for name, path in modules():
        allowed = set().union(*(JOB_WRITERS.get(part, set()) for part in name.split(".")[1:]))
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in WRITES - allowed
                and _rooted_at_job(node.func.value)
            ):
                writes.append(f"{name}:{node.lineno} .{node.func.attr}()")
    assert not writes, f"Job rows written outside {sorted(JOB_WRITERS)}: {writes}"
