"""The seam between the hub's parts and replication (``gateway.hub.coordination``), in memory:
a hub alone writes what its board decided to its own store (``Alone``), and the board makes
every decision another replica could race for through its coordination (a recording fake
here), never asking whether it runs alone."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.hub.board import BoardError, Changes, JobBoard
from gateway.hub.coordination import Alone, Coordination, Funds, Guard, Route, SessionKey
from gateway.hub.job import Job
from gateway.hub.settings import HubSettings
from gateway.hub.store import KeyLimits, Store, StoredSession, open_store
from gateway.hub.turn import Turn

OWNER, PROJECT = "acme", "chat"


@pytest.fixture
async def store() -> AsyncIterator[Store]:
    opened = open_store(None)  # SQLite in memory
    yield opened
    await opened.close()


class Recording:
    """A ``Coordination`` that records each call the parts make and answers as told: what
    another replica's decisions look like from this board."""

    turn_type = Turn

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.claims = True  # whether a claim is this board's
        self.ends = True
        self.withdrawal: str | None = "cancelled"
        self.reread: Job | None = None  # the job as "the store" has it

    async def save_job(self, job: Job) -> None:
        self.calls.append(("save_job", job.id))

    async def offered(self, job: Job) -> None:
        self.calls.append(("offered", job.id, job.runners))

    async def claim_job(self, job: Job, runner_id: str, name: str, run_id: str) -> bool:
        self.calls.append(("claim_job", job.id, runner_id))
        return self.claims

    async def complete_job(self, job: Job, conclusion: str, final: bool) -> bool:
        self.calls.append(("complete_job", job.id, conclusion, final))
        return self.ends

    async def withdraw_job(self, job: Job, reason: str) -> str | None:
        self.calls.append(("withdraw_job", job.id, reason))
        return self.withdrawal

    async def decided(self, job: Job) -> None:
        self.calls.append(("decided", job.id, job.status, job.claimed_by, job.cancelled))

    async def reread_job(self, job_id: str, known: Job | None) -> Job | None:
        self.calls.append(("reread_job", job_id))
        return self.reread

    def runner_seen(self, runner_id: str, changed: bool) -> None:
        self.calls.append(("runner_seen", runner_id, changed))

    def session_cap(self, limit: int) -> int:
        return limit

    def learned_job(self, key: SessionKey, known: str | None) -> str | None:
        return known

    async def bind_session(
        self, session: Any, stored: StoredSession, before: str | None
    ) -> str | None:
        return stored.job_id or None

    async def reap_sessions(self, sessions: Any) -> float:
        return float("inf")

    def remote_channel(self, job_id: str) -> Any:
        return None

    def awaiting(self, job_id: str) -> bool:
        return False

    def narrows_offers(self) -> bool:
        return True

    async def channel_accepted(self, ch: Any) -> None:
        return None

    async def admit(
        self, accounting: Any, turn: Turn, limits: KeyLimits, budget: Any, funds: Funds | None
    ) -> None:
        return None

    def turn_ended(self, accounting: Any, turn: Turn, wall: float) -> None:
        return None

    async def settle(self, turn: Turn) -> None:
        return None

    def join(self, **parts: Any) -> Any:
        return None

    async def run(self, task_status: Any = None) -> None:
        return None

    async def restore(self, local: Any) -> None:
        return None

    def advertise(self, base_url: str) -> None:
        return None

    def routes(self) -> tuple[list[Guard], list[Route]]:
        return [], []

    def connected_runners(self) -> set[str] | None:
        return None

    def identity(self) -> Any:
        return None


def _board(store: Store, coordination: Coordination | None = None) -> JobBoard:
    return JobBoard(store, HubSettings(), Changes(), coordination)


def _recorded(store: Store) -> tuple[JobBoard, Recording]:
    recording = Recording()
    return _board(store, recording), recording


async def test_a_board_alone_writes_each_decision_to_its_own_store(store: Store) -> None:
    board = _board(store)
    assert isinstance(board.coordination, Alone)
    queued = await board.enqueue(OWNER, PROJECT, ["chat"])
    claimed = await board.enqueue(OWNER, PROJECT, ["chat"])
    run_id = await board.claim("r-1", OWNER, PROJECT, claimed.id, "runner one")
    stored = await store.load_job(claimed.id)
    assert stored is not None and (stored.claimed_by, stored.run_id) == ("r-1", run_id)
    # a claim is the board's own decision alone: a second runner is refused, nothing written
    with pytest.raises(BoardError) as refused:
        await board.claim("r-2", OWNER, PROJECT, claimed.id, "runner two")
    assert refused.value.kind == "conflict"
    assert (await store.load_job(claimed.id)).claimed_by == "r-1"  # type: ignore[union-attr]
    # a queued job withdrawn is forgotten, in memory and in the store, a claimed one cancelled
    await board.withdraw(queued.id, "no longer wanted")
    assert queued.id not in board.jobs and await store.load_job(queued.id) is None
    await board.withdraw(claimed.id, "its session ended")
    cancelled = await store.load_job(claimed.id)
    assert cancelled is not None and cancelled.cancelled
    assert cancelled.cancel_reason == "its session ended"
    # the runner's final report ends it: saved completed, out of the live jobs
    job = await board.own_job("r-1", OWNER, PROJECT, run_id, claimed.id)
    await board.report_status(job, {"status": "completed", "conclusion": "success"})
    ended = await store.load_job(claimed.id)
    assert ended is not None and (ended.status, ended.conclusion) == ("completed", "success")
    assert claimed.id not in board.jobs


async def test_the_board_decides_through_its_coordination_and_writes_nothing_itself(
    store: Store,
) -> None:
    board, recording = _recorded(store)
    job = await board.enqueue(OWNER, PROJECT, ["chat"])
    assert recording.calls == [("save_job", job.id)]
    assert await store.load_job(job.id) is None  # every write went through the coordination
    board.seen("r-1")
    board.seen("r-1")
    assert recording.calls[-2:] == [("runner_seen", "r-1", True), ("runner_seen", "r-1", False)]
    await board.target(job, frozenset({"r-1"}))
    assert recording.calls[-1] == ("offered", job.id, frozenset({"r-1"}))

    recording.calls.clear()
    run_id = await board.claim("r-1", OWNER, PROJECT, job.id, "runner one")
    assert recording.calls == [
        ("claim_job", job.id, "r-1"),
        ("decided", job.id, "queued", "r-1", False),  # applied, then handed back to write
    ]
    assert board.jobs[job.id].run_id == run_id


async def test_a_claim_another_replica_won_is_refused_and_the_board_is_left_as_it_was(
    store: Store,
) -> None:
    board, recording = _recorded(store)
    job = await board.enqueue(OWNER, PROJECT, ["chat"])
    recording.claims = False  # another claim came first, as the store says
    recording.calls.clear()
    with pytest.raises(BoardError) as refused:
        await board.claim("r-1", OWNER, PROJECT, job.id, "runner one")
    assert refused.value.kind == "conflict"
    assert recording.calls == [("claim_job", job.id, "r-1"), ("reread_job", job.id)]
    assert job.claimed_by is None and job.run_id is None  # nothing applied, nothing decided


async def test_an_end_or_a_withdrawal_another_replica_made_first_is_not_applied_here(
    store: Store,
) -> None:
    board, recording = _recorded(store)
    job = await board.enqueue(OWNER, PROJECT, ["chat"])
    run_id = await board.claim("r-1", OWNER, PROJECT, job.id, "runner one")
    recording.withdrawal = None  # ended meanwhile, through another replica
    recording.calls.clear()
    await board.withdraw(job.id, "its session ended")
    assert recording.calls == [
        ("withdraw_job", job.id, "its session ended"),
        ("reread_job", job.id),
    ]
    assert not job.cancelled
    recording.ends = False  # another replica ended it first: this final report is late
    recording.calls.clear()
    owned = await board.own_job("r-1", OWNER, PROJECT, run_id, job.id)
    with pytest.raises(BoardError) as late:
        await board.report_status(owned, {"status": "completed", "conclusion": "success"})
    assert late.value.kind == "conflict" and board.late_reports == 1
    assert recording.calls == [
        ("complete_job", job.id, "success", True),
        ("reread_job", job.id),
    ]
    assert job.status != "completed"
