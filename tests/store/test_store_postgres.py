"""The hub's store on a real PostgreSQL (``tests/pgserver.py``'s throwaway server): migrations, a
newer schema refused, the pool's bound, the database going away and coming back (under load,
through a real hub's route), the admin credential shared by every hub on one database, and the
URL's password never printed. Every method of the store runs on PostgreSQL in
``tests/test_store.py`` too (its ``BACKENDS``)."""

from __future__ import annotations

import itertools
import logging
import os
import stat
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pgserver
import psycopg
import pytest
import trio
import trio.testing
from helpers import ADMIN, TEAM_SECRET

import gateway.hub.hub
from gateway.hub import Hub, open_hub
from gateway.hub.cli import main as hub_main
from gateway.hub.settings import HubSettings
from gateway.hub.store import (
    SCHEMA_VERSION,
    StoredSession,
    StoreError,
    StoreMissing,
    StoreUnavailable,
    UsageRecord,
    dburl,
    open_store,
    token_hash,
)
from gateway.hub.store.postgres import PostgresStore
from gateway.hub.store.postgres_io import APPLICATION
from gateway.hub.store.schema import MIGRATIONS


def _sql(url: str, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    """One statement on a connection of its own (what another process would see)."""
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement, params or None)
        return cur.fetchall() if cur.description else []


def _record(n: int = 0) -> UsageRecord:
    return UsageRecord("id-alice", "alice", "s", "chat", "m", True, "ok", prompt_tokens=n)


@pytest.fixture
def store_logs() -> Iterator[list[logging.LogRecord]]:
    """Every record the store's logger writes (and the hub's, which share its parent)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.DEBUG)
    logger = logging.getLogger("gateway")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old)


async def _until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Until ``check()`` holds (what the store or the server reach by themselves), 30 s at most."""
    with trio.fail_after(30):
        for _ in itertools.count():
            if await check():
                return
            await trio.sleep(0.01)
    raise AssertionError(what)


def _lines(records: list[logging.LogRecord], name: str, words: str) -> list[str]:
    return [r.getMessage() for r in records if r.name == name and words in r.getMessage()]


# -- migrations ------------------------------------------------------------------------------


async def test_migrations_make_the_schema_once_and_a_reopened_store_is_unchanged(
    pg_url: str,
) -> None:
    store = open_store(pg_url)
    key = await store.create_api_key("alice")
    await store.close()
    versions = _sql(pg_url, "SELECT version FROM schema_version ORDER BY 1")
    assert versions == [(m.version,) for m in MIGRATIONS]
    types = dict(
        _sql(
            pg_url,
            "SELECT table_name || '.' || column_name, data_type FROM information_schema.columns"
            " WHERE table_schema = 'public'",
        )
    )
    # SQLite's 64-bit INTEGER and 8-byte REAL, said in PostgreSQL's words
    assert types["usage_turns.id"] == types["usage_hourly.turns"] == "bigint"
    assert types["usage_turns.at"] == types["runner_models.answered_at"] == "double precision"
    assert types["jobs.seq"] == "bigint" and types["usage_turns.estimated"] == "bigint"
    assert types["credentials.hash"] == "text"
    again = open_store(pg_url)
    assert await again.check_api_key(key) is not None
    await again.close()
    versions = _sql(pg_url, "SELECT version FROM schema_version ORDER BY 1")
    assert versions == [(m.version,) for m in MIGRATIONS]


def test_hubs_starting_together_migrate_once(pg_url: str) -> None:
    """Replicas started at once: the migrations hold an advisory lock, so each is applied once."""
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def open_one() -> None:
        try:
            start.wait()
            trio.run(open_store(pg_url).close)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    versions = _sql(pg_url, "SELECT version FROM schema_version ORDER BY 1")
    assert versions == [(m.version,) for m in MIGRATIONS]


def test_a_newer_schema_is_refused_with_one_line(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trio.run(open_store(pg_url).close)
    _sql(pg_url, "INSERT INTO schema_version VALUES (99, '2099-01-01T00:00:00Z')")
    with pytest.raises(StoreError) as refused:
        open_store(pg_url)
    message = str(refused.value)
    assert message == (
        f"the hub store {dburl.redact(pg_url)} has schema version 99, newer than this "
        f"alp-gateway knows (up to {SCHEMA_VERSION}): run the alp-gateway that made it, or a "
        "newer one"
    )
    password = pg_url.split(":")[2].split("@")[0]
    assert password not in message and ":***@" in message
    for argv in (["keys", "list"], ["usage"]):
        assert hub_main([*argv, "--store", pg_url]) == 2
        out, err = capsys.readouterr()
        assert err == f"alp-gateway hub: error: {message}\n" and out == ""
    assert _sql(pg_url, "SELECT MAX(version) FROM schema_version") == [(99,)]  # left as it was


# -- hub keys and hub usage on --store ------------------------------------------------------------


def test_keys_and_usage_work_on_the_store_and_never_print_its_password(
    pg_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    password = pg_url.split(":")[2].split("@")[0]
    shown = dburl.redact(pg_url)
    assert hub_main(["keys", "create", "alice", "--store", pg_url]) == 2  # no hub there yet
    out, err = capsys.readouterr()
    assert err == (
        f"alp-gateway hub: error: no hub in {shown} (no hub store in that database): give the "
        "--store of the hub you run; or `keys create --create` to start a new hub store there\n"
    )
    assert hub_main(["keys", "create", "alice", "--rpm", "3", "--store", pg_url, "--create"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("alpk_")
    monkeypatch.setenv("ALP_GATEWAY_HUB_STORE", pg_url)  # the variable, as a service sets it
    assert hub_main(["keys", "list"]) == 0
    out, err = capsys.readouterr()
    assert "alice" in out and "rpm=3" in out
    assert hub_main(["usage"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("no usage since ")
    assert hub_main(["--help"]) == 0
    out, err = capsys.readouterr()
    help_text = " ".join(out.split())
    assert "--store URL" in help_text and "SQLite in the data directory" in help_text
    wrong = pg_url.replace(password, "not-the-password")
    assert hub_main(["keys", "list", "--store", wrong]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"alp-gateway hub: error: the hub store {dburl.redact(wrong)}: ")
    assert "password authentication failed" in err and err.count("\n") == 1
    assert "not-the-password" not in err
    everything = capsys.readouterr()
    assert password not in everything.out + everything.err


def test_urls_are_said_without_their_passwords() -> None:
    assert dburl.redact("postgresql://alice:s3cret@db:5432/hub") == (
        "postgresql://alice:***@db:5432/hub"
    )
    assert dburl.redact("postgres://db/hub?sslmode=require&password=s3cret") == (
        "postgres://db/hub?sslmode=require&password=***"
    )
    assert dburl.redact("postgresql://alice@db/hub") == "postgresql://alice@db/hub"
    assert dburl.redact("postgresql://a%3Ab:p%40ss@h1:5,h2:6/hub") == (
        "postgresql://a%3Ab:***@h1:5,h2:6/hub"
    )
    assert dburl.redact("postgresql://alice:s3cret@[::1/hub") == "postgresql://***"
    assert dburl.scrub("x p@ss y p%40ss z", "postgresql://a:p%40ss@h/d") == "x *** y *** z"
    for url in (
        "postgresql://alice:s3cret@[::1/hub",  # libpq quotes a URL it cannot read
        "postgresql://alice:s3cret@db/hub?bogus=1",
    ):
        with pytest.raises(StoreError) as refused:
            open_store(url)
        assert "s3cret" not in str(refused.value) and "\n" not in str(refused.value)


# -- the pool --------------------------------------------------------------------------------------


async def test_the_pool_never_holds_more_connections_than_its_size(pg_url: str) -> None:
    store = PostgresStore(pg_url, pool_size=2)
    await store.save_session(StoredSession("k", "s", "acme", "chat", "j-1"))
    done = 0

    async def load() -> None:
        nonlocal done
        await store.load_sessions()
        done += 1

    locker = await trio.to_thread.run_sync(lambda: psycopg.connect(pg_url))
    try:  # a lock that holds every read of sessions until it is let go
        await trio.to_thread.run_sync(
            locker.execute, "LOCK TABLE sessions IN ACCESS EXCLUSIVE MODE"
        )
        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(load)
            waiting = (
                "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = %s AND wait_event_type = 'Lock'"
            )

            async def two_wait() -> bool:  # two of our calls wait on the lock, server side
                found = await trio.to_thread.run_sync(_sql, pg_url, waiting, APPLICATION)
                return bool(found[0][0] >= 2)

            await _until(two_wait, "two calls waiting on the lock")
            await trio.testing.wait_all_tasks_blocked()
            assert store.connections == 2 and done == 0
            assert store._slots.statistics().tasks_waiting == 8  # the others wait for a connection
            everyone = "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = %s"
            assert _sql(pg_url, everyone, APPLICATION) == [(2,)]
            await trio.to_thread.run_sync(locker.commit)  # the lock let go
    finally:
        await trio.to_thread.run_sync(locker.close)
    assert done == 10 and store.connections == 2
    await store.close()
    assert store.connections == 0


async def test_a_call_cancelled_mid_statement_leaves_no_connection_behind(pg_url: str) -> None:
    store = PostgresStore(pg_url, pool_size=1)
    await store.count_jobs()
    locker = await trio.to_thread.run_sync(lambda: psycopg.connect(pg_url))
    waiting = (
        "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = %s AND wait_event_type = 'Lock'"
    )

    async def stuck() -> bool:  # our call waits on the lock, server side
        found = await trio.to_thread.run_sync(_sql, pg_url, waiting, APPLICATION)
        return bool(found[0][0] == 1)

    try:
        await trio.to_thread.run_sync(locker.execute, "LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.count_jobs)  # waits on the lock until cancelled
            await _until(stuck, "the call waiting on the lock")
            nursery.cancel_scope.cancel()
        assert store.connections == 0  # closed mid-statement, never lent again
        await trio.to_thread.run_sync(locker.commit)
    finally:
        await trio.to_thread.run_sync(locker.close)
    assert await store.count_jobs() == 0 and store.connections == 1
    await store.close()


# -- a database that goes away ----------------------------------------------------------------------


async def test_a_restarted_server_between_calls_costs_no_call(
    pg_server: pgserver.PgServer, pg_url: str, store_logs: list[logging.LogRecord]
) -> None:
    store = PostgresStore(pg_url)
    await store.save_session(StoredSession("k", "s", "acme", "chat", "j-1"))
    try:
        await trio.to_thread.run_sync(pg_server.stop)
    finally:
        await trio.to_thread.run_sync(pg_server.start)
    # the idle connection the server ended is found so before it is lent: a new one serves
    assert len(await store.load_sessions()) == 1
    assert [r for r in store_logs if r.levelno >= logging.WARNING] == []
    await store.close()


async def test_a_connection_lent_when_the_database_went_is_closed_not_trusted(
    pg_url: str, store_logs: list[logging.LogRecord]
) -> None:
    """A server shutting down ends its connections one by one: a call that still succeeds on
    one lent before the database was found gone proves nothing (it said "back" before, then
    "unavailable" again: two lines each way for one stop). Such a connection is closed when
    given back; the next call connects anew, and that one says the database is back."""
    store = PostgresStore(pg_url, pool_size=2)
    await store.save_session(StoredSession("k", "s", "acme", "chat", "j-1"))
    ours = "SELECT pid, wait_event_type FROM pg_stat_activity WHERE application_name = %s"
    locker = await trio.to_thread.run_sync(lambda: psycopg.connect(pg_url))
    killed = trio.Event()
    try:  # each of two calls waits on a lock of its own, on its own connection
        await trio.to_thread.run_sync(
            locker.execute, "LOCK TABLE jobs, sessions IN ACCESS EXCLUSIVE MODE"
        )

        async def two_wait() -> bool:
            found = await trio.to_thread.run_sync(_sql, pg_url, ours, APPLICATION)
            return sum(1 for _pid, wait in found if wait == "Lock") == 2

        async def failing() -> None:  # its connection is ended under it
            with pytest.raises(StoreUnavailable):
                await store.load_sessions()
            killed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.count_jobs)  # on the connection lent as the other fails
            nursery.start_soon(failing)
            await _until(two_wait, "two calls waiting on the locks")
            lent = {
                pid for pid, _wait in await trio.to_thread.run_sync(_sql, pg_url, ours, APPLICATION)
            }
            sessions_reader = _sql(
                pg_url,
                "SELECT pid FROM pg_locks WHERE relation = 'sessions'::regclass AND NOT granted",
            )
            (victim,) = {pid for (pid,) in sessions_reader} & lent
            _sql(pg_url, "SELECT pg_terminate_backend(%s)", victim)
            await killed.wait()
            assert not store.available
            await trio.to_thread.run_sync(locker.commit)  # the other call goes on, and succeeds
    finally:
        await trio.to_thread.run_sync(locker.close)
    assert not store.available  # its success on a connection lent before is no proof
    assert store.connections == 0  # that connection closed when given back
    assert len(await store.load_sessions()) == 1  # on a new connection: back
    assert store.available
    (now,) = {pid for pid, _wait in _sql(pg_url, ours, APPLICATION)}
    assert now not in lent
    assert len([r for r in store_logs if "is unavailable" in r.getMessage()]) == 1
    assert len([r for r in store_logs if "is back after" in r.getMessage()]) == 1
    await store.close()


async def test_usage_rows_wait_for_a_database_that_comes_back(
    pg_server: pgserver.PgServer, pg_url: str, store_logs: list[logging.LogRecord]
) -> None:
    store = PostgresStore(pg_url)
    store.queue_usage(_record(1), 1_700_000_000.0)
    await store.flush_usage()
    try:
        await trio.to_thread.run_sync(pg_server.stop)
        for n in range(2, 5):
            store.queue_usage(_record(n), 1_700_000_000.0 + n)
            await store.flush_usage()  # refused: kept for later, not lost
        with pytest.raises(StoreUnavailable):
            await store.count_jobs()
    finally:
        await trio.to_thread.run_sync(pg_server.start)
    (down,) = _lines(store_logs, "gateway.hub.store", "is unavailable")
    assert down.startswith(f"the hub store {dburl.redact(pg_url)} is unavailable: ")
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)  # the writer tries again; the store connects again

        async def written() -> bool:  # within a second of the server's return
            return store.rows_written >= 4

        await _until(written, "the kept rows written")
        nursery.cancel_scope.cancel()
    rows = await store.usage_rows()
    assert [r["prompt_tokens"] for r in rows] == [1, 2, 3, 4]
    assert len(_lines(store_logs, "gateway.hub.store", "is back after")) == 1
    assert _lines(store_logs, "gateway.hub.store", "could not record") == []
    await store.close()


async def test_the_database_stopped_and_started_under_load_through_a_hub(
    pg_server: pgserver.PgServer,
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
    store_logs: list[logging.LogRecord],
) -> None:
    """A hub on PostgreSQL (its store handed in where ``Hub`` opens it) under admin requests:
    the server stopped, every request answered 503 store_unavailable, one log line; started
    again, the hub serves again by itself, one line more."""
    monkeypatch.setattr(gateway.hub.hub, "open_store", lambda _d, **kw: open_store(pg_url, **kw))
    # a team secret as every hub on PostgreSQL is given one (else one more line, that warning)
    hub = Hub(admin_token=ADMIN, settings=HubSettings(team_secret=(TEAM_SECRET,)))
    assert isinstance(hub.store, PostgresStore)
    await hub.keys.create("alice")
    codes: list[int] = []
    served, unavailable, back = trio.Event(), trio.Event(), trio.Event()
    stopped = False

    async def load(http: httpx.AsyncClient) -> None:
        while True:
            reply = await http.get("/api/hub/keys", headers={"Authorization": f"Bearer {ADMIN}"})
            codes.append(reply.status_code)
            if reply.status_code == 503:
                assert reply.json()["error"]["code"] == "store_unavailable"
                assert reply.headers["retry-after"] == "1"
                unavailable.set()
            else:
                assert reply.status_code == 200 and reply.json()["keys"][0]["name"] == "alice"
                served.set()
                if unavailable.is_set() and not stopped:
                    back.set()
            await trio.sleep(0.005)  # a steady load, not a spin

    async with open_hub(hub) as (_, url), httpx.AsyncClient(base_url=url) as http:
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(load, http)
            with trio.fail_after(30):
                await served.wait()
            try:
                stopped = True
                await trio.to_thread.run_sync(pg_server.stop)
                with trio.fail_after(30):
                    await unavailable.wait()
            finally:
                await trio.to_thread.run_sync(pg_server.start)
                stopped = False
            with trio.fail_after(30):
                await back.wait()
            nursery.cancel_scope.cancel()
    assert codes[0] == 200 and codes.count(503) >= 1 and set(codes) == {200, 503}
    (down,) = _lines(store_logs, "gateway.hub.store", "is unavailable")
    assert down.endswith("answered 503 store_unavailable until it is back")
    assert len(_lines(store_logs, "gateway.hub.store", "is back after")) == 1
    password = pg_url.split(":")[2].split("@")[0]
    assert not [r for r in store_logs if password in r.getMessage()]
    warnings = [r.getMessage() for r in store_logs if r.levelno >= logging.WARNING]
    assert warnings == [down], warnings  # nothing per request


# -- the admin credential ------------------------------------------------------------------------------


def test_every_hub_on_one_database_shares_the_admin_credential(pg_url: str, tmp_path: Path) -> None:
    first, later = tmp_path / "first", tmp_path / "later"
    made = PostgresStore(pg_url).admin_credential(first)
    assert made.created and made.token is not None and made.hash == token_hash(made.token)
    path = first / "admin-token"
    assert path.read_text().strip() == made.token  # kept where a homelab's hub keeps it
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    read = PostgresStore(pg_url).admin_credential(later)
    assert (read.token, read.hash, read.created) == (None, made.hash, False)
    assert not (later / "admin-token").exists()  # a replica holds no copy of the secret
    again = PostgresStore(pg_url).admin_credential(first)
    assert (again.token, again.created) == (made.token, False)
    assert _sql(pg_url, "SELECT name, hash FROM credentials") == [("admin", made.hash)]


def test_a_data_directory_s_admin_token_is_kept_on_a_new_database(
    pg_url: str, tmp_path: Path
) -> None:
    """A homelab's hub moved onto PostgreSQL keeps the admin credential its runners know."""
    sqlite = open_store(tmp_path)
    old = sqlite.admin_credential(tmp_path)
    trio.run(sqlite.close)
    moved = PostgresStore(pg_url).admin_credential(tmp_path)
    assert (moved.token, moved.hash, moved.created) == (old.token, old.hash, False)


def test_a_hub_without_a_store_there_is_refused_not_made(pg_url: str) -> None:
    with pytest.raises(StoreMissing, match="no hub store in that database"):
        open_store(pg_url, create=False)
    assert _sql(pg_url, "SELECT to_regclass('schema_version')::text") == [(None,)]


def test_without_postgresql_its_tests_skip_with_the_reason_but_fail_in_ci(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ALP_TEST_PG_BIN", str(tmp_path))  # no initdb there
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="PostgreSQL is not installed"):
        pgserver.start_or_skip()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must run the PostgreSQL tests"):
        pgserver.start_or_skip()
