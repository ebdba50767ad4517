"""A runner that stops cleanly is down at once on every replica (issue 36, point 1), not only on
the one its last poll reached: two ``alp-gateway hub`` processes on one PostgreSQL, a runner
polling replica A stopped gently; replica B's status page and ``/readyz`` count it down within
``BOUND``, far inside ``offline_after`` (60 s). Each look is made at one of the store's
notifications (or 0.2 s after one); ``GUARD`` bounds every wait."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio
from helpers import ADMIN, runner_config
from test_replicas_killed import GUARD, Notes, team

from gateway.runner.supervisor import Runner
from gateway.sim import Simulator

BOUND = 5.0  # s from the runner's stop to replica B counting it down (offline_after is 60 s)


async def _runners(url: str) -> tuple[list[tuple[str, bool]], int]:
    """The status page's runners (id, up) and ``/readyz``'s status, as replica ``url`` says."""
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        found = await http.get("/api/hub/runners", headers={"Authorization": f"Bearer {ADMIN}"})
        ready = await http.get("/readyz")
    runners: list[dict[str, Any]] = found.json()["runners"]
    return [(r["id"], bool(r["up"])) for r in runners], ready.status_code


async def _until(url: str, notes: Notes, wanted: tuple[list[tuple[str, bool]], int]) -> None:
    while await _runners(url) != wanted:
        with trio.move_on_after(0.2):
            await notes.changed.wait()


async def test_a_runner_that_stops_cleanly_is_down_at_once_on_the_other_replica(
    pg_url: str, sim: Simulator, tmp_path: Path
) -> None:
    async with Notes(pg_url).running() as notes, team(pg_url, tmp_path) as (a, b):
        url_a, url_b = (f"http://127.0.0.1:{h.port}" for h in (a, b))
        runner = Runner(runner_config(url_a, sim.url, tmp_path / "r", name="r"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner.run)
            with trio.fail_after(GUARD):
                await runner.first_poll.wait()
            assert runner.registration is not None
            rid = runner.registration.id
            with trio.fail_after(GUARD):
                await _until(url_b, notes, ([(rid, True)], 200))
            runner.begin_shutdown()
        stopped = trio.current_time()
        with trio.fail_after(BOUND):
            await _until(url_b, notes, ([(rid, False)], 503))
        took = trio.current_time() - stopped
        on_a = await _runners(url_a)
    print(f"replica b counts the stopped runner down {took:.3f} s after its stop; a says {on_a}")
    assert on_a == ([(rid, False)], 503)
