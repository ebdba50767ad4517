"""Guards on the relay's hot path that count work instead of timing it, so they cannot flake.

A fixed script of backend reads (several SSE events each) is relayed by a real ``Channel``'s
relay (``channel.relay.answer``, its public face: no private state of the channel touched) over
real sockets: each backend is a socket pair whose far end a thread writes (a chunked
HTTP/1.1 response, one block per write), and the channel is our WebSocket client on a socket
pair whose far end a thread reads (the Server's side, wsproto); and through the hub front door's
``relay_stream``. Threads are never counted: what is measured is the trio thread alone. What is
counted:

- socket writes: the frames of one backend read go out in one write, so writes per read stay
  at one (plus one for the done frame), never one per chunk;
- Python calls per relayed chunk (``sys.setprofile`` call and c_call events): in all (every task
  of the thread, trio's scheduler included), and those made by the gateway's own code; a change
  that adds a function call, an await or a log call per chunk to the path fails a bound;
- memory still held after relaying (tracemalloc): nothing is kept per chunk;
- the zero-buffer guarantee: the backend sends its next event only once the previous one was
  written to the channel, and the relay still finishes (a chunk held back for more deadlocks);
- no chunk waits for another turn's read: many turns whose backends release their events in
  the same instant (a batched model server's decode step); each turn's frames are written
  before any other turn's read comes next (the design before this one read the whole burst
  first and wrote it from a writer task afterwards);
- the front door: chunk frames already queued go to the HTTP client in one body write.

Each bound sits above what the code does by more than scheduling order (trio shuffles it) can
move the count, and below what one more piece of work per chunk adds.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import threading
import tracemalloc
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request, TextMessage

from gateway.hub.turn import State
from gateway.runner.backends import BackendPool
from gateway.runner.channel import Channel, ChannelKit
from gateway.runner.poller import Poller
from gateway.runner.resume import ResumeBuffer
from gateway.runner.turn import Turn
from gateway.runner.turns import Turns
from gateway.wire import http1, netio, protocol, wsclient
from gateway.wire.sse import SSESplitter

GATEWAY = os.path.dirname(os.path.dirname(protocol.__file__)) + os.sep  # the gateway's code
JOB = "job-hotpath"
EVENTS_PER_READ = 25
READS = 40
CHUNKS = EVENTS_PER_READ * READS
WAIT = 20.0  # s: a thread gives up on a frame that never comes (the test fails, never hangs)

# The bounds (see the module docstring). Measured when they were set (the design before them in
# brackets): 1.02 socket writes per backend read (1.02); 8.0 Python calls per chunk in all (28.5;
# 304 before that), of which 5.3 made by the gateway's own code (18.8); a handful of blocks kept
# after 1,000 chunks; 0 chunks that waited for another turn's read, of 64 x 10 in lockstep (the
# writer task read the whole burst first). One more call per chunk on the path takes the
# gateway's count over its bound; a scheduling point per chunk adds about 40 calls in all.
MAX_WRITES_PER_READ = 1.1
MAX_CALLS_PER_CHUNK = 12
MAX_GATEWAY_CALLS_PER_CHUNK = 5.8
MAX_BLOCKS_KEPT = 32
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def payload(i: int) -> bytes:
    return (
        b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"tok%d "},"finish_reason":null}]}' % i
    )


def script(reads: int = READS, per_read: int = EVENTS_PER_READ) -> list[bytes]:
    blocks = []
    for r in range(reads):
        blocks.append(
            b"".join(b"data: %b\n\n" % payload(r * per_read + i) for i in range(per_read))
        )
    blocks[-1] += b"data: [DONE]\n\n"
    return blocks


def chunked(block: bytes, last: bool = False) -> bytes:
    """One block as one chunk of a chunked body (and the body's end after the last one)."""
    return b"%x\r\n%b\r\n" % (len(block), block) + (b"0\r\n\r\n" if last else b"")


class Log:
    """What happened on the trio thread's sockets, in order: ("read", backend) and ("write",
    the request ids of the frames written)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.on = False


class ChannelSocket(socket.socket):
    """The runner's end of the channel: counts its writes and logs the request ids each held."""

    log: Log
    writes = 0

    def send(self, data: Any, flags: int = 0) -> int:
        sent = super().send(data, flags)
        self.writes += 1
        if self.log.on:
            self.log.events.append(("write", _request_ids(bytes(data[:sent]))))
        return sent


class BackendSocket(socket.socket):
    """The runner's end of one backend connection: counts and logs the reads that got bytes."""

    log: Log
    name = ""
    reads = 0

    def recv(self, size: int, flags: int = 0) -> bytes:
        data = super().recv(size, flags)
        if data:
            self.reads += 1
            if self.log.on:
                self.log.events.append(("read", self.name))
        return data


def _request_ids(data: bytes) -> list[str]:
    """The requestId of every (masked, client) frame in ``data``: our own frames, parsed here."""
    ids = []
    pos = 0
    while pos < len(data):
        size = data[pos + 1] & 0x7F
        pos += 2
        if size == 126:
            size = int.from_bytes(data[pos : pos + 2], "big")
            pos += 2
        elif size == 127:
            size = int.from_bytes(data[pos : pos + 8], "big")
            pos += 8
        key = data[pos : pos + 4]
        pos += 4
        body = bytes(b ^ key[i % 4] for i, b in enumerate(data[pos : pos + 200]))
        pos += size
        found = body.split(b'"requestId":"', 1)
        ids.append(found[1].split(b'"', 1)[0].decode() if len(found) == 2 else "")
    return ids


class Server(threading.Thread):
    """The Server's end of the channel, on a thread of its own: the handshake, then every
    message received, in order; ``wait_for(n)`` blocks until n have come."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(daemon=True)
        self.sock = sock
        self.ws = WSConnection(ConnectionType.SERVER)
        self.messages: list[str] = []
        self.cond = threading.Condition()
        self.parts: list[str] = []

    def run(self) -> None:
        while True:
            data = self.sock.recv(1 << 20)
            if not data:
                return
            self.ws.receive_data(data)
            got = []
            for event in self.ws.events():
                if isinstance(event, Request):
                    self.sock.sendall(self.ws.send(AcceptConnection()))
                elif isinstance(event, TextMessage):
                    self.parts.append(event.data)
                    if event.message_finished:
                        got.append("".join(self.parts))
                        self.parts = []
            if got:
                with self.cond:
                    self.messages += got
                    self.cond.notify_all()

    def wait_for(self, n: int) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.messages) >= n, WAIT):
                raise AssertionError(f"{len(self.messages)} frames came, {n} expected")

    def frames(self) -> list[dict[str, Any]]:
        with self.cond:
            return [json.loads(m) for m in self.messages]


def _feed(sock: socket.socket, blocks: list[bytes], server: Server, base: int, per: int) -> None:
    """A backend answering one turn in lockstep: block n+1 is written once the frames of the
    blocks before it were received (``per`` frames each, after the ``base`` already there)."""
    sock.sendall(HEAD)
    for r, block in enumerate(blocks):
        if r:
            server.wait_for(base + r * per)
        sock.sendall(chunked(block, last=r == len(blocks) - 1))


class Rig:
    """A Channel serving a WebSocket on a socket pair, the Server's end on a thread."""

    def __init__(self, channel: Channel, sock: ChannelSocket, server: Server, log: Log) -> None:
        self.channel = channel
        self.sock = sock
        self.server = server
        self.log = log
        self.turns: dict[str, Turn] = {}  # the turns in flight: a test may stop one
        self.keep: ResumeBuffer | None = None  # where turns keep their frames (a resume)

    def backend(self, name: str) -> tuple[http1.ClientResponse, BackendSocket, socket.socket]:
        near, far = socket.socketpair()
        sock = BackendSocket(fileno=near.detach())
        sock.log, sock.name = self.log, name
        return http1.ClientResponse(netio.Transport(sock)), sock, far

    async def relay(
        self, request_id: str, blocks: list[bytes], per: int = EVENTS_PER_READ
    ) -> tuple[str | None, int]:
        """Relay one turn whose backend sends ``blocks`` in lockstep; (error, reads)."""
        response, sock, far = self.backend(request_id)
        base = len(self.server.messages)
        feeder = threading.Thread(
            target=_feed, args=(far, blocks, self.server, base, per), daemon=True
        )
        feeder.start()
        error = await self.relay_response(request_id, response)
        await trio.to_thread.run_sync(feeder.join)
        far.close()
        return error, sock.reads

    async def relay_response(self, request_id: str, response: http1.ClientResponse) -> str | None:
        """One turn's answer relayed by the channel's relay, under the turn's scope as its
        task runs it; the turn's error (as it would be framed), or None."""
        frames = protocol.TurnFrames(JOB, request_id)
        self.turns[request_id] = turn = Turn(request_id, frames, trio.current_time())
        turn.keep = self.keep
        try:
            with trio.fail_after(WAIT), turn.scope:  # a chunk held back for more deadlocks here
                await response.read_head()
                with trio.CancelScope() as idle:
                    response.idle, response.idle_timeout = idle, 600.0
                    await self.channel.relay.answer(turn, response)
        except Exception as exc:
            return str(exc)
        finally:
            del self.turns[request_id]
            response.close()
        return None


async def _rig(
    nursery: trio.Nursery, log: Log | None = None, poller: bool = True, resume: bool = False
) -> Rig:
    """A channel as the runner has it: its backend reads in the runner's poller (``poller``
    False: each turn's own task reads its socket, as where there is no epoll); ``resume``: its
    turns keep their frames for a resume (docs/protocol.md §6), in a 1 MiB buffer."""
    near, far = socket.socketpair()
    sock = ChannelSocket(fileno=near.detach())
    sock.log = log = log or Log()
    server = Server(far)
    server.start()
    ws = await wsclient.handshake(netio.Transport(sock), "hub", "/api/lives/chat/channel/ws")
    the_poller = Poller.open() if poller else None
    if the_poller is not None:
        nursery.start_soon(the_poller.run)
    kit = ChannelKit(pool=BackendPool([], None), shutdown=trio.Event(), poller=the_poller)
    turns = Turns(JOB, kit, nursery, resume_buffer=1 << 20) if resume else None
    channel = Channel(JOB, ws, kit, turns=turns)
    nursery.start_soon(channel.serve)
    await trio.testing.wait_all_tasks_blocked()
    sock.writes = 0  # from here on count only the channel's own writes
    rig = Rig(channel, sock, server, log)
    rig.keep = turns.buffer if turns is not None else None
    return rig


@pytest.mark.parametrize("poller", [True, False], ids=["poller", "own-task"])
async def test_one_write_per_backend_read_and_frames_verbatim(poller: bool) -> None:
    async with trio.open_nursery() as nursery:
        rig = await _rig(nursery, poller=poller)
        error, reads = await rig.relay("r1", script())
        assert error is None
        rig.server.wait_for(CHUNKS + 1)
        frames = rig.server.frames()
        chunks = [f for f in frames if f["type"] == protocol.COMPLETION_CHUNK]
        assert len(chunks) == CHUNKS
        assert frames[-1] == {"type": protocol.COMPLETION_DONE, "jobId": JOB, "requestId": "r1"}
        # each payload spliced in unchanged, in order
        assert [c["chunk"]["choices"][0]["delta"]["content"] for c in chunks[:3]] == [
            "tok0 ",
            "tok1 ",
            "tok2 ",
        ]
        seventh = rig.server.messages[7]
        assert seventh.endswith(',"chunk":' + payload(7).decode() + "}")  # the bytes as they came
        assert json.loads(seventh) == {
            "type": protocol.COMPLETION_CHUNK,
            "jobId": JOB,
            "requestId": "r1",
            "chunk": json.loads(payload(7)),
        }
        writes_per_read = rig.sock.writes / reads
        print(f"\nwrites per backend read: {writes_per_read:.2f} ({rig.sock.writes} for {reads})")
        assert reads >= READS
        assert writes_per_read <= MAX_WRITES_PER_READ
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("resume", [False, True], ids=["plain", "frames-kept"])
async def test_python_calls_per_chunk(resume: bool) -> None:
    """``resume``: the turn keeps its frames for a resume (one entry a read, by reference):
    within the same bounds."""
    async with trio.open_nursery() as nursery:
        rig = await _rig(nursery, resume=resume)
        await rig.relay("warm", script(reads=2))  # first-use costs stay out of the count
        calls = made_by_gateway = 0

        def count(frame: Any, event: str, arg: object) -> None:
            nonlocal calls, made_by_gateway
            if event == "call":
                calls += 1
                caller = frame.f_back
                if caller is not None and caller.f_code.co_filename.startswith(GATEWAY):
                    made_by_gateway += 1
            elif event == "c_call":
                calls += 1
                if frame.f_code.co_filename.startswith(GATEWAY):
                    made_by_gateway += 1

        response, sock, far = rig.backend("r2")
        base = len(rig.server.messages)
        feeder = threading.Thread(
            target=_feed, args=(far, script(), rig.server, base, EVENTS_PER_READ), daemon=True
        )
        feeder.start()
        sys.setprofile(count)
        try:
            error = await rig.relay_response("r2", response)
            await trio.testing.wait_all_tasks_blocked()
        finally:
            sys.setprofile(None)
        feeder.join(WAIT)
        far.close()
        assert error is None
        print(
            f"\nPython calls per relayed chunk: {calls / CHUNKS:.1f} in all, "
            f"{made_by_gateway / CHUNKS:.2f} made by the gateway's code"
        )
        assert calls / CHUNKS <= MAX_CALLS_PER_CHUNK
        assert made_by_gateway / CHUNKS <= MAX_GATEWAY_CALLS_PER_CHUNK
        nursery.cancel_scope.cancel()


async def test_nothing_kept_per_chunk() -> None:
    async with trio.open_nursery() as nursery:
        rig = await _rig(nursery)
        await rig.relay("warm", script(reads=4))
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            error, _ = await rig.relay("r3", script())
            gc.collect()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        assert error is None
        kept = [
            s
            for s in after.compare_to(before, "lineno")
            if s.count_diff > 0 and s.traceback[0].filename.startswith(GATEWAY)
        ]
        blocks = sum(s.count_diff for s in kept)
        print(f"\nblocks kept by gateway code after {CHUNKS} chunks: {blocks}")
        assert blocks <= MAX_BLOCKS_KEPT, kept[:5]
        nursery.cancel_scope.cancel()


async def test_no_chunk_waits_for_the_next_one() -> None:
    """Lockstep, one event per read: the backend sends event n+1 only once event n's frame was
    written; a chunk held back until more arrive would deadlock (and fail on the deadline)."""
    async with trio.open_nursery() as nursery:
        rig = await _rig(nursery)
        error, reads = await rig.relay("r4", script(reads=10, per_read=1), per=1)
        assert error is None and reads >= 10
        nursery.cancel_scope.cancel()


TURNS = 64
STEPS = 10


@pytest.mark.parametrize("poller", [True, False], ids=["poller", "own-task"])
async def test_no_chunk_waits_for_another_turns_read(poller: bool) -> None:
    """A batched server's decode step: every turn's backend releases its next event in the same
    instant (written from this thread without a scheduling point in between, so the turns wake
    together). Each turn's frame must be written before any other turn's read comes next."""
    log = Log()
    async with trio.open_nursery() as nursery:
        rig = await _rig(nursery, log, poller=poller)
        backends = [rig.backend(f"t{i}") for i in range(TURNS)]
        for _, _, far in backends:
            far.setblocking(False)
            far.send(HEAD)
        step_done = trio.Event()
        token = trio.lowlevel.current_trio_token()

        async def turn(i: int, response: http1.ClientResponse) -> None:
            assert await rig.relay_response(f"t{i}", response) is None

        def watch() -> None:  # the Server's side: tell the trio thread when a step is written
            for step in range(1, STEPS + 1):
                rig.server.wait_for(step * TURNS)
                trio.from_thread.run_sync(step_done.set, trio_token=token)
            rig.server.wait_for(STEPS * TURNS + TURNS)  # the done frames

        async with trio.open_nursery() as turns:
            for i, (response, _, _) in enumerate(backends):
                turns.start_soon(turn, i, response)
            await trio.testing.wait_all_tasks_blocked()
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            log.on = True
            for step in range(STEPS):
                event = b"data: %b\n\n" % payload(step)
                if step == STEPS - 1:
                    event += b"data: [DONE]\n\n"
                for _, _, far in backends:  # the whole burst, no scheduling point in between
                    far.send(chunked(event, last=step == STEPS - 1))
                with trio.fail_after(WAIT):
                    await step_done.wait()
                step_done = trio.Event()
        log.on = False
        await trio.to_thread.run_sync(watcher.join, WAIT)
        for _, _, far in backends:
            far.close()
        waited = written = 0
        for n, (kind, who) in enumerate(log.events):
            if kind != "read":
                continue
            for later_kind, later in log.events[n + 1 :]:
                if later_kind == "write" and who in later:
                    written += 1
                    break
                if later_kind == "read" and later != who:
                    waited += 1  # another turn read before this turn's frame went out
                    break
        print(f"\nchunks that waited for another turn's read: {waited} of {TURNS * STEPS}")
        assert written + waited >= TURNS * STEPS
        assert waited == 0
        nursery.cancel_scope.cancel()


async def test_invalid_utf8_in_an_event_is_a_turn_error() -> None:
    async with trio.open_nursery() as nursery:
        rig = await _rig(nursery)
        bad = b'data: {"choices":[{"delta":{"content":"\xff"}}]}\n\n'
        error, _ = await rig.relay("r5", [b"data: " + payload(0) + b"\n\n", bad], per=1)
        assert error is not None and "UTF-8" in error
        good = b'data: {"choices":[{"delta":{"content":"h\xc3\xa9"}}]}\n\ndata: [DONE]\n\n'
        error, _ = await rig.relay("r6", [good])
        assert error is None
        rig.server.wait_for(3)
        frames = [f for f in rig.server.frames() if f.get("requestId") == "r6"]
        assert frames[0]["chunk"]["choices"][0]["delta"]["content"] == "hé"
        assert rig.channel.ws.closed is None
        nursery.cancel_scope.cancel()


# -- the front door -------------------------------------------------------------------------


class _CountingTransport(netio.Transport):
    """A real socket's transport that keeps every write it is asked for."""

    __slots__ = ("writes",)

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.writes: list[bytes] = []

    def write(self, data: bytes | bytearray) -> bool:
        self.writes.append(bytes(data))
        return super().write(data)


def _front_door_turn(
    rid: str, strip_usage: bool = False
) -> tuple[Any, _CountingTransport, Any, Any, socket.socket]:
    """A channel, and a streamed turn on it whose client is the far end of a socket pair (its
    usage chunk kept from the client with ``strip_usage``)."""
    from types import SimpleNamespace

    from gateway.apis.dialects import CHAT
    from gateway.hub import Hub
    from gateway.hub.channel import ServerChannel
    from gateway.hub.routekit import Response
    from gateway.hub.turn import Turn

    ours, theirs = socket.socketpair()
    transport = _CountingTransport(ours)
    request = SimpleNamespace(body_pending=False, keep_alive=True)  # a POST whose body was read
    resp = Response(request, transport, False, b"POST")
    ch = ServerChannel(JOB, "runner", None, Hub().channels)
    turn = Turn(
        rid,
        "key-id",
        "key",
        "s",
        b"{}",
        CHAT,
        resp,
        model="m",
        stream=True,
        bound=1 << 20,
        max_answer=1 << 20,
        strip_usage=strip_usage,
        now=trio.current_time(),
    )
    turn.sent(rid, "runner", JOB)
    ch.open(rid, turn)
    return ch, transport, resp, turn, theirs


def _chunk_frame(rid: str, i: int) -> str:
    return protocol.TurnFrames(JOB, rid).chunk(payload(i)).decode()


def _events(raw: bytes) -> list[bytes]:
    """The SSE events of a whole chunked response, as a client reads them."""
    import h11

    client = h11.Connection(h11.CLIENT)
    client.send(
        h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")])
    )
    client.send(h11.EndOfMessage())
    client.receive_data(raw)
    body = b""
    while not isinstance(event := client.next_event(), h11.EndOfMessage | type(h11.NEED_DATA)):
        if isinstance(event, h11.Data):
            body += event.data
    return body.split(b"\n\n")[:-1]


async def test_front_door_writes_a_reads_chunks_in_one_write() -> None:
    """The channel's reader writes a read's 100 chunks, [DONE] and the end of the response to
    the client's socket in one write, the response head with them."""
    ch, transport, resp, sink, client = _front_door_turn("f1")
    texts = [_chunk_frame("f1", i).encode() for i in range(100)]
    await ch.on_texts([*texts, protocol.done_frame(JOB, "f1").encode()])
    assert len(transport.writes) == 1
    assert sink.state is State.DONE and resp.finished
    events = _events(client.recv(1 << 20))
    assert events[0] == b"data: " + payload(0) and events[99] == b"data: " + payload(99)
    assert events[100:] == [b"data: [DONE]"]


async def test_front_door_never_holds_a_chunk_back() -> None:
    """Each read's chunk is on the client's socket before the next read is handed over."""
    ch, transport, resp, sink, client = _front_door_turn("f2")
    for i in range(5):
        await ch.on_texts([_chunk_frame("f2", i).encode()])
        assert len(transport.writes) == i + 1 and payload(i) in transport.writes[-1]
    await ch.on_texts([protocol.done_frame(JOB, "f2").encode()])
    assert len(transport.writes) == 6 and resp.finished
    events = _events(client.recv(1 << 20))
    assert events == [b"data: " + payload(i) for i in range(5)] + [b"data: [DONE]"]


USAGE_ONLY = (
    b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":100,"total_tokens":103}}'
)


async def _front_door_calls(rid: str, accounted: bool) -> tuple[int, Any, list[bytes]]:
    """Python calls (call and c_call events) while a front-door turn of 100 chunks, one a read,
    then the usage chunk the hub asked for and done are handed to the channel's reader; with
    ``accounted`` the turn's usage chunk (the hub asked for it) is kept from the client."""
    ch, _transport, resp, record, client = _front_door_turn(rid, accounted)
    texts = [_chunk_frame(rid, i).encode() for i in range(100)]
    usage = protocol.TurnFrames(JOB, rid).chunk(USAGE_ONLY)
    reads = [[t] for t in texts] + [[usage, protocol.done_frame(JOB, rid).encode()]]
    calls = 0

    def count(frame: Any, event: str, arg: object) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        for read in reads:
            await ch.on_texts(read)
    finally:
        sys.setprofile(None)
    assert resp.finished
    return calls, record, _events(client.recv(1 << 20))


async def test_front_door_accounting_adds_at_most_one_call_per_chunk() -> None:
    """A turn's accounting (its chunks counted, its usage chunk kept from a client that did not
    ask for it, its tokens taken at the end) costs at most one Python call per chunk over a turn
    without it, and a few per turn (a ``startswith`` at the offset where the turn's chunks open
    their choices; the search of each frame for an empty ``choices`` cost two), and takes the
    tokens exactly."""
    await _front_door_calls("warm", True)  # first-use costs stay out of the count
    plain, _, events = await _front_door_calls("plain", False)
    accounted, record, kept = await _front_door_calls("accounted", True)
    assert events[-2:] == [b"data: " + USAGE_ONLY, b"data: [DONE]"]
    assert kept == events[:-2] + [b"data: [DONE]"]  # the usage chunk did not reach the client
    assert (record.prompt_tokens, record.completion_tokens, record.chunks) == (3, 100, 101)
    print(f"\nPython calls the accounting adds: {accounted - plain} for 100 chunks")
    assert accounted - plain <= 100 + 30  # and a few a turn: the first chunk, usage, done


# -- the SSE splitter's fast path gives what the line parser gives ------------------------------


def _reference(pieces: list[bytes]) -> list[bytes]:
    """The SSE data payloads by the spec's line algorithm, on the whole stream at once."""
    text = b"".join(pieces).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    out, data = [], []
    lines = text.split(b"\n")
    complete, tail = lines[:-1], lines[-1]
    for line in complete:
        if not line:
            if data:
                out.append(b"\n".join(data))
                data = []
        elif line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value[:1] == b" " else value)
    if tail.startswith(b"data:"):  # flush(): a last event without its blank line
        value = tail[5:]
        data.append(value[1:] if value[:1] == b" " else value)
    if data:
        out.append(b"\n".join(data))
    return out


_ATOMS = st.sampled_from(
    [
        b"data: x",
        b"data:y",
        b'data: {"a":1}',
        b": comment",
        b"event: e",
        b"id: 7",
        b"data",
        b"data:",
        b"data: ",
        b"",
        b"retry: 1",
        b"data: [DONE]",
        b"da",
        b"ta: z",
    ]
)
_ENDS = st.sampled_from([b"\n", b"\r\n", b"\r", b"\n\n", b"\r\n\r\n", b""])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(_ATOMS, _ENDS), max_size=14), st.lists(st.integers(0, 200), max_size=6))
def test_sse_splitter_matches_the_line_algorithm(
    parts: list[tuple[bytes, bytes]], cuts: list[int]
) -> None:
    stream = b"".join(a + e for a, e in parts)
    points = sorted({c for c in cuts if 0 < c < len(stream)})
    pieces = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    splitter = SSESplitter()
    got: list[bytes] = []
    for piece in pieces:
        got += splitter.feed(piece)
    got += splitter.flush()
    assert got == _reference(pieces)
