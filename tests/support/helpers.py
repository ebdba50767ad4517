"""Test helpers: runner configs, a running runner, chat sessions on the hub, frame collection."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import weakref
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import trio
import trio.testing
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, Request, TextMessage

from gateway.config import Config
from gateway.hub import Hub, ServerChannel
from gateway.hub.cli import main as hub_main
from gateway.runner.supervisor import Runner
from gateway.wire import protocol
from gateway.wire.wsframes import OP_BINARY

ADMIN = "alpa_test_admin_credential"
BACKEND_KEY = "sk-backend-very-secret-4242"
TEAM_SECRET = "team-secret-of-the-tests-0123456789abcdef"  # the replicas sign with it
OWNER, PROJECT = "acme", "chat"
CHAT_DEFINITION = {"jobType": "chat_llm", "needs": ["chat-llm:v1"]}


def runner_config(server: str, backend: str | None, state_dir: Path, **overrides: Any) -> Config:
    base = Config(
        server=server,
        server_explicit=True,
        project=f"{OWNER}/{PROJECT}",
        state_dir=state_dir,
        backend=backend,
        backend_key=BACKEND_KEY,
        model="sim-model",
        user_token=ADMIN,
        name="test-runner",
        poll_interval=10.0,
        reconnect_window=10.0,
        grace=5.0,
        connect_timeout=5.0,
    )
    return replace(base, **overrides)


@asynccontextmanager
async def running(config: Config) -> AsyncIterator[Runner]:
    """A Runner serving in the background; cancelled (not drained) when the block ends."""
    runner = Runner(config)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner.run)
        with trio.fail_after(10):
            await runner.first_poll.wait()
        yield runner
        nursery.cancel_scope.cancel()


async def register_runner(
    hub: Hub, owner: str, project: str, name: str, labels: list[str]
) -> dict[str, Any]:
    """Register a runner straight in the hub's store (as ``POST {base}/runners`` does)."""
    registration, token = await hub.store.add_registration(owner, project, name, list(labels))
    hub.board.seen(registration.id, registration)
    return {
        "id": registration.id,
        "name": registration.name,
        "token": token,
        "registeredAt": registration.registered_at,
    }


class Inbox:
    """Every frame a channel's runner sends that no request of the hub's own is open for (a
    test playing the Server's part sends its own request frames): ``(text, receipt time)``."""

    def __init__(self, channel: ServerChannel) -> None:
        self._send, self._receive = trio.open_memory_channel[tuple[str, float]](100_000)
        channel.unrouted = self._put
        self._note = channel._note
        self._closed = channel.closed

    def _put(self, frame: Any, text: bytes) -> None:
        self._note(frame, text)  # the channel's own bookkeeping (a runner's chat.end) first
        self._send.send_nowait((text.decode(errors="replace"), time.perf_counter()))

    async def recv(self) -> tuple[str, float]:
        """The next frame; ``trio.EndOfChannel`` once the channel is closed and every frame it
        read was taken."""
        while True:
            try:
                return self._receive.receive_nowait()
            except trio.WouldBlock:
                pass
            if self._closed.is_set():
                raise trio.EndOfChannel
            got: list[tuple[str, float]] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._take, got, nursery.cancel_scope)
                await self._closed.wait()
                nursery.cancel_scope.cancel()
            if got:
                return got[0]

    async def _take(self, into: list[tuple[str, float]], done: trio.CancelScope) -> None:
        into.append(await self._receive.receive())
        done.cancel()


_INBOXES: weakref.WeakKeyDictionary[ServerChannel, Inbox] = weakref.WeakKeyDictionary()


def inbox(channel: ServerChannel) -> Inbox:
    """The channel's inbox (made, and put in place, at the first call)."""
    found = _INBOXES.get(channel)
    if found is None:
        found = _INBOXES[channel] = Inbox(channel)
    return found


class RequestFrames:
    """One request's frames as a test playing the Server's part reads them (a ``Sink`` the
    channel routes to): ``(frame text, receipt time)`` on ``rx``, which ends after the request's
    last frame, or when the channel is lost."""

    def __init__(self, channel: ServerChannel, request_id: str) -> None:
        self._send, self.rx = trio.open_memory_channel[tuple[str, float]](100_000)
        self._job, self._rid = channel.job_id, request_id

    def _put(self, text: bytes) -> None:
        try:
            self._send.send_nowait((text.decode(errors="replace"), time.perf_counter()))
        except trio.ClosedResourceError:
            pass

    def chunk(self, chunk: Any, frame: bytes = b"") -> None:
        self._put(frame or protocol.encode_frame(protocol.ChunkFrame(self._job, self._rid, chunk)))

    def flush(self) -> None:
        pass

    def reply(self, frame: Any) -> None:
        self._put(protocol.encode_frame(frame))
        self._send.close()

    def lost(self) -> bool:
        self._send.close()
        return False

    def resume_count(self) -> int | None:
        return None  # a test's own request is never resumed

    def resumed(self) -> None:
        pass


def open_request(channel: ServerChannel, request_id: str) -> trio.MemoryReceiveChannel[Any]:
    """The frames of ``request_id`` (a request the test sends itself) as they are read, until
    its last frame or the channel's loss (then the iteration ends)."""
    frames = RequestFrames(channel, request_id)
    channel.open(request_id, frames)
    return frames.rx


async def send(channel: ServerChannel, frame: dict[str, Any] | str | bytes) -> None:
    """Send a test's frame on a hub channel: a dict as JSON text, a str as text, bytes as a
    binary message (which the hub itself never sends)."""
    if isinstance(frame, bytes):
        assert channel._ws is not None
        await channel._ws.send_message(OP_BINARY, frame)
        return
    data = json.dumps(frame, separators=(",", ":")) if isinstance(frame, dict) else frame
    await channel.send(data.encode())


async def hub_command(clock: trio.testing.MockClock, argv: list[str]) -> int:
    """``alp-gateway hub ARGV`` as another process on the same store runs it: its own trio run
    (in a thread), the test's virtual clock held still while it runs (no autojump meanwhile)."""
    threshold = clock.autojump_threshold
    clock.autojump_threshold = math.inf
    try:
        return await trio.to_thread.run_sync(hub_main, argv)
    finally:
        clock.autojump_threshold = threshold


async def open_chat(hub: Hub, within: float = 10) -> tuple[Any, ServerChannel]:
    """Queue a Kind B job and wait for the runner's channel (its inbox in place)."""
    job = await hub.board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], dict(CHAT_DEFINITION))
    channel = await hub.channels.wait(job.id, within)
    assert channel is not None, "the runner did not open the chat channel"
    inbox(channel)
    return job, channel


def request_frame(
    job_id: str, request_id: str, sim: dict[str, Any] | None = None, **body: Any
) -> dict[str, Any]:
    payload: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    payload.update(body)
    if sim is not None:
        payload["sim"] = sim
    return {
        "type": "chat.completion.request",
        "jobId": job_id,
        "requestId": request_id,
        "body": payload,
    }


_LAST_FRAMES = ("chat.completion.done", "chat.completion.error", "chat.models.response")


class Turns:
    """Reads a channel's inbox and sorts frames by requestId, with receive times."""

    def __init__(self, channel: ServerChannel) -> None:
        self.channel = channel
        self.inbox = inbox(channel)
        self.frames: dict[str, list[tuple[dict[str, Any], str, float]]] = {}
        self.other: list[dict[str, Any]] = []

    def finished(self, request_id: str) -> bool:
        """The turn has its last frame (done, error or a models answer), whatever it says."""
        return any(f["type"] in _LAST_FRAMES for f, _, _ in self.frames.get(request_id, []))

    async def settled(self, *request_ids: str, within: float = 15) -> None:
        """Wait for every turn's last frame, however it ended (the caller asserts the outcome)."""
        with trio.fail_after(within):
            while not all(self.finished(r) for r in request_ids):
                await self.next()

    async def until(
        self, *request_ids: str, within: float = 15, errors: Collection[str] = ()
    ) -> None:
        """Wait for every turn's last frame and assert how it ended: each turn in ``errors`` with
        an error frame, every other one done (or answered): a turn that errors has not finished."""
        await self.settled(*request_ids, within=within)
        for rid in request_ids:
            last = next(f for f in reversed(self.of(rid)) if f["type"] in _LAST_FRAMES)
            if rid in errors:
                assert last["type"] == "chat.completion.error", f"turn {rid} did not fail: {last}"
            else:
                assert last["type"] != "chat.completion.error", f"turn {rid} failed: {last}"

    async def next(self) -> dict[str, Any]:
        text, at = await self.inbox.recv()
        frame = json.loads(text)
        rid = frame.get("requestId")
        if rid is None:
            self.other.append(frame)
        else:
            self.frames.setdefault(rid, []).append((frame, text, at))
        return frame

    def of(self, request_id: str) -> list[dict[str, Any]]:
        return [f for f, _, _ in self.frames.get(request_id, [])]

    def chunks(self, request_id: str) -> list[dict[str, Any]]:
        return [f["chunk"] for f in self.of(request_id) if f["type"] == "chat.completion.chunk"]

    def last(self, request_id: str) -> dict[str, Any]:
        return self.of(request_id)[-1]


class LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


class RecordingProxy:
    """A loopback TCP proxy that keeps every byte each client connection sent (what the Server receives)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.connections: list[bytearray] = []
        self.port = 0

    def received(self) -> bytes:
        """All bytes the Server received, with WebSocket frames unmasked into their messages."""
        out = bytearray()
        for data in self.connections:
            head, sep, rest = bytes(data).partition(b"\r\n\r\n")
            if b"upgrade: websocket" not in head.lower():
                out += data
                continue
            out += head + sep
            ws = WSConnection(ConnectionType.SERVER)
            ws.receive_data(head + sep)
            for event in ws.events():
                if isinstance(event, Request):
                    ws.send(AcceptConnection())
            ws.receive_data(rest)
            for event in ws.events():
                if isinstance(event, TextMessage):
                    out += event.data.encode()
                elif isinstance(event, BytesMessage):
                    out += bytes(event.data)
        return bytes(out)

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        record = bytearray()
        self.connections.append(record)
        async with client:
            try:
                server = await trio.open_tcp_stream("127.0.0.1", self.target_port)
            except OSError:
                return
            async with server, trio.open_nursery() as nursery:

                async def pump(src: trio.SocketStream, dst: trio.SocketStream, keep: bool) -> None:
                    try:
                        while data := await src.receive_some(65536):
                            if keep:
                                record.extend(data)
                            await dst.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                    nursery.cancel_scope.cancel()

                nursery.start_soon(pump, client, server, True)
                nursery.start_soon(pump, server, client, False)


def quick_alp_requests(monkeypatch: Any, timeout: float) -> None:
    """Give the runners' ALP client a short request timeout (30 s in production), so a held or
    black-holed Server request times out quickly."""
    import gateway.runner.supervisor
    from gateway.runner.alp import AlpClient

    class QuickAlpClient(AlpClient):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["timeout"] = timeout
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gateway.runner.supervisor, "AlpClient", QuickAlpClient)


async def start_killable_sim(nursery: trio.Nursery, **kwargs: Any) -> tuple[Any, trio.CancelScope]:
    """A simulator the test can kill mid-test (cancel the returned scope): a backend that dies."""
    from gateway.sim import serve_sim

    scope = trio.CancelScope()

    async def serve(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await serve_sim(task_status=task_status, **kwargs)

    return await nursery.start(serve), scope


EXE = str(Path(sys.executable).with_name("alp-gateway"))  # the installed command


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any of the runner's own settings, plus ``extra``."""
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("AGENTICS_", "CHAT_LLM_", "ALP_"))
    }
    base.update(extra)
    return base


def runner_env(server: str, backend: str, **extra: str) -> dict[str, str]:
    """The environment of an ``alp-gateway run`` subprocess on ``server`` and ``backend``: the
    reference Runner's names, the test credentials and model, plus ``extra``."""
    return clean_env(
        AGENTICS_SERVER=server,
        CHAT_LLM_BACKEND_URL=backend,
        CHAT_LLM_BACKEND_KEY=BACKEND_KEY,
        CHAT_LLM_MODEL="sim-model",
        AGENTICS_USER_TOKEN=ADMIN,
        **extra,
    )
