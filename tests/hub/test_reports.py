"""A hostile runner's progress and status reports (issue 30, row 7), over raw loopback sockets to
an in-process hub, by a registered runner the test drives through the runner API itself.

A report is validated before anything of it is kept: a refused one is not kept, in memory or in
the store. One after its job's final report is dropped and counted (``JobBoard.late_reports``),
never stored. A report body is at most ``REPORT_MAX_BYTES``: a larger one is refused (413) from
its ``Content-Length``, before it is read. What one job keeps is bounded: its first
``in_progress`` report, its final one and its last heartbeat.
"""

from __future__ import annotations

import gc
import json
import tracemalloc
from pathlib import Path
from typing import Any

import trio
import trio.testing
from helpers import ADMIN, CHAT_DEFINITION, OWNER, PROJECT, register_runner
from rawclient import RawConn, bearer, head, request

from gateway.hub import Hub, open_hub
from gateway.hub.board import REPORT_MAX_BYTES

BASE = f"/api/owners/{OWNER}/projects/{PROJECT}"
MiB = 1024 * 1024
IN_PROGRESS = {"status": "in_progress"}
DONE = {
    "status": "completed",
    "conclusion": "success",
    "logs": "bye",
    "completionReason": "success",
}


def _hub(data: Path | None = None) -> Hub:
    return Hub(data, admin_token=ADMIN, ping_interval=0.0)


def padded(report: dict[str, Any], size: int) -> dict[str, Any]:
    """``report`` with an unknown field that makes its JSON body ``size`` bytes."""
    return {**report, "pad": "x" * (size - len(json.dumps({**report, "pad": ""})))}


class Runner:
    """A registered runner with one claimed job, reporting over one kept-alive connection."""

    def __init__(self, hub: Hub, url: str) -> None:
        self.hub, self.url = hub, url
        self.token = ""
        self.job_id = ""
        self.run_id = ""
        self.conn: RawConn | None = None

    @classmethod
    async def open(cls, hub: Hub, url: str) -> Runner:
        runner = cls(hub, url)
        registered = await register_runner(hub, OWNER, PROJECT, "box", ["chat-llm:v1"])
        runner.token = registered["token"]
        job = await hub.board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], dict(CHAT_DEFINITION))
        runner.job_id = job.id
        return runner

    async def send(self, method: str, path: str, body: Any) -> Any:
        """One request on the kept-alive connection (a new one after the hub closed it)."""
        if self.conn is None or self.conn.eof:
            self.conn = await RawConn.open(self.url)
        await self.conn.send(request(method, path, [bearer(self.token)], body))
        resp = await self.conn.response()
        assert resp is not None, "no answer"
        return resp

    async def claim(self) -> None:
        body = {"jobId": self.job_id, "name": "box"}
        resp = await self.send("POST", f"{BASE}/runners/generate-jitconfig", body)
        assert resp.status == 200, resp.body
        self.run_id = resp.json()["runId"]

    @property
    def job_path(self) -> str:
        return f"{BASE}/runs/{self.run_id}/jobs/{self.job_id}"

    async def status(self, report: dict[str, Any]) -> Any:
        return await self.send("PATCH", self.job_path, report)

    async def progress(self, report: dict[str, Any]) -> Any:
        return await self.send("POST", f"{self.job_path}/progress", report)

    async def stored(self) -> list[dict[str, Any]]:
        """The job's reports as the store has them."""
        job = await self.hub.store.load_job(self.job_id)
        assert job is not None
        return list(job.reports)

    async def aclose(self) -> None:
        if self.conn is not None:
            await self.conn.aclose()


def error_of(resp: Any, status: int, code: str) -> str:
    """The message of an error answer in the runner API's shape (OpenAI's error envelope)."""
    assert resp.status == status, (resp.status, resp.body[:200])
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    message: str = error["message"]
    return message


async def test_refused_progress_and_status_reports_are_not_kept(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with open_hub(_hub(tmp_path / "hub")) as (hub, url):
        runner = await Runner.open(hub, url)
        await runner.claim()
        assert (await runner.status(IN_PROGRESS)).status == 200
        beat = {"stage": "chat_llm_active", "message": None}
        assert (await runner.progress(beat)).status == 200
        job = hub.board.jobs[runner.job_id]
        size = REPORT_MAX_BYTES - 256  # each under the body bound: read, then refused
        for _ in range(40):
            resp = await runner.progress(padded({"stage": 5}, size))
            assert error_of(resp, 400, "invalid") == '"stage" must be a string'
            resp = await runner.progress(padded({"stage": "s", "message": 7}, size))
            assert error_of(resp, 400, "invalid") == '"message" must be a string or null'
        refused_status = [
            {"status": "bogus"},
            {"status": "completed", "conclusion": "maybe"},
            {"status": "completed", "conclusion": "success", "logs": ["not", "text"]},
        ]
        for report in refused_status * 10:
            resp = await runner.status(padded(report, size))
            error_of(resp, 400, "invalid")
        assert job.last_progress == beat and job.heartbeats == 1
        assert job.reports == [IN_PROGRESS] and await runner.stored() == [IN_PROGRESS]
        assert job.status == "in_progress" and hub.board.late_reports == 0
        await runner.aclose()


async def test_a_report_over_the_bound_is_refused_413_before_it_is_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(_hub()) as (hub, url):
        runner = await Runner.open(hub, url)
        await runner.claim()
        for path, method in ((f"{runner.job_path}/progress", "POST"), (runner.job_path, "PATCH")):
            conn = await RawConn.open(url)
            # only the head: the answer comes without the body ever being sent
            headers = [bearer(runner.token), ("Content-Length", str(MiB))]
            await conn.send(head(method, path, headers))
            resp = await conn.response()
            assert resp is not None and resp.status == 413, resp
            await conn.aclose()
        # one byte over the bound, sent whole: refused as well
        report = padded({"stage": "s"}, REPORT_MAX_BYTES + 1)
        assert len(json.dumps(report)) == REPORT_MAX_BYTES + 1
        assert (await runner.progress(report)).status == 413
        assert hub.board.jobs[runner.job_id].last_progress is None
        await runner.aclose()


async def test_forty_refused_one_mib_progress_reports_leave_the_hub_its_size(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Today's probe: 40 x 1 MiB progress reports grew the hub by 39 MB. The Python heap is
    measured (tracemalloc), not RSS: the same bytes, without the allocator's noise."""
    async with open_hub(_hub()) as (hub, url):
        runner = await Runner.open(hub, url)
        await runner.claim()
        report = request("POST", f"{runner.job_path}/progress", [bearer(runner.token)])
        body = json.dumps({"stage": "s" * MiB}).encode()
        report = report.replace(b"Content-Length: 0", f"Content-Length: {len(body)}".encode())
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(40):
                conn = await RawConn.open(url)
                await conn.send(report + body)  # the hub may close before it all arrives
                resp = await conn.response()
                assert resp is not None and resp.status == 413
                await conn.aclose()
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert grown < 2 * MiB, f"the hub's heap grew by {grown} bytes"
        assert hub.board.jobs[runner.job_id].last_progress is None


async def test_late_reports_are_dropped_counted_and_never_stored(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with open_hub(_hub(tmp_path / "hub")) as (hub, url):
        runner = await Runner.open(hub, url)
        await runner.claim()
        assert (await runner.status(IN_PROGRESS)).status == 200
        assert (await runner.status(DONE)).status == 200
        late = padded(DONE, REPORT_MAX_BYTES - 256)
        for n in range(20):
            resp = await runner.status(late)
            assert error_of(resp, 409, "conflict") == "this job is already completed"
            assert hub.board.late_reports == n + 1
        resp = await runner.progress({"stage": "chat_llm_active"})
        error_of(resp, 409, "conflict")
        resp = await runner.status(IN_PROGRESS)
        error_of(resp, 409, "conflict")
        assert hub.board.late_reports == 22
        assert await runner.stored() == [IN_PROGRESS, DONE]
        job = await hub.board.all_jobs.get(runner.job_id)
        assert job.reports == [IN_PROGRESS, DONE] and job.last_progress is None
        conn = await RawConn.open(url)
        await conn.send(head("GET", "/api/hub/jobs", [bearer(ADMIN)]))
        listing = await conn.response()
        await conn.aclose()
        assert listing is not None and listing.status == 200
        assert len(listing.body) < 4096, len(listing.body)
        (listed,) = [j for j in listing.json()["jobs"] if j["id"] == runner.job_id]
        assert listed["reports"] == [IN_PROGRESS, DONE]
        await runner.aclose()


async def test_a_job_keeps_its_first_in_progress_and_its_last_heartbeat_only(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with open_hub(_hub(tmp_path / "hub")) as (hub, url):
        runner = await Runner.open(hub, url)
        await runner.claim()
        size = REPORT_MAX_BYTES - 256
        first = padded(IN_PROGRESS, size)
        for _ in range(50):
            assert (await runner.status(first)).status == 200
        for n in range(50):
            resp = await runner.progress(padded({"stage": f"beat {n}"}, size))
            assert resp.status == 200
        job = hub.board.jobs[runner.job_id]
        assert job.reports == [first] and await runner.stored() == [first]
        assert job.last_progress is not None and job.last_progress["stage"] == "beat 49"
        assert job.heartbeats == 50
        final = padded(DONE, size)
        assert (await runner.status(final)).status == 200
        assert await runner.stored() == [first, final]
        assert hub.board.late_reports == 0
        await runner.aclose()
