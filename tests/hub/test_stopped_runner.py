"""A runner that stops cleanly is forgotten at once (issue 36, point 1): its last poll says it
stops, and the status page, ``/readyz`` and ``alp_hub_runners_up`` count it down from then on,
not after ``offline_after``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio
from helpers import ADMIN, runner_config

from gateway.hub import Hub
from gateway.runner.supervisor import Runner
from gateway.sim import Simulator


async def _views(url: str) -> tuple[list[dict[str, Any]], httpx.Response, str]:
    """The status page's runners, ``/readyz``'s answer and ``alp_hub_runners_up``'s line."""
    auth = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        runners = (await http.get("/api/hub/runners", headers=auth)).json()["runners"]
        ready = await http.get("/readyz")
        metrics = (await http.get("/metrics", headers=auth)).text
    (up,) = [line for line in metrics.splitlines() if line.startswith("alp_hub_runners_up ")]
    return runners, ready, up


async def test_a_runner_that_stops_cleanly_is_down_at_once_on_the_page_readyz_and_metrics(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    """A real runner against a hub on loopback: up while it runs; after SIGTERM's clean stop
    (its last poll says so) it is down on ``/api/hub/runners``, ``/readyz`` answers 503 "no
    runner is connected" and ``alp_hub_runners_up`` is 0, well within ``offline_after``."""
    server, url = hub
    runner = Runner(runner_config(url, sim.url, tmp_path / "state"))
    with trio.fail_after(30):  # a hang guard only
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner.run)
            await runner.first_poll.wait()
            before = await _views(url)
            runner.begin_shutdown()
        stopped_at = trio.current_time()
        after = await _views(url)
        took = trio.current_time() - stopped_at
    assert runner.registration is not None
    print(f"after the stop: runners {after[0]}, /readyz {after[1].status_code} {after[1].json()}")
    print(f"{after[2]} ({took:.3f} s after the runner stopped, offline_after 60 s)")
    assert [(r["id"], r["up"]) for r in before[0]] == [(runner.registration.id, True)]
    assert before[1].status_code == 200 and before[2] == "alp_hub_runners_up 1.0"
    assert [(r["id"], r["up"]) for r in after[0]] == [(runner.registration.id, False)]
    assert after[1].status_code == 503 and after[1].json()["runners"] == 0
    assert after[1].json()["reason"] == "no runner is connected"
    assert after[2] == "alp_hub_runners_up 0.0"
    assert server.board.alive(runner.registration.id)  # a sign of life within offline_after
