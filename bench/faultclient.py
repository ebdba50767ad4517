"""The fault bench's client: one streamed turn in one of the hub's three APIs, its SSE read by hand.

A turn is one HTTP/1.1 request on a fresh loopback connection (``connection: close``), its
response head and chunked body decoded here, every SSE event kept with the time it was read (the
read that brought it), so that nothing a client library might smooth over (a keepalive, a second
role delta, an error event after text) goes unseen. What the client saw is an :class:`Answer`:
its text (the API's text deltas joined), its errors, whether it is one answer in the API's shape,
and the longest pause between two content deltas.

The text per API: chat completions ``choices[].delta.content``; Anthropic Messages
``content_block_delta``'s ``delta.text``; the Responses API ``response.output_text.delta``'s
``delta`` (and its ``response.completed`` must hold the same text).
"""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

APIS = ("chat", "messages", "responses")
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
ENDS = {"chat": "[DONE]", "messages": "message_stop", "responses": "response.completed"}
ERROR_TYPES = ("error", "response.failed", "response.incomplete")


def body(api: str, say: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": say}]
    if api == "chat":
        return {"model": "sim-model", "messages": messages, "stream": True}
    if api == "messages":
        return {"model": "sim-model", "max_tokens": 4096, "messages": messages, "stream": True}
    return {"model": "sim-model", "input": say, "stream": True}


@dataclass
class Answer:
    """One streamed turn as its client saw it."""

    api: str
    sent: float = 0.0  # time.perf_counter() when the request went
    status: int = 0
    events: list[tuple[float, str, Any]] = field(default_factory=list)  # (read at, name, data)
    deltas: list[tuple[float, str]] = field(default_factory=list)  # content deltas (read at, text)
    keepalives: int = 0  # SSE comments, and Anthropic's ping events
    ended: bool = False  # the API's last event came
    error: str | None = None  # what went wrong below the events (status, connection, deadline)

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.deltas)

    @property
    def error_events(self) -> list[Any]:
        out = []
        for _, _, d in self.events:
            if not isinstance(d, dict):
                continue
            if "error" in d or d.get("type") in ERROR_TYPES:
                out.append(d)
        return out

    @property
    def failed(self) -> str | None:
        """What the client saw go wrong (None: a whole answer, no error)."""
        if self.error:
            return self.error
        errors = self.error_events
        if errors:
            e = errors[0].get("error") or errors[0].get("response", {}).get("error") or errors[0]
            code = e.get("code") or e.get("type") if isinstance(e, dict) else e
            return f"error event: {code}"
        if not self.ended:
            return "no end event"
        return None

    @property
    def ttft(self) -> float | None:
        return self.deltas[0][0] - self.sent if self.deltas else None

    @property
    def gap(self) -> float | None:
        """The longest pause between two content deltas (s)."""
        if len(self.deltas) < 2:
            return None
        return max(b[0] - a[0] for a, b in zip(self.deltas, self.deltas[1:], strict=False))

    def shape(self) -> str | None:
        """None when the events make one answer in the API's shape; else what is wrong."""
        # Anthropic's ``ping`` is its keepalive (the hub's, while a turn waits): anywhere
        data = [d for _, _, d in self.events if isinstance(d, dict) and d.get("type") != "ping"]
        if self.api == "chat":
            ids = {d.get("id") for d in data}
            choices = [c for d in data for c in d.get("choices") or []]
            roles = sum("role" in (c.get("delta") or {}) for c in choices)
            finishes = sum(c.get("finish_reason") is not None for c in choices)
            if len(ids) != 1 or roles != 1 or finishes != 1:
                return f"{len(ids)} ids, {roles} role deltas, {finishes} finishes"
            return None
        kinds = [d.get("type") for d in data]
        if self.api == "messages":
            if kinds.count("message_start") != 1 or kinds.count("message_stop") != 1:
                return f"{kinds.count('message_start')} starts, {kinds.count('message_stop')} stops"
            if kinds[0] != "message_start" or kinds[-1] != "message_stop":
                return "message_start/stop not first/last"
            starts = [d["index"] for d in data if d.get("type") == "content_block_start"]
            if starts != list(range(len(starts))):
                return f"block indices {starts}"
            return None
        if kinds.count("response.created") != 1 or kinds.count("response.completed") != 1:
            return f"{kinds.count('response.created')} created, {kinds.count('response.completed')} completed"
        added = [d["output_index"] for d in data if d.get("type") == "response.output_item.added"]
        if added != list(range(len(added))):
            return f"output indices {added}"
        items = {d.get("item_id") for d in data if d.get("type") == "response.output_text.delta"}
        if len(items) != 1:
            return f"{len(items)} text items"
        done = next(d for d in data if d.get("type") == "response.completed")
        whole = "".join(
            part.get("text", "")
            for item in done["response"].get("output") or []
            for part in item.get("content") or []
        )
        if whole != self.text:
            return "response.completed's text is not the deltas'"
        return None

    def _event(self, at: float, name: str, raw: str) -> int:
        """Take one event; returns how many content deltas it held."""
        if raw == "[DONE]":
            self.events.append((at, name, raw))
            self.ended = self.api == "chat"
            return 0
        try:
            data = json.loads(raw)
        except ValueError:
            self.events.append((at, name, raw))
            return 0
        self.events.append((at, name, data))
        if not isinstance(data, dict):
            return 0
        kind = data.get("type")
        texts: list[str] = []
        if self.api == "chat":
            for choice in data.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    texts.append(content)
        elif self.api == "messages":
            self.keepalives += kind == "ping"
            if kind == "content_block_delta" and data["delta"].get("text"):
                texts.append(data["delta"]["text"])
            self.ended = self.ended or kind == "message_stop"
        else:
            if kind == "response.output_text.delta" and data.get("delta"):
                texts.append(data["delta"])
            self.ended = self.ended or kind == "response.completed"
        for text in texts:
            self.deltas.append((at, text))
        return len(texts)


class _Dechunk:
    """HTTP/1.1 chunked transfer coding, decoded as it comes."""

    def __init__(self) -> None:
        self.buf = b""
        self.size: int | None = None
        self.done = False

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        out = []
        while not self.done:
            if self.size is None:
                at = self.buf.find(b"\r\n")
                if at < 0:
                    break
                self.size = int(self.buf[:at].split(b";")[0], 16)
                self.buf = self.buf[at + 2 :]
                if self.size == 0:
                    self.done = True
                    break
            if len(self.buf) < self.size + 2:
                break
            out.append(self.buf[: self.size])
            self.buf = self.buf[self.size + 2 :]
            self.size = None
        return b"".join(out)


async def turn(
    port: int,
    key: str,
    api: str,
    session: str,
    say: str,
    within: float,
    on_delta: Callable[[int], None] | None = None,
    extra: dict[str, Any] | None = None,
) -> Answer:
    """One streamed turn to ``127.0.0.1:port`` (``extra``: more fields of its body);
    ``on_delta(n)`` after the n-th content delta is read. Never longer than ``within`` s."""
    answer = Answer(api)
    payload = json.dumps({**body(api, say), **(extra or {})}).encode()
    head = (
        f"POST {PATHS[api]} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        "content-type: application/json\r\naccept: text/event-stream\r\n"
        f"authorization: Bearer {key}\r\nx-chat-session: {session}\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    ).encode()
    with trio.move_on_after(within) as scope:
        try:
            await _exchange(port, head + payload, answer, on_delta)
        except OSError as exc:
            answer.error = answer.error or f"connection: {type(exc).__name__}"
        except trio.BrokenResourceError:
            answer.error = answer.error or "connection broken"
    if scope.cancelled_caught:
        answer.error = answer.error or f"no end within {within:g} s"
    return answer


async def _exchange(
    port: int, request: bytes, answer: Answer, on_delta: Callable[[int], None] | None
) -> None:
    sock = trio.socket.socket()
    sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
    with sock:
        await sock.connect(("127.0.0.1", port))
        answer.sent = time.perf_counter()
        view = memoryview(request)
        while view:
            view = view[await sock.send(view) :]
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = await sock.recv(65536)
            if not data:
                answer.error = "closed before the response head"
                return
            buf += data
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        answer.status = int(lines[0].split(" ", 2)[1])
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])
        }
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        dechunk = _Dechunk()
        if answer.status != 200:
            whole = rest
            while True:  # the whole (short) error body, to say what it was
                data = await sock.recv(65536)
                if not data:
                    break
                whole += data
            raw = dechunk.feed(whole) if chunked else whole
            answer.error = f"HTTP {answer.status}: {raw[:200].decode(errors='replace')}"
            return
        decode = codecs.getincrementaldecoder("utf-8")().decode
        text = ""
        n = 0
        data = rest
        at = time.perf_counter()
        while True:
            text += decode(dechunk.feed(data) if chunked else data)
            while "\n\n" in text:
                event, text = text.split("\n\n", 1)
                name, parts = "", []
                for line in event.split("\n"):
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        parts.append(line[5:].removeprefix(" "))
                if not parts:
                    answer.keepalives += 1
                    continue
                got = answer._event(at, name, "\n".join(parts))
                if got and on_delta is not None:
                    for _ in range(got):
                        n += 1
                        on_delta(n)
            if answer.ended or dechunk.done:
                return
            data = await sock.recv(65536)
            at = time.perf_counter()
            if not data:
                if not answer.ended:
                    answer.error = "closed mid-stream"
                return
