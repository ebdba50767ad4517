"""The fallback tier (issue 37, point 7), on trio's autojump clock: a real hub on loopback, the
simulator, and two real runners of one project serving the same model, ``gpu`` (the primary
tier, the default) and ``cloud`` (``tier="fallback"``, as ``run --tier fallback``). New sessions
go to the primary while it can serve; with the primary stopped the next session is served by the
fallback; with the primary back new sessions go to it again. The runners API and the status
page's data show each runner's tier."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import test_failover as failover
import trio
import trio.testing
from helpers import ADMIN, OWNER, PROJECT, runner_config
from test_causes import GUARD, chat, hub_of

from gateway.hub import Hub, open_hub
from gateway.hub.dispatcher import FALLBACK_AFTER
from gateway.runner.supervisor import Runner
from gateway.sim import Simulator


@asynccontextmanager
async def runner(
    url: str, sim: Simulator, state: Path, name: str, **more: object
) -> AsyncIterator[Runner]:
    """A runner in the background until the block ends, then cancelled as a killed one is: no
    goodbye (the hub still counts it alive until ``offline_after``)."""
    r = Runner(runner_config(url, sim.url, state, name=name, **more))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(r.run)
        with trio.fail_after(GUARD):
            await r.first_poll.wait()
        yield r
        nursery.cancel_scope.cancel()


async def served_by(hub: Hub, url: str, key: str, session: str) -> str | None:
    """One new session's first turn; the name of the runner whose job served it."""
    reply = await chat(url, key, session, model="sim-model")
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"].startswith("tok0 tok1 ")
    job_id = hub.sessions.listing()[("k", session)]
    assert job_id is not None
    job = await hub.board.all_jobs.get(job_id)
    assert job is not None
    return job.runner_name


async def test_the_fallback_serves_only_while_the_primary_cannot(
    autojump_clock: trio.testing.MockClock, sim: Simulator, tmp_path: Path
) -> None:
    async with open_hub(hub_of()) as (hub, url), trio.open_nursery():
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        async with runner(url, sim, tmp_path / "cloud", "cloud", tier="fallback"):
            async with runner(url, sim, tmp_path / "gpu", "gpu"):
                with trio.fail_after(GUARD):
                    before = [await served_by(hub, url, key, f"a{n}") for n in range(4)]
                    async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                        listed = await http.get(
                            "/api/hub/runners", headers={"Authorization": f"Bearer {ADMIN}"}
                        )
            # the primary is gone without a word: it looks alive until offline_after, so the
            # job offered to it alone goes to the fallback too after a moment
            with trio.fail_after(GUARD):
                stopped_at = trio.current_time()
                during = await served_by(hub, url, key, "b")
                waited = trio.current_time() - stopped_at
            async with runner(url, sim, tmp_path / "gpu", "gpu"):  # back (its registration kept)
                with trio.fail_after(GUARD):
                    after = [await served_by(hub, url, key, f"c{n}") for n in range(4)]
    assert before == ["gpu"] * 4
    assert during == "cloud"
    assert waited <= FALLBACK_AFTER + 1.0  # not held until the primary is counted offline
    assert after == ["gpu"] * 4
    tiers = {r["name"]: r["tier"] for r in listed.json()["runners"]}
    assert tiers == {"gpu": "primary", "cloud": "fallback"}
    print(f"OBSERVED fallback took the session {waited:.1f} s (virtual) after the primary died")


async def test_an_answer_cut_by_the_primarys_death_is_continued_on_the_fallback(
    sim: Simulator, tmp_path: Path
) -> None:
    """``alp-gateway run --tier fallback`` as a process beside a primary one: the session goes to
    the primary; SIGKILLed mid-answer, its answer is continued on the fallback (one whole answer,
    no error), the only runner left that serves the model."""
    async with open_hub(failover.hub_of()) as (hub, url):
        client = failover.Client(url, await hub.keys.create("failover", f"{OWNER}/{PROJECT}"))
        async with (
            failover.runners(url, sim, tmp_path, "cloud", extra=("--tier", "fallback")) as cloud,
            failover.runners(url, sim, tmp_path, "gpu") as gpu,
        ):
            with trio.fail_after(failover.GUARD):
                while len(hub.board.runners) < 2 or any(
                    s.capabilities is None for s in hub.board.runners.values()
                ):
                    await hub.board.changes.wait()  # both polled: their tiers known
            killed: list[str] = []

            def kill_after_three(answer: failover.Answer) -> None:
                if len(answer.events) == 3 and not killed:
                    job = hub.board.jobs[failover.session_job(hub, "s")]
                    assert job.runner_name is not None
                    killed.append(job.runner_name)
                    gpu["gpu"].kill()

            with trio.fail_after(failover.GUARD):
                cut = await client.turn("s", chunks=60, interval=0.02, on_event=kill_after_three)
                job = hub.board.jobs[failover.session_job(hub, "s")]
            assert cloud["cloud"].returncode is None
    assert killed == ["gpu"]  # the session went to the primary
    assert cut.served and cut.text == "".join(f"tok{i} " for i in range(60))
    assert hub.counters.turns_continued == 1
    assert job.runner_name == "cloud"
