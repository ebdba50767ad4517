"""The fair queue (issue 20, point 3): while every capable runner of a project is at capacity,
requests for a new session wait in a bounded FIFO per API key, served round-robin across keys;
on trio's autojump clock, a real hub on loopback and a runner driven by hand whose slots the
test frees one at a time.

"At once" is asserted on the virtual clock: a wait the hub should not make is set so long that
making it would show as that much virtual time."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio
import trio.testing
import trio_websocket
from helpers import register_runner
from test_causes import (
    CHAT_DEFINITION,
    GUARD,
    NEVER,
    OWNER,
    PROJECT,
    HandRunner,
    error_of,
    frontdoor_jobs,
    hub_of,
)

from gateway.hub import Hub, open_hub
from gateway.hub.dispatchplan import FairQueue, Waiter
from gateway.wire import protocol

DEPTH = f"{OWNER}/{PROJECT}"


class SlotRunner(HandRunner):
    """A runner at its capacity until the test frees a slot (``take``): then it advertises
    chat-llm:v1 once, claims the one job offered, serves it on a channel (every turn answered
    with one chunk naming the turn's message), and is at capacity again."""

    def __init__(self, registration: dict[str, Any], url: str, nursery: trio.Nursery) -> None:
        super().__init__(registration, url)
        self.token = self.http.headers["Authorization"].removeprefix("Bearer ")
        self.url = url
        self.nursery = nursery
        self.served: dict[str, list[str]] = {}  # job id -> the messages of its turns

    async def fill(self, hub: Hub) -> None:
        """Hold one session (a job claimed, never served) and advertise nothing."""
        job = await hub.board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], dict(CHAT_DEFINITION))
        assert [j["id"] for j in await self.poll("chat-llm:v1")] == [job.id]
        await self.claim(job.id)
        assert await self.poll() == []

    async def take(self) -> str:
        """Free one slot: the one job then offered is claimed and served; at capacity again."""
        (job,) = await self.poll("chat-llm:v1")
        await self.claim(job["id"])
        self.served[job["id"]] = []
        await self.nursery.start(self._serve, job["id"])
        assert await self.poll() == []
        return str(job["id"])

    async def _serve(self, job_id: str, task_status: trio.TaskStatus[None]) -> None:
        authority = urllib.parse.urlsplit(self.url).netloc
        query = urllib.parse.urlencode({"jobId": job_id, "token": self.token})
        url = f"ws://{authority}/api/lives/chat/channel/ws?{query}"
        async with trio_websocket.open_websocket_url(url) as ws:
            task_status.started()
            try:
                while True:
                    frame = json.loads(await ws.get_message())
                    if frame.get("type") != protocol.COMPLETION_REQUEST:
                        continue
                    text = frame["body"]["messages"][-1]["content"]
                    self.served[job_id].append(text)
                    chunk = {
                        "id": "chatcmpl-1",
                        "object": "chat.completion.chunk",
                        "created": 1,
                        "model": "fake-model",
                        "choices": [{"index": 0, "delta": {"content": f"served {text}"}}],
                    }
                    frames = protocol.TurnFrames(job_id, frame["requestId"])
                    await ws.send_message(frames.chunk(json.dumps(chunk).encode()).decode())
                    await ws.send_message(protocol.done_frame(job_id, frame["requestId"]))
            except trio_websocket.ConnectionClosed:
                pass


@asynccontextmanager
async def busy_hub(**settings: Any) -> AsyncIterator[tuple[Hub, str, SlotRunner, trio.Nursery]]:
    """A hub whose project's only runner holds one session and is at capacity (a runner driven
    by hand: it polls only when the test frees a slot, so the hub must not count it offline
    while virtual time passes)."""
    settings.setdefault("offline_after", 10 * GUARD)
    async with open_hub(hub_of(**settings)) as (hub, url), trio.open_nursery() as nursery:
        registration = await register_runner(hub, OWNER, PROJECT, "by-hand", ["self-hosted"])
        runner = SlotRunner(registration, url, nursery)
        await runner.fill(hub)
        yield hub, url, runner, nursery
        nursery.cancel_scope.cancel()


def body(text: str, **more: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": text}], **more}


def headers(key: str, session: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "X-Chat-Session": session}


async def post(url: str, key: str, text: str) -> httpx.Response:
    """One non-streamed turn in its own session (named after ``text``)."""
    async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
        return await http.post("/v1/chat/completions", json=body(text), headers=headers(key, text))


def depth(hub: Hub) -> int:
    return hub.snapshot().queue.depth.get(DEPTH, 0)


async def until(hub: Hub, predicate: Any) -> None:
    """Wait until ``predicate`` holds: looked at on every change of the board (the queue's joins
    and leaves notify it), and each virtual second (what a hand-driven runner did is no change
    of the hub's)."""
    while not predicate():
        with trio.move_on_after(1.0):
            await hub.board.changes.wait()


# -- the order: pure -------------------------------------------------------------------------


def Entry(lane: str, arrived: float) -> Waiter:  # noqa: N802 (one waiting turn of a lane)
    return Waiter(lane, object(), None, arrived)


def test_round_robin_across_lanes_fifo_within_one() -> None:
    queue = FairQueue()
    a = [Entry("A", float(i)) for i in range(3)]
    b = [Entry("B", 10.0), Entry("B", 11.0)]
    for entry in [*a, *b]:
        queue.join(entry)
    assert queue.order() == [a[0], b[0], a[1], b[1], a[2]]
    assert queue.position(b[1]) == (4, 5)
    assert queue.position(Entry("C", 20.0)) == (3, 6)  # where a new key would go: one more
    assert len(queue) == 5  # asking did not join it
    queue.leave(a[0], served=True)  # A had its turn: B's
    assert queue.order() == [b[0], a[1], b[1], a[2]]
    queue.leave(a[1])  # gave up: the rotation stays as it is
    assert queue.order() == [b[0], a[2], b[1]]
    queue.leave(b[0], served=True)
    queue.join(c := Entry("C", 30.0))  # a new lane joins at the back
    assert queue.order() == [a[2], b[1], c]
    assert queue.lanes() == {"A": 1, "B": 1, "C": 1}


# -- the hub ---------------------------------------------------------------------------------


async def test_a_burst_of_one_key_does_not_starve_another(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with busy_hub(queue_wait=NEVER) as (hub, url, runner, _):
        key_a = await hub.keys.create("a", DEPTH)
        key_b = await hub.keys.create("b", DEPTH)
        replies: dict[str, httpx.Response] = {}
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as clients:

                async def turn(key: str, text: str) -> None:
                    replies[text] = await post(url, key, text)

                arrivals = [(key_a, f"A{i}") for i in range(1, 6)] + [(key_b, "B1")]
                for n, (key, text) in enumerate(arrivals, 1):
                    clients.start_soon(turn, key, text)
                    await until(hub, lambda n=n: depth(hub) == n)  # queued in this order
                assert hub.snapshot().queue.depth == {DEPTH: 6}
                assert len(frontdoor_jobs(hub)) == 1  # only the first holds a job: no race
                order = []
                for _ in arrivals:  # slots free up one at a time
                    job_id = await runner.take()
                    await until(hub, lambda job_id=job_id: bool(runner.served[job_id]))
                    order += runner.served[job_id]
    assert order == ["A1", "B1", "A2", "A3", "A4", "A5"]
    assert {text: r.status_code for text, r in replies.items()} == dict.fromkeys(order, 200)
    assert replies["B1"].json()["choices"][0]["message"]["content"] == "served B1"
    stats = hub.snapshot().queue
    assert stats.depth == {} and stats.waits == 6 and len(stats.recent_waits) == 6
    assert hub.counters.queued == 6 and hub.counters.queue_timeouts == 0


async def test_past_the_bound_503_queue_full_at_once_with_the_position(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with busy_hub(queue_length=2, queue_wait=NEVER) as (hub, url, _runner, _):
        key_a = await hub.keys.create("a", DEPTH)
        key_b = await hub.keys.create("b", DEPTH)
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as clients:
                for n, text in enumerate(["A1", "A2"], 1):
                    clients.start_soon(post, url, key_a, text)
                    await until(hub, lambda n=n: depth(hub) == n)
                started = trio.current_time()
                refused = await post(url, key_b, "B1")
                elapsed = trio.current_time() - started
                clients.cancel_scope.cancel()  # the two waiting clients leave
            await until(hub, lambda: depth(hub) == 0)
    assert elapsed < NEVER  # refused at once, not after queue_wait
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == str(int(NEVER))
    assert error_of(refused) == {
        "message": "every runner is busy (1 at capacity) and the queue is full (2 waiting): "
        f"position 2 of 3: retry in {NEVER:g} s, or start another runner",
        "type": "service_unavailable",
        "param": None,
        "code": "queue_full",
    }
    assert hub.counters.queue_full == 1 and hub.counters.queued == 2
    assert frontdoor_jobs(hub) == []  # the leavers' job withdrawn, none opened for B1


async def test_a_streamed_client_gets_keepalives_while_queued_then_its_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with busy_hub(queue_wait=NEVER, keepalive_interval=5.0) as (hub, url, runner, _):
        key = await hub.keys.create("a", DEPTH)
        received = b""
        with trio.fail_after(GUARD):
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                async with http.stream(
                    "POST",
                    "/v1/chat/completions",
                    json=body("S1", stream=True),
                    headers=headers(key, "s"),
                ) as reply:
                    status = reply.status_code
                    chunks = reply.aiter_raw()
                    async for data in chunks:
                        received += data
                        if received.count(b": keepalive\n\n") == 2:
                            break
                    queued_for = trio.current_time()
                    assert depth(hub) == 1  # still waiting after two keepalives
                    await runner.take()
                    async for data in chunks:
                        received += data
    assert status == 200 and queued_for >= 10.0
    keepalives, _, rest = received.rpartition(b": keepalive\n\n")
    assert keepalives == b": keepalive\n\n"  # only keepalives before the slot freed
    events = [line for line in rest.split(b"\n\n") if line]
    assert json.loads(events[0].removeprefix(b"data: "))["choices"][0]["delta"] == {
        "content": "served S1"
    }
    assert events[-1] == b"data: [DONE]"
    stats = hub.snapshot().queue
    assert stats.waits == 1 and stats.recent_waits[0] >= 10.0 and stats.longest_wait >= 10.0


async def test_a_queued_streamed_turn_that_times_out_ends_its_stream_with_queue_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with busy_hub(queue_wait=12.0, keepalive_interval=5.0) as (hub, url, _runner, _):
        key = await hub.keys.create("a", DEPTH)
        with trio.fail_after(GUARD):
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                reply = await http.post(
                    "/v1/messages",
                    json={
                        "model": "fake-model",
                        "max_tokens": 10,
                        "stream": True,
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                    headers={"x-api-key": key},
                )
    assert reply.status_code == 200  # the stream had started: the error ends it
    text = reply.text
    assert text.count("event: ping") == 2  # Anthropic's keepalive, at 5 and 10 s
    assert text.rstrip().endswith("}")
    last = json.loads(text.rstrip().rpartition("data: ")[2])
    assert last["type"] == "error"
    assert (
        "none took this request within 12 s in the queue): position 1 of 1"
        in (last["error"]["message"])
    )
    assert hub.counters.queue_timeouts == 1 and frontdoor_jobs(hub) == []


async def test_a_client_that_leaves_the_queue_is_removed_at_once_and_the_next_is_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with busy_hub(queue_wait=NEVER) as (hub, url, runner, _):
        key_a = await hub.keys.create("a", DEPTH)
        key_b = await hub.keys.create("b", DEPTH)
        replies: dict[str, httpx.Response] = {}
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as clients:
                leaver = trio.CancelScope()

                async def turn(key: str, text: str, scope: trio.CancelScope) -> None:
                    with scope:
                        replies[text] = await post(url, key, text)

                clients.start_soon(turn, key_a, "A1", leaver)
                await until(hub, lambda: depth(hub) == 1)
                (held,) = frontdoor_jobs(hub)  # the first waiter's job, for the next free slot
                clients.start_soon(turn, key_b, "B1", trio.CancelScope())
                await until(hub, lambda: depth(hub) == 2)
                left_at = trio.current_time()
                leaver.cancel()  # A1's client disconnects
                await until(hub, lambda: depth(hub) == 1)
                removed_after = trio.current_time() - left_at
                job_id = await runner.take()
    assert removed_after < NEVER
    assert held.cancelled  # A1's job was withdrawn: it never takes the slot
    assert "A1" not in replies and replies["B1"].status_code == 200
    assert runner.served[job_id] == ["B1"]
    assert hub.snapshot().queue.waits == 2


async def test_a_job_no_runner_claims_costs_its_waiter_no_place(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with busy_hub(queue_wait=NEVER) as (hub, url, runner, _):
        key_a = await hub.keys.create("a", DEPTH)
        key_b = await hub.keys.create("b", DEPTH)
        replies: dict[str, httpx.Response] = {}
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as clients:

                async def turn(key: str, text: str) -> None:
                    replies[text] = await post(url, key, text)

                assert await runner.poll("chat-llm:v1") == []  # it says it has a free slot
                for n, (key, text) in enumerate([(key_a, "A1"), (key_b, "B1")], 1):
                    clients.start_soon(turn, key, text)
                    await until(hub, lambda n=n: len(frontdoor_jobs(hub)) == n)
                first, second = frontdoor_jobs(hub)  # both opened at once: a runner was free
                assert hub.counters.queued == 0
                assert await runner.poll() == []  # at capacity after all: neither was claimed
                await until(hub, lambda: frontdoor_jobs(hub) == [first])
                assert second.cancelled and depth(hub) == 2  # B1 gave its job back, waits on
                served = []
                for _ in range(2):
                    job_id = await runner.take()
                    await until(hub, lambda job_id=job_id: bool(runner.served[job_id]))
                    served += runner.served[job_id]
    assert served == ["A1", "B1"] and runner.served[first.id] == ["A1"]
    assert [replies[t].status_code for t in served] == [200, 200]
    assert hub.counters.queued == 2  # both waited once every runner was busy
