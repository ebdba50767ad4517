"""Reliability against a faulty Server: HTTP faults on every runner route, a hub restart mid-session.

The HTTP faults come from a fault-injecting proxy in front of the in-process hub
(``tests/support/faultproxy.py``: an HTTP status, ``RESET``, ``LOST``, ``Hold``; a Server that stops
reading a channel); the restart test runs the hub as a subprocess (``alp-gateway hub``), SIGKILLs it during
a turn and restarts it on the same port and data directory.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from faultproxy import LOST, RESET, Fault, FaultProxy, Hold, fault_proxy
from helpers import (
    ADMIN,
    EXE,
    LogCapture,
    Turns,
    clean_env,
    open_chat,
    open_request,
    quick_alp_requests,
    request_frame,
    runner_config,
    running,
    send,
)

from gateway.hub import Hub, open_hub
from gateway.hub.store import load_or_create_admin_token, open_store
from gateway.runner.supervisor import Runner
from gateway.sim import Simulator

REQUEST_TIMEOUT = 2.5  # the runner's Server request timeout in these tests (30 s in production)
HOLD = Hold(60.0)  # held past the runner's timeout: the runner gives up first (a hung Server)
KINDS: list[Fault] = [500, 502, 503, RESET, HOLD]


@pytest.fixture
async def proxy(hub: tuple[Hub, str]) -> AsyncIterator[FaultProxy]:
    """The fault proxy in front of the test's hub: the runners' Server is ``proxy.url``."""
    async with fault_proxy(hub[1]) as p:
        yield p


def kind_id(kind: Fault) -> str:
    return "hold" if isinstance(kind, Hold) else str(kind)


@pytest.fixture
def quick_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Give the runner's ALP client a short request timeout (a held request times out quickly)."""
    quick_alp_requests(monkeypatch, REQUEST_TIMEOUT)


async def serve_turn(hub: Hub, job_id: str, request_id: str = "t", chunks: int = 3) -> None:
    """One turn down the job's current channel, relayed to the end (done)."""
    ch = hub.channels.get(job_id)
    assert ch is not None
    await send(ch, request_frame(job_id, request_id, sim={"chunks": chunks}))
    turns = Turns(ch)
    await turns.until(request_id)
    assert turns.last(request_id)["type"] == "chat.completion.done"


def completed(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in reports if r.get("status") == "completed"]


# -- HTTP faults on poll, claim, status, progress ----------------------------------------------


async def test_poll_faults_back_off_then_serve(
    hub: tuple[Hub, str],
    proxy: FaultProxy,
    sim: Simulator,
    tmp_path: Path,
    quick_requests: None,
) -> None:
    server, url = hub[0], proxy.url
    proxy.faults["poll"] = list(KINDS)
    async with running(runner_config(url, sim.url, tmp_path, poll_interval=0.2)) as runner:
        with trio.fail_after(30):
            hits = await proxy.wait_hits("poll", len(KINDS) + 1)
        assert [h.fault for h in hits[: len(KINDS) + 1]] == [*KINDS, None]
        # each failure waited at least the lower bound of its backoff (0.2 s · 2^(n-1) · 0.5,
        # capped at 6 poll intervals) before the next poll: no hammering, growing waits
        gaps = [b.at - a.at for a, b in zip(hits, hits[1 : len(KINDS) + 1], strict=False)]
        for n, gap in enumerate(gaps, 1):
            assert gap >= 0.9 * 0.5 * min(1.2, 0.2 * 2 ** (n - 1)), gaps
        assert runner.counters.get("poll_errors") >= len(KINDS)
        job, _ = await open_chat(server, within=15)  # alive and serving
        await serve_turn(server, job.id)


async def test_claim_faults_claim_once_when_cleared(
    hub: tuple[Hub, str],
    proxy: FaultProxy,
    sim: Simulator,
    tmp_path: Path,
    quick_requests: None,
) -> None:
    server, url = hub[0], proxy.url
    proxy.faults["claim"] = list(KINDS)
    async with running(runner_config(url, sim.url, tmp_path, poll_interval=0.2)) as runner:
        job, _ = await open_chat(server, within=30)
        await serve_turn(server, job.id)
        claims = [h.fault for h in proxy.hits if h.route == "claim"]
        assert claims == [*KINDS, None]  # retried at each poll until one landed
        polls = runner.counters.get("polls")
        with trio.fail_after(10):
            await runner.counters.wait("polls", polls + 3)
        assert proxy.hit_counts["claim"] == len(KINDS) + 1  # never claimed again
        assert runner.counters.get("sessions_started") == 1 and list(runner.sessions) == [job.id]


async def test_lost_claim_answer_is_reoffered_and_claimed_once(
    sim: Simulator, tmp_path: Path
) -> None:
    # the hub claims the job but the runner never hears back: after reoffer_after the hub offers
    # that runner its unstarted claim again, and the repeated claim returns the same runId
    hub = Hub(admin_token=ADMIN, reoffer_after=0.5)
    async with open_hub(hub) as (server, direct), fault_proxy(direct) as proxy:
        url = proxy.url
        proxy.faults["claim"] = [LOST]
        async with running(runner_config(url, sim.url, tmp_path, poll_interval=0.2)) as runner:
            job, _ = await open_chat(server, within=20)
            await serve_turn(server, job.id)
            assert proxy.hit_counts["claim"] == 2
            assert runner.counters.get("sessions_started") == 1
            assert job.reports[0] == {"status": "in_progress"}


async def test_lost_claim_answer_on_a_server_that_never_reoffers(
    sim: Simulator, tmp_path: Path
) -> None:
    # like the Server that stops offering a claimed job: the runner asks again at once
    hub = Hub(admin_token=ADMIN, reoffer_after=float("inf"))
    async with open_hub(hub) as (server, direct), fault_proxy(direct) as proxy:
        url = proxy.url
        proxy.faults["claim"] = [LOST]
        async with running(runner_config(url, sim.url, tmp_path, poll_interval=0.2)) as runner:
            job, _ = await open_chat(server, within=20)
            await serve_turn(server, job.id)
            assert proxy.hit_counts["claim"] == 2
            assert runner.counters.get("sessions_started") == 1


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
async def test_status_and_progress_faults_are_logged_and_the_session_goes_on(
    heartbeats_wanted: None,
    hub: tuple[Hub, str],
    proxy: FaultProxy,
    sim: Simulator,
    tmp_path: Path,
    quick_requests: None,
    logs: LogCapture,
    kind: Fault,
) -> None:
    server, url = hub[0], proxy.url
    proxy.faults["status"] = [kind]  # the in_progress report
    proxy.faults["progress"] = [kind]  # the first heartbeat
    config = runner_config(url, sim.url, tmp_path, heartbeat_interval=0.1)
    async with running(config) as runner:
        job, ch = await open_chat(server, within=20)
        with trio.fail_after(20):
            await proxy.wait_hits("progress", 2)  # the faulted heartbeat, then one that landed
        await serve_turn(server, job.id)
        assert job.heartbeats and not ch.closed.is_set()
        text = "\n".join(logs.lines)
        assert "in_progress not recorded" in text and "heartbeat failed" in text
        await send(ch, {"type": "chat.end", "reason": "user left"})
        with trio.fail_after(20):
            await runner.counters.wait("sessions_ended", 1)
    finals = completed(job.reports)
    assert len(finals) == 1 and finals[0]["conclusion"] == "success"


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
async def test_final_report_retried_until_it_lands(
    hub: tuple[Hub, str],
    proxy: FaultProxy,
    sim: Simulator,
    tmp_path: Path,
    quick_requests: None,
    kind: Fault,
) -> None:
    server, url = hub[0], proxy.url
    async with running(runner_config(url, sim.url, tmp_path)) as runner:
        job, ch = await open_chat(server)
        await serve_turn(server, job.id)
        proxy.faults["status"] = [kind]
        await send(ch, {"type": "chat.end", "reason": "user left"})
        with trio.fail_after(30):
            await runner.counters.wait("sessions_ended", 1)
    statuses = [h.fault for h in proxy.hits if h.route == "status"]
    assert statuses == [None, kind, None]  # in_progress, the faulted report, the retry
    finals = completed(job.reports)
    assert len(finals) == 1 and finals[0]["conclusion"] == "success"
    assert job.final_reported and runner.counters.get("reports_success") == 1


async def test_final_report_answer_lost_is_not_recorded_twice(
    hub: tuple[Hub, str],
    proxy: FaultProxy,
    sim: Simulator,
    tmp_path: Path,
    quick_requests: None,
    logs: LogCapture,
) -> None:
    # the Server records the report, then the connection breaks: the runner retries, the hub
    # refuses the second "completed" (409) and the job keeps its one outcome
    server, url = hub[0], proxy.url
    async with running(runner_config(url, sim.url, tmp_path)) as runner:
        job, ch = await open_chat(server)
        proxy.faults["status"] = [LOST]
        await send(ch, {"type": "chat.end", "reason": "user left"})
        with trio.fail_after(30):
            await runner.counters.wait("sessions_ended", 1)
    finals = completed(job.reports)
    assert len(finals) == 1  # received twice: the recorded one kept, the refused retry not
    assert server.board.late_reports == 1
    assert job.status == "completed" and job.conclusion == "success" and job.final_reported
    assert proxy.hit_counts["status"] == 3
    assert any("409" in line for line in logs.lines)


async def test_channel_handshake_faults_are_redialled(
    hub: tuple[Hub, str], proxy: FaultProxy, sim: Simulator, tmp_path: Path
) -> None:
    # a held handshake is given up by the hub after 2 s here: trio-websocket's connect_timeout
    # does not end a dial whose handshake the Server holds open (its reader task keeps the
    # nursery open until the Server closes), so the runner alone would wait as long as the Server
    server, url = hub[0], proxy.url
    proxy.faults["channel"] = [503, RESET, Hold(2.0)]
    config = runner_config(url, sim.url, tmp_path, connect_timeout=1.0, reconnect_window=30.0)
    async with running(config) as runner:
        job = await server.board.enqueue("acme", "chat", ["chat-llm:v1"], {"jobType": "chat_llm"})
        ch = await server.channels.wait(job.id, 30)
        assert ch is not None
        await serve_turn(server, job.id)
        assert proxy.hit_counts["channel"] == 4
        assert runner.counters.get("sessions_started") == 1 and not job.completed.is_set()


# -- the Server restarts mid-session -----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HubProcess:
    """``alp-gateway hub`` as a subprocess on a fixed port and data directory; its log lines
    (stderr) are read as they come, kept in ``log_path``, and waited on for "hub listening on"."""

    def __init__(self, data: Path, port: int, log_path: Path, nursery: trio.Nursery) -> None:
        self.data = data
        self.port = port
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: trio.Process | None = None
        self.nursery = nursery

    async def start(self) -> None:
        with self.log_path.open("ab") as log:  # stdout: the admin credential at the first start
            self.proc = await trio.lowlevel.open_process(
                [EXE, "hub", "--listen", f"127.0.0.1:{self.port}", "--data", str(self.data)],
                stdout=log,
                stderr=subprocess.PIPE,
                env=clean_env(),
            )
        listening = trio.Event()
        self.nursery.start_soon(self._read_log, self.proc, listening)
        with trio.fail_after(30):
            await listening.wait()
        if self.proc.returncode is not None:
            raise AssertionError(f"the hub exited: {self.log_path.read_text()}")

    async def _read_log(self, proc: trio.Process, listening: trio.Event) -> None:
        """Every log line into the log file until the process ends (an unread pipe would stop
        the hub once full); ``listening`` set at "hub listening on" or at the end."""
        assert proc.stderr is not None
        seen = b""
        with self.log_path.open("ab") as log:
            while data := await proc.stderr.receive_some():
                log.write(data)
                log.flush()
                if not listening.is_set():
                    seen += data
                    if b"hub listening on" in seen:
                        listening.set()
        await proc.wait()
        listening.set()

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()  # SIGKILL: no goodbye to anyone
        with trio.fail_after(10):
            await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(10):
                await self.proc.wait()
            if self.proc.returncode is None:
                self.proc.kill()
                await self.proc.wait()


@pytest.fixture
async def hub_process(tmp_path: Path) -> AsyncIterator[HubProcess]:
    async with trio.open_nursery() as nursery:
        proc = HubProcess(tmp_path / "hub", _free_port(), tmp_path / "hub.log", nursery)
        try:
            yield proc
        finally:
            with trio.CancelScope(shield=True):
                await proc.stop()


async def admin_get(url: str, token: str, what: str) -> Any:
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.get(f"{url}/api/hub/{what}", headers={"authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    return r.json()[what]


async def chat_text(client: openai.AsyncOpenAI, sim_options: dict[str, Any]) -> str:
    stream = await client.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_body={"sim": sim_options},
    )
    text = ""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    return text


async def test_hub_restart_mid_session_same_job_goes_on(
    hub_process: HubProcess, sim: Simulator, tmp_path: Path
) -> None:
    admin, _ = load_or_create_admin_token(hub_process.data)
    store = open_store(hub_process.data)
    key = await store.create_api_key("faults", "acme/chat")
    await store.close()
    await hub_process.start()
    url = hub_process.url
    client = openai.AsyncOpenAI(
        base_url=url + "/v1",
        api_key=key,
        max_retries=0,
        timeout=20,
        default_headers={"X-Chat-Session": "s1"},
    )
    config = runner_config(
        url, sim.url, tmp_path / "state", user_token=admin, reconnect_window=60.0
    )
    runner = Runner(config)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner.run)
        with trio.fail_after(30):
            assert await chat_text(client, {"chunks": 3}) == "tok0 tok1 tok2 "
        sessions = await admin_get(url, admin, "sessions")
        assert [(s["session"], s["key"]) for s in sessions] == [("s1", "faults")]
        job_id = sessions[0]["jobId"]

        # turn 2 is streaming when the hub is SIGKILLed: the client gets an error, not a hang
        failure: BaseException | None = None
        with trio.fail_after(30):
            stream = await client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": "slow"}],
                stream=True,
                extra_body={"sim": {"chunks": 400, "interval": 0.05}},
            )
            seen = 0
            try:
                async for _ in stream:
                    seen += 1
                    if seen == 3:
                        await hub_process.kill()
            except (openai.APIError, httpx.HTTPError) as exc:
                failure = exc
        assert failure is not None and 3 <= seen < 400
        cut = sim.streams[1]

        # restarted on the same port and data: the runner redials the same job (the turn it
        # kept for a resume is not named by the new hub: cancelled), turn 3 goes on
        await hub_process.start()
        back_from = trio.current_time()
        with trio.fail_after(45):
            await runner.counters.wait("reconnects", 1)
            redialled = trio.current_time() - back_from
            await cut.finished.wait()  # the runner closed the backend request of the cut turn
            assert cut.client_closed and not cut.completed
            assert await chat_text(client, {"chunks": 2}) == "tok0 tok1 "
        print(f"OBSERVED hub restart: the runner's channel back {redialled:.3f} s after it")
        assert redialled < 5.0  # within the runner's redial cap (1 s) and a loaded machine's lag
        sessions = await admin_get(url, admin, "sessions")
        assert [s["jobId"] for s in sessions] == [job_id]
        jobs = await admin_get(url, admin, "jobs")
        assert [j["id"] for j in jobs] == [job_id] and jobs[0]["status"] == "in_progress"
        assert runner.counters.get("sessions_started") == 1

        runner.begin_shutdown()  # ends the session: chat.end, then the one final report
        with trio.fail_after(30):
            await runner.counters.wait("sessions_ended", 1)
    jobs = await admin_get(url, admin, "jobs")
    assert [j["id"] for j in jobs] == [job_id]
    job = jobs[0]
    assert job["status"] == "completed" and job["conclusion"] == "success" and job["finalReported"]
    assert [r["status"] for r in job["reports"]] == ["in_progress", "completed"]
    assert runner.counters.get("reports_success") == 1
    # the ledger: each finished turn once, the one the kill cut recorded as cut (its journal)
    await hub_process.stop()
    store = open_store(hub_process.data)
    rows = await store.usage_rows()
    await store.close()
    assert sorted(r["outcome"] for r in rows if r["session"] == "s1") == ["cut", "ok", "ok"]


# -- a slow Server: backpressure from the channel to the backend ---------------------------------


async def _sent_when_stalled(stream: Any, total: int) -> int:
    """The simulator's sent count once it stops growing (a measurement: bounded, generous)."""
    last = -1
    with trio.fail_after(20):
        while True:
            await trio.sleep(0.25)
            now = len(stream.payloads)
            assert now < total, "the whole answer went out while the Server was not reading"
            if now == last:
                return now
            last = now


async def test_slow_server_backpressure_reaches_the_backend(
    hub: tuple[Hub, str], proxy: FaultProxy, sim: Simulator, tmp_path: Path
) -> None:
    # the Server stops reading the channel (the proxy in front of it does)
    server = hub[0]
    async with running(runner_config(proxy.url, sim.url, tmp_path)):
        await _backpressure(server, proxy, sim)


async def _backpressure(server: Hub, proxy: FaultProxy, sim: Simulator) -> None:
    chunks, size = 5000, 2000  # ~10 MB of content, sent as fast as the sockets take it
    total = chunks + 3  # the role chunk, the content chunks, the finish chunk, [DONE]
    job, ch = await open_chat(server)
    rx = open_request(ch, "big")
    texts: list[str] = []
    last: dict[str, Any] = {}

    async def read_all() -> None:  # the hub reads on: only the proxy in front of it stalls
        async for text, _ in rx:
            frame = json.loads(text)
            if frame["type"] != "chat.completion.chunk":
                last.update(frame)
                return
            for choice in frame["chunk"].get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    texts.append(content)

    proxy.pause_channels()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all)
        await send(
            ch,
            request_frame(job.id, "big", sim={"chunks": chunks, "chunk_size": size, "interval": 0}),
        )
        with trio.fail_after(10):
            stream = await sim.wait_for_streams(1)
        stalled = await _sent_when_stalled(stream, total)
        await trio.sleep(1.0)  # paused for a while: nothing more may leave the backend meanwhile
        assert len(stream.payloads) == stalled
        assert stalled < total // 2, (stalled, total)  # bounded: the runner did not buffer it
        assert not stream.finished.is_set() and not last

        proxy.resume_channels()
        with trio.fail_after(30):
            await stream.finished.wait()
    assert last["type"] == "chat.completion.done"
    # every token arrived once, in order: tok0 .. tok4999, each padded to the chunk size
    assert [t.split(" ", 1)[0] for t in texts] == [f"tok{i}" for i in range(chunks)]
    assert all(len(t) == size for t in texts)
    assert stream.completed and len(stream.payloads) == total
