"""The job board (``gateway.hub.board.JobBoard``) driven in memory: a store in memory, no socket,
trio's autojump clock. Jobs are queued and announced to their project, offered to a poll that
can run them, claimed once, reported on (a report refused or late keeps nothing), withdrawn, and
force-ended when their runner goes silent for ``offline_after``."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from gateway.hub.board import BoardError, Changes, JobBoard
from gateway.hub.settings import HubSettings
from gateway.hub.store import open_store

CAP = "chat-llm:v1"


def board(**settings: float) -> JobBoard:
    return JobBoard(open_store(None), HubSettings(**settings), Changes())


async def test_a_queued_job_is_announced_to_its_project_and_offered_to_a_capable_poll() -> None:
    b = board()
    with b.subscribe("o", "p") as ours, b.subscribe("o", "other") as theirs:
        job = await b.enqueue("o", "p", [CAP])
        assert ours.receive_nowait() == job.id
        with pytest.raises(trio.WouldBlock):
            theirs.receive_nowait()
    assert b.offered("r1", "o", "p", {CAP}) == [job]
    assert b.offered("r2", "o", "p", {"something-else"}) == []  # lacks what the job needs
    assert b.offered("r3", "o", "other", {CAP}) == []  # another project's runner
    stored = await b.store.load_job(job.id)
    assert stored is not None and stored.status == "queued"


async def test_a_job_offered_to_one_runner_is_offered_to_no_other() -> None:
    b = board()
    job = await b.enqueue("o", "p", [CAP], runners=frozenset({"r1"}))
    assert b.offered("r2", "o", "p", {CAP}) == []
    assert b.offered("r1", "o", "p", {CAP}) == [job]


async def test_a_job_is_claimed_once() -> None:
    b = board()
    job = await b.enqueue("o", "p", [CAP])
    run_id = await b.claim("r1", "o", "p", job.id, "box-1")
    assert job.claimed.is_set() and job.claimed_by == "r1" and job.runner_name == "box-1"
    # the same runner again (its answer was lost): the same run; anyone else: a conflict
    assert await b.claim("r1", "o", "p", job.id, "box-1") == run_id
    with pytest.raises(BoardError) as refused:
        await b.claim("r2", "o", "p", job.id, "box-2")
    assert refused.value.kind == "conflict" and job.claimed_by == "r1"
    with pytest.raises(BoardError) as missing:
        await b.claim("r2", "o", "other", job.id, "box-2")  # not its project's
    assert missing.value.kind == "not_found"
    assert b.offered("r2", "o", "p", {CAP}) == []  # claimed: no longer offered to others


async def test_reports_keep_the_first_in_progress_and_the_final_one_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    b = board()
    job = await b.enqueue("o", "p", [CAP])
    run_id = await b.claim("r1", "o", "p", job.id, "box")
    with pytest.raises(BoardError) as forbidden:
        await b.own_job("r2", "o", "p", run_id, job.id)
    assert forbidden.value.kind == "forbidden"
    with pytest.raises(BoardError) as other_run:
        await b.own_job("r1", "o", "p", "another-run", job.id)
    assert other_run.value.kind == "not_found"
    mine = await b.own_job("r1", "o", "p", run_id, job.id)
    assert mine is job

    with pytest.raises(BoardError) as invalid:
        await b.report_status(job, {"status": "done"})
    assert invalid.value.kind == "invalid" and job.reports == []  # refused: nothing kept
    await b.report_status(job, {"status": "in_progress"})
    await b.report_status(job, {"status": "in_progress"})  # a repeat changes nothing
    assert job.status == "in_progress" and len(job.reports) == 1
    b.report_progress(job, {"stage": "turn", "message": "1 of 2"})
    assert job.heartbeats == 1 and job.last_progress == {"stage": "turn", "message": "1 of 2"}

    await b.report_status(job, {"status": "completed", "conclusion": "success", "logs": "ok"})
    assert job.completed.is_set() and job.conclusion == "success" and job.final_reported
    assert job.id not in b.jobs  # ended: out of the live jobs, found in the store
    ended = await b.lookup(job.id)
    assert ended is not None and ended.status == "completed"
    stored = await b.store.load_job(job.id)
    assert stored is not None and stored.conclusion == "success"

    with pytest.raises(BoardError) as late:
        await b.report_status(job, {"status": "completed", "conclusion": "failure"})
    assert late.value.kind == "conflict" and b.late_reports == 1 and job.conclusion == "success"
    with pytest.raises(BoardError):
        b.report_progress(job, {"stage": "late"})
    assert b.late_reports == 2 and job.heartbeats == 1


async def test_a_final_report_past_a_bound_is_refused_and_keeps_nothing() -> None:
    b = board()
    job = await b.enqueue("o", "p", [CAP])
    await b.claim("r1", "o", "p", job.id, "box")
    with pytest.raises(BoardError) as refused:
        await b.report_status(
            job, {"status": "completed", "conclusion": "success", "logs": "x" * 100_000}
        )
    assert refused.value.kind == "invalid" and '"logs"' in refused.value.message
    assert job.status == "queued" and job.reports == [] and not job.completed.is_set()


async def test_a_withdrawn_job_is_forgotten_when_queued_and_refused_a_channel_when_claimed() -> (
    None
):
    b = board()
    queued = await b.enqueue("o", "p", [CAP])
    claimed = await b.enqueue("o", "p", [CAP])
    await b.claim("r1", "o", "p", claimed.id, "box")
    assert b.may_open_channel("r1", claimed.id) is claimed
    await b.withdraw(queued.id, "nobody waits")
    await b.withdraw(claimed.id, "nobody waits")
    assert queued.id not in b.jobs and await b.lookup(queued.id) is None
    assert claimed.cancelled and claimed.cancel_reason == "nobody waits"
    assert b.may_open_channel("r1", claimed.id) is None
    assert b.offered("r2", "o", "p", {CAP}) == []


async def test_a_silent_runners_jobs_end_after_offline_after(
    autojump_clock: trio.testing.MockClock,
) -> None:
    b = board(offline_after=60.0)
    silent = await b.enqueue("o", "p", [CAP])
    lively = await b.enqueue("o", "p", [CAP])
    await b.claim("r-silent", "o", "p", silent.id, "a")
    await b.claim("r-lively", "o", "p", lively.id, "b")
    b.seen("r-silent")
    b.seen("r-lively")
    await trio.sleep(59)
    b.seen("r-lively")
    assert await b.check_offline() == []  # 59 s: within offline_after
    await trio.sleep(2)
    assert b.alive("r-lively") and not b.alive("r-silent")
    assert await b.check_offline() == [silent]
    assert silent.completed.is_set() and silent.conclusion == "failure"
    assert silent.reports[-1]["logs"] == "runner offline" and silent.reports[-1]["forced"]
    assert lively.id in b.jobs and not lively.completed.is_set()
    assert await b.check_offline() == []  # ended once


async def test_availability_counts_the_projects_live_runners_by_what_they_can_do(
    autojump_clock: trio.testing.MockClock,
) -> None:
    b = board(offline_after=60.0)
    for runner in ("free", "busy", "down", "gone"):
        b.seen(runner)
    b.polled("free", "o", "p", {CAP})
    b.polled("busy", "o", "p", set())
    b.polled("down", "o", "p", set())
    b.polled("gone", "o", "p", {CAP})
    job = await b.enqueue("o", "p", [CAP])
    await b.claim("busy", "o", "p", job.id, "x")
    await trio.sleep(30)
    for runner in ("free", "busy", "down"):
        b.seen(runner)
    await trio.sleep(31)  # "gone" silent for 61 s
    found = b.availability("o", "p", CAP)
    assert (found.free, found.busy, found.down, found.unknown) == (1, 1, 1, 0)
    assert b.availability("o", "p", CAP, exclude="free").free == 0
