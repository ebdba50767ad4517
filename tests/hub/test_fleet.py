"""A hub under a fleet (issue 39), counted, never timed, on trio's autojump clock: a real hub
on loopback and runners that keep the push stream open. A new session wakes one runner it was
offered to, not the fleet, and no claim is lost; a runner that does not take its offer is passed
over for the next; an idle poll looks at the jobs a poll may offer, never at the open sessions;
the ended jobs' notes do not pile up."""

from __future__ import annotations

import trio
import trio.testing
from fake_runner import FakeRunner
from test_causes import ADMIN, GUARD, OWNER, PROJECT, chat, hub_of

from gateway.hub import open_hub
from gateway.runner.backoff import POLL_SPREAD, poll_delay

RUNNERS = 12
POLL = 10.0  # s: as a deployed runner polls; pushes wake it in between


def fleet(url: str, n: int, **kwargs: object) -> list[FakeRunner]:
    return [
        FakeRunner(
            url,
            ADMIN,
            owner=OWNER,
            project=PROJECT,
            name=f"r{i}",
            poll_interval=POLL,
            push=True,
            **kwargs,  # type: ignore[arg-type]
        )
        for i in range(n)
    ]


async def test_a_new_session_wakes_one_runner_not_the_fleet(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(hub_of(max_sessions_per_key=1000)) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        async with trio.open_nursery() as nursery:
            runners = fleet(url, RUNNERS)
            for fake in runners:
                await nursery.start(fake.run)
            with trio.fail_after(GUARD):
                await trio.sleep(POLL)  # every runner has polled once: all of them capable
                pushed, offered = [], []
                for n in range(20):
                    pushes0 = sum(f.pushes for f in runners)
                    offers0 = sum(f.offers for f in runners)
                    reply = await chat(url, key, f"s{n}")
                    assert reply.status_code == 200, reply.text
                    pushed.append(sum(f.pushes for f in runners) - pushes0)
                    offered.append(sum(f.offers for f in runners) - offers0)
            nursery.cancel_scope.cancel()
    assert max(pushed) <= 2, pushed  # one runner woken a session (main: all 12)
    assert max(offered) <= 2, offered  # only the woken runner's poll offers it
    assert sum(f.lost_claims for f in runners) == 0
    # spread over the fleet: the least busy runner is chosen each time
    assert sum(1 for f in runners if f.claimed) == RUNNERS


async def test_a_runner_that_does_not_take_its_offer_is_passed_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(hub_of(max_sessions_per_key=1000)) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        async with trio.open_nursery() as nursery:
            runners = fleet(url, 3)
            for fake in runners:
                await nursery.start(fake.run)
            with trio.fail_after(GUARD):
                await trio.sleep(POLL)
                for stuck in runners[:2]:  # they poll, are offered the job, never claim it
                    stuck.claims = False
                replies = [await chat(url, key, f"s{n}") for n in range(3)]
                assert [r.status_code for r in replies] == [200] * 3, replies[0].text
            nursery.cancel_scope.cancel()
    assert not runners[0].claimed and not runners[1].claimed
    assert len(runners[2].claimed) == 3
    # each stuck runner was offered the first job and passed over; the next jobs skip neither
    # (the choice goes round): each was offered at most two jobs
    assert 1 <= runners[0].offers <= 2 and 1 <= runners[1].offers <= 2


async def test_an_idle_poll_does_not_walk_the_open_sessions(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scanned: dict[int, int] = {}
    async with open_hub(hub_of(max_sessions_per_key=1000)) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        async with trio.open_nursery() as nursery:
            runners = fleet(url, 4)
            for fake in runners:
                await nursery.start(fake.run)
            with trio.fail_after(GUARD):
                opened = 0
                for sessions in (10, 60):
                    while opened < sessions:
                        assert (await chat(url, key, f"s{opened}")).status_code == 200
                        opened += 1
                    assert len(hub.board.jobs) >= sessions  # every session's job is live
                    before, polls = hub.board.scanned, sum(f.polls for f in runners)
                    await trio.sleep(3 * POLL)  # every runner polls a few times, idle
                    polls = sum(f.polls for f in runners) - polls
                    assert polls >= len(runners)
                    scanned[sessions] = hub.board.scanned - before
                # turns that name their model on open sessions: no walk over the runners
                walks = hub.catalog.walks
                for n in range(20):
                    reply = await chat(url, key, f"s{n}", model="fake-model")
                    assert reply.status_code == 200
                walked = hub.catalog.walks - walks
            nursery.cancel_scope.cancel()
    assert scanned[60] <= scanned[10] + 4, scanned  # main walked every live job on each poll
    assert walked == 0  # main: a walk over every runner per turn (Catalog.known)


async def test_a_runners_ended_sessions_are_not_kept_for_ever(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(hub_of(max_sessions_per_key=1000)) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        async with trio.open_nursery() as nursery:
            (runner,) = fleet(url, 1)
            await nursery.start(runner.run)
            with trio.fail_after(GUARD):
                for n in range(5):
                    assert (await chat(url, key, f"s{n}")).status_code == 200
                ended = list(runner.claimed)
                for job_id in ended:
                    await runner.end_session(job_id)
                # its final report answered: the hub has ended the job by then
                await runner.wait_until(
                    lambda: all(
                        runner.reports.get(job_id, [{}])[-1].get("status") == "completed"
                        for job_id in ended
                    )
                )
                assert not set(ended) & set(hub.board.jobs)
            nursery.cancel_scope.cancel()
        assert not set(ended) & hub.channels.runner_ended  # main kept every one


def test_a_fleets_poll_timers_drift_apart_after_a_push() -> None:
    """A push wakes every runner it reaches at one instant: their next polls' timers differ (a
    fleet's polls do not stay in one burst), none later than the interval."""
    delays = [poll_delay(POLL) for _ in range(200)]
    assert all(POLL * (1 - POLL_SPREAD) <= d <= POLL for d in delays)
    assert max(delays) - min(delays) > POLL * POLL_SPREAD / 2
    assert len(set(delays)) > 190


async def test_a_live_channels_pongs_keep_its_runner_alive_without_polls_or_heartbeats() -> None:
    """One liveness signal a session: a runner that neither polls nor sends heartbeats once it
    holds its job (the fake sends none) stays alive while its channel answers the hub's pings,
    well past ``offline_after``: its job is not force-completed (main: ended after 1 s)."""
    ping = 0.1  # s, real sockets and the real clock; nothing asserts how long anything took
    hub = hub_of(ping_interval=ping, offline_after=1.0, max_sessions_per_key=10)
    async with open_hub(hub) as (hub, url), trio.open_nursery() as nursery:
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        runner = FakeRunner(url, ADMIN, owner=OWNER, project=PROJECT, poll_until_claimed=True)
        await nursery.start(runner.run)
        with trio.fail_after(60):
            assert (await chat(url, key, "s")).status_code == 200
            (job_id,) = runner.claimed
            pings = hub.counters.pings_sent
            # 40 pings (4 s): four times offline_after, counted (no event says a ping went)
            while hub.counters.pings_sent < pings + 40:  # noqa: ASYNC110
                await trio.sleep(ping)
            job = hub.board.jobs.get(job_id)
            assert job is not None and job.status != "completed"
            assert hub.board.alive(runner.runner_id or "")
            assert (await chat(url, key, "s")).status_code == 200  # the same channel serves
        nursery.cancel_scope.cancel()
    assert runner.dials[job_id] == 1
