"""The hub's store through its async interface: every method, the write-behind batch of usage rows,
the versioned migrations (a newer schema refused with one line; a data directory made before
migrations opens unchanged).

The ``store`` fixture is parametrized over backends (``BACKENDS``: SQLite in a data directory,
PostgreSQL in a fresh database of the session's throwaway server, ``tests/pgserver.py``); a test
that takes it speaks only ``Store``'s methods, so every backend runs it. ``other`` opens a second
handle on the same database, as another process (or replica) would. Tests that build a database
by hand are SQLite's own (an existing data directory is SQLite's file); PostgreSQL's own are in
``tests/test_store_postgres.py``.

The writer's tests move a mock clock by hand (``mock_clock``, no autojump): a database reached
over a socket is waited on as trio waits on any socket, so an autojumping clock would jump while
the database answers. They wait for the writer's rows by its counter (``rows_written``)."""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
import trio.testing

from gateway.hub import Hub, open_hub
from gateway.hub.cli import main as hub_main
from gateway.hub.money import KeyBudget, Price
from gateway.hub.store import (
    DEFAULT_KEY_PROJECT,
    PRUNE_BATCH,
    SCHEMA_VERSION,
    HourlyUsage,
    KeyLimits,
    ModelList,
    Store,
    StoredJob,
    StoredSession,
    StoreError,
    StoreUnavailable,
    UsageRecord,
    key_id_of,
    open_store,
    token_hash,
)
from gateway.hub.store.schema import MIGRATIONS

Place = Callable[[pytest.FixtureRequest, Path], "Path | str"]  # where a backend's store is

BACKENDS: dict[str, Place] = {
    "sqlite": lambda _request, tmp_path: tmp_path / "hub",  # a data directory
    "postgresql": lambda request, _tmp: request.getfixturevalue("pg_url"),  # a fresh database
}

VERSIONS = [m.version for m in MIGRATIONS]  # every migration this code knows, in order


@pytest.fixture(params=sorted(BACKENDS))
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., Store]:
    """Opens a store of the backend in this test's place (each call a new handle on it)."""
    place = BACKENDS[request.param](request, tmp_path)
    return lambda **batch: open_store(place, **batch)


@pytest.fixture
async def store(opener: Callable[..., Store]) -> AsyncIterator[Store]:
    opened = opener()
    yield opened
    await opened.close()


@pytest.fixture
async def other(opener: Callable[..., Store]) -> AsyncIterator[Store]:
    """A second handle on the same database: what another process sees."""
    opened = opener()
    yield opened
    await opened.close()


async def _written(store: Store, rows: int) -> None:
    """Until the store's writer has written ``rows`` rows (its counter), whatever the clock."""
    deadline = time.monotonic() + 30
    while store.rows_written < rows:
        assert time.monotonic() < deadline, f"{store.rows_written} of {rows} rows written"
        await trio.lowlevel.checkpoint()


def _record(name: str = "alice", model: str | None = "m", outcome: str = "ok") -> UsageRecord:
    return UsageRecord(
        f"id-{name}",
        name,
        "s",
        "chat",
        model or "",
        True,
        outcome,
        prompt_tokens=2,
        completion_tokens=3,
        runner_id="r-1",
        job_id="j-1",
        ttft=0.25,
        duration=1.0,
    )


# -- jobs ------------------------------------------------------------------------------------


async def test_jobs_saved_updated_loaded_and_deleted(store: Store) -> None:
    queued = StoredJob("j-1", "acme", "chat", ["chat-llm:v1"], {"jobType": "chat_llm"})
    claimed = StoredJob("j-2", "acme", "chat", [], {}, origin="frontdoor", claimed_by="r-1")
    for job in (queued, claimed):
        await store.save_job(job)
    claimed.status, claimed.run_id, claimed.runner_name = "completed", "run-2", "box"
    claimed.conclusion, claimed.final_reported = "success", True
    claimed.cancelled, claimed.cancel_reason = True, "because"
    await store.save_job(claimed)  # an update: its fields, not a second row
    await store.add_job_report("j-2", {"status": "in_progress"})
    await store.add_job_report("j-2", {"status": "completed", "conclusion": "success"})

    assert await store.job_ids() == ["j-1", "j-2"] and await store.count_jobs() == 2
    loaded = await store.load_job("j-2")
    assert loaded is not None
    assert (loaded.status, loaded.run_id, loaded.runner_name, loaded.origin) == (
        "completed",
        "run-2",
        "box",
        "frontdoor",
    )
    assert (loaded.conclusion, loaded.final_reported, loaded.cancelled) == ("success", True, True)
    assert loaded.cancel_reason == "because" and loaded.claimed_by == "r-1"
    assert [r["status"] for r in loaded.reports] == ["in_progress", "completed"]
    assert [j.id for j in await store.load_jobs()] == ["j-1", "j-2"]
    (live,) = await store.load_jobs(live_only=True)
    assert (live.id, live.needs, live.agent_definition, live.reports) == (
        "j-1",
        ["chat-llm:v1"],
        {"jobType": "chat_llm"},
        [],
    )
    assert await store.load_job("nope") is None

    await store.save_session(StoredSession("k", "s", "acme", "chat", "j-1"))
    await store.add_job_report("j-1", {"status": "in_progress"})
    await store.delete_job("j-1")  # its reports and the sessions on it go with it
    assert await store.job_ids() == ["j-2"] and await store.load_sessions() == []


# -- sessions and model lists -----------------------------------------------------------------


async def test_sessions_replaced_and_deleted_only_while_on_their_job(store: Store) -> None:
    await store.save_session(StoredSession("k", "b", "acme", "chat", "j-1", "id-k"))
    await store.save_session(StoredSession("k", "a", "acme", "chat", "j-1"))
    await store.save_session(StoredSession("k", "a", "acme", "chat", "j-2"))  # replaced
    assert await store.load_sessions() == [
        StoredSession("k", "a", "acme", "chat", "j-2"),
        StoredSession("k", "b", "acme", "chat", "j-1", "id-k"),
    ]
    await store.delete_session("k", "a", "j-1")  # no longer on j-1: kept
    assert len(await store.load_sessions()) == 2
    await store.delete_session("k", "a", "j-2")
    await store.delete_session("k", "b")  # whatever its job
    assert await store.load_sessions() == []


async def test_model_lists_replaced_per_runner_newest_first(store: Store) -> None:
    await store.save_models(ModelList("r-1", "acme", "chat", ("a",), 1.0))
    await store.save_models(ModelList("r-2", "acme", "chat", ("b", "c"), 2.0))
    await store.save_models(ModelList("r-1", "acme", "chat", ("d",), 3.0))
    await store.save_models(ModelList("r-3", "acme", "other", ("e",), 4.0))
    assert await store.load_models("acme", "chat") == [
        ModelList("r-1", "acme", "chat", ("d",), 3.0),
        ModelList("r-2", "acme", "chat", ("b", "c"), 2.0),
    ]
    assert await store.load_models("nobody", "chat") == []


# -- registrations and API keys -------------------------------------------------------------------


async def test_registrations_found_by_token_and_id(store: Store) -> None:
    runner, token = await store.add_registration("acme", "chat", "box", ["gpu", "fast"])
    assert token.startswith("alpr_") and runner.token_hash == token_hash(token)
    assert (runner.name, runner.owner, runner.project, runner.labels) == (
        "box",
        "acme",
        "chat",
        ("gpu", "fast"),
    )
    assert await store.registration_by_token(token) == runner
    assert await store.registration(runner.id) == runner
    assert await store.registration_by_token(token + "x") is None
    assert await store.registration("nope") is None


async def test_api_keys_created_checked_limited_and_revoked(store: Store) -> None:
    key = await store.create_api_key("alice", "acme/chat", KeyLimits(rpm=3, max_streams=0))
    default = await store.create_api_key("bob")
    assert key.startswith("alpk_")
    found = await store.check_api_key(key)
    assert found is not None and (found.name, found.owner, found.project) == (
        "alice",
        "acme",
        "chat",
    )
    assert found.id == key_id_of(token_hash(key))
    assert await store.check_api_key(key + "x") is None
    bob = await store.check_api_key(default)
    assert bob is not None and f"{bob.owner}/{bob.project}" == DEFAULT_KEY_PROJECT
    assert await store.key_limits("alice") == (found.id, KeyLimits(rpm=3))  # 0: no limit
    assert await store.set_key_limits("alice", KeyLimits(tpm=10, tokens_per_day=20))
    assert await store.key_limits("alice") == (found.id, KeyLimits(tpm=10, tokens_per_day=20))
    assert not await store.set_key_limits("nobody", KeyLimits(rpm=1))
    assert await store.active_key_ids() == {found.id, bob.id}
    assert await store.active_key_id("alice") == found.id
    for bad in (("", "acme/chat"), ("  ", "acme/chat"), ("carol", "no-slash"), ("alice", "a/b")):
        with pytest.raises(ValueError):
            await store.create_api_key(*bad)

    assert await store.revoke_api_key("alice") and not await store.revoke_api_key("alice")
    assert await store.check_api_key(key) is None and await store.key_limits("alice") is None
    assert await store.active_key_ids() == {bob.id} and await store.active_key_id("alice") is None
    listed = await store.list_api_keys()
    assert [(k["name"], k["revoked"], k["limits"]) for k in listed] == [
        ("alice", True, KeyLimits(tpm=10, tokens_per_day=20)),
        ("bob", False, KeyLimits()),
    ]
    again = await store.create_api_key("alice", "acme/chat")  # a revoked name is free again
    renewed = await store.check_api_key(again)
    assert renewed is not None and renewed.id != found.id


async def test_a_revoked_key_s_name_taken_again_starts_without_its_budgets(store: Store) -> None:
    """A key made again under a revoked key's name starts as a new key does, on either
    database: no budgets, the standard priority (PostgreSQL's kept the old ones before its
    statement and SQLite's became one, ``ops.CREATE_API_KEY``)."""
    await store.create_api_key("alice")
    assert await store.set_key_budget("alice", KeyBudget(1.0, 20.0, "interactive"))
    assert await store.revoke_api_key("alice")
    assert await store.key_budgets() == {}
    await store.create_api_key("bob")
    with pytest.raises(ValueError, match="already exists"):  # an active key's name is not free
        await store.create_api_key("bob")
    await store.create_api_key("alice")
    assert (await store.key_budgets()).get("alice", KeyBudget()) == KeyBudget()


# -- who may register and run runners ----------------------------------------------------------


async def test_enrollments_made_found_used_to_their_count_and_revoked(store: Store) -> None:
    now = time.time()
    first, token = await store.create_enrollment("acme/chat", None, 2)
    later, other_token = await store.create_enrollment("acme/ops", now + 60, None)
    assert (first.owner, first.project, first.uses_left, first.used) == ("acme", "chat", 2, 0)
    assert token.startswith("alpe_") and token not in repr(first)
    in_order = sorted([first, later], key=lambda e: (e.created_at, e.id))  # ties: by id
    assert await store.list_enrollments() == in_order
    assert await store.enrollment_by_token(token) == first
    assert await store.enrollment_by_token(token + "x") is None
    assert await store.use_enrollment(first.id, now) and await store.use_enrollment(first.id, now)
    assert not await store.use_enrollment(first.id, now)  # used up
    used = await store.enrollment_by_token(token)
    assert used is not None and (used.uses_left, used.used) == (0, 2)
    assert not await store.use_enrollment(later.id, now + 61)  # expired
    assert await store.use_enrollment(later.id, now)
    assert await store.revoke_enrollment(later.id) and not await store.revoke_enrollment(later.id)
    assert not await store.use_enrollment(later.id, now)
    revoked = await store.enrollment_by_token(other_token)
    assert revoked is not None and revoked.revoked and revoked.used == 1


async def test_runners_listed_with_models_and_sessions_seen_and_revoked(store: Store) -> None:
    box, box_token = await store.add_registration("acme", "chat", "box", ["gpu"])
    cube, _ = await store.add_registration("acme", "chat", "cube", [])
    await store.save_models(ModelList(box.id, "acme", "chat", ("m1", "m2"), 10.0))
    await store.save_job(StoredJob("j-1", "acme", "chat", [], {}, claimed_by=box.id))
    await store.save_session(StoredSession("alice", "s-1", "acme", "chat", "j-1", "id-a"))
    await store.runners_seen([box.id, cube.id], 1_700_000_000.5)
    await store.runners_seen([], 1.0)  # nothing to mark
    listed = {r.name: r for r in await store.list_runners()}
    assert listed["box"].models == ("m1", "m2") and listed["box"].sessions == 1
    assert listed["cube"].models is None and listed["cube"].sessions == 0
    assert {r.last_seen for r in listed.values()} == {1_700_000_000.5}
    assert await store.revoked_runners() == set()
    assert await store.revoke_runner(box.id) and not await store.revoke_runner(box.id)
    assert await store.revoked_runners() == {box.id}
    assert await store.registration_by_token(box_token) is None
    assert {r.name: r.revoked_at is not None for r in await store.list_runners()} == {
        "box": True,
        "cube": False,
    }


# -- usage -----------------------------------------------------------------------------------------


async def test_usage_rows_hourly_totals_and_tokens(store: Store) -> None:
    hour = 1_700_000_000 // 3600 * 3600
    await store.add_usage(_record("alice", "m1"), hour + 10)
    await store.add_usage(_record("alice", "m1", "error"), hour + 20)
    await store.add_usage(_record("alice", None, "client_gone"), hour + 3600)
    await store.add_usage(_record("bob", "m1", "lost"), hour + 30)
    rows = await store.usage_rows(key_name="alice")
    assert [(r["at"], r["model"], r["outcome"]) for r in rows] == [
        (hour + 10, "m1", "ok"),
        (hour + 20, "m1", "error"),
        (hour + 3600, "", "client_gone"),
    ]
    assert rows[0] | {"at": 0} == {
        "at": 0,
        "key_id": "id-alice",
        "key_name": "alice",
        "session": "s",
        "runner_id": "r-1",
        "job_id": "j-1",
        "model": "m1",
        "api": "chat",
        "stream": True,
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "ttft": 0.25,
        "duration": 1.0,
        "outcome": "ok",
        "estimated": False,
        "continued": False,
        "cost": None,
        "ref_cost": None,
    }
    assert len(await store.usage_rows(hour + 25)) == 2
    assert await store.hourly_usage(hour, "alice") == [
        HourlyUsage(hour, "alice", "m1", 2, 4, 6, 1, unpriced=2),
        HourlyUsage(hour + 3600, "alice", None, 1, 2, 3, 0, unpriced=1),
    ]
    totals, exact = await store.usage_totals(hour)
    assert exact and [(t.key_name, t.model, t.turns, t.errors) for t in totals] == [
        ("alice", "", 1, 0),
        ("alice", "m1", 2, 1),
        ("bob", "m1", 1, 1),
    ]
    assert await store.tokens_since("id-alice", hour) == 15
    assert await store.tokens_since("id-alice", hour + 3600) == 5
    assert await store.usage_turns_from() == -float("inf")
    assert await store.prune_usage(hour + 15, PRUNE_BATCH) == 1
    assert await store.usage_turns_from() == hour + 15
    totals, exact = await store.usage_totals(hour)  # older than the rows kept: the hours
    assert not exact and [t.turns for t in totals] == [1, 2, 1]


async def test_prices_budgets_cost_throughput_and_a_journal_s_mark(store: Store) -> None:
    hour = 1_700_000_000 // 3600 * 3600
    await store.set_price(Price("b", 1.0, 2.0))
    await store.set_price(Price("a", 3.0, 4.0, "gpt", 5.0, 6.0))
    await store.set_price(Price("B", watts=300.0, kwh_price=0.25))
    await store.set_price(Price("b", 1.5, 2.5))  # replaced
    assert await store.list_prices() == [  # by bytes: capitals first
        Price("B", watts=300.0, kwh_price=0.25),
        Price("a", 3.0, 4.0, "gpt", 5.0, 6.0),
        Price("b", 1.5, 2.5),
    ]
    assert await store.delete_price("B") and not await store.delete_price("B")
    assert [p.model for p in await store.list_prices()] == ["a", "b"]

    await store.create_api_key("alice")
    assert await store.key_budgets() == {"alice": KeyBudget()}
    assert await store.set_key_budget("alice", KeyBudget(2.0, None, "background"))
    assert not await store.set_key_budget("nobody", KeyBudget(1.0))
    assert await store.key_budgets() == {"alice": KeyBudget(2.0, None, "background")}

    priced = msgspec.structs.replace(_record("alice", "m1"), cost=0.5, ref_cost=1.0)
    estimated = msgspec.structs.replace(priced, estimated=True, ttft=0.1)
    assert await store.journal_mark("journal-a") == 0
    await store._write_usage([(priced, hour + 1.0), (estimated, hour + 3601.0)], ("journal-a", 7))
    assert await store.journal_mark("journal-a") == 7
    await store.add_usage(priced, hour + 2.0)
    assert await store.cost_since("id-alice", hour) == 1.5
    assert await store.cost_since("id-alice", hour + 3600) == 0.5
    assert await store.cost_since("id-nobody", hour) == 0.0
    # prefill: 2 prompt tokens in 0.25 s; decoding: 3 tokens in 0.75 s (the estimated row not)
    assert await store.throughput("m1", hour) == (8.0, 4.0)
    assert await store.throughput("m2", hour) == (0.0, 0.0)
    totals, exact = await store.usage_totals(hour, "alice")
    assert exact and [(t.turns, t.estimated, t.cost, t.unpriced) for t in totals] == [
        (3, 1, 1.5, 0)
    ]


async def test_a_queued_row_is_written_by_the_writer_within_its_interval(
    mock_clock: trio.testing.MockClock, opener: Callable[..., Store], other: Store
) -> None:
    store = opener(batch_interval=0.5, batch_rows=100)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        queued_at = trio.current_time()
        store.queue_usage(_record(), 1_700_000_000.0)
        store.queue_usage(_record("bob"), 1_700_000_001.0)
        await trio.testing.wait_all_tasks_blocked()  # the writer waits out its interval
        mock_clock.jump(0.49)
        assert await other.usage_rows() == []  # not written on the turn's path, nor yet
        assert store.rows_written == 0
        mock_clock.jump(0.02)
        await _written(store, 2)
        assert trio.current_time() - queued_at == pytest.approx(0.51)
        assert [r["key_name"] for r in await other.usage_rows()] == ["alice", "bob"]
        nursery.cancel_scope.cancel()
    await store.close()


async def test_a_full_batch_is_written_at_once_and_the_rest_at_stop(
    mock_clock: trio.testing.MockClock, opener: Callable[..., Store], other: Store
) -> None:
    store = opener(batch_interval=3600.0, batch_rows=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        for n in range(3):
            store.queue_usage(_record(), 1_700_000_000.0 + n)
        await _written(store, 3)
        assert len(await other.usage_rows()) == 3 and trio.current_time() == 0
        store.queue_usage(_record(), 1_700_000_003.0)
        await trio.testing.wait_all_tasks_blocked()  # the writer waits out its interval
        assert len(await other.usage_rows()) == 3 and store.rows_written == 3
        nursery.cancel_scope.cancel()  # the hub stops: the last row is written too
    assert len(await other.usage_rows()) == 4
    await store.close()


async def test_a_read_between_does_not_hold_the_next_full_batch(
    mock_clock: trio.testing.MockClock, opener: Callable[..., Store], other: Store
) -> None:
    store = opener(batch_interval=3600.0, batch_rows=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        store.queue_usage(_record(), 1_700_000_000.0)
        await trio.testing.wait_all_tasks_blocked()  # the writer waits out its interval
        assert len(await store.usage_rows()) == 1  # a reader wrote the row meanwhile
        for n in range(1, 4):
            store.queue_usage(_record(), 1_700_000_000.0 + n)
        await _written(store, 4)
        assert len(await other.usage_rows()) == 4 and trio.current_time() == 0
        nursery.cancel_scope.cancel()
    await store.close()


async def test_a_read_sees_every_queued_row(store: Store, other: Store) -> None:
    store.queue_usage(_record(), 1_700_000_000.0)
    assert await other.usage_rows() == []
    assert await store.tokens_since("id-alice", 0) == 5  # the read wrote it first
    store.queue_usage(_record(), 1_700_000_001.0)
    assert [t.turns for t in (await store.usage_totals(0))[0]] == [2]
    store.queue_usage(_record(), 1_700_000_002.0)
    assert [h.turns for h in await store.hourly_usage(0)] == [3]
    store.queue_usage(_record(), 1_700_000_003.0)
    assert len(await store.usage_rows()) == 4 and len(await other.usage_rows()) == 4


async def test_writes_prune_rows_older_than_the_retention(opener: Callable[..., Store]) -> None:
    store = opener(usage_retention=100.0)
    for at in (1000.0, 1050.0, 1120.0):
        store.queue_usage(_record(), at)
    await store.flush_usage()  # one batch; the newest row is 1120: rows before 1020 go
    assert [r["at"] for r in await store.usage_rows()] == [1050.0, 1120.0]
    assert await store.usage_turns_from() == 1020.0
    assert sum(h.turns for h in await store.hourly_usage(0)) == 3  # the totals stay
    await store.close()


async def test_a_refused_batch_costs_its_rows_and_one_warning(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    await store.close()
    store.queue_usage(_record(), 1_700_000_000.0)
    with caplog.at_level(logging.WARNING, "gateway.hub.store"):
        await store.flush_usage()  # never raises: serving goes on
    (line,) = caplog.messages
    assert line.startswith("could not record the usage of 1 turn(s): the hub store ")
    assert line.endswith(" is closed") and "\n" not in line
    with pytest.raises(StoreUnavailable, match="is closed"):
        await store.usage_rows()


# -- migrations ----------------------------------------------------------------------------------


def _versions(path: Path) -> list[int]:
    with sqlite3.connect(path) as db:
        return [r[0] for r in db.execute("SELECT version FROM schema_version ORDER BY version")]


async def test_a_new_store_is_at_the_latest_version_and_reopens_unchanged(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    key = await store.create_api_key("alice")
    await store.close()
    assert _versions(tmp_path / "hub.sqlite3") == VERSIONS and SCHEMA_VERSION == VERSIONS[-1]
    again = open_store(tmp_path)
    assert await again.check_api_key(key) is not None
    await again.close()
    assert _versions(tmp_path / "hub.sqlite3") == VERSIONS


# The schema every store had before migrations (main at 96d9d4b, gateway/hub/store.py), verbatim.
VERSIONS = [m.version for m in MIGRATIONS]  # every migration, applied in order

BEFORE = """
CREATE TABLE IF NOT EXISTS runners (id TEXT PRIMARY KEY, name TEXT NOT NULL, owner TEXT NOT NULL,
    project TEXT NOT NULL, labels TEXT NOT NULL, token_hash TEXT NOT NULL,
    registered_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS api_keys (name TEXT PRIMARY KEY, owner TEXT NOT NULL,
    project TEXT NOT NULL, key_hash TEXT NOT NULL, created_at TEXT NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0, rpm INTEGER, tpm INTEGER, tokens_per_day INTEGER,
    max_streams INTEGER);
CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, run_id TEXT, owner TEXT NOT NULL,
    project TEXT NOT NULL, needs TEXT NOT NULL, agent_definition TEXT NOT NULL,
    origin TEXT NOT NULL, claimed_by TEXT, runner_name TEXT, status TEXT NOT NULL,
    conclusion TEXT, final_reported INTEGER NOT NULL DEFAULT 0,
    cancelled INTEGER NOT NULL DEFAULT 0, cancel_reason TEXT, created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS job_reports (job_id TEXT NOT NULL, seq INTEGER NOT NULL,
    body TEXT NOT NULL, received_at TEXT NOT NULL, PRIMARY KEY (job_id, seq));
CREATE TABLE IF NOT EXISTS runner_models (runner_id TEXT PRIMARY KEY, owner TEXT NOT NULL,
    project TEXT NOT NULL, models TEXT NOT NULL, answered_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (key_name TEXT NOT NULL, session_id TEXT NOT NULL,
    owner TEXT NOT NULL, project TEXT NOT NULL, job_id TEXT NOT NULL,
    key_id TEXT NOT NULL DEFAULT '', PRIMARY KEY (key_name, session_id));
CREATE TABLE IF NOT EXISTS usage_turns (id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL,
    key_id TEXT NOT NULL, key_name TEXT NOT NULL, session TEXT NOT NULL, runner_id TEXT,
    job_id TEXT, model TEXT NOT NULL, api TEXT NOT NULL, stream INTEGER NOT NULL,
    prompt_tokens INTEGER, completion_tokens INTEGER, ttft REAL, duration REAL,
    outcome TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS usage_turns_at ON usage_turns (at);
CREATE TABLE IF NOT EXISTS usage_hourly (hour INTEGER NOT NULL, key_id TEXT NOT NULL,
    key_name TEXT NOT NULL, model TEXT NOT NULL, turns INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, errors INTEGER NOT NULL,
    PRIMARY KEY (hour, key_id, model));
CREATE TABLE IF NOT EXISTS usage_meta (name TEXT PRIMARY KEY, value REAL NOT NULL);
"""
KEY = "alpk_made-before-migrations"
RUNNER_TOKEN = "alpr_made-before-migrations"


def _store_from_before(path: Path, *, sessions_keyed: bool = True) -> None:
    """A data directory's database as the hub made it before migrations, with a key, a runner,
    a job and its report, a session, a model list and a turn's usage in it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = BEFORE
    if not sessions_keyed:  # older still: sessions before keys had ids
        schema = schema.replace("    key_id TEXT NOT NULL DEFAULT '', PRIMARY KEY", "PRIMARY KEY")
    with sqlite3.connect(path) as db:
        db.executescript(schema)
        db.execute(
            "INSERT INTO api_keys VALUES ('alice', 'acme', 'chat', ?, '2026-01-01T00:00:00Z',"
            " 0, 5, NULL, NULL, 2)",
            (token_hash(KEY),),
        )
        db.execute(
            "INSERT INTO runners VALUES ('r-1', 'box', 'acme', 'chat', '[\"gpu\"]', ?,"
            " '2026-01-01T00:00:00Z')",
            (token_hash(RUNNER_TOKEN),),
        )
        db.execute(
            "INSERT INTO jobs VALUES ('j-1', 'run-1', 'acme', 'chat', '[\"chat-llm:v1\"]',"
            " '{\"jobType\": \"chat_llm\"}', 'frontdoor', 'r-1', 'box', 'in_progress', NULL,"
            " 0, 0, NULL, '2026-01-01T00:00:00Z', '2026-01-01T00:00:00Z')"
        )
        db.execute(
            "INSERT INTO job_reports VALUES ('j-1', 1, '{\"status\": \"in_progress\"}',"
            " '2026-01-01T00:00:00Z')"
        )
        if sessions_keyed:
            db.execute("INSERT INTO sessions VALUES ('alice', 's', 'acme', 'chat', 'j-1', 'id')")
        else:
            db.execute("INSERT INTO sessions VALUES ('alice', 's', 'acme', 'chat', 'j-1')")
        db.execute("INSERT INTO runner_models VALUES ('r-1', 'acme', 'chat', '[\"m\"]', 5.0)")
        db.execute(
            "INSERT INTO usage_turns (at, key_id, key_name, session, runner_id, job_id, model,"
            " api, stream, prompt_tokens, completion_tokens, ttft, duration, outcome) VALUES"
            " (1700000000, 'id', 'alice', 's', 'r-1', 'j-1', 'm', 'chat', 1, 4, 5, 0.1, 1.0,"
            " 'ok')"
        )
        db.execute("INSERT INTO usage_hourly VALUES (1699999200, 'id', 'alice', 'm', 1, 4, 5, 0)")


def _shape(path: Path) -> dict[str, Any]:
    """Every table's columns and every row, but the version table's."""
    with sqlite3.connect(path) as db:
        tables = [
            r[0]
            for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY 1")
            if r[0] not in ("schema_version", "sqlite_sequence")
        ]
        return {
            t: (
                list(db.execute(f"PRAGMA table_info({t})")),
                sorted(db.execute(f"SELECT * FROM {t}"), key=repr),
            )
            for t in tables
        }


async def test_a_data_directory_from_before_migrations_opens_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "hub.sqlite3"
    _store_from_before(path)
    before = _shape(path)
    store = open_store(tmp_path)
    # migration 1 is that schema; migration 2 adds the usage's ``estimated`` columns (0: said);
    # migration 3 the credentials table (empty: SQLite's admin token stays in its file);
    # migration 4 the turns' ``continued`` column (0: answered by one runner); migration 6 the
    # enrollment tokens (none) and the runners' revocation, enrollment and last sign of life;
    # migration 7 the people who sign in, the keys they own and their page sessions (empty)
    after = _shape(path)
    # migration 8 the prices table (empty), the turns' costs (unknown: NULL), the keys' budgets
    # (none) and priority class (standard)
    people = {"people", "key_owners", "page_sessions"}
    made = {"credentials", "enrollment_tokens", "prices"} | people
    assert _versions(path) == VERSIONS and after.keys() == before.keys() | made
    assert after.pop("credentials")[1] == [] and after.pop("enrollment_tokens")[1] == []
    assert after.pop("prices")[1] == []
    for table in people:
        assert after.pop(table)[1] == []
    grown = ("usage_turns", "usage_hourly", "runners", "api_keys")
    for table, added, values in (
        ("usage_turns", ["estimated", "continued", "cost", "ref_cost"], {0, None}),
        ("usage_hourly", ["estimated", "cost", "ref_cost", "unpriced"], {0}),
        ("runners", ["revoked_at", "enrollment_id", "last_seen"], {None}),
        ("api_keys", ["budget_daily", "budget_monthly", "priority"], {None, "standard"}),
    ):
        columns, rows = after[table]
        width = len(before[table][0])
        assert columns[:width] == before[table][0] and [c[1] for c in columns[width:]] == added
        assert [row[:width] for row in rows] == before[table][1]
        assert {v for row in rows for v in row[width:]} <= values
    assert {t: v for t, v in after.items() if t not in grown} == {
        t: v for t, v in before.items() if t not in grown
    }
    key = await store.check_api_key(KEY)
    assert key is not None and await store.key_limits("alice") == (
        key.id,
        KeyLimits(rpm=5, max_streams=2),
    )
    runner = await store.registration_by_token(RUNNER_TOKEN)
    assert runner is not None and runner.labels == ("gpu",)
    (job,) = await store.load_jobs(live_only=True)
    assert (job.id, job.status, job.reports) == ("j-1", "in_progress", [{"status": "in_progress"}])
    assert await store.load_sessions() == [StoredSession("alice", "s", "acme", "chat", "j-1", "id")]
    assert [m.models for m in await store.load_models("acme", "chat")] == [("m",)]
    assert await store.tokens_since("id", 0) == 9 and len(await store.usage_rows()) == 1
    await store.close()


async def test_an_older_store_gains_the_columns_it_lacks(tmp_path: Path) -> None:
    path = tmp_path / "hub.sqlite3"
    _store_from_before(path, sessions_keyed=False)
    store = open_store(tmp_path)
    assert await store.load_sessions() == [StoredSession("alice", "s", "acme", "chat", "j-1")]
    await store.close()
    assert _versions(path) == VERSIONS


def test_a_newer_schema_is_refused_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "hub"
    trio.run(open_store(data).close)
    with sqlite3.connect(data / "hub.sqlite3") as db:
        db.execute("INSERT INTO schema_version VALUES (99, '2099-01-01T00:00:00Z')")
    with pytest.raises(StoreError) as refused:
        open_store(data)
    message = str(refused.value)
    assert message == (
        f"the hub store {data / 'hub.sqlite3'} has schema version 99, newer than this "
        f"alp-gateway knows (up to {SCHEMA_VERSION}): run the alp-gateway that made it, or a "
        "newer one"
    )
    for argv in (["keys", "list"], ["usage"], ["--listen", "127.0.0.1:0"]):
        assert hub_main([*argv, "--data", str(data)]) == 2
        err = capsys.readouterr().err
        assert err == f"alp-gateway hub: error: {message}\n"
    assert _versions(data / "hub.sqlite3") == [*VERSIONS, 99]  # left as it was
    assert not (data / "admin-token").exists()  # the hub made nothing before refusing


# -- the hub on its store ---------------------------------------------------------------------


async def test_a_store_that_fails_answers_503_store_unavailable(tmp_path: Path) -> None:
    hub = Hub(tmp_path / "hub", admin_token="alpa_admin")
    async with open_hub(hub) as (_, url), httpx.AsyncClient(base_url=url) as http:
        await hub.store.close()  # as a database that went away
        reply = await http.get("/api/hub/keys", headers={"Authorization": "Bearer alpa_admin"})
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "store_unavailable"


async def test_turns_that_ended_are_in_the_store_when_the_hub_stops(tmp_path: Path) -> None:
    hub = Hub(tmp_path / "hub")
    async with open_hub(hub):
        for n in range(3):
            hub.store.queue_usage(_record(f"key{n}"), 1_700_000_000.0 + n)
    reopened = open_store(tmp_path / "hub")
    assert [r["key_name"] for r in await reopened.usage_rows()] == ["key0", "key1", "key2"]
    await reopened.close()
    await hub.store.close()
