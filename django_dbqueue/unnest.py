"""The unnest INSERT of new job rows on PostgreSQL: ``INSERT ... SELECT ... FROM unnest()`` of one
array per column, each sent as one array literal (``insert`` sends it; docs/performance.md)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from .db import cached_sql
from .models import Job
from .rows import FIELDS, NO_FLOW, OWN, PK, START, TIMES, Flow, NewJob


def column(connection: BaseDatabaseWrapper, name: str) -> str:
    """The quoted column of ``Job``'s field ``name``."""
    return str(connection.ops.quote_name(str(FIELDS[name].column)))


# The unnest INSERT's ON CONFLICT: none (no key); DO NOTHING; or DO UPDATE ... WHERE false, which
# only locks the holder, so that the read that follows finds it.
PLAIN, SKIP, LOCK = "", "skip", "lock"


# Each column travels as one array literal: joining strings costs less than psycopg's adaptation.
def _text_array(values: Sequence[str]) -> str:
    """``{"a","b"}``: each element double-quoted, with its backslashes and double quotes escaped."""
    return "{" + ",".join(['"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values]) + "}"


def _nullable_text_array(values: Sequence[str | None]) -> str:
    return "{" + ",".join(["NULL" if v is None else _text_array([v])[1:-1] for v in values]) + "}"


def _int_array(values: Sequence[int | None]) -> str:
    return "{" + ",".join(["NULL" if v is None else str(int(v)) for v in values]) + "}"


def _encoder(name: str) -> tuple[str, Callable[[Sequence[Any]], str]]:
    """The array type of a column sent (text, not varchar(n), whose cast would cut a long value) and its encoder."""
    if name == "delay":
        return "float8", lambda values: "{" + ",".join([repr(float(v)) for v in values]) + "}"
    field = FIELDS[name]
    kind = field.get_internal_type()
    if kind in ("CharField", "TextField"):
        return "text", _nullable_text_array if field.null else _text_array
    if kind == "BooleanField":
        return "boolean", lambda values: "{" + ",".join(["t" if v else "f" for v in values]) + "}"
    return "", _int_array  # the field's own type, read per database when the statement is built


_ARRAYS = {name: _encoder(name) for name in (*NewJob._fields[: len(OWN) + 1], "batch_id", *Flow._fields)}


def unnest_insert(
    connection: BaseDatabaseWrapper, batch: Sequence[NewJob], conflict: str = PLAIN
) -> tuple[str, list[str]]:
    """The unnest INSERT of ``batch`` and its parameters: the batch and flow columns only if a job uses
    them (the flow always with ``conflict``, whose RETURNING gives each row's key)."""
    columns = dict(zip(NewJob._fields, zip(*batch, strict=True), strict=True))
    sent = list(NewJob._fields[: len(OWN) + 1])  # the row's own values and the delay
    if any(columns["batch_id"]):
        sent.append("batch_id")
    if conflict or any(columns["flow"]):
        columns.update(zip(Flow._fields, zip(*[new.flow or NO_FLOW for new in batch], strict=True), strict=True))
        sent += Flow._fields
    params = [_ARRAYS[name][1](columns[name]) for name in sent]
    return _unnest_sql(tuple(sent), conflict)(connection), params


@functools.cache
def _unnest_sql(sent: tuple[str, ...], conflict: str) -> Callable[[BaseDatabaseWrapper], str]:
    return cached_sql(functools.partial(_build_unnest, sent=sent, conflict=conflict))


def _build_unnest(connection: BaseDatabaseWrapper, sent: tuple[str, ...], conflict: str) -> str:
    def literal(value: Any) -> str:
        if value is None or isinstance(value, bool):
            return {None: "NULL", True: "true", False: "false"}[value]
        return str(value) if isinstance(value, int) else "'" + str(value).replace("'", "''") + "'"

    stored = [name for name in sent if name != "delay"]
    names = ", ".join(column(connection, name) for name in (*stored, *TIMES, *START))
    values = [f"r.{name}" for name in stored]
    values += ["statement_timestamp() + make_interval(secs => r.delay)", "statement_timestamp()"]
    values += [literal(value) for value in START.values()]
    arrays = ", ".join(f"%s::{_ARRAYS[name][0] or FIELDS[name].cast_db_type(connection)}[]" for name in sent)
    returning = "RETURNING " + ", ".join(column(connection, name) for name in (PK, *TIMES))
    on_conflict = ""
    if conflict:
        key = column(connection, "unique_key")
        # The partial unique index (migration 0008), named by its column and predicate.
        on_conflict = f"ON CONFLICT ({key}) WHERE {key} IS NOT NULL " + (
            "DO NOTHING " if conflict == SKIP else f"DO UPDATE SET {key} = EXCLUDED.{key} WHERE false "
        )
        returning += f", {key}"
    return (
        f"INSERT INTO {connection.ops.quote_name(Job._meta.db_table)} ({names}) SELECT {', '.join(values)} "
        f"FROM unnest({arrays}) AS r({', '.join(sent)}) {on_conflict}{returning}"
    )
