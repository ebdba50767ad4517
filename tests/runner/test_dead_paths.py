"""A runner's dead paths, found and left: by the channel keepalive, its turns cancelled, redialled, slots freed.

Real parts over loopback: the hub, the simulator, and ``tests/support/pathproxy.py`` between the runner and
the hub, whose paths die silently (frozen, or forgotten by a NAT when idle). Intervals are short
(pings every 0.2-0.3 s); what is asserted is orders, counts and outcomes, never a duration. The
durations seen are printed (``pytest -s``) for the record: detection, redial, first token after it.

A dead path on every connection a runner holds is found in seconds (issue 27 point 4).

Real parts over loopback, all in this process on trio's autojump clock (time is virtual: the
bound is asserted exactly, and nothing depends on how loaded the machine is): the hub, the
simulator, and ``tests/support/pathproxy.py`` in front of the hub for everything the runner sends (its
REST requests, its push-events stream, its channels). The proxy freezes every connection the
runner holds at that moment: its channel, its events stream, the kept-alive connections of its
HTTP pool. A client then asks for a new session's turn at the hub's front door. The runner must
find its dead paths, redial, and serve that turn within 2 x the ping interval + 1 s.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import trio
import trio.testing
from helpers import (
    ADMIN,
    EXE,
    OWNER,
    PROJECT,
    LogCapture,
    clean_env,
    open_chat,
    open_request,
    quick_alp_requests,
    request_frame,
    runner_config,
    runner_env,
    running,
    send,
)
from pathproxy import PathProxy, path_proxy

import gateway.runner.session
from gateway.hub import Hub, ServerChannel, open_hub
from gateway.runner.alp import Deadlines
from gateway.sim import SimOptions, Simulator, open_sim

PING = 0.3  # s: ping interval and timeout of these runners
GUARD = 60  # s: a never-hangs guard only; nothing here is expected to come near it


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def observed(what: str, **seconds: float) -> None:
    """One line of observed durations, for the record (not asserted)."""
    print(f"\nobserved {what}: " + ", ".join(f"{k} {v:.3f} s" for k, v in seconds.items()))


async def serve_turn(ch: ServerChannel, job_id: str, request_id: str, chunks: int = 3) -> float:
    """One turn on ``ch``, relayed to its done frame; the seconds to its first chunk."""
    sent = trio.current_time()
    rx = open_request(ch, request_id)
    await send(ch, request_frame(job_id, request_id, sim={"chunks": chunks}))
    first: float | None = None
    frames = []
    async with rx:
        async for text, _ in rx:
            frame = json.loads(text)
            frames.append(frame["type"])
            if first is None:
                first = trio.current_time() - sent
            if frame["type"] in ("chat.completion.done", "chat.completion.error"):
                break
    assert frames[-1] == "chat.completion.done", frames
    assert frames.count("chat.completion.chunk") == len(frames) - 1 >= chunks, frames
    assert first is not None
    return first


def channel_definition(proxy: PathProxy) -> dict[str, Any]:
    """A Chat Job whose channel (only) goes through ``proxy``: its HTTP calls go straight on."""
    url = f"ws://127.0.0.1:{proxy.port}/api/lives/chat/channel/ws"
    return {"jobType": "chat_llm", "needs": ["chat-llm:v1"], "channelUrl": url}


# -- a frozen path between runner and hub ------------------------------------------------------


async def test_frozen_path_turn_cancelled_channel_redialled_session_goes_on(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Everything the runner sends to the hub goes through the proxy; the path freezes while a
    turn streams. The runner finds the channel dead after at most one unanswered ping, cancels
    the turn (its backend request is closed), redials once, and the session goes on on the same
    job: the next turn is served, one session slot all along, none after the session ends."""
    # an HTTP connection the runner keeps alive is frozen too: a request reusing it waits for the
    # request timeout (30 s in production), 1.5 s here, then goes on a new connection
    quick_alp_requests(monkeypatch, 1.5)
    server, url = hub
    async with path_proxy(port_of(url)) as proxy:
        config = runner_config(proxy.url, sim.url, tmp_path, ping_interval=PING, ping_timeout=PING)
        async with running(config) as runner:
            counters = runner.counters
            slots_before = len(runner.sessions)
            job, ch = await open_chat(server)
            await serve_turn(ch, job.id, "warm")
            assert list(runner.sessions) == [job.id]
            long_rx = open_request(ch, "long")
            await send(ch, request_frame(job.id, "long", sim={"chunks": 100_000, "interval": 0.02}))
            with trio.fail_after(GUARD):
                stream = await sim.wait_for_streams(2)
                assert await stream.wait_sent(1)
            pings_at_freeze = counters.get("pings_sent")
            frozen_at = trio.current_time()
            assert proxy.freeze() >= 1  # the channel and any pooled HTTP connection
            during_rx = open_request(ch, "during")  # a turn sent while the path is dead
            await send(ch, request_frame(job.id, "during", sim={"chunks": 3}))
            with trio.fail_after(GUARD):
                await counters.wait("channels_dead", 1)
                detected = trio.current_time()
                await stream.finished.wait()
                await counters.wait("turns_cancelled", 1)
                await counters.wait("reconnects", 1)
                await ch.closed.wait()  # the redial replaced the hub's old channel
                redialled = trio.current_time()
                new = server.channels.get(job.id)
                assert new is not None and new is not ch
                # both turns of the old channel end there, at the redial: none hangs
                assert [t async for t, _ in long_rx if "chat.completion.done" in t] == []
                assert [t async for t, _ in during_rx] == []
                ttft = await serve_turn(new, job.id, "after")
            # found dead on the first ping that went unanswered: at most one more ping was sent
            assert counters.get("pings_sent") - pings_at_freeze <= 1
            assert counters.get("pong_timeouts") == counters.get("channels_dead") == 1
            assert stream.client_closed and not stream.completed  # backend request closed
            assert counters.get("turns_cancelled") == 1 and counters.get("turns_done") == 2
            # the turn sent into the dead path never reached the runner (nor the backend)
            assert len(sim.streams) == 3
            assert counters.get("reconnects") == 1 and counters.get("sessions_started") == 1
            assert list(runner.sessions) == [job.id]  # the same slot, not a second one
            await server.channels.end_job(job.id, "bye")
            with trio.fail_after(GUARD):
                await counters.wait("sessions_ended", 1)
            assert len(runner.sessions) == slots_before
            assert counters.get("reports_success") == 1
            observed(
                "frozen path (in-process runner, ping 0.3 s / timeout 0.3 s)",
                detection=detected - frozen_at,
                redial=redialled - frozen_at,
                first_token_after_redial=ttft,
            )


class RunnerProcess:
    """An ``alp-gateway run`` subprocess whose log lines are read as they come."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.lines: list[tuple[float, str]] = []
        self._changed = trio.Event()

    async def read(self) -> None:
        assert self.proc.stdout is not None
        buf = b""
        async for data in self.proc.stdout:
            buf += data
            *done, buf = buf.split(b"\n")
            now = trio.current_time()
            self.lines.extend((now, line.decode(errors="replace")) for line in done)
            self._changed.set()
            self._changed = trio.Event()

    async def line(self, text: str, after: int = 0) -> tuple[int, float, str]:
        """The first log line from index ``after`` on that contains ``text``: (index, when, line)."""
        while True:
            for i in range(after, len(self.lines)):
                if text in self.lines[i][1]:
                    return i, *self.lines[i]
            await self._changed.wait()

    @property
    def log(self) -> str:
        return "\n".join(line for _, line in self.lines)


@asynccontextmanager
async def runner_process(
    server: str, backend: str, state: Path, *args: str
) -> AsyncIterator[RunnerProcess]:
    proc = await trio.lowlevel.open_process(
        [EXE, "run", "--project", f"{OWNER}/{PROJECT}", "--state-dir", str(state), *args],
        env=runner_env(server, backend),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    runner = RunnerProcess(proc)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner.read)
            yield runner
            nursery.cancel_scope.cancel()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _chat(oc: openai.AsyncOpenAI, chunks: int) -> tuple[str, float]:
    """One streamed front-door turn: (its text, seconds to its first content)."""
    sent = trio.current_time()
    stream = await oc.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_body={"sim": {"chunks": chunks}},
    )
    text, first = "", None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = trio.current_time() - sent if first is None else first
            text += chunk.choices[0].delta.content
    assert first is not None
    return text, first


async def _status(url: str) -> str:
    result = await trio.run_process(
        [EXE, "status", "--metrics-url", url],
        env=clean_env(),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode()


async def test_runner_process_behind_a_frozen_path_redials_and_the_client_never_hangs(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    """The installed command behind a proxy that freezes; an official OpenAI client on the hub's
    front door. The turn sent during the freeze is served after the redial or answered with a
    clear error, never hangs; the next turn is served on the same session; the runner holds one
    session slot throughout; `status` shows the keepalive's counters."""
    server, url = hub
    key = await server.keys.create("keepalive", f"{OWNER}/{PROJECT}")
    oc = openai.AsyncOpenAI(
        base_url=url + "/v1",
        api_key=key,
        max_retries=0,
        timeout=GUARD,
        default_headers={"X-Chat-Session": "frozen"},
    )
    whole = "".join(f"tok{i} " for i in range(5))
    async with path_proxy(port_of(url)) as proxy:
        args = ["--ping-interval", str(PING), "--ping-timeout", str(PING)]
        args += ["--reconnect-window", "30", "--metrics-listen", "127.0.0.1:0"]
        async with runner_process(proxy.url, sim.url, tmp_path / "s", *args) as runner:
            with trio.fail_after(GUARD):
                _, _, line = await runner.line("health and metrics on ")
                metrics = line.split("health and metrics on ", 1)[1].split("/healthz", 1)[0]
                assert (await _chat(oc, 5))[0] == whole
                ((_, job_id),) = server.sessions.listing().items()
                ch = server.channels.get(job_id)
                assert ch is not None
                frozen_at = trio.current_time()
                assert proxy.freeze() >= 1
                outcome: list[str] = []

                async def during() -> None:
                    try:
                        text, _ = await _chat(oc, 5)
                        outcome.append("served" if text == whole else f"cut: {text!r}")
                    except openai.APIError as exc:
                        outcome.append(f"error: {exc}")

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(during)
                    mark, detected, _ = await runner.line("no answer to a ping within 0.3 s")
                    await runner.line("channel redialled", after=mark)
                    await ch.closed.wait()
                    redialled = trio.current_time()
                answered = trio.current_time()
                text, ttft = await _chat(oc, 5)
                assert text == whole
                report = await _status(metrics)
            assert len(outcome) == 1
            assert outcome[0] == "served" or (
                outcome[0].startswith("error: ") and "lost" in outcome[0]
            ), outcome
            assert server.sessions.listing() == {("keepalive", "frozen"): job_id}
            lines = report.splitlines()
            assert "sessions    1 open (max 64), 1 started, 0 ended" in lines, report
            assert any(x.startswith("channels    1 redials, ") for x in lines), report
            keepalive = next(x for x in lines if x.startswith("keepalive   "))
            assert keepalive.startswith("keepalive   ping every 0.3 s: ") and keepalive.endswith(
                " pings sent, 1 pong timeouts, 1 channels dead"
            ), keepalive
    observed(
        "frozen path (alp-gateway run, ping 0.3 s / timeout 0.3 s)",
        detection=detected - frozen_at,
        redial=redialled - frozen_at,
        turn_during_freeze_answered=answered - frozen_at,
        first_token_after_redial=ttft,
    )
    print(f"turn sent during the freeze: {outcome[0]}")


# -- a NAT that forgets idle paths ----------------------------------------------------------


NAT_IDLE = 1.0  # s: T, the NAT's idle limit (a ping may come 2/3 T late before it forgets)


@pytest.mark.parametrize("ping", [NAT_IDLE / 3, 0.0], ids=["pings-at-T/3", "pings-off"])
async def test_nat_forgets_an_idle_channel_unless_pinged(
    ping: float, heartbeats_wanted: None, hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    """The channel goes through a NAT that forgets a path idle for T. Pinged at T/3, a session
    idle for 10 T serves its next turn on the same connection. With pings off the path is
    forgotten and the runner cannot notice: it neither reads nor writes on an idle channel, so
    the hub's next turn is dropped on the way, never reaches the runner or the backend, and the
    runner goes on holding the session with no redial. Nothing frees that slot today: the hub's
    chat.end (or its close, once the hub pings) is lost on the same path, and the heartbeats of a
    job the Server withdrew are still accepted. That is why pings are on by default."""
    server = hub[0]
    async with path_proxy(port_of(hub[1]), nat_idle=NAT_IDLE) as proxy:
        config = runner_config(
            hub[1], sim.url, tmp_path, ping_interval=ping, heartbeat_interval=NAT_IDLE
        )
        async with running(config) as runner:
            counters = runner.counters
            job = await server.board.enqueue(
                OWNER, PROJECT, ["chat-llm:v1"], channel_definition(proxy)
            )
            with trio.fail_after(GUARD):
                ch = await server.channels.wait(job.id, GUARD)
                assert ch is not None
                await serve_turn(ch, job.id, "first")
            if ping:
                await trio.sleep(10 * NAT_IDLE)  # the scenario: a session left idle for 10 T
                with trio.fail_after(GUARD):
                    await serve_turn(ch, job.id, "after-idle")
                assert proxy.forgotten == 0 and proxy.connections == 1  # the same connection
                assert counters.get("pings_sent") >= 1 and counters.get("channels_dead") == 0
                assert counters.get("reconnects") == 0 and server.channels.get(job.id) is ch
                return
            with trio.fail_after(GUARD):  # forgotten T after the first turn's last byte
                await proxy.wait_until(lambda: proxy.forgotten == 1)
            rx = open_request(ch, "after-idle")
            await send(ch, request_frame(job.id, "after-idle", sim={"chunks": 3}))
            with trio.move_on_after(10 * NAT_IDLE):  # nothing comes back: the turn is lost
                async for text, _ in rx:
                    raise AssertionError(f"a frame came through a forgotten path: {text}")
            assert len(sim.streams) == 1  # the backend never saw the turn
            assert counters.get("pings_sent") == 0 and counters.get("channels_dead") == 0
            assert counters.get("reconnects") == 0 and proxy.connections == 1
            assert list(runner.sessions) == [job.id] and server.channels.get(job.id) is ch
            # the Server withdraws the job: its chat.end is lost on the forgotten path too, and
            # its heartbeats are still accepted (over HTTP, a live path): the slot stays taken
            await server.channels.cancel_job(job.id, "given up by the Server")
            beats = counters.get("heartbeats")
            with trio.fail_after(GUARD):
                await counters.wait("heartbeats", beats + 2)
            assert list(runner.sessions) == [job.id] and counters.get("sessions_ended") == 0


# -- the Server gone entirely ---------------------------------------------------------------


@pytest.mark.parametrize("server_back", [True, False], ids=["server-back", "reports-given-up"])
async def test_server_gone_slots_freed_jobs_reported_failure_polling_resumes(
    server_back: bool,
    hub: tuple[Hub, str],
    sim: Simulator,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    logs: LogCapture,
) -> None:
    """Every byte to and from the Server black-holed (``freeze_all``) under two open sessions:
    both channels are found dead, redialled in vain for the reconnect window, and both slots are
    freed then, while the Server is still gone. Each job's ``failure`` report arrives once the
    Server is back, or is given up after its bounded retries; polling resumes and a new job is
    served."""
    quick_alp_requests(monkeypatch, 1.5)  # a black-holed request times out in 1.5 s, not 30
    if not server_back:
        monkeypatch.setattr(gateway.runner.session, "REPORT_ATTEMPTS", 2)
    server, url = hub
    async with path_proxy(port_of(url)) as proxy:
        config = runner_config(
            proxy.url,
            sim.url,
            tmp_path,
            ping_interval=PING,
            ping_timeout=PING,
            reconnect_window=2.0,
            connect_timeout=1.0,
            poll_interval=0.5,
            max_sessions=2,
        )
        async with running(config) as runner:
            counters = runner.counters
            jobs = []
            for n in range(2):
                job, ch = await open_chat(server)
                await serve_turn(ch, job.id, f"t{n}")
                jobs.append(job)
            assert runner.capabilities() == []  # both slots taken
            gone_at = trio.current_time()
            proxy.freeze_all()
            with trio.fail_after(GUARD):
                await counters.wait("channels_dead", 2)
                await counters.wait_for(lambda: not runner.sessions)
            freed = trio.current_time()
            # freed while the Server is still gone: nothing of it reached the Server
            assert counters.get("reports_failure") == 0
            assert not any(j.final_reported for j in jobs)
            if server_back:
                assert counters.get("sessions_ended") == 0  # ended once reported
                proxy.thaw_all()
            with trio.fail_after(GUARD):
                await counters.wait("sessions_ended", 2)
            reported = trio.current_time()
            if server_back:
                assert counters.get("reports_failure") == 2
                for job in jobs:
                    finals = [r for r in job.reports if r.get("status") == "completed"]
                    assert len(finals) == 1 and finals[0]["conclusion"] == "failure", job.reports
                    assert "gave up redialling the chat channel after 2 s" in finals[0]["logs"]
            else:
                assert counters.get("reports_failure") == 0 and counters.get("reports_lost") == 2
                assert not any(j.final_reported for j in jobs)
                lost = [line for line in logs.lines if "final report lost after 2 attempts" in line]
                assert len(lost) == 2, logs.lines
                proxy.thaw_all()
            back_at = trio.current_time()
            with trio.fail_after(GUARD):
                await counters.wait_for(
                    lambda: runner.last_poll_ok is not None and runner.last_poll_ok > back_at
                )
                job, ch = await open_chat(server, within=GUARD)  # a free slot serves a new job
                await serve_turn(ch, job.id, "again")
            assert list(runner.sessions) == [job.id]
    observed(
        f"Server gone ({'back' if server_back else 'never back'}; ping 0.3 s, window 2 s)",
        slots_freed=freed - gone_at,
        reports_done_or_given_up=reported - gone_at,
    )


# -- every connection a runner holds frozen at once (issue 27 point 4), on the autojump clock --


async def chat(client: httpx.AsyncClient, key: str, session: str) -> str:
    """One streamed front-door turn in ``session``: its text."""
    body = {"model": "sim-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"authorization": f"Bearer {key}", "x-chat-session": session}
    text = ""
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    return text


def test_deadlines_follow_the_ping_settings() -> None:
    assert Deadlines.of(20.0, None) == Deadlines(request=20.0, register=30.0, events=40.0)
    assert Deadlines.of(1.0, 3.0) == Deadlines(request=3.0, register=30.0, events=4.0)
    assert Deadlines.of(0.0, None) == Deadlines()  # pings off: the defaults


@pytest.mark.parametrize("ping", [1.0, 20.0], ids=["ping-1s", "ping-20s-default"])
async def test_a_runner_whose_every_connection_froze_serves_a_new_session_in_time(
    ping: float, autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """``ping``: the runner's ping interval and timeout; the hub sends its keepalive comments
    on the events stream every ``ping / 2`` (what the runner asks of a Server), and waits for
    a runner as long as the bound."""
    hub = Hub(admin_token=ADMIN, keepalive_interval=ping / 2, runner_wait_timeout=2 * ping + 10)
    async with (
        open_hub(hub) as (server, url),
        open_sim(options=SimOptions(chunks=5)) as sim,
        path_proxy(port_of(url)) as proxy,
    ):
        config = runner_config(proxy.url, sim.url, tmp_path, ping_interval=ping, ping_timeout=ping)
        key = await server.keys.create("deadpath", f"{OWNER}/{PROJECT}")
        async with (
            running(config) as runner,
            httpx.AsyncClient(base_url=url, timeout=120) as client,
        ):
            whole = "tok0 tok1 tok2 tok3 tok4 "
            assert await chat(client, key, "first") == whole
            await trio.sleep(0.3 * ping)  # polls and the events' keepalives go on as usual
            frozen_at = trio.current_time()
            assert proxy.freeze() >= 2  # at least the channel and the events stream
            with trio.fail_after(120):
                assert await chat(client, key, "second") == whole
            served = trio.current_time() - frozen_at
            with trio.fail_after(120):
                await runner.counters.wait("reconnects", 1)  # the first session's channel too
            redialled = trio.current_time() - frozen_at
        print(f"\nnew session served {served:.2f} s after the freeze; redial {redialled:.2f} s")
        assert served <= 2 * ping + 1
        assert redialled <= 2 * ping + 1
        assert runner.alp is not None and runner.alp.pools_dropped >= 1
