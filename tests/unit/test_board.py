"""The job board (``gateway.hub.board.JobBoard``) driven in memory: a store in memory, no socket,
trio's autojump clock. Jobs are queued and announced to their project, offered to a poll that
can run them, claimed once, reported on (a report refused or late keeps nothing), withdrawn, and
force-ended when their runner goes silent for ``offline_after``."""

from __future__ import annotations

import contextlib
import random

import pytest
import trio
import trio.testing

from gateway.hub.board import BoardError, Changes, JobBoard
from gateway.hub.job import Job
from gateway.hub.replicas.boardsync import apply
from gateway.hub.replicas.store.base import TeamJob
from gateway.hub.runnertable import RunnerState
from gateway.hub.settings import HubSettings
from gateway.hub.store import Registration, open_store

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


def _recount(b: JobBoard) -> dict[str, int]:
    """Each runner's held jobs counted the slow way: a walk of every live job."""
    held: dict[str, int] = {}
    for job in b.jobs.values():
        if job.claimed_by is not None and not job.over:
            held[job.claimed_by] = held.get(job.claimed_by, 0) + 1
    return held


@pytest.mark.parametrize("seed", range(8))
async def test_the_held_counts_equal_a_recount_after_claims_ends_withdrawals_and_forced_ends(
    seed: int, autojump_clock: trio.testing.MockClock
) -> None:
    """The board keeps each runner's held jobs as jobs are claimed and end (a runner's final
    report, a withdrawal, an end forced offline or at a revocation, another replica's word
    read back), so no step of the dispatcher walks the jobs to count them: after every one of
    a random sequence of those, the counts and the table's runners by project equal a
    recount."""
    rng = random.Random(seed)
    b = board(offline_after=60.0)
    projects = [("o", "p"), ("o", "q")]
    runners = {f"r{i}": projects[i % 2] for i in range(6)}
    for runner_id, (owner, project) in runners.items():
        b.seen(runner_id, Registration(runner_id, runner_id, owner, project, (), "", ""))
    checks = most = 0
    for _ in range(300):
        live = list(b.jobs.values())
        op = rng.choice(
            ["enqueue", "enqueue", "claim", "claim", "report", "withdraw", "sync"] * 2
            + ["offline", "revoke", "reload"]
        )
        if op == "enqueue" or not live:
            await b.enqueue(*rng.choice(projects), [CAP])
        elif op == "claim":
            job = rng.choice(live)
            ours = [r for r, p in runners.items() if p == (job.owner, job.project)]
            with contextlib.suppress(BoardError):
                await b.claim(rng.choice(ours), job.owner, job.project, job.id, "box")
        elif op == "report":
            job = rng.choice(live)
            status = rng.choice(["in_progress", "completed"])
            with contextlib.suppress(BoardError):
                await b.report_status(job, {"status": status, "conclusion": "success"})
        elif op == "withdraw":
            await b.withdraw(rng.choice(live).id, "queued behind another request")
        elif op == "sync":  # another replica's word on a job, read back into this board
            job = rng.choice(live)
            stored = job.record()
            change = rng.choice(["gone", "claimed", "cancelled", "completed"])
            if change == "gone":
                apply(b, job.id, None)
            else:
                if change == "claimed" and stored.claimed_by is None:
                    stored.claimed_by = rng.choice(list(runners))
                    stored.run_id, stored.runner_name = f"run-{job.id}", "box"
                stored.cancelled = stored.cancelled or change == "cancelled"
                stored.status = "completed" if change == "completed" else stored.status
                apply(b, job.id, TeamJob(stored, None, "other"))
        elif op == "offline":
            await trio.sleep(rng.choice([1.0, 30.0, 61.0]))
            for runner_id in rng.sample(list(runners), 3):
                if runner_id in b.runners:
                    b.seen(runner_id)
            await b.check_offline()
        elif op == "revoke":
            runner_id = rng.choice(list(runners))
            await b.revoked(runner_id)
            owner, project = runners[runner_id]
            b.seen(runner_id, Registration(runner_id, runner_id, owner, project, (), "", ""))
        elif op == "reload":  # a claimed job read back from the store (as at a start)
            job = rng.choice(live)
            b.drop(job.id)
            b.add(Job.from_record(job.record()))
        expected = _recount(b)
        assert {r: b.held(r) for r in runners} == {r: expected.get(r, 0) for r in runners}, op
        assert b.runners.holding() == set(expected)  # no runner kept with nothing held
        for owner, project in projects:
            ours = {r for r, s in b.runners.items() if (s.owner, s.project) == (owner, project)}
            assert set(b.runners.of(owner, project)) == ours
        checks += 1
        most = max(most, sum(expected.values()))
    assert checks == 300 and most > 2


async def test_a_project_s_runners_version_moves_with_what_the_dispatcher_views_of_them() -> None:
    """A change the dispatcher's view of a runner shows (capabilities, models, a job held, a
    runner added or gone) moves its project's version and no other's; a poll that changes
    nothing does not."""
    b = board()
    b.seen("r1", Registration("r1", "r1", "o", "p", (), "", ""))
    b.polled("r1", "o", "p", {CAP})
    b.seen("r2", Registration("r2", "r2", "o", "q", (), "", ""))
    versions = lambda: (b.runners.version("o", "p"), b.runners.version("o", "q"))  # noqa: E731
    before = versions()
    b.polled("r1", "o", "p", {CAP})  # the same capabilities again
    b.runners["r1"].models = None  # the same models
    assert versions() == before
    b.polled("r1", "o", "p", set())
    assert versions()[0] > before[0] and versions()[1] == before[1]
    before = versions()
    b.runners["r1"].models = frozenset({"m"})
    assert versions()[0] > before[0]
    before = versions()
    job = await b.enqueue("o", "p", [CAP])
    assert versions() == before  # queued: nobody holds it
    await b.claim("r1", "o", "p", job.id, "box")
    assert versions()[0] > before[0] and b.held("r1") == 1
    before = versions()
    await b.revoked("r1")
    assert versions()[0] > before[0] and b.runners.of("o", "p") == {} and b.held("r1") == 0
    # every other way a dict is written goes through the index too
    b.runners.update({"r9": RunnerState("o", "q")})
    b.runners.setdefault("r8", RunnerState("o", "p"))
    assert set(b.runners.of("o", "q")) == {"r2", "r9"} and set(b.runners.of("o", "p")) == {"r8"}
    assert b.runners.popitem()[0] == "r8" and b.runners.of("o", "p") == {}
    b.runners.clear()
    assert b.runners.of("o", "q") == {} and not b.runners
