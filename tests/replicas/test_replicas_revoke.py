"""A key revoked through one replica's admin API ends its turns in flight on another within a
second (issue 36, point 4): two ``alp-gateway hub`` processes on one PostgreSQL, a runner and the
simulator in this process, a stream in flight on replica B, the key revoked with ``DELETE
/api/hub/keys/NAME`` on replica A. Nothing waits on a sleep: the stream's own lines and the
store's notifications say when to look again; ``GUARD`` bounds every wait."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from helpers import ADMIN, OWNER, PROJECT, runner_config, running
from test_replicas_killed import GUARD, Notes, team

from gateway.hub.store import KeyLimits, open_store
from gateway.sim import Simulator

BOUND = 1.0  # s: the bound, from the revoke's request to the stream's end on B


async def _ready(url: str) -> bool:
    async with httpx.AsyncClient(timeout=5) as client:
        found = (await client.get(f"{url}/readyz")).json()
    return bool(found.get("capable") == 1)


async def _until_ready(url: str, notes: Notes) -> None:
    """Until the replica at ``url`` counts the runner capable: looked at again at each of the
    store's notifications, and 0.2 s after one (the replica, another process, reads what the
    notification names after it is sent: no event of its own to wait on)."""
    with trio.fail_after(GUARD):
        while not await _ready(url):
            with trio.move_on_after(0.2):
                await notes.changed.wait()


@pytest.mark.parametrize("runner_on", ["a", "b"])
async def test_a_revoke_on_one_replica_ends_the_keys_stream_on_another_within_a_second(
    pg_url: str, sim: Simulator, tmp_path: Path, runner_on: str
) -> None:
    """The runner polls replica ``runner_on`` (on A, B's turn goes to A's channel); a stream of
    40 s is in flight on B; A's admin API revokes its key: the stream on B ends within ``BOUND``
    of the revoke's request, with an error event naming the revocation, not the answer's end."""
    store = open_store(pg_url)
    await store.create_api_key("doomed", f"{OWNER}/{PROJECT}", KeyLimits())
    key = await store.create_api_key("doomed-too", f"{OWNER}/{PROJECT}", KeyLimits())
    await store.revoke_api_key("doomed")  # a name the fixture's store is known to hold
    await store.close()
    async with Notes(pg_url).running() as notes, team(pg_url, tmp_path) as (a, b):
        url_a, url_b = (f"http://127.0.0.1:{h.port}" for h in (a, b))
        server = url_a if runner_on == "a" else url_b
        async with running(runner_config(server, sim.url, tmp_path / "r", name="r")):
            for url in (url_a, url_b):
                await _until_ready(url, notes)
            lines: list[str] = []
            first = trio.Event()
            asked = ended = 0.0
            async with httpx.AsyncClient(timeout=GUARD) as client:

                async def stream() -> None:
                    nonlocal ended
                    async with client.stream(
                        "POST",
                        f"{url_b}/v1/chat/completions",
                        headers={"Authorization": f"Bearer {key}", "X-Chat-Session": "s"},
                        json={
                            "model": "sim-model",
                            "stream": True,
                            "messages": [{"role": "user", "content": "a long answer"}],
                            "sim": {"chunks": 2000, "interval": 0.02},  # 40 s
                        },
                    ) as response:
                        assert response.status_code == 200, await response.aread()
                        async for line in response.aiter_lines():
                            lines.append(line)
                            if line.startswith("data: {"):
                                first.set()
                    ended = trio.current_time()

                with trio.fail_after(GUARD):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(stream)
                        await first.wait()
                        asked = trio.current_time()
                        revoked = await client.delete(
                            f"{url_a}/api/hub/keys/doomed-too",
                            headers={"Authorization": f"Bearer {ADMIN}"},
                        )
                        answered = trio.current_time() - asked
    took = ended - asked
    errors = [line for line in lines if line.startswith("data: ") and '"error"' in line]
    chunks = len([line for line in lines if line.startswith("data: {") and line not in errors])
    print(
        f"runner on {runner_on}: the stream on b ended {took:.3f} s after the revoke was asked "
        f"on a (answered in {answered:.3f} s), after {chunks} chunks; its end: {errors}"
    )
    assert revoked.status_code == 200, revoked.text
    assert took < BOUND, f"the stream on b went on {took:.3f} s after the revoke"
    assert chunks < 1000 and "data: [DONE]" not in lines[-3:]  # cut, not answered whole
    assert errors and "revoked" in errors[-1], lines[-5:]
