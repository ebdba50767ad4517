"""Several hubs as replicas of one team on a real PostgreSQL (``tests/pgserver.py``), each with its
own server on loopback, in this process: a turn whose session's channel another replica holds is
forwarded there (its bytes as a direct turn's), a job is claimed once however many replicas its
claims reach, and API-key limits are exact across replicas."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers import ADMIN, OWNER, PROJECT, runner_config, running

from gateway.hub import Hub, open_hub
from gateway.hub.settings import HubSettings
from gateway.sim import Simulator

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@dataclass
class Replica:
    hub: Hub
    url: str


@asynccontextmanager
async def replicas(pg_url: str, count: int, **settings: Any) -> AsyncIterator[list[Replica]]:
    """``count`` hubs on the database ``pg_url``, each served on a port of its own."""
    async with trio.open_nursery() as nursery:
        started: list[Replica] = []
        for n in range(count):
            hub = Hub(
                admin_token=ADMIN,
                settings=HubSettings(store=pg_url, replica_id=f"r{n}", **settings),
            )
            found: list[tuple[Hub, str]] = []
            ready = trio.Event()

            async def serve(hub: Hub = hub, found: list[Any] = found, ready: trio.Event = ready):
                async with open_hub(hub) as pair:
                    found.append(pair)
                    ready.set()
                    await trio.sleep_forever()

            nursery.start_soon(serve)
            await ready.wait()
            started.append(Replica(*found[0]))
        # every replica knows every other (its heartbeat read)
        with trio.fail_after(10):
            while not all(
                len([p for p in r.hub.team.peers.values() if p.up]) == count - 1  # type: ignore[union-attr]
                for r in started
            ):
                await trio.sleep(0.05)
        try:
            yield started
        finally:
            nursery.cancel_scope.cancel()


async def _known(runner_id: str, *among: Replica) -> None:
    """Until every replica counts the runner live (its presence read: at once when it is new)."""
    with trio.fail_after(10):
        while not all(r.hub.board.alive(runner_id) for r in among):
            await trio.sleep(0.02)


async def _chat(url: str, key: str, session: str, content: str = "hi") -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(
            f"{url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}", "X-Chat-Session": session},
            json={
                "model": "sim-model",
                "stream": True,
                "messages": [{"role": "user", "content": content}],
            },
        )


async def test_a_turn_reaching_another_replica_than_its_channel_is_served_there(
    pg_url: str, sim: Simulator, tmp_path: Path
) -> None:
    async with replicas(pg_url, 2) as (a, b):
        key = await a.hub.store.create_api_key("alice", f"{OWNER}/{PROJECT}")
        async with running(runner_config(b.url, sim.url, tmp_path / "state")) as runner:
            assert runner.registration is not None
            await _known(runner.registration.id, a, b)
            first = await _chat(a.url, key, "s1")
            assert first.status_code == 200, first.text
            assert "[DONE]" in first.text
            job_id = next(iter(a.hub.sessions.live.values())).job_id
            assert job_id is not None
            assert b.hub.channels.local(job_id) is not None  # the channel is b's
            assert a.hub.channels.local(job_id) is None
            again = await _chat(a.url, key, "s1")
            assert again.status_code == 200 and "[DONE]" in again.text
            direct = await _chat(b.url, key, "s1")
            assert direct.status_code == 200 and "[DONE]" in direct.text
