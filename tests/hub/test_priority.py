"""Priority classes in the fair queue (issue 35, point 3): while every runner is at capacity, a
key's turns wait in its class (interactive, standard, background), the higher class served
first and round robin within one; a turn that waited ``priority_promote_after`` counts one class
higher, so a background job is never starved. The order itself (pure), then a real hub on
loopback with a runner driven by hand whose slots the test frees one at a time (tests/hub/test_queue.py's),
on trio's autojump clock; then two replicas on PostgreSQL reading each key's class from the store."""

from __future__ import annotations

import httpx
import trio
import trio.testing
from helpers import ADMIN
from test_causes import GUARD, NEVER, frontdoor_jobs
from test_queue import DEPTH, busy_hub, depth, post, until
from test_replicas import replicas

from gateway.hub.dispatchplan import FairQueue, Waiter
from gateway.hub.money import KeyBudget


def entry(lane: str, arrived: float, priority: int) -> Waiter:
    return Waiter(lane, object(), None, arrived, priority=priority)


def test_the_higher_class_first_round_robin_within_one_and_promoted_when_it_waited() -> None:
    queue = FairQueue(promote_after=30.0)
    background = [entry("B", float(i), 2) for i in range(3)]
    standard = [entry("S", 5.0, 1), entry("S", 6.0, 1)]
    interactive = [entry("I", 10.0, 0), entry("J", 11.0, 0)]
    for waiter in [*background, *standard, *interactive]:
        queue.join(waiter)
    queue.now = 12.0
    assert queue.order() == [*interactive, *standard, *background]
    # 31 s on, the first background turns waited past the bound: standard now, after S's
    # in the rotation (lane B is ahead of lane S, so B0 first), then the rest
    queue.now = 31.5
    assert [queue.rank(w) for w in background] == [1, 1, 2]
    assert queue.order() == [
        *interactive,
        background[0],
        standard[0],
        background[1],
        standard[1],
        background[2],
    ]
    # 60 s on, B0 waited twice the bound and S's once: interactive, in turn with I and J
    queue.now = 60.0
    assert queue.order()[:5] == [background[0], standard[0], *interactive, standard[1]]
    # without a bound (the default) nobody is promoted
    plain = FairQueue()
    for waiter in [*background, *interactive]:
        plain.join(waiter)
    plain.now = 1e9
    assert plain.order() == [*interactive, *background]


async def test_an_interactive_turn_is_served_before_a_queued_background_burst(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with busy_hub(queue_wait=NEVER, priority_promote_after=NEVER) as (hub, url, runner, _):
        keys = {}
        for name, priority in (("bg", "background"), ("std", "standard"), ("ia", "interactive")):
            keys[name] = await hub.keys.create(name, DEPTH)
            assert await hub.keys.set_budget(name, KeyBudget(priority=priority))
        replies: dict[str, httpx.Response] = {}
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as clients:

                async def turn(key: str, text: str) -> None:
                    replies[text] = await post(url, key, text)

                arrivals = [("bg", f"B{i}") for i in range(1, 5)] + [("std", "S1"), ("ia", "I1")]
                for n, (name, text) in enumerate(arrivals, 1):
                    clients.start_soon(turn, keys[name], text)
                    await until(hub, lambda n=n: depth(hub) == n)  # queued in this order
                await until(hub, lambda: len(frontdoor_jobs(hub)) == 1)  # only I1 holds one
                order = []
                for _ in arrivals:
                    job_id = await runner.take()
                    await until(hub, lambda job_id=job_id: bool(runner.served[job_id]))
                    order += runner.served[job_id]
    assert order == ["I1", "S1", "B1", "B2", "B3", "B4"]
    assert all(r.status_code == 200 for r in replies.values())


async def test_a_background_turn_that_waited_past_the_bound_is_promoted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with busy_hub(queue_wait=NEVER, priority_promote_after=100.0) as (hub, url, runner, _):
        keys = {}
        for name, priority in (("bg", "background"), ("ia", "interactive")):
            keys[name] = await hub.keys.create(name, DEPTH)
            assert await hub.keys.set_budget(name, KeyBudget(priority=priority))
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as clients:
                clients.start_soon(post, url, keys["bg"], "B1")
                await until(hub, lambda: depth(hub) == 1)
                await trio.sleep(200.0)  # virtual: B1 waits twice the bound (interactive now)
                clients.start_soon(post, url, keys["ia"], "I1")
                await until(hub, lambda: depth(hub) == 2)
                order = []
                for _ in range(2):
                    job_id = await runner.take()
                    await until(hub, lambda job_id=job_id: bool(runner.served[job_id]))
                    order += runner.served[job_id]
    # B1 is interactive now and its lane is first in the rotation: it is not starved by I1
    assert order == ["B1", "I1"]


async def test_each_replica_reads_a_keys_class_from_the_store(pg_url: str) -> None:
    # the queue is each replica's own (its turns wait in its dispatcher); the class is the
    # store's, set through one replica and read by both
    async with replicas(pg_url, 2) as (a, b):
        await a.hub.keys.create("bg", DEPTH)
        async with httpx.AsyncClient(base_url=b.url, timeout=30) as http:
            set_class = await http.post(
                "/api/hub/keys/bg/budget",
                headers={"Authorization": f"Bearer {ADMIN}"},
                json={"priority": "background"},
            )
            bad = await http.post(
                "/api/hub/keys/bg/budget",
                headers={"Authorization": f"Bearer {ADMIN}"},
                json={"priority": "urgent"},
            )
        found = [await replica.hub.accounting.budget("bg") for replica in (a, b)]
    assert set_class.status_code == 200 and set_class.json()["priority"] == "background"
    assert [(f.priority, f.rank) for f in found] == [("background", 2)] * 2
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == (
        "the priority must be one of interactive, standard, background, not 'urgent'"
    )
