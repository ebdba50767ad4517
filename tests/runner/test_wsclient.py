"""The Chat Channel's WebSocket client (gateway.wire.wsclient) against a WebSocket server on loopback:
pings answered, a close frame answered, an oversized message refused with 1009, a refused
upgrade, and the keepalive that finds a silent (dead) path."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing
from helpers import OWNER, PROJECT, request_frame, runner_config
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Event,
    Ping,
    Pong,
    RejectConnection,
    Request,
    TextMessage,
)

from gateway.hub import Hub
from gateway.runner.supervisor import Runner
from gateway.sim import Simulator
from gateway.wire import wsclient


class Peer:
    """The Server's side of one connection: wsproto over a trio stream, driven by the test."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.SERVER)

    async def send(self, event: Event) -> None:
        await self.stream.send_all(self.ws.send(event))

    async def next_event(self) -> Event:
        while True:
            for event in self.ws.events():
                return event
            data = await self.stream.receive_some(65536)
            self.ws.receive_data(data or None)


Script = Callable[[Peer], Awaitable[None]]


@asynccontextmanager
async def server(script: Script, accept: bool = True) -> AsyncIterator[str]:
    async def handle(stream: trio.SocketStream) -> None:
        peer = Peer(stream)
        request = await peer.next_event()
        assert isinstance(request, Request)
        if not accept:
            await peer.send(RejectConnection(status_code=403))
            return
        await peer.send(AcceptConnection())
        await script(peer)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handle, 0)
        port = listeners[0].socket.getsockname()[1]
        yield f"ws://127.0.0.1:{port}/api/lives/chat/channel/ws?jobId=j"
        nursery.cancel_scope.cancel()


async def test_ping_is_answered_and_messages_arrive() -> None:
    got: list[Event] = []
    answered = trio.Event()

    async def script(peer: Peer) -> None:
        await peer.send(Ping(b"are you there"))
        await peer.send(TextMessage('{"type":"chat.end"}'))
        got.append(await peer.next_event())
        answered.set()
        await trio.sleep_forever()

    async with server(script) as url:
        ws = await wsclient.connect(url)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ws.run)
            assert await ws.receive() == '{"type":"chat.end"}'
            with trio.fail_after(5):
                await answered.wait()
            nursery.cancel_scope.cancel()
        await ws.aclose()
    assert got == [Pong(b"are you there")]


async def test_close_frame_is_answered_and_ends_the_connection() -> None:
    replies: list[Event] = []
    replied = trio.Event()

    async def script(peer: Peer) -> None:
        await peer.send(CloseConnection(4000, "job over"))
        replies.append(await peer.next_event())
        replied.set()

    async with server(script) as url:
        ws = await wsclient.connect(url)
        with pytest.raises(wsclient.ChannelClosed) as info:
            await ws.receive()
        assert str(info.value) == "code 4000: job over"
        with trio.fail_after(5):
            await replied.wait()
        await ws.aclose()
        with pytest.raises(wsclient.ChannelClosed):
            await ws.send(b"{}")
    assert isinstance(replies[0], CloseConnection) and replies[0].code == 4000


async def test_oversized_message_is_refused_with_1009() -> None:
    replies: list[Event] = []
    replied = trio.Event()

    async def script(peer: Peer) -> None:
        await peer.send(TextMessage("x" * 5000))
        replies.append(await peer.next_event())
        replied.set()

    async with server(script) as url:
        ws = await wsclient.connect(url, max_message_size=4096)
        with pytest.raises(wsclient.ChannelClosed) as info:
            await ws.receive()
        assert "exceeded max_frame_size" in str(info.value) and "1009" in str(info.value)
        with trio.fail_after(5):
            await replied.wait()
        await ws.aclose()
    assert isinstance(replies[0], CloseConnection) and replies[0].code == 1009


def _frame(opcode: int, payload: bytes, fin: bool = True, mask: bytes | None = None) -> bytes:
    """A Server frame written by hand (``mask``: a frame a Server must not send)."""
    n = len(payload)
    head = bytes(((0x80 if fin else 0) | opcode,))
    bit = 0x80 if mask else 0
    if n < 126:
        head += bytes((bit | n,))
    elif n < 65536:
        head += bytes((bit | 126,)) + n.to_bytes(2, "big")
    else:
        head += bytes((bit | 127,)) + n.to_bytes(8, "big")
    if mask:
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        head += mask
    return head + payload


async def test_frames_split_anywhere_with_control_frames_and_fragments_between() -> None:
    """Whole text frames, frames cut into single bytes, a ping, a fragmented message and one
    of 70,000 bytes (a 64-bit length) arrive as their messages, in order; the ping is answered."""
    big = "é" * 35000
    wire = (
        _frame(1, b'{"n":1}')
        + _frame(9, b"hello?")
        + _frame(1, b'{"n":2,"t":"' + "ø".encode() * 100 + b'"}')
        + _frame(1, b'{"n":', fin=False)
        + _frame(0, b"3}")
        + _frame(1, big.encode())
        + _frame(1, b'{"n":4}')
    )
    got_pong: list[Event] = []
    answered = trio.Event()

    async def script(peer: Peer) -> None:
        await peer.stream.send_all(wire[:9])  # the first frame and two bytes of the ping
        for i in range(9, 60):
            await peer.stream.send_all(wire[i : i + 1])
        await peer.stream.send_all(wire[60:])
        got_pong.append(await peer.next_event())
        answered.set()
        await trio.sleep_forever()

    async with server(script) as url:
        ws = await wsclient.connect(url)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ws.run)
            with trio.fail_after(5):
                messages = [await ws.receive() for _ in range(5)]
                await answered.wait()
            nursery.cancel_scope.cancel()
        await ws.aclose()
    assert messages == [
        '{"n":1}',
        '{"n":2,"t":"' + "ø" * 100 + '"}',
        '{"n":3}',
        big,
        '{"n":4}',
    ]
    assert got_pong == [Pong(b"hello?")]


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (_frame(1, b'{"bad":"\xff"}'), 1007),  # not UTF-8
        (_frame(1, b'{"masked":1}', mask=b"abcd"), 1002),  # a Server must not mask
    ],
)
async def test_a_bad_text_frame_closes_the_connection(frame: bytes, code: int) -> None:
    replies: list[Event] = []
    replied = trio.Event()

    async def script(peer: Peer) -> None:
        await peer.stream.send_all(_frame(1, b'{"n":1}') + frame + _frame(1, b'{"n":2}'))
        replies.append(await peer.next_event())
        replied.set()

    async with server(script) as url:
        ws = await wsclient.connect(url)
        assert await ws.receive() == '{"n":1}'
        with pytest.raises(wsclient.ChannelClosed):
            await ws.receive()
        with trio.fail_after(5):
            await replied.wait()
        await ws.aclose()
    assert isinstance(replies[0], CloseConnection) and replies[0].code == code


async def test_refused_upgrade_names_the_status() -> None:
    async def script(peer: Peer) -> None:
        pass

    async with server(script, accept=False) as url:
        with pytest.raises(wsclient.HandshakeError) as info:
            await wsclient.connect(url)
    assert info.value.status_code == 403


RawScript = Callable[[trio.SocketStream, bytes], Awaitable[None]]


@asynccontextmanager
async def raw_server(script: RawScript) -> AsyncIterator[str]:
    """A Server written by hand: ``script`` gets the stream and the client's key once the
    upgrade request has come, and answers it as it likes."""

    async def handle(stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            head += await stream.receive_some(65536)
        key = next(
            line.split(b":", 1)[1].strip()
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"sec-websocket-key:")
        )
        await script(stream, key)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handle, 0)
        port = listeners[0].socket.getsockname()[1]
        yield f"ws://127.0.0.1:{port}/api/lives/chat/channel/ws?jobId=j"
        nursery.cancel_scope.cancel()


def _answer(key: bytes, accept: bytes | None = None, extra: bytes = b"") -> bytes:
    if accept is None:
        digest = hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()
        accept = base64.b64encode(digest)
    return (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: " + accept + b"\r\n" + extra + b"\r\n"
    )


async def test_frames_that_come_with_the_answer_are_read() -> None:
    """The 101, a whole frame and half of the next in one write: both messages arrive."""
    second = _frame(1, b'{"n":2,"pad":"' + b"p" * 300 + b'"}')

    async def script(stream: trio.SocketStream, key: bytes) -> None:
        await stream.send_all(_answer(key) + _frame(1, b'{"n":1}') + second[:100])
        await stream.send_all(second[100:])
        await trio.sleep_forever()

    async with raw_server(script) as url:
        ws = await wsclient.connect(url)
        with trio.fail_after(5):
            assert await ws.receive() == '{"n":1}'
            assert (await ws.receive()).startswith('{"n":2,')
        await ws.aclose()


@pytest.mark.parametrize(
    ("accept", "extra", "problem"),
    [
        (b"bm90IHRoZSBrZXk=", b"", "does not match the key"),
        (None, b"Sec-WebSocket-Extensions: permessage-deflate\r\n", "not asked for"),
        (None, b"Sec-WebSocket-Protocol: chat\r\n", "not asked for"),
    ],
)
async def test_an_upgrade_answer_that_does_not_fit_the_request_is_refused(
    accept: bytes | None, extra: bytes, problem: str
) -> None:
    async def script(stream: trio.SocketStream, key: bytes) -> None:
        await stream.send_all(_answer(key, accept, extra))
        await trio.sleep_forever()

    async with raw_server(script) as url:
        with pytest.raises(wsclient.HandshakeError) as info:
            await wsclient.connect(url)
    assert problem in str(info.value) and info.value.status_code is None


async def test_a_connection_that_ends_without_a_close_frame_is_closed() -> None:
    async def script(stream: trio.SocketStream, key: bytes) -> None:
        await stream.send_all(_answer(key) + _frame(1, b'{"n":1}'))
        await stream.aclose()

    async with raw_server(script) as url:
        ws = await wsclient.connect(url)
        with trio.fail_after(5):
            assert await ws.receive() == '{"n":1}'
            with pytest.raises(wsclient.ChannelClosed) as info:
                await ws.receive()
        await ws.aclose()
    assert info.value.code is None and "no close frame" in str(info.value)


async def test_a_message_in_too_many_fragments_closes_the_connection_with_1009() -> None:
    """A Server that opens a fragmented message and sends empty continuation frames: the
    client counts them (issue 30 row 3, both ends) and closes with 1009 at the bound."""
    reply = bytearray()
    replied = trio.Event()

    async def script(stream: trio.SocketStream, key: bytes) -> None:
        empty = _frame(0, b"", fin=False)
        await stream.send_all(_answer(key) + _frame(1, b"{", fin=False) + empty * 2000)
        while len(reply) < 8:
            reply.extend(await stream.receive_some(65536))
        replied.set()
        await trio.sleep_forever()

    async with raw_server(script) as url:
        ws = await wsclient.connect(url)
        with trio.fail_after(5):
            with pytest.raises(wsclient.ChannelClosed) as info:
                await ws.receive()
            await replied.wait()
        await ws.aclose()
    assert info.value.code == 1009 and "fragment" in str(info.value)
    assert reply[0] == 0x88  # the close frame, masked, with its code
    payload = bytes(b ^ reply[2 + (i % 4)] for i, b in enumerate(reply[6:8]))
    assert int.from_bytes(payload, "big") == 1009


async def test_sent_frames_arrive_in_order_with_writes_in_between() -> None:
    received: list[str] = []
    done = trio.Event()

    async def script(peer: Peer) -> None:
        parts: list[str] = []
        while len(received) < 2001:
            event = await peer.next_event()
            if isinstance(event, TextMessage):
                parts.append(event.data)
                if event.message_finished:
                    received.append("".join(parts))
                    parts = []
        done.set()

    async with server(script) as url:
        ws = await wsclient.connect(url)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ws.run)
            for i in range(1000):  # large enough that some writes leave bytes to the task
                await ws.send(b'{"n":%d,"pad":"%s"}' % (i, b"p" * 2000))
            if not ws.offer_batch([b'{"n":%d}' % i for i in range(1000, 2000)]):
                await ws.wait_room()
            await ws.send("last")
            await ws.drain()
            with trio.fail_after(10):
                await done.wait()
            nursery.cancel_scope.cancel()
        await ws.aclose()
    assert [r[:12] for r in received[:3]] == ['{"n":0,"pad"', '{"n":1,"pad"', '{"n":2,"pad"']
    assert received[1500] == '{"n":1500}' and received[-1] == "last"


# -- keepalive -------------------------------------------------------------------------------


async def _keepalive(answer: bool) -> tuple[list[str], float, wsclient.ChannelClosed | None]:
    seen: list[str] = []
    pings: list[float] = []

    async def script(peer: Peer) -> None:
        while True:
            event = await peer.next_event()
            if isinstance(event, Ping):
                pings.append(trio.current_time())
                if answer:
                    await peer.send(event.response())

    start = trio.current_time()
    closed: wsclient.ChannelClosed | None = None
    async with server(script) as url:
        ws = await wsclient.connect(url, ping_interval=20, ping_timeout=10, on_ping=seen.append)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ws.run)
            with trio.move_on_after(190):
                try:
                    await ws.receive()
                except wsclient.ChannelClosed as exc:
                    closed = exc
            nursery.cancel_scope.cancel()
        elapsed = trio.current_time() - start
        await ws.aclose()
    assert pings and pings[0] - start == pytest.approx(20, abs=0.5)
    return seen, elapsed, closed


async def test_keepalive_pings_and_a_live_peer_stays_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen, elapsed, closed = await _keepalive(answer=True)
    assert closed is None and elapsed == pytest.approx(190, abs=0.5)
    assert seen.count("sent") == 9 and "timeout" not in seen  # every 20 s for 190 s


async def test_keepalive_declares_a_silent_peer_dead(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen, elapsed, closed = await _keepalive(answer=False)
    assert closed is not None and "no answer to a ping within 10 s" in str(closed)
    assert elapsed == pytest.approx(30, abs=0.5)  # ping at 20 s, silence until 30 s
    assert seen == ["sent", "timeout"]


# -- the runner's channels -------------------------------------------------------------------


async def test_runner_finds_a_silent_channel_dead_cancels_its_turn_and_redials(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    """The job's channel goes to a Server that takes one turn and then falls silent (a frozen
    path: open, carrying nothing). With pings every 0.2 s the runner finds it dead, cancels the
    turn (its backend request is closed) and redials."""
    dials: list[Peer] = []
    dialled = trio.Event()
    job_ids: list[str] = []  # the job's id, known once it is queued (before any dial)

    async def script(peer: Peer) -> None:
        dials.append(peer)
        dialled.set()
        if len(dials) == 1:
            frame = request_frame(job_ids[0], "slow", sim={"chunks": 10_000, "interval": 0.05})
            await peer.send(TextMessage(json.dumps(frame)))
        await trio.sleep_forever()  # never reads again, never answers a ping

    async with server(script) as url:
        definition = {"jobType": "chat_llm", "channelUrl": url}
        runner = Runner(
            runner_config(
                hub[1],
                sim.url,
                tmp_path,
                reconnect_window=30.0,
                ping_interval=0.2,
                ping_timeout=0.2,
            )
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner.run)
            job = await hub[0].board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], definition)
            job_ids.append(job.id)
            with trio.fail_after(20):
                stream = await sim.wait_for_streams(1)
                await runner.counters.wait("channels_dead", 1)
                await stream.finished.wait()
                await runner.counters.wait("turns_cancelled", 1)
                while len(dials) < 2:
                    await dialled.wait()
                    dialled = trio.Event()
            assert stream.client_closed  # the turn was cancelled and its backend request closed
            assert runner.counters.get("pings_sent") >= 1
            assert runner.counters.get("pong_timeouts") == 1
            assert runner.counters.get("turns_done") == 0
            assert list(runner.sessions) == [job.id]  # the session lives on, redialled
            nursery.cancel_scope.cancel()
