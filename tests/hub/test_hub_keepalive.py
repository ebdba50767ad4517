"""The hub's own server: channel pings, a silent channel closed (1011), a live idle one kept, HTTP."""

from __future__ import annotations

import gc
import json
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from helpers import ADMIN, OWNER, PROJECT, register_runner, send
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Ping,
    Pong,
    Request,
    TextMessage,
)

from gateway.hub import Hub, open_hub
from gateway.wire import protocol
from gateway.wire.server import CLOSE_NO_PONG

BASE = f"/api/owners/{OWNER}/projects/{PROJECT}"
PING = 0.2  # s: short intervals, real sockets; no test asserts how long anything took


@dataclass(eq=False)
class RawChannel:
    """A Chat Channel client on wsproto that may leave the hub's pings unanswered."""

    stream: trio.SocketStream
    ws: WSConnection
    answer_pings: bool
    pings: int = 0
    pongs: int = 0
    texts: list[str] = field(default_factory=list)
    close: CloseConnection | None = None
    changed: trio.Event = field(default_factory=trio.Event)

    async def read(self) -> None:
        """Read until the hub closes the channel (or the TCP connection ends)."""
        while self.close is None:
            try:
                data = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:
                data = b""
            self.ws.receive_data(data or None)
            for event in self.ws.events():
                if isinstance(event, Ping):
                    self.pings += 1
                    if self.answer_pings:
                        await self.stream.send_all(self.ws.send(event.response()))
                elif isinstance(event, Pong):
                    self.pongs += 1
                elif isinstance(event, TextMessage):
                    self.texts.append(event.data)
                elif isinstance(event, CloseConnection):
                    self.close = event
            self.changed.set()
            self.changed = trio.Event()
            if not data:
                return

    async def wait_until(self, predicate: object) -> None:
        assert callable(predicate)
        while not predicate():
            await self.changed.wait()


async def dial(
    url: str, job_id: str, token: str, *, answer_pings: bool, target: str | None = None
) -> RawChannel:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    ws = WSConnection(ConnectionType.CLIENT)
    target = target or f"/api/lives/chat/channel/ws?jobId={job_id}&token={token}"
    await stream.send_all(ws.send(Request(host=parts.netloc, target=target)))
    while True:
        ws.receive_data(await stream.receive_some(65536))
        events = list(ws.events())
        if any(isinstance(e, AcceptConnection) for e in events):
            return RawChannel(stream, ws, answer_pings)
        assert not events, events


async def claimed(hub: Hub, client: httpx.AsyncClient) -> tuple[str, str]:
    """(job id, runner token) of a chat job a freshly registered runner claimed."""
    runner = await register_runner(hub, OWNER, PROJECT, "box", [])
    job = await hub.board.enqueue(OWNER, PROJECT, [protocol.CAPABILITY], {"jobType": "chat_llm"})
    r = await client.post(
        f"{BASE}/runners/generate-jitconfig",
        json={"jobId": job.id, "name": "box"},
        headers={"Authorization": f"Bearer {runner['token']}"},
    )
    assert r.status_code == 200, r.text
    return job.id, runner["token"]


async def test_silent_channel_is_closed_1011_and_counted() -> None:
    async with open_hub(Hub(admin_token=ADMIN, ping_interval=PING)) as (hub, url):
        async with httpx.AsyncClient(base_url=url) as client:
            job_id, token = await claimed(hub, client)
            with trio.fail_after(30):  # a hang guard only
                ch = await dial(url, job_id, token, answer_pings=False)
                opened = await hub.channels.wait(job_id, 10)
                assert opened is not None
                await ch.read()  # until the hub closes it
                await opened.closed.wait()
            counters = (await client.get("/api/hub/counters", headers=_admin())).json()
    assert ch.pings >= 1
    assert ch.close is not None and ch.close.code == CLOSE_NO_PONG
    assert ch.close.reason == f"no answer to a ping within {PING:g} s"
    assert opened.end_code == CLOSE_NO_PONG and hub.channels.get(job_id) is None
    assert counters["pingsSent"] >= 1
    assert counters["pongTimeouts"] == 1 and counters["channelsDead"] == 1
    assert counters["failovers"] == 0


async def test_live_idle_channel_stays_open_through_many_pings() -> None:
    async with open_hub(Hub(admin_token=ADMIN, ping_interval=PING)) as (hub, url):
        async with httpx.AsyncClient(base_url=url) as client:
            job_id, token = await claimed(hub, client)
            with trio.fail_after(30):
                ch = await dial(url, job_id, token, answer_pings=True)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ch.read)
                    await ch.wait_until(lambda: ch.pings >= 10)  # idle for ten intervals
                    opened = await hub.channels.wait(job_id, 10)
                    assert opened is not None and not opened.closed.is_set()
                    await send(opened, {"type": "chat.end", "reason": "done"})
                    await ch.wait_until(lambda: any("chat.end" in t for t in ch.texts))
                    nursery.cancel_scope.cancel()
    assert ch.close is None and hub.counters.pong_timeouts == 0
    assert hub.counters.pings_sent >= 10
    # besides what the hub asks of every new channel (its models; its hello)
    said = [t for t in ch.texts if "chat.models.request" not in t and "channel.hello" not in t]
    assert said == ['{"type":"chat.end","reason":"done"}']


async def test_a_runner_that_pings_is_not_pinged_and_wakes_no_keepalive_timer(
    autojump_clock: Any,
) -> None:
    """Issue 39: one keepalive per channel, not one from each end. A runner that pings every
    15 s gets its pongs; the hub, hearing from it within its 20 s interval, sends no ping of its
    own, its keepalive's timer never fires (the wait is moved at each of the runner's pings, the
    same one waiting throughout), and the runner stays alive on the board."""
    async with open_hub(Hub(admin_token=ADMIN, ping_interval=20.0, offline_after=60.0)) as (
        hub,
        url,
    ):
        async with httpx.AsyncClient(base_url=url) as client:
            job_id, token = await claimed(hub, client)
        with trio.fail_after(1000):
            ch = await dial(url, job_id, token, answer_pings=True)
            opened = await hub.channels.wait(job_id, 10)
            assert opened is not None
            server_ws = opened._ws  # the hub's end of the channel
            assert server_ws is not None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ch.read)
                await trio.sleep(1.0)  # the hub's keepalive waiting
                waiting = server_ws._asleep
                for n in range(20):  # 300 s of pings, 15 s apart
                    await ch.stream.send_all(ch.ws.send(Ping(payload=b"r")))
                    await ch.wait_until(lambda n=n: ch.pongs > n)
                    await trio.sleep(15.0)
                still = server_ws._asleep
                nursery.cancel_scope.cancel()
    assert ch.pongs == 20 and ch.pings == 0 and hub.counters.pings_sent == 0
    assert waiting is not None and still is waiting  # the one wait, never woken
    assert hub.board.alive(opened.runner_id)


async def test_no_pings_when_off() -> None:
    async with open_hub(Hub(admin_token=ADMIN, ping_interval=0)) as (hub, url):
        async with httpx.AsyncClient(base_url=url) as client:
            job_id, token = await claimed(hub, client)
            with trio.fail_after(30):
                ch = await dial(url, job_id, token, answer_pings=False)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ch.read)
                    opened = await hub.channels.wait(job_id, 10)
                    assert opened is not None
                    for n in range(3):  # frames both ways; no ping among them
                        await send(opened, {"type": "chat.end", "reason": f"r{n}"})
                    await ch.wait_until(lambda: sum("chat.end" in t for t in ch.texts) == 3)
                    nursery.cancel_scope.cancel()
    assert ch.pings == 0 and hub.counters.pings_sent == 0 and ch.close is None


async def test_http_keep_alive_streamed_body_and_refused_handshake() -> None:
    async with open_hub(Hub(admin_token=ADMIN)) as (hub, url):
        async with httpx.AsyncClient(base_url=url) as client:
            for _ in range(3):  # one connection, several requests
                r = await client.get("/api/hub/counters", headers=_admin())
                assert r.status_code == 200
            r = await client.post(f"{BASE}/runners/jobs", content=b"{", headers=_admin())
            assert r.status_code == 401  # an admin token is no runner token
            job_id, _token = await claimed(hub, client)
            ws = url.replace("http://", "ws://")
            r = await client.get(  # a handshake with a wrong token: refused with 403, no upgrade
                f"{ws.replace('ws://', 'http://')}/api/lives/chat/channel/ws?jobId={job_id}&token=x",
                headers={
                    "Connection": "Upgrade",
                    "Upgrade": "websocket",
                    "Sec-WebSocket-Version": "13",
                    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
                },
            )
            assert r.status_code == 403


@pytest.mark.parametrize("value", ["-1", "x"])
def test_cli_refuses_a_bad_ping_interval(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.hub.cli import main

    assert main(["--ping-interval", value]) == 2
    assert "--ping-interval" in capsys.readouterr().err


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


@pytest.mark.parametrize("stream", [False, True])
async def test_with_pings_off_a_silent_channel_is_bounded(stream: bool) -> None:
    """No pings, a runner that takes the turn and never answers: each wait for the first frame
    ends after first_frame_timeout, the channel is closed and the turn tried again (the runner
    redials the same job); after MAX_ATTEMPTS the client gets a clear error, never a hang."""
    from fake_runner import FakeRunner, Script

    from gateway.hub.serving import MAX_ATTEMPTS

    hub = Hub(
        admin_token=ADMIN,
        ping_interval=0,
        first_frame_timeout=0.3,
        keepalive_interval=0.05,
        reconnect_timeout=10.0,
    )
    async with open_hub(hub) as (hub, url):
        key = await hub.keys.create("k")  # the fake runner serves the default project
        runner = FakeRunner(url, ADMIN, scripts={"silent": Script(gate=trio.Event())})
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            body = {"model": "silent", "messages": [{"role": "user", "content": "hi"}]}
            body["stream"] = stream
            async with httpx.AsyncClient(
                base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30
            ) as client:
                with trio.fail_after(30):  # a hang guard only
                    r = await client.post("/v1/chat/completions", json=body)
            nursery.cancel_scope.cancel()
    (job_id,) = runner.claimed
    assert len(runner.turns) == MAX_ATTEMPTS and runner.dials[job_id] >= MAX_ATTEMPTS
    if stream:  # keepalive comments went out first, then one error event ends the stream
        assert r.status_code == 200 and r.text.startswith(": keepalive\n\n")
        events = [e for e in r.text.split("\n\n") if e.startswith("data: ")]
        assert len(events) == 1 and "[DONE]" not in r.text
        error = json.loads(events[0][6:])["error"]
    else:
        assert r.status_code == 502  # the API's own answer to a lost channel (issue 36, point 3)
        error = r.json()["error"]
    assert error["code"] == "channel_lost"
    assert error["message"] == f"the chat channel was lost {MAX_ATTEMPTS} times before an answer"
    assert hub.counters.pings_sent == 0 and hub.counters.failovers == 0


async def test_an_app_slow_to_read_is_not_a_dead_path() -> None:
    """The app stops reading (a slow consumer holds the channel's reader up): the frames, the
    pongs among them, wait in the socket; the connection is not declared dead for that."""
    from gateway.hub.counters import HubCounters
    from gateway.wire.server import Keepalive, Server

    release = trio.Event()
    got: list[str] = []
    total = 256

    class SlowApp:
        async def http(self, req: Any) -> None:
            raise AssertionError("no HTTP here")

        async def websocket(self, req: Any) -> None:
            ws = await req.accept()

            async def on_texts(texts: list[bytes]) -> None:
                await release.wait()  # held up: reads nothing meanwhile
                got.extend(t.decode() for t in texts)
                if len(got) == total:
                    ws.close_nowait(1000)

            await ws.run(on_texts)

    counters = HubCounters()
    server = Server(SlowApp(), keepalive=Keepalive(PING, PING), counters=counters)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(server.serve, "127.0.0.1", 0)
        with trio.fail_after(30):  # a hang guard only
            ch = await dial(url, "", "", answer_pings=True, target="/slow")
            nursery.start_soon(ch.read)
            for n in range(total):
                await ch.stream.send_all(ch.ws.send(TextMessage(data=f"m{n}")))
            await ch.wait_until(lambda: ch.pings >= 5)  # five timeouts long, unread
            release.set()
            await ch.wait_until(lambda: ch.close is not None)
        nursery.cancel_scope.cancel()
    assert counters.pong_timeouts == 0 and counters.pings_sent >= 5
    assert got == [f"m{n}" for n in range(total)]
    assert ch.close is not None and ch.close.code == 1000


def _errors_kept_by(module: str) -> list[BaseException]:
    """The BlockingIOErrors alive whose traceback passes through ``module``."""
    kept = []
    for obj in gc.get_objects():
        if isinstance(obj, BlockingIOError):
            tb = obj.__traceback__
            while tb is not None:
                if tb.tb_frame.f_code.co_filename.endswith(module):
                    kept.append(obj)
                    break
                tb = tb.tb_next
    return kept


async def test_a_quiet_channel_keeps_no_exception_alive() -> None:
    """The channel's reader waits for the next bytes outside the handler of the read that found
    none: a wait inside it kept that BlockingIOError and its traceback alive for as long as the
    channel was quiet (one a session, walked by every garbage collection)."""
    async with open_hub(Hub(admin_token=ADMIN, ping_interval=0)) as (hub, url):
        async with httpx.AsyncClient(base_url=url) as client:
            job_id, token = await claimed(hub, client)
            with trio.fail_after(30):  # a hang guard only
                ch = await dial(url, job_id, token, answer_pings=True)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ch.read)
                    opened = await hub.channels.wait(job_id, 10)
                    assert opened is not None
                    await trio.testing.wait_all_tasks_blocked()  # the reader waits: quiet
                    kept = _errors_kept_by("gateway/wire/wsserver.py")
                    nursery.cancel_scope.cancel()
    assert kept == []
