"""A small protocol-following Kind B runner that answers chat turns with scripted chunk frames (tests only)."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio
import trio_websocket

from gateway.wire import protocol

CONTENT_MODEL = "fake-model"


@dataclass
class Script:
    """How the fake runner answers one ``chat.completion.request``."""

    chunks: int = 3  # content chunks ("tok0", "tok1", ...)
    pace: float = 0.0  # seconds between chunks (behaviour, not synchronisation)
    tool_calls: bool = False  # answer with one streamed tool call instead of text
    usage: bool | None = None  # None: when body.stream_options.include_usage
    error_before: str | None = None  # chat.completion.error before any chunk
    error_after: str | None = None  # chat.completion.error after the first chunk
    gate: trio.Event | None = None  # wait for this before the first chunk
    stream_anyway: bool = False  # chunk frames even when the body says stream: false
    text: str = "tok"
    # a hostile runner's own frames instead of the above: called with a ``send`` of one text
    # message and the turn (chunk frames, done, error, however many and however large)
    play: Callable[[Callable[[str], Awaitable[None]], Turn], Awaitable[None]] | None = None


SLOW = Script(chunks=100_000, pace=0.01)
TOOL_ARGUMENTS = ['{"city"', ': "Par', 'is", "unit"', ': "c"}']


@dataclass
class Turn:
    """One request the fake runner received, and what became of it."""

    job_id: str
    request_id: str
    body: dict[str, Any]
    started: trio.Event = field(default_factory=trio.Event)
    cancelled: trio.Event = field(default_factory=trio.Event)
    finished: trio.Event = field(default_factory=trio.Event)
    sent_chunks: int = 0


class FakeRunner:
    """Registers with the hub, polls, claims chat-llm:v1 jobs, dials their channels, answers turns.

    ``scripts`` maps a request's ``model`` to a ``Script``; other models get ``default``.
    Everything observed is recorded; ``wait_until(predicate)`` waits on state changes.
    """

    def __init__(
        self,
        server: str,
        admin_token: str,
        *,
        owner: str = "local",
        project: str = "chat",
        scripts: dict[str, Script] | None = None,
        default: Script | None = None,
        models: tuple[str, ...] | None = None,
        poll_interval: float = 0.02,
        name: str = "fake-runner",
        redials: int = 3,
        poll_until_claimed: bool = False,
        lists_models: bool = True,
        push: bool = False,
    ) -> None:
        self.server = server.rstrip("/")
        self.admin_token = admin_token
        self.base = f"{self.server}/api/owners/{owner}/projects/{project}"
        self.scripts = scripts or {}
        self.default = default or Script()
        # what it lists when asked: by default every model it has a script for
        self.models = list(models) if models is not None else [CONTENT_MODEL, *self.scripts]
        self.poll_interval = poll_interval
        self.name = name
        self.redials = redials
        self.poll_until_claimed = poll_until_claimed  # no poll once it holds a job
        self.lists_models = lists_models  # False: models requests go unanswered
        self.push = push  # keep the push stream open: poll at each job_available too
        self.claims = True  # False: offered jobs are left (a runner that hangs before its claim)
        self.runner_id: str | None = None
        self.token: str | None = None
        # observations
        self.claimed: list[str] = []
        self.turns: dict[str, Turn] = {}
        self.cancels: list[str] = []
        self.ends: list[tuple[str, str | None]] = []
        self.models_requests = 0
        self.dials: dict[str, int] = {}
        self.reports: dict[str, list[dict[str, Any]]] = {}
        self.polls = 0
        self.pushes = 0  # job_available events received
        self.offers = 0  # jobs its polls offered
        self.lost_claims = 0  # claims refused (another runner had it)
        self._pushed = trio.Event()
        self._change = trio.Event()
        self._sockets: dict[str, trio_websocket.WebSocketConnection] = {}
        self._closing: set[str] = set()

    # -- observation ----------------------------------------------------------

    def _changed(self) -> None:
        self._change.set()
        self._change = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds (re-checked at every recorded change)."""
        while not predicate():
            await self._change.wait()

    def turns_of(self, job_id: str) -> list[Turn]:
        return [t for t in self.turns.values() if t.job_id == job_id]

    # -- runner-side actions -----------------------------------------------------

    async def end_session(self, job_id: str, reason: str = "runner shutdown") -> None:
        """The runner ends a session: chat.end on the channel, close it, final report."""
        self._closing.add(job_id)
        ws = self._sockets.get(job_id)
        if ws is not None:
            try:
                await ws.send_message(protocol.end_frame(job_id, reason))
            finally:
                await ws.aclose()

    async def drop_channel(self, job_id: str) -> None:
        """Drop the channel abnormally; the session redials it."""
        ws = self._sockets.get(job_id)
        if ws is not None:
            await ws.aclose(code=1011, reason="dropped by test")

    # -- the runner ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with httpx.AsyncClient(timeout=10.0) as http, trio.open_nursery() as nursery:
            reply = await http.post(
                f"{self.base}/runners",
                json={"name": self.name, "labels": ["self-hosted", "linux"]},
                headers={"Authorization": f"Bearer {self.admin_token}"},
            )
            reply.raise_for_status()
            registration = reply.json()
            self.runner_id, self.token = registration["id"], registration["token"]
            auth = {"Authorization": f"Bearer {self.token}"}
            if self.push:
                await nursery.start(self._events, http, auth)
            task_status.started()
            while True:
                self.polls += 1
                try:
                    reply = await http.post(
                        f"{self.base}/runners/jobs",
                        json={"capabilities": [protocol.CAPABILITY]},
                        headers=auth,
                    )
                except httpx.RemoteProtocolError:  # a kept-alive connection the hub closed idle
                    continue
                jobs: list[dict[str, Any]] = []
                if reply.status_code == 200 and reply.content:
                    jobs = (reply.json() or {}).get("jobs") or []
                for job in jobs:
                    if job["id"] in self.claimed or not _is_chat_job(job):
                        continue
                    self.offers += 1
                    if not self.claims:
                        continue
                    claim = await http.post(
                        f"{self.base}/runners/generate-jitconfig",
                        json={"jobId": job["id"], "name": self.name},
                        headers=auth,
                    )
                    if not claim.is_success:
                        self.lost_claims += 1
                        continue
                    run_id = claim.json()["runId"]
                    self.claimed.append(job["id"])
                    self._changed()
                    nursery.start_soon(self._session, http, auth, job["id"], run_id)
                if self.poll_until_claimed and self.claimed:
                    await trio.sleep_forever()
                with trio.move_on_after(self.poll_interval):
                    await self._pushed.wait()
                self._pushed = trio.Event()

    async def _events(
        self,
        http: httpx.AsyncClient,
        auth: dict[str, str],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The push stream: a poll at once on each ``job_available``."""
        url = f"{self.base}/runners/events"
        async with http.stream("GET", url, headers=auth, timeout=None) as resp:
            task_status.started()
            async for line in resp.aiter_lines():
                if line.startswith("event: job_available"):
                    self.pushes += 1
                    self._pushed.set()
                    self._changed()

    async def _report(
        self,
        http: httpx.AsyncClient,
        auth: dict[str, str],
        run_id: str,
        job_id: str,
        body: dict[str, Any],
    ) -> None:
        await http.patch(f"{self.base}/runs/{run_id}/jobs/{job_id}", json=body, headers=auth)
        self.reports.setdefault(job_id, []).append(body)
        self._changed()

    async def _session(
        self, http: httpx.AsyncClient, auth: dict[str, str], job_id: str, run_id: str
    ) -> None:
        await self._report(http, auth, run_id, job_id, {"status": "in_progress"})
        authority = urllib.parse.urlsplit(self.server).netloc
        query = urllib.parse.urlencode({"jobId": job_id, "token": self.token})
        url = f"ws://{authority}/api/lives/chat/channel/ws?{query}"
        reason = "success"
        for _attempt in range(1 + self.redials):
            self.dials[job_id] = self.dials.get(job_id, 0) + 1
            self._changed()
            try:
                async with trio_websocket.open_websocket_url(url) as ws:
                    self._sockets[job_id] = ws
                    ended = await self._serve_channel(ws, job_id)
            except (trio_websocket.ConnectionClosed, trio_websocket.HandshakeError, OSError):
                ended = False
            finally:
                self._sockets.pop(job_id, None)
            if ended or job_id in self._closing:
                break
        else:
            reason = "failure"
        await self._report(
            http,
            auth,
            run_id,
            job_id,
            {
                "status": "completed",
                "conclusion": reason,
                "logs": "fake runner",
                "completionReason": reason,
            },
        )

    async def _serve_channel(self, ws: trio_websocket.WebSocketConnection, job_id: str) -> bool:
        """Serve one connection; True when the session ended (chat.end), False when it dropped."""
        scopes: dict[str, trio.CancelScope] = {}
        async with trio.open_nursery() as nursery:
            try:
                while True:
                    message = await ws.get_message()
                    try:
                        frame = json.loads(message)
                    except ValueError:
                        continue
                    kind = frame.get("type")
                    if kind == protocol.COMPLETION_REQUEST:
                        turn = Turn(job_id, frame["requestId"], frame["body"])
                        self.turns[turn.request_id] = turn
                        self._changed()
                        scope = scopes[turn.request_id] = trio.CancelScope()
                        nursery.start_soon(self._turn, ws, turn, scope)
                    elif kind == protocol.COMPLETION_CANCEL:
                        self.cancels.append(frame["requestId"])
                        turn = self.turns.get(frame["requestId"])
                        if turn is not None:
                            turn.cancelled.set()
                        scope = scopes.pop(frame["requestId"], None)
                        if scope is not None:
                            scope.cancel()
                        self._changed()
                    elif kind == protocol.MODELS_REQUEST:
                        self.models_requests += 1
                        self._changed()
                        if not self.lists_models:
                            continue
                        await ws.send_message(
                            protocol.models_frame(job_id, frame["requestId"], self.models)
                        )
                    elif kind == protocol.END:
                        self.ends.append((job_id, frame.get("reason")))
                        self._closing.add(job_id)
                        self._changed()
                        await ws.aclose()
                        nursery.cancel_scope.cancel()
                        return True
            except trio_websocket.ConnectionClosed:
                nursery.cancel_scope.cancel()
                return job_id in self._closing
        return True

    async def _turn(
        self, ws: trio_websocket.WebSocketConnection, turn: Turn, scope: trio.CancelScope
    ) -> None:
        body = turn.body
        script = self.scripts.get(body.get("model"), self.default)
        frames = protocol.TurnFrames(turn.job_id, turn.request_id)

        async def chunk(obj: dict[str, Any]) -> None:
            await ws.send_message(frames.chunk(json.dumps(obj).encode()).decode())
            turn.sent_chunks += 1
            self._changed()

        try:
            with scope:
                turn.started.set()
                self._changed()
                if script.gate is not None:
                    await script.gate.wait()
                if script.play is not None:
                    await script.play(ws.send_message, turn)
                    return
                if script.error_before is not None:
                    await ws.send_message(
                        protocol.error_frame(turn.job_id, turn.request_id, script.error_before)
                    )
                    return
                if not body.get("stream") and not script.stream_anyway:
                    await chunk(completion(body, script))
                    await ws.send_message(protocol.done_frame(turn.job_id, turn.request_id))
                    return
                for c in stream_chunks(body, script):
                    await chunk(c)
                    if script.error_after is not None:
                        await ws.send_message(
                            protocol.error_frame(turn.job_id, turn.request_id, script.error_after)
                        )
                        return
                    if script.pace:
                        await trio.sleep(script.pace)
                await ws.send_message(protocol.done_frame(turn.job_id, turn.request_id))
            if scope.cancelled_caught:
                with trio.move_on_after(2) as shield:
                    shield.shield = True
                    await ws.send_message(
                        protocol.error_frame(turn.job_id, turn.request_id, protocol.CANCELLED)
                    )
        except trio_websocket.ConnectionClosed:
            pass
        finally:
            turn.finished.set()
            self._changed()


def _is_chat_job(job: dict[str, Any]) -> bool:
    definition = job.get("agentDefinition") or {}
    return (
        definition.get("jobType") == "chat_llm"
        or protocol.CAPABILITY in (job.get("needs") or [])
        or protocol.CAPABILITY in (definition.get("needs") or [])
    )


def _base(body: dict[str, Any], kind: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": kind,
        "created": 1700000000,
        "model": body.get("model") or CONTENT_MODEL,
    }


def _chunk(
    body: dict[str, Any], delta: dict[str, Any], finish: str | None = None
) -> dict[str, Any]:
    return {
        **_base(body, "chat.completion.chunk"),
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def stream_chunks(body: dict[str, Any], script: Script) -> Iterator[dict[str, Any]]:
    """The chunk objects of one streamed answer, as an OpenAI backend would send them."""
    if script.tool_calls:
        yield _chunk(
            body,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_fake1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ],
            },
        )
        for piece in TOOL_ARGUMENTS:
            yield _chunk(body, {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        yield _chunk(body, {}, "tool_calls")
    else:
        pieces = [f"{script.text}{i}" for i in range(script.chunks)]
        # a trailing assistant message (a continuation) is continued, as llama.cpp does: the
        # pieces it already holds are not sent again
        messages = body.get("messages") or [{}]
        so_far = messages[-1].get("content") if messages[-1].get("role") == "assistant" else None
        if isinstance(so_far, str) and "".join(pieces).startswith(so_far):
            while pieces and so_far.startswith(pieces[0]):
                so_far = so_far[len(pieces[0]) :]
                pieces.pop(0)
        for n, piece in enumerate(pieces):
            delta: dict[str, Any] = {"content": piece}
            if n == 0:
                delta["role"] = "assistant"
            yield _chunk(body, delta)
        yield _chunk(body, {}, "stop")
    usage = script.usage
    if usage is None:
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
    if usage:
        yield {**_base(body, "chat.completion.chunk"), "choices": [], "usage": USAGE}


def completion(body: dict[str, Any], script: Script) -> dict[str, Any]:
    """The whole ``chat.completion`` of a non-streamed answer."""
    text = "".join(f"{script.text}{i}" for i in range(script.chunks))
    return {
        **_base(body, "chat.completion"),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
    }
