"""The dispatcher's applying half (``gateway.hub.dispatcher.Dispatcher``) in memory: the plans of
``gateway.hub.dispatchplan`` applied to a real board, channels and sessions over a store in memory,
on trio's autojump clock, with no socket (a channel accepted without a WebSocket, a client's
connection that only says when it leaves). ``tests/unit/test_dispatch.py`` holds the plans
themselves; here: a job opened for a waiting turn and given to it once its channel is up (the
session bound to it), a turn refused in its words when no runner can serve it, a job taken back
when its turn's client leaves before it was claimed, a second turn of the session on the open
channel at once."""

from __future__ import annotations

import contextlib
import random
from typing import Any

import pytest
import trio
import trio.testing
from walks import walk_counting

from gateway.apis.dialects import CHAT
from gateway.hub import dispatcher
from gateway.hub.board import Changes, JobBoard
from gateway.hub.channel import Channels
from gateway.hub.counters import HubCounters
from gateway.hub.dispatcher import Dispatcher, Unplaced
from gateway.hub.dispatchplan import Refusal
from gateway.hub.job import Job
from gateway.hub.sessions import Session, Sessions
from gateway.hub.settings import HubSettings
from gateway.hub.store import ApiKey, KeyLimits, open_store
from gateway.hub.turn import Turn
from gateway.wire.park import Park
from gateway.wire.protocol import CAPABILITY


class _Resp:
    """A response nobody reads (no turn here is streamed to a client)."""

    started = finished = gone = False
    backlog = 0


class Conn:
    """A client's connection as a waiting turn sees it: it only says when the client leaves."""

    def __init__(self) -> None:
        self.left = trio.Event()

    async def wait_disconnect(self, park: Park | None = None) -> bool:
        if park is None:
            await self.left.wait()
            return True
        gone = False

        async def leave() -> None:
            nonlocal gone
            await self.left.wait()
            gone = True
            park.cancel()

        async with trio.open_nursery() as nursery:  # the turn's wake or its client's leave
            nursery.start_soon(leave)
            await park.wait(None)
            nursery.cancel_scope.cancel()
        return gone


class Parts:
    """A hub's dispatching parts over a store in memory."""

    def __init__(self, **settings: float) -> None:
        self.changes = Changes()
        self.settings = HubSettings(**settings)
        self.store = open_store(None)
        self.board = JobBoard(self.store, self.settings, self.changes)
        self.channels = Channels(self.board, self.changes, HubCounters())
        s = self.settings

        async def end_job(job_id: str, reason: str) -> None:
            await self.channels.end_job(job_id, reason)

        self.sessions = Sessions(
            self.store,
            idle_timeout=lambda: s.session_idle_timeout,
            max_per_key=lambda: s.max_sessions_per_key,
            key_check_interval=lambda: s.key_check_interval,
            job_over=lambda job_id: False,
            end_job=end_job,
        )
        self.counters = HubCounters()
        self.dispatcher = Dispatcher(s, self.board, self.channels, self.sessions, self.counters)

    async def session(self, session_id: str = "s1") -> Session:
        await self.store.create_api_key("k", "o/p", KeyLimits())
        found = await self.store.key_limits("k")
        assert found is not None
        session, _ = await self.sessions.enter(ApiKey("k", "o", "p", found[0]), session_id)
        return session

    def runner(self, runner_id: str) -> None:
        self.board.seen(runner_id)
        self.board.polled(runner_id, "o", "p", {CAPABILITY})


def turn(session: Session) -> Turn:
    return Turn(
        "t",
        session.key[0],
        session.key_name,
        session.key[1],
        b'{"messages":[{"role":"user","content":"hi"}]}',
        CHAT,
        _Resp(),  # type: ignore[arg-type]
        model=None,
        stream=False,
        bound=1,
        max_answer=1,
        now=trio.current_time(),
    )


async def test_a_job_is_opened_for_a_waiting_turn_and_given_to_it_on_its_channel(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hub = Parts()
    hub.runner("r1")
    session = await hub.session()
    got: list[object] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.dispatcher.run)

        async def wait_for_channel() -> None:
            got.append(await hub.dispatcher.channel_for(session, turn(session), Conn()))

        nursery.start_soon(wait_for_channel)
        await trio.testing.wait_all_tasks_blocked()
        (job,) = hub.board.jobs.values()  # opened for the turn, offered to any capable runner
        assert job.origin == "frontdoor" and job.needs == [CAPABILITY] and job.claimed_by is None
        assert got == [] and session.job_id is None
        await hub.board.claim("r1", "o", "p", job.id, "box")
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # claimed, its channel not up yet: the turn still waits
        ch = hub.channels.accept(job.id, "r1", None)
        await trio.testing.wait_all_tasks_blocked()
        assert got == [(ch, True)]  # the channel, and "opened for this turn"
        assert session.job_id == job.id  # the session is bound to its job
        # the session's next turn takes the open channel at once: no step, no new job
        assert hub.dispatcher.open_channel(session, None) is ch
        nursery.cancel_scope.cancel()
    assert len(hub.board.jobs) == 1


async def test_a_turn_no_runner_can_serve_is_refused_saying_why(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hub = Parts()
    session = await hub.session()
    refused: list[Refusal] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.dispatcher.run)
        try:
            await hub.dispatcher.channel_for(session, turn(session), Conn())
        except Unplaced as exc:
            refused.append(exc.refusal.why)
        nursery.cancel_scope.cancel()
    assert refused == [Refusal.NO_RUNNER_CONNECTED]
    assert hub.board.jobs == {}  # no job opened for nobody


async def test_a_runner_that_never_claims_leaves_the_turn_refused_within_the_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hub = Parts(runner_wait_timeout=5.0)
    hub.runner("r1")
    session = await hub.session()
    start = trio.current_time()
    refused: list[Refusal] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.dispatcher.run)

        async def keep_runner_alive() -> None:
            while True:  # polls without taking the job
                hub.board.polled("r1", "o", "p", {CAPABILITY})
                hub.board.seen("r1")
                await trio.sleep(1)

        nursery.start_soon(keep_runner_alive)
        try:
            await hub.dispatcher.channel_for(session, turn(session), Conn())
        except Unplaced as exc:
            refused.append(exc.refusal.why)
        nursery.cancel_scope.cancel()
    assert refused == [Refusal.NO_RUNNER]
    assert trio.current_time() - start <= 5.0 + 1.0
    assert hub.board.jobs == {}  # the job opened for it, never claimed, taken back


async def test_a_job_is_taken_back_when_its_turns_client_leaves_before_a_claim(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hub = Parts()
    hub.runner("r1")
    session = await hub.session()
    conn = Conn()
    got: list[object] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.dispatcher.run)

        async def wait_for_channel() -> None:
            got.append(await hub.dispatcher.channel_for(session, turn(session), conn))

        nursery.start_soon(wait_for_channel)
        await trio.testing.wait_all_tasks_blocked()
        (job,) = hub.board.jobs.values()
        conn.left.set()  # the client hangs up while its turn waits
        await trio.testing.wait_all_tasks_blocked()
        assert got == [None]
        assert job.id not in hub.board.jobs and job.cancelled  # withdrawn: no runner takes it
        assert hub.board.offered("r1", "o", "p", {CAPABILITY}) == []
        assert hub.dispatcher.depth() == {}
        nursery.cancel_scope.cancel()


def counted(base: type[dict[str, Any]]) -> Any:
    """``base`` (the board's table's own type), empty, counting the walks over it."""
    return walk_counting(base)()


@pytest.mark.parametrize("push", [False, True])
async def test_a_new_sessions_dispatch_walks_neither_the_jobs_nor_the_runners(
    push: bool, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 39: with 1,000 runners in the project and 5,000 live jobs, a new session's steps
    (its job opened, offered, claimed, its channel up) never walk the board's jobs nor its
    runners; only the runners that changed since the last step (here: the one whose claim it
    took) are viewed again and the project's fleet is not built anew; and with every runner on
    a push stream, the one its job is offered to is found without asking after every runner
    (main: every step walked both and viewed every runner, every offer looked at each)."""
    hub = Parts()
    board = hub.board
    board.jobs = counted(type(board.jobs))
    board.runners = counted(type(board.runners))
    for i in range(1000):
        hub.runner(f"r{i}")
    for i in range(5000):  # the fleet's open sessions: five jobs held by each runner
        held = Job(f"j{i}", "o", "p", [CAPABILITY], {}, claimed_by=f"r{i % 1000}")
        held.status = "in_progress"
        board.add(held)
    calls = {"views": 0, "fleets": 0, "asked": 0}

    def counting(name: str, make: Any) -> Any:
        def count(*args: Any) -> Any:
            calls[name] += 1
            return make(*args)

        return count

    monkeypatch.setattr(dispatcher, "RunnerView", counting("views", dispatcher.RunnerView))
    if hasattr(dispatcher, "Fleet"):
        monkeypatch.setattr(dispatcher, "Fleet", counting("fleets", dispatcher.Fleet))
    monkeypatch.setattr(board, "subscribed", counting("asked", board.subscribed))
    await hub.store.create_api_key("k", "o/p", KeyLimits())
    found = await hub.store.key_limits("k")
    assert found is not None
    key = ApiKey("k", "o", "p", found[0])
    spent: list[dict[str, int]] = []
    walks = []
    with contextlib.ExitStack() as streams:
        pushed = {
            f"r{i}": streams.enter_context(board.subscribe("o", "p", f"r{i}"))
            for i in range(1000 if push else 0)
        }
        offered = streams.enter_context(board.subscribe("o", "p"))  # offered to any
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.dispatcher.run)
            for n in range(4):
                session, _ = await hub.sessions.enter(key, f"s{n}")
                jobs0, runners0, calls0 = board.jobs.walks, board.runners.walks, dict(calls)
                got: list[object] = []

                async def wait_for_channel(session: Session = session, got: list = got) -> None:
                    got.append(await hub.dispatcher.channel_for(session, turn(session), Conn()))

                nursery.start_soon(wait_for_channel)
                await trio.testing.wait_all_tasks_blocked()
                woken = {}  # the runners its job was pushed to
                for runner_id, stream in pushed.items():
                    with contextlib.suppress(trio.WouldBlock):
                        woken[runner_id] = stream.receive_nowait()
                if push:
                    ((who, job_id),) = woken.items()  # one runner woken, not the fleet
                else:
                    who, job_id = f"r{n}", offered.receive_nowait()
                await board.claim(who, "o", "p", job_id, "box")
                await trio.testing.wait_all_tasks_blocked()
                ch = hub.channels.accept(job_id, who, None)
                await trio.testing.wait_all_tasks_blocked()
                assert got == [(ch, True)]
                walks.append((board.jobs.walks - jobs0, board.runners.walks - runners0))
                spent.append({k: calls[k] - calls0[k] for k in calls})
            nursery.cancel_scope.cancel()
    assert walks == [(0, 0)] * 4, walks  # main: (a walk of the jobs, one of the runners) a step
    # the first session views every runner once; a later one views again only the runner
    # whose held jobs changed (the last one's claim), and builds no fleet (main: 6,000 views)
    assert spent[0]["views"] <= 1001 and max(s["views"] for s in spent[1:]) <= 2, spent
    assert max(s["fleets"] for s in spent[1:]) == 0, spent
    # the runner chosen among 1,000 on push streams: the first asked (main: each of them)
    assert max(s["asked"] for s in spent) <= 2, spent


@pytest.mark.parametrize("seed", range(6))
async def test_the_runners_a_step_keeps_equal_the_runners_viewed_afresh(
    seed: int, autojump_clock: trio.testing.MockClock
) -> None:
    """The project's runners the dispatcher keeps between steps (views of the runners that
    changed taken again, the rest kept) are, after every one of a random sequence of polls,
    model lists, claims, ends, revocations, new runners and silences, what a dispatcher that
    keeps nothing sees."""
    rng = random.Random(seed)
    hub = Parts(offline_after=60.0)
    board = hub.board
    ids = [f"r{i}" for i in range(12)]
    for runner_id in ids[:8]:
        hub.runner(runner_id)
    fresh = lambda: Dispatcher(  # noqa: E731
        hub.settings, board, hub.channels, hub.sessions, HubCounters()
    )._runners(("o", "p"))
    for _ in range(200):
        known = [r for r in ids if r in board.runners]
        op = rng.choice(["poll", "models", "claim", "end", "revoke", "new", "sleep", "seen"])
        if op == "poll" and known:
            caps = rng.choice([{CAPABILITY}, set(), {CAPABILITY, "fallback"}])
            board.polled(rng.choice(known), "o", "p", caps)
        elif op == "models" and known:
            board.runners[rng.choice(known)].models = frozenset(rng.sample(["a", "b", "c"], 2))
        elif op == "claim" and known:
            job = await board.enqueue("o", "p", [CAPABILITY])
            await board.claim(rng.choice(known), "o", "p", job.id, "box")
        elif op == "end":
            held = [j for j in board.jobs.values() if j.claimed_by is not None]
            if held:
                job = rng.choice(held)
                await board.report_status(job, {"status": "completed", "conclusion": "success"})
        elif op == "revoke" and known:
            await board.revoked(rng.choice(known))
        elif op == "new":
            hub.runner(rng.choice(ids))
        elif op == "sleep":
            await trio.sleep(rng.choice([5.0, 30.0, 61.0]))
        elif op == "seen" and known:
            board.seen(rng.choice(known))
        kept = hub.dispatcher._runners(("o", "p"))
        assert dict(kept.runners) == dict(fresh().runners), op
