"""SQLite's own part of the hub's store: running a sans-IO operation (``ops``, ``trust_ops``,
``usage_ops``) on a connection in autocommit mode, the migrations, and writing a batch of usage
rows (``sqlite.py`` opens the connection and runs these).

A write of one statement is its own transaction; a write of several takes the write lock first
(``BEGIN IMMEDIATE``, ``sql.BEGIN``) and commits them together."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator

from gateway.hub.store.records import UsageRecord, hourly_totals, utc_now
from gateway.hub.store.schema import MIGRATIONS, VERSION_TABLE, SchemaTooNew, too_new
from gateway.hub.store.sql import Op, T

Db = sqlite3.Connection


def run(db: Db, op: Op[T]) -> T:
    """``op`` on the connection, to its end; a transaction it leaves open when it fails (or a
    statement does) is rolled back."""
    try:
        query = next(op)
        while True:
            query = op.send(db.execute(query.sql, query.params).fetchall())
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except BaseException:
        op.close()
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


@contextlib.contextmanager
def transaction(db: Db) -> Iterator[None]:
    """The statements of the block as one transaction, the write lock taken at its start."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


# -- the schema ---------------------------------------------------------------------------


def migrate(db: Db, where: str) -> int:
    """Apply the migrations this store lacks, in one transaction; its version after them.
    SchemaTooNew when its version is newer than any this code knows."""
    with transaction(db):
        db.execute(VERSION_TABLE)
        row = db.execute("SELECT MAX(version) FROM schema_version").fetchone()
        current = int(row[0] or 0)
        if current > MIGRATIONS[-1].version:
            raise SchemaTooNew(too_new(where, current))
        for migration in MIGRATIONS:
            if migration.version <= current:
                continue
            for statement in migration.statements:
                db.execute(statement)
            for table, column, declaration in migration.columns:
                present = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
                if column not in present:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
            db.execute(
                "INSERT INTO schema_version (version, applied_at) VALUES (?, ?)",
                (migration.version, utc_now()),
            )
            current = migration.version
    return current


# -- usage ----------------------------------------------------------------------------------


def write_usage(
    db: Db, rows: list[tuple[UsageRecord, float]], mark: tuple[str, int] | None = None
) -> None:
    """The turns' rows and their keys' hourly totals (summed per hour, key and model first);
    ``mark``: a usage journal's name and the segment these rows complete, kept with them."""
    hourly = hourly_totals(rows)
    with transaction(db):
        if mark is not None:
            db.execute(
                "INSERT INTO usage_meta (name, value) VALUES (?, ?)"
                " ON CONFLICT(name) DO UPDATE SET value = excluded.value",
                mark,
            )
        db.executemany(
            "INSERT INTO usage_turns (at, key_id, key_name, session, runner_id, job_id, model,"
            " api, stream, prompt_tokens, completion_tokens, ttft, duration, outcome, estimated,"
            " continued, cost, ref_cost)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    at,
                    record.key_id,
                    record.key_name,
                    record.session,
                    record.runner_id,
                    record.job_id,
                    record.model,
                    record.api,
                    int(record.stream),
                    record.prompt_tokens,
                    record.completion_tokens,
                    record.ttft,
                    record.duration,
                    record.outcome,
                    int(record.estimated),
                    int(record.continued),
                    record.cost,
                    record.ref_cost,
                )
                for record, at in rows
            ],
        )
        db.executemany(
            "INSERT INTO usage_hourly (hour, key_id, key_name, model, turns, prompt_tokens,"
            " completion_tokens, errors, estimated, cost, ref_cost, unpriced)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(hour, key_id, model) DO UPDATE SET turns = turns + excluded.turns,"
            " prompt_tokens = prompt_tokens + excluded.prompt_tokens,"
            " completion_tokens = completion_tokens + excluded.completion_tokens,"
            " errors = errors + excluded.errors, estimated = estimated + excluded.estimated,"
            " cost = cost + excluded.cost, ref_cost = ref_cost + excluded.ref_cost,"
            " unpriced = unpriced + excluded.unpriced, key_name = excluded.key_name",
            [(hour, key_id, t[0], model, *t[1:]) for (hour, key_id, model), t in hourly.items()],
        )
