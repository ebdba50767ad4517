"""Shared fixtures: a hub and a backend simulator on loopback, an in-process runner, log capture,
a throwaway PostgreSQL server (one per test session) and a fresh database in it per test."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pgserver
import pytest
from helpers import ADMIN, BACKEND_KEY, LogCapture, runner_config, running

from gateway.hub import Hub, open_hub
from gateway.runner.supervisor import Runner
from gateway.sim import Simulator, open_sim
from gateway.wire import protocol


@pytest.fixture
async def sim() -> AsyncIterator[Simulator]:
    async with open_sim(require_key=BACKEND_KEY) as simulator:
        yield simulator


@pytest.fixture
async def hub() -> AsyncIterator[tuple[Hub, str]]:
    async with open_hub(Hub(admin_token=ADMIN)) as pair:
        yield pair


@pytest.fixture
def heartbeats_wanted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub's hello without the ``liveness`` extension, as a Server that does not know it
    (agentics.dk) sends it: its runners send every progress heartbeat (docs/protocol.md §3)."""
    import gateway.hub.channel

    offered = [e for e in gateway.hub.channel.EXTENSIONS if e != protocol.LIVENESS]
    monkeypatch.setattr(gateway.hub.channel, "EXTENSIONS", offered)


@pytest.fixture
async def runner(hub: tuple[Hub, str], sim: Simulator, tmp_path: Path) -> AsyncIterator[Runner]:
    async with running(runner_config(hub[1], sim.url, tmp_path / "state")) as r:
        yield r


@pytest.fixture
def logs() -> Iterator[LogCapture]:
    handler = LogCapture()
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(old)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[pgserver.PgServer]:
    """A PostgreSQL server for the session (skipped where PostgreSQL is not installed, but in
    CI), stopped and deleted at its end."""
    server = pgserver.start_or_skip()
    yield server
    server.destroy()


@pytest.fixture
def pg_url(pg_server: pgserver.PgServer) -> Iterator[str]:
    """The URL (with its password) of a new empty database, dropped after the test."""
    url = pg_server.database()
    yield url
    pg_server.drop(url)
