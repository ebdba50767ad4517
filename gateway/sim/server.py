"""Serve a simulated OpenAI-compatible model server (its HTTP from ``gateway.wire.server``)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import logging
import math
import random
import string
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
import trio

from gateway.wire.errors import ClientGone, HTTPError, error_envelope
from gateway.wire.http import Request
from gateway.wire.server import ConnectionLimits, Server

__all__ = [
    "DIALECTS",
    "EMBEDDING_DIMENSIONS",
    "FAULTS",
    "WORDS",
    "RecordedRequest",
    "SimOptions",
    "Simulator",
    "StreamRecord",
    "embedding_of",
    "open_sim",
    "serve_sim",
    "token_text",
]

logger = logging.getLogger(__name__)

FAULTS: frozenset[str] = frozenset({"500", "stall", "disconnect", "malformed"})
"""The fault names ``SimOptions.fault`` accepts."""

DIALECTS: frozenset[str] = frozenset({"openai", "ollama", "vllm", "llamacpp", "litellm"})
"""The streaming shapes ``SimOptions.dialect`` can imitate (see ``_Reply`` for their sources)."""

WORDS: frozenset[str] = frozenset({"tok", "conversation"})
"""What ``SimOptions.words`` accepts: ``tok<i>`` tokens, or words drawn from the conversation."""

_VOCABULARY = (
    "the a of and to in is it that for on with as was at by be this from or an are not but "
    "model token answer stream chunk runner channel hub backend session turn frame resume "
    "continue fault path socket keep bound window hello server client reply words same again"
).split()

_MAX_BODY = 64 * 1024 * 1024  # bytes: a larger request body is refused (413)
# no deadline (a test may hold a connection idle as long as it likes), no connection cap
_LIMITS = ConnectionLimits(head_timeout=math.inf, body_timeout=math.inf, max_connections=1 << 30)
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
_perf_counter = time.perf_counter

_CHAT_PATH = "/v1/chat/completions"
_MODELS_PATH = "/v1/models"
_EMBEDDINGS_PATH = "/v1/embeddings"
EMBEDDING_DIMENSIONS = 8  # the length of each vector the simulator embeds
_DONE = b"[DONE]"
_MALFORMED = b"{not json"
_CHUNK_HEAD = b'{"id":%b,"object":"chat.completion.chunk","created":%d,"model":%b,"choices":'
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

# Outcomes of a guarded response.
_COMPLETED = "completed"
_GONE = "gone"
_ABORT = "abort"


def token_text(i: int, chunk_size: int = 0) -> str:
    """The content of token ``i``: ``"tok<i> "``, padded with dots to ``chunk_size`` characters."""
    text = f"tok{i} "
    if chunk_size > len(text):
        text += "." * (chunk_size - len(text))
    return text


def embedding_of(text: str) -> list[float]:
    """The simulator's vector for ``text``: ``EMBEDDING_DIMENSIONS`` numbers in [-1, 1) drawn
    from its SHA-256, the same every time."""
    digest = hashlib.sha256(text.encode()).digest()
    return [
        round(int.from_bytes(digest[2 * i : 2 * i + 2], "big") / 32768 - 1, 6)
        for i in range(EMBEDDING_DIMENSIONS)
    ]


@dataclass(slots=True)
class SimOptions:
    """How the simulator answers a chat completion; every field can be overridden per request.

    ``chunks`` content chunks (or tool-call argument fragments) are streamed, each token
    padded to ``chunk_size`` characters (see ``token_text``); ``ttft`` seconds pass before
    the first event and ``interval`` seconds before every later one (``[DONE]`` included).
    A non-streamed reply waits ``ttft + interval * chunks``. ``fault`` is one of ``FAULTS``;
    stream faults fire after ``fault_after`` events (at the latest just before ``[DONE]``).
    ``dialect`` picks whose chunk shape to imitate: one of ``DIALECTS``. ``words``: ``"tok"``
    (``tok0 tok1 …``, whatever the conversation) or ``"conversation"`` (words drawn from a hash
    of the messages, so each conversation has its own answer, always the same).

    A request whose messages end with an assistant message is continued from there, as llama.cpp
    or Ollama continue a prefill: when that message is a prefix of the conversation's answer,
    only the rest is sent, so the answer so far plus the continuation is the answer a request
    without it gets (streamed or not); otherwise the whole answer follows it.
    """

    chunks: int = 8
    interval: float = 0.0
    ttft: float = 0.0
    tool_calls: bool = False
    usage: bool = False
    fault: str | None = None
    fault_after: int = 2
    chunk_size: int = 0
    dialect: str = "openai"
    words: str = "tok"

    def __post_init__(self) -> None:
        for name in ("chunks", "fault_after", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"sim option {name!r} must be a non-negative integer")
        for name in ("interval", "ttft"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"sim option {name!r} must be a non-negative number")
            setattr(self, name, float(value))
        for name in ("tool_calls", "usage"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"sim option {name!r} must be a boolean")
        if isinstance(self.fault, int) and not isinstance(self.fault, bool):
            self.fault = str(self.fault)
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"sim option 'fault' must be null or one of {sorted(FAULTS)}")
        if self.dialect not in DIALECTS:
            raise ValueError(f"sim option 'dialect' must be one of {sorted(DIALECTS)}")
        if self.words not in WORDS:
            raise ValueError(f"sim option 'words' must be one of {sorted(WORDS)}")

    def override(self, overrides: Mapping[str, Any]) -> SimOptions:
        """A copy with ``overrides`` applied; ``ValueError`` on unknown names or bad values."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown sim option(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **overrides)


@dataclass(slots=True, eq=False)
class RecordedRequest:
    """One HTTP request as the simulator received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass(slots=True, eq=False)
class StreamRecord:
    """What happened to one ``/v1/chat/completions`` request, streamed or not.

    ``payloads`` holds each SSE ``data:`` payload exactly as written (``[DONE]`` and a
    malformed line included) or, for a non-streamed reply, the one response body;
    ``sent_at[i]`` is ``time.perf_counter()`` right after ``payloads[i]`` was sent.

    Each send is recorded before the simulator yields to other tasks, so a client in the
    same trio run never sees bytes (the final ones included, with ``completed`` and
    ``finished``) that the record does not show yet, unless a write had to wait for room in
    the socket buffer. Every request to the chat path gets a record, errors included
    (``status`` 401/400/404/500, the error body in ``payloads``).
    """

    body: bytes
    request: RecordedRequest | None = field(default=None, repr=False)
    payloads: list[bytes] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)
    finished: trio.Event = field(default_factory=trio.Event)
    client_closed: bool = False
    completed: bool = False
    status: int = 0
    stream: bool = False
    model: str | None = None
    options: SimOptions | None = None
    id: str = ""
    _waiters: list[tuple[int, trio.Event]] = field(default_factory=list, repr=False)

    async def wait_sent(self, n: int) -> bool:
        """Wait until ``n`` payloads were sent or the stream ended; True if ``n`` were sent."""
        if len(self.sent_at) < n and not self.finished.is_set():
            event = trio.Event()
            self._waiters.append((n, event))
            await event.wait()
        return len(self.sent_at) >= n

    def _wake(self) -> None:
        sent = len(self.sent_at)
        keep = []
        for n, event in self._waiters:
            if n <= sent:
                event.set()
            else:
                keep.append((n, event))
        self._waiters = keep

    def _finish(self) -> None:
        for _, event in self._waiters:
            event.set()
        self._waiters = []
        self.finished.set()


class Simulator:
    """A running simulator: its address, its model list, and what it has received and sent."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        options: SimOptions,
        models: list[str],
        require_key: str | None,
        record: bool,
        context: int | None = None,
    ) -> None:
        self.host = host
        self.port = port
        url_host = f"[{host}]" if ":" in host else host
        self.url = f"http://{url_host}:{port}/v1"
        self.options = options
        self.models = models
        self.require_key = require_key
        self.record = record
        # each model's context length, said where the imitated server says it (None: not said):
        # /v1/models' max_model_len (vLLM; the default dialect too), llama.cpp's /props n_ctx,
        # Ollama's /api/show num_ctx
        self.context = context
        self.requests: list[RecordedRequest] = []
        self.streams: list[StreamRecord] = []
        self.connections = 0  # connections that sent a request
        self._seen: weakref.WeakSet[Any] = weakref.WeakSet()  # the open ones among them
        self._changed = trio.Event()
        self._ids = itertools.count(1)

    def __repr__(self) -> str:
        return f"<Simulator {self.url} models={self.models!r}>"

    async def wait_for_streams(self, n: int = 1) -> StreamRecord:
        """Wait until at least ``n`` chat completions were received; return the ``n``-th."""
        while len(self.streams) < n:
            await self._changed.wait()
        return self.streams[n - 1]

    async def wait_for_requests(self, n: int = 1) -> RecordedRequest:
        """Wait until at least ``n`` requests were received; return the ``n``-th."""
        while len(self.requests) < n:
            await self._changed.wait()
        return self.requests[n - 1]

    def clear(self) -> None:
        """Forget the recorded requests and streams (the counts restart from zero)."""
        self.requests.clear()
        self.streams.clear()

    def _notify(self) -> None:
        event = self._changed
        self._changed = trio.Event()
        event.set()

    async def http(self, req: Request) -> None:
        """One request from the server core (``gateway.wire.server``): answered in turn."""
        conn = req.connection
        if conn not in self._seen:
            self._seen.add(conn)
            self.connections += 1
        await _Exchange(self, req).run()


def request_limits(data: Mapping[str, Any]) -> tuple[int, int | None]:
    """The request's ``n`` (choices; default 1) and ``max_tokens`` (or
    ``max_completion_tokens``; default none); ``ValueError`` naming the field when one is not a
    positive integer (the simulator answers 400, as OpenAI does)."""
    values: dict[str, int | None] = {}
    for name, default in (("n", 1), ("max_tokens", None), ("max_completion_tokens", None)):
        value = data.get(name)
        if value is None:
            values[name] = default
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            values[name] = value
        else:
            raise ValueError(f"{name}: {value!r} is not a positive integer")
    n = values["n"] or 1
    max_tokens = values["max_tokens"]
    return n, max_tokens if max_tokens is not None else values["max_completion_tokens"]


def _prompt_tokens(data: Mapping[str, Any]) -> int:
    messages = data.get("messages")
    count = 0
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                count += len(message["content"].split())
    return count


def _prefill(data: Mapping[str, Any]) -> tuple[list[Any], str | None]:
    """The conversation (the messages before a trailing assistant message) and that message's
    text (None when the messages do not end with an assistant message with text)."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return [], None
    last = messages[-1] if messages else None
    if isinstance(last, dict) and last.get("role") == "assistant":
        content = last.get("content")
        if isinstance(content, str):
            return messages[:-1], content
    return messages, None


def _words(opts: SimOptions, conversation: list[Any]) -> list[str]:
    """The whole answer's tokens (``opts.chunks`` of them, before ``max_tokens``)."""
    size = opts.chunk_size
    if opts.words == "tok":
        return [token_text(i, size) for i in range(opts.chunks)]
    digest = hashlib.blake2b(_encode(conversation), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "big"))
    words = [rng.choice(_VOCABULARY) + " " for _ in range(opts.chunks)]
    return [w + "." * (size - len(w)) if size > len(w) else w for w in words]


def _rest(words: list[str], so_far: str) -> list[str]:
    """The tokens that continue ``so_far`` into the answer ``words`` (the end of a token cut in
    the middle first); the whole answer when ``so_far`` is not a prefix of it."""
    whole = "".join(words)
    if not whole.startswith(so_far):
        return words
    done = len(so_far)
    at = 0
    for i, word in enumerate(words):
        if at + len(word) > done:
            return [word[done - at :], *words[i + 1 :]]
        at += len(word)
    return []


def _tool_name(data: Mapping[str, Any]) -> str:
    tools = data.get("tools")
    if isinstance(tools, list) and tools and isinstance(tools[0], dict):
        function = tools[0].get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    return "sim_tool"


def _tool_fragments(chunks: int) -> list[str]:
    """Argument fragments whose concatenation is ``{"seq":"tok0 tok1 ... "}``."""
    if chunks == 0:
        return []
    frags = [token_text(i) for i in range(chunks)]
    frags[0] = '{"seq":"' + frags[0]
    frags[-1] += '"}'
    return frags


class _Reply:
    """The per-request constants a reply is built from, with pre-encoded chunk templates."""

    __slots__ = (
        "id",
        "created",
        "model",
        "opts",
        "data",
        "include_usage",
        "head",
        "n",
        "count",
        "stop_reason",
        "pieces",
    )

    def __init__(self, sim: Simulator, model: str, opts: SimOptions, data: dict[str, Any]) -> None:
        # the request's own n and max_tokens (checked by request_limits): ``n`` choices, each
        # of ``count`` tokens, cut at max_tokens with finish_reason "length" as a server does
        self.n, max_tokens = request_limits(data)
        # the tokens, when not the plain tok0 tok1 … of the fast path (None): other words, or
        # the rest of an answer whose beginning the request ends with
        self.pieces: list[str] | None = None
        full = opts.chunks
        conversation, so_far = _prefill(data)
        if so_far is not None or opts.words != "tok":
            words = _words(opts, conversation)
            self.pieces = words if so_far is None else _rest(words, so_far)
            full = len(self.pieces)
        self.count = full if max_tokens is None else min(full, max_tokens)
        self.stop_reason = "length" if self.count < full else "stop"
        if self.pieces is not None:
            del self.pieces[self.count :]
        number = next(sim._ids)
        self.id = _dialect_id(opts.dialect, number)
        self.created = int(time.time())
        self.model = model
        self.opts = opts
        self.data = data
        stream_options = data.get("stream_options")
        self.include_usage = opts.usage or (
            isinstance(stream_options, dict) and stream_options.get("include_usage") is True
        )
        self.head = _CHUNK_HEAD % (_encode(self.id), self.created, _encode(model))

    def usage(self) -> dict[str, int]:
        prompt = _prompt_tokens(self.data)
        completion = self.count * self.n
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _choice(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        """One chunk: the same delta for each of the ``n`` choices, each with its ``index``."""
        choices = [
            {"index": i, "delta": delta, "finish_reason": finish_reason} for i in range(self.n)
        ]
        return self.head + _encode(choices) + b"}"

    def payloads(self) -> Iterator[bytes]:
        """The ``data:`` payloads of the stream, ``[DONE]`` excluded."""
        opts = self.opts
        if opts.dialect != "openai":
            for chunk in _DIALECT_STREAMS[opts.dialect](self):
                yield _encode(chunk)
            return
        n = self.count
        if opts.tool_calls:
            frags = _tool_fragments(n)
            call = {
                "index": 0,
                "id": f"call_sim_{self.id.rsplit('-', 1)[1]}",
                "type": "function",
                "function": {"name": _tool_name(self.data), "arguments": "" if frags else "{}"},
            }
            yield self._choice({"role": "assistant", "content": None, "tool_calls": [call]})
            for frag in frags:
                yield self._choice({"tool_calls": [{"index": 0, "function": {"arguments": frag}}]})
            finish = "tool_calls"
        else:
            yield self._choice({"role": "assistant", "content": ""})
            prefix = self.head + b'[{"index":0,"delta":{"content":"tok'
            suffix = b' "},"finish_reason":null}]}'
            size = opts.chunk_size
            if self.pieces is not None:
                for text in self.pieces:
                    yield self._choice({"content": text})
            elif self.n > 1:
                for i in range(n):
                    yield self._choice({"content": token_text(i, size)})
            elif size == 0:
                for i in range(n):
                    yield b"%b%d%b" % (prefix, i, suffix)
            else:
                pads: dict[int, bytes] = {}
                for i in range(n):
                    digits = b"%d" % i
                    pad = pads.get(len(digits))
                    if pad is None:
                        pad = pads[len(digits)] = b"." * max(0, size - 4 - len(digits))
                    yield b"".join((prefix, digits, b" ", pad, suffix[1:]))
            finish = self.stop_reason
        yield self._choice({}, finish)
        if self.include_usage:
            yield self.head + b'[],"usage":' + _encode(self.usage()) + b"}"

    def completion(self) -> bytes:
        """The non-streamed ``chat.completion`` body."""
        opts = self.opts
        message: dict[str, Any]
        if opts.tool_calls:
            frags = _tool_fragments(self.count)
            call = {
                "id": f"call_sim_{self.id.rsplit('-', 1)[1]}",
                "type": "function",
                "function": {"name": _tool_name(self.data), "arguments": "".join(frags) or "{}"},
            }
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
            finish = "tool_calls"
        else:
            text = "".join(self.texts())
            message = {"role": "assistant", "content": text}
            finish = self.stop_reason
        completion: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": i, "message": message, "finish_reason": finish} for i in range(self.n)
            ],
            "usage": self.usage(),
        }
        if opts.dialect == "ollama":
            completion["system_fingerprint"] = "fp_ollama"
        elif opts.dialect == "llamacpp":
            completion["system_fingerprint"] = _LLAMACPP_BUILD
            completion["timings"] = _llamacpp_timings(self)
        return _encode(completion)

    # -- what the dialects share -----------------------------------------------------------

    def texts(self) -> list[str]:
        if self.pieces is not None:
            return list(self.pieces)
        return [token_text(i, self.opts.chunk_size) for i in range(self.count)]

    @property
    def tool_name(self) -> str:
        return _tool_name(self.data)


# -- dialects ------------------------------------------------------------------------------
#
# Each builds the chunk objects (dicts, encoded in insertion order) of one server's
# /v1/chat/completions stream. The sources each shape follows are named above each one.

_ALNUM = string.ascii_letters + string.digits
# what each imitated server says owns its models in /v1/models (a runner tells the kind from it)
_OWNED_BY = {"vllm": "vllm", "llamacpp": "llamacpp", "ollama": "library", "litellm": "openai"}
_LLAMACPP_BUILD = "b6000-sim0000"


def _random_alnum(n: int) -> str:
    return "".join(random.choices(_ALNUM, k=n))


def _dialect_id(dialect: str, number: int) -> str:
    if dialect == "ollama":  # middleware/openai.go: fmt.Sprintf("chatcmpl-%d", rand.Intn(999))
        return f"chatcmpl-{number % 999}"
    if dialect == "vllm":  # vllm: f"chatcmpl-{random_uuid()}" (32 hex digits)
        return f"chatcmpl-{uuid.uuid4().hex}"
    if dialect == "llamacpp":  # server: "chatcmpl-" + random_string() (32 alphanumerics)
        return f"chatcmpl-{_random_alnum(32)}"
    if dialect == "litellm":  # litellm: "chatcmpl-" + str(uuid.uuid4())
        return f"chatcmpl-{uuid.uuid4()}"
    return f"chatcmpl-sim-{number}"


def _ollama_stream(reply: _Reply) -> Iterator[dict[str, Any]]:
    """Ollama's OpenAI layer: openai/openai.go ``ToChunk`` and middleware/openai.go ``ChatWriter``.

    Every chunk has ``system_fingerprint: "fp_ollama"`` and a delta with ``role`` and
    ``content``; a tool call comes whole in one chunk; the last chunk has empty content and
    the finish reason. Usage only when ``stream_options.include_usage``: a copy of the last
    chunk with ``choices: []`` and ``usage`` (prompt, completion, total).
    """

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": reply.id,
            "object": "chat.completion.chunk",
            "created": reply.created,
            "model": reply.model,
            "system_fingerprint": "fp_ollama",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    if reply.opts.tool_calls:
        call = {
            "id": f"call_{_random_alnum(8).lower()}",
            "index": 0,
            "type": "function",
            "function": {
                "name": reply.tool_name,
                "arguments": "".join(_tool_fragments(reply.count)) or "{}",
            },
        }
        yield chunk({"role": "assistant", "content": "", "tool_calls": [call]})
        finish = "tool_calls"
    else:
        for text in reply.texts():
            yield chunk({"role": "assistant", "content": text})
        finish = reply.stop_reason
    last = chunk({"role": "assistant", "content": ""}, finish)
    yield last
    if reply.include_usage:
        u = reply.usage()
        last["choices"] = []
        last["usage"] = {
            "prompt_tokens": u["prompt_tokens"],
            "completion_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
        }
        yield last


def _vllm_stream(reply: _Reply) -> Iterator[dict[str, Any]]:
    """vLLM: vllm/entrypoints/openai/serving_chat.py ``chat_completion_stream_generator``.

    Pydantic ``model_dump_json(exclude_unset=True)``: no ``system_fingerprint``, every choice
    has ``logprobs: null``; a first chunk with ``role`` and empty content; the finish chunk
    adds ``stop_reason``; tool calls stream as a header (id ``chatcmpl-tool-…``, name) then
    argument fragments. With ``stream_options.include_usage`` a final chunk with empty
    ``choices`` and ``usage`` in UsageInfo's field order (prompt, total, completion).
    """

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": reply.id,
            "object": "chat.completion.chunk",
            "created": reply.created,
            "model": reply.model,
            "choices": [choice],
        }

    def choice(delta: dict[str, Any]) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}

    yield chunk(choice({"role": "assistant", "content": ""}))
    if reply.opts.tool_calls:
        frags = _tool_fragments(reply.count)
        header = {
            "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
            "type": "function",
            "index": 0,
            "function": {"name": reply.tool_name},
        }
        yield chunk(choice({"tool_calls": [header]}))
        for frag in frags:
            yield chunk(choice({"tool_calls": [{"index": 0, "function": {"arguments": frag}}]}))
        final: dict[str, Any] = {}
        finish = "tool_calls"
    else:
        for text in reply.texts():
            yield chunk(choice({"content": text}))
        final = {"content": ""}
        finish = reply.stop_reason
    yield chunk(
        {"index": 0, "delta": final, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    )
    if reply.include_usage:
        u = reply.usage()
        yield {
            "id": reply.id,
            "object": "chat.completion.chunk",
            "created": reply.created,
            "model": reply.model,
            "choices": [],
            "usage": {
                "prompt_tokens": u["prompt_tokens"],
                "total_tokens": u["total_tokens"],
                "completion_tokens": u["completion_tokens"],
            },
        }


def _llamacpp_timings(reply: _Reply) -> dict[str, Any]:
    prompt_n = max(1, _prompt_tokens(reply.data))
    predicted_n = reply.count
    prompt_ms = 1.25 * prompt_n
    predicted_ms = max(reply.opts.interval * predicted_n * 1000.0, 0.5 * predicted_n)
    return {
        "cache_n": 0,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n,
        "prompt_per_second": 1000.0 * prompt_n / prompt_ms,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1000.0 * predicted_n / predicted_ms if predicted_ms else 0.0,
    }


def _llamacpp_stream(reply: _Reply) -> Iterator[dict[str, Any]]:
    """llama.cpp's server: ``to_json_oaicompat_chat_stream`` (server-task.cpp) with ordered_json.

    Keys in insertion order: ``choices`` first (each choice ``finish_reason``, ``index``,
    ``delta``), then ``created``, ``id``, ``model``, ``system_fingerprint`` (the build),
    ``object``. The first delta is ``{"role": "assistant", "content": null}``; the finish
    chunk has an empty delta; with ``include_usage`` a chunk with ``choices: []`` and
    ``usage`` follows; the last chunk carries the extra ``timings`` object.
    """

    def chunk(
        delta: dict[str, Any], finish: str | None = None, choices: bool = True
    ) -> dict[str, Any]:
        return {
            "choices": [{"finish_reason": finish, "index": 0, "delta": delta}] if choices else [],
            "created": reply.created,
            "id": reply.id,
            "model": reply.model,
            "system_fingerprint": _LLAMACPP_BUILD,
            "object": "chat.completion.chunk",
        }

    yield chunk({"role": "assistant", "content": None})
    if reply.opts.tool_calls:
        frags = _tool_fragments(reply.count) or ["{}"]
        call_id = _random_alnum(32)
        for i, frag in enumerate(frags):
            call: dict[str, Any] = {"index": 0}
            if i == 0:
                call.update(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": reply.tool_name, "arguments": frag},
                    }
                )
            else:
                call["function"] = {"arguments": frag}
            yield chunk({"tool_calls": [call]})
        finish = "tool_calls"
    else:
        for text in reply.texts():
            yield chunk({"content": text})
        finish = reply.stop_reason
    last = chunk({}, finish)
    if reply.include_usage:
        yield last
        u = reply.usage()
        last = chunk({}, choices=False)
        last["usage"] = {
            "completion_tokens": u["completion_tokens"],
            "prompt_tokens": u["prompt_tokens"],
            "total_tokens": u["total_tokens"],
        }
    last["timings"] = _llamacpp_timings(reply)
    yield last


def _litellm_stream(reply: _Reply) -> Iterator[dict[str, Any]]:
    """LiteLLM's proxy: ``ModelResponseStream`` as litellm 1.82 sends it (recorded from its
    ``/v1/chat/completions`` with a ``mock_response`` model, and in front of this simulator).

    Keys ``id``, ``created``, ``model``, ``object``, ``choices``; no ``finish_reason`` key until
    the finish chunk; ``role`` after ``content`` in the first delta; with ``include_usage`` a
    last chunk whose one choice has an empty delta, plus ``usage`` with ``completion_tokens_details``.
    """

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": reply.id,
            "created": reply.created,
            "model": reply.model,
            "object": "chat.completion.chunk",
            "choices": [choice],
        }

    if reply.opts.tool_calls:
        frags = _tool_fragments(reply.count)
        header = {
            "id": f"call_{_random_alnum(24)}",
            "function": {"arguments": "", "name": reply.tool_name},
            "type": "function",
            "index": 0,
        }
        yield chunk({"index": 0, "delta": {"role": "assistant", "tool_calls": [header]}})
        for frag in frags:
            call = {"function": {"arguments": frag}, "type": "function", "index": 0}
            yield chunk({"index": 0, "delta": {"tool_calls": [call]}})
        finish = "tool_calls"
    else:
        for i, text in enumerate(reply.texts()):
            delta: dict[str, Any] = {"content": text}
            if i == 0:
                delta["role"] = "assistant"
            yield chunk({"index": 0, "delta": delta})
        finish = reply.stop_reason
    yield chunk({"finish_reason": finish, "index": 0, "delta": {}})
    if reply.include_usage:
        u = reply.usage()
        last = chunk({"index": 0, "delta": {}})
        last["usage"] = {
            "completion_tokens": u["completion_tokens"],
            "prompt_tokens": u["prompt_tokens"],
            "total_tokens": u["total_tokens"],
            "completion_tokens_details": {"reasoning_tokens": 0},
        }
        yield last


_DIALECT_STREAMS: dict[str, Callable[[_Reply], Iterator[dict[str, Any]]]] = {
    "ollama": _ollama_stream,
    "vllm": _vllm_stream,
    "llamacpp": _llamacpp_stream,
    "litellm": _litellm_stream,
}


class _Exchange:
    """One request and its answer: recorded, routed, the chat path streamed with its faults."""

    __slots__ = ("sim", "req", "resp")

    def __init__(self, sim: Simulator, req: Request) -> None:
        self.sim = sim
        self.req = req
        self.resp = req.resp

    async def run(self) -> None:
        """Read the body, answer; a ``disconnect`` fault resets the connection."""
        resp = self.resp
        try:
            body = await self.req.body(_MAX_BODY)
        except HTTPError as err:
            await resp.error(err)
            return
        outcome = await self._dispatch(body)
        if outcome == _ABORT:
            resp.reset()
        elif outcome == _GONE:
            resp.gone = True  # the connection ends here

    async def _dispatch(self, body: bytes) -> str:
        sim = self.sim
        scope = self.req.scope
        method: str = scope["method"]
        path = scope["raw_path"].decode("latin-1")
        query: bytes = scope["query_string"]
        target = f"{path}?{query.decode('latin-1')}" if query else path
        headers: dict[str, str] = {}
        for raw_name, raw_value in scope["headers"]:
            name = raw_name.decode("latin-1")
            value = raw_value.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        recorded = RecordedRequest(method=method, path=target, headers=headers, body=body)
        if sim.record:
            sim.requests.append(recorded)
            sim._notify()

        if path == _CHAT_PATH and method == "POST":
            rec = StreamRecord(body=body, request=recorded)
            if sim.record:
                sim.streams.append(rec)
                sim._notify()
            try:
                return await self._chat(rec, headers, body)
            finally:
                rec._finish()

        if not self._authorized(headers):
            await self._send_unauthorized()
        elif path == _MODELS_PATH and method == "GET":
            created = int(time.time())
            owner = _OWNED_BY.get(sim.options.dialect, "sim")  # as the imitated server says
            data: list[dict[str, Any]] = [
                {"id": m, "object": "model", "created": created, "owned_by": owner}
                for m in sim.models
            ]
            if sim.context is not None and sim.options.dialect in ("openai", "vllm"):
                for entry in data:
                    entry["max_model_len"] = sim.context
            await self.resp.whole(200, _encode({"object": "list", "data": data}))
        elif path == _EMBEDDINGS_PATH and method == "POST":
            await self._embeddings(body)
        elif path == "/props" and method == "GET" and sim.options.dialect == "llamacpp":
            settings = {} if sim.context is None else {"n_ctx": sim.context}
            props = {"default_generation_settings": settings, "total_slots": 1}
            await self.resp.whole(200, _encode(props))
        elif path == "/api/ps" and method == "GET" and sim.options.dialect == "ollama":
            await self.resp.whole(200, _encode({"models": []}))
        elif path == "/api/show" and method == "POST" and sim.options.dialect == "ollama":
            shown: dict[str, Any] = {"model_info": {"llama.context_length": 131072}}
            if sim.context is not None:
                shown["parameters"] = (
                    f'stop                           "<|eot|>"\nnum_ctx                        {sim.context}'
                )
            await self.resp.whole(200, _encode(shown))
        elif path in (_MODELS_PATH, _CHAT_PATH, _EMBEDDINGS_PATH):
            message = f"Method {method} not allowed for {path}"
            await self.resp.whole(405, error_envelope(message, "invalid_request_error", None))
        else:
            message = f"Invalid URL ({method} {path})"
            await self.resp.whole(
                404, error_envelope(message, "invalid_request_error", "not_found")
            )
        return _COMPLETED

    async def _embeddings(self, body: bytes) -> None:
        """``/v1/embeddings`` as OpenAI answers it: one vector per input (a string, or a list of
        strings), each the same for the same text (drawn from its hash), and the usage (a token
        a word)."""
        try:
            data = _decode(body)
        except msgspec.DecodeError as exc:
            message = f"We could not parse the JSON body of your request: {exc}"
            await self.resp.whole(400, error_envelope(message, "invalid_request_error", None))
            return
        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, str) or model not in self.sim.models:
            message = f"The model `{model}` does not exist or you do not have access to it."
            error = error_envelope(message, "invalid_request_error", "model_not_found", "model")
            await self.resp.whole(404, error)
            return
        given = data.get("input")
        inputs = [given] if isinstance(given, str) else given
        if (
            not isinstance(inputs, list)
            or not inputs
            or not all(isinstance(t, str) for t in inputs)
        ):
            message = "'input' must be a string or a non-empty list of strings"
            error = error_envelope(message, "invalid_request_error", None, "input")
            await self.resp.whole(400, error)
            return
        vectors = [
            {"object": "embedding", "index": i, "embedding": embedding_of(text)}
            for i, text in enumerate(inputs)
        ]
        tokens = sum(len(text.split()) for text in inputs)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        answer = {"object": "list", "data": vectors, "model": model, "usage": usage}
        await self.resp.whole(200, _encode(answer))

    def _authorized(self, headers: Mapping[str, str]) -> bool:
        key = self.sim.require_key
        return key is None or headers.get("authorization") == f"Bearer {key}"

    async def _send_unauthorized(self, rec: StreamRecord | None = None) -> None:
        body = error_envelope(
            "Incorrect API key provided.", "invalid_request_error", "invalid_api_key"
        )
        await self._send_error(401, body, rec)

    async def _send_error(self, status: int, body: bytes, rec: StreamRecord | None) -> None:
        await self.resp.whole(status, body)
        if rec is not None:
            rec.status = status
            rec.payloads.append(body)
            rec.sent_at.append(_perf_counter())

    async def _chat(self, rec: StreamRecord, headers: Mapping[str, str], body: bytes) -> str:
        sim = self.sim
        if not self._authorized(headers):
            await self._send_unauthorized(rec)
            return _COMPLETED
        try:
            data = _decode(body)
        except msgspec.DecodeError as exc:
            message = f"We could not parse the JSON body of your request: {exc}"
            await self._send_error(400, error_envelope(message, "invalid_request_error", None), rec)
            return _COMPLETED
        if not isinstance(data, dict):
            message = "The request body must be a JSON object."
            await self._send_error(400, error_envelope(message, "invalid_request_error", None), rec)
            return _COMPLETED
        model = data.get("model")
        if not isinstance(model, str):
            message = "you must provide a model parameter"
            error = error_envelope(message, "invalid_request_error", None, "model")
            await self._send_error(400, error, rec)
            return _COMPLETED
        rec.model = model
        if model not in sim.models:
            message = f"The model `{model}` does not exist or you do not have access to it."
            error = error_envelope(message, "invalid_request_error", "model_not_found", "model")
            await self._send_error(404, error, rec)
            return _COMPLETED
        overrides = data.get("sim")
        try:
            if overrides is None:
                opts = sim.options
            elif isinstance(overrides, dict):
                opts = sim.options.override(overrides)
            else:
                raise ValueError("'sim' must be an object")
        except (ValueError, TypeError) as exc:
            await self._send_error(
                400, error_envelope(str(exc), "invalid_request_error", None, "sim"), rec
            )
            return _COMPLETED
        try:
            request_limits(data)
        except ValueError as exc:
            param = str(exc).split(":", 1)[0]
            await self._send_error(
                400, error_envelope(str(exc), "invalid_request_error", None, param), rec
            )
            return _COMPLETED
        rec.options = opts
        rec.stream = data.get("stream") is True
        if opts.fault == "500":
            error = error_envelope("The simulator failed on purpose.", "server_error", None)
            await self._send_error(500, error, rec)
            return _COMPLETED
        reply = _Reply(sim, model, opts, data)
        rec.id = reply.id
        if rec.stream:
            rec.status = 200
            try:
                if not self.resp.start_nowait(200, _SSE_HEADERS):
                    await self.resp.flush()
            except ClientGone:
                rec.client_closed = True
                return _GONE
            outcome = await self._guarded(partial(self._emit, rec, reply))
        else:
            outcome = await self._guarded(partial(self._complete, rec, reply))
        if outcome == _GONE:
            rec.client_closed = True
        elif outcome == _COMPLETED:
            rec.completed = True
        return outcome

    async def _guarded(self, respond: Callable[[], Awaitable[str]]) -> str:
        """Run ``respond`` while watching the socket; ``_GONE`` as soon as the client leaves."""
        outcome = _GONE
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch, scope)
                try:
                    outcome = await respond()
                except ClientGone:
                    outcome = _GONE
                nursery.cancel_scope.cancel()
        return outcome  # stays _GONE when the watcher cancelled ``respond``

    async def _watch(self, scope: trio.CancelScope) -> None:
        """Read while a response is being written, so a closed connection is noticed at once
        (a pipelined next request is kept for its turn)."""
        await self.req.receive()
        scope.cancel()

    async def _emit(self, rec: StreamRecord, reply: _Reply) -> str:
        opts = reply.opts
        resp = self.resp
        write = resp.write_nowait
        flush = resp.flush
        record_payload = rec.payloads.append
        record_time = rec.sent_at.append
        checkpoint = trio.lowlevel.checkpoint
        interval = opts.interval
        fault = opts.fault
        fault_after = opts.fault_after
        pending_fault = fault is not None
        delay = opts.ttft
        sent = 0

        async def event(data: bytes, end: bool = False) -> None:
            """Pace, write one ``data:`` event (with ``end``: the end of the body too, in the
            same write), record it, wake its waiters."""
            nonlocal delay
            if delay > 0:
                await trio.sleep(delay)
            else:
                await checkpoint()
            delay = interval
            if not write(b"data: %b\n\n" % data, end=end):
                await flush()
            record_payload(data)
            record_time(_perf_counter())
            if rec._waiters:
                rec._wake()

        # Each event yields once (its pacing wait) before it is written, and is recorded
        # right after the write, before the next yield.
        for payload in itertools.chain(reply.payloads(), (None,)):
            if pending_fault and (sent >= fault_after or payload is None):
                pending_fault = False
                if fault == "stall":
                    await trio.sleep_forever()
                if fault == "disconnect":
                    return _ABORT
                await event(_MALFORMED)  # "malformed": one broken event, then carry on normally
                sent += 1
            if payload is None:
                await event(_DONE, end=True)
                rec.completed = True
                rec._finish()
                return _COMPLETED
            await event(payload)
            sent += 1
        raise AssertionError("unreachable: the loop returns at [DONE]")

    async def _complete(self, rec: StreamRecord, reply: _Reply) -> str:
        opts = reply.opts
        delay = opts.ttft + opts.interval * reply.count  # the tokens it has (max_tokens)
        if delay > 0:
            await trio.sleep(delay)
        if opts.fault == "stall":
            await trio.sleep_forever()
        if opts.fault == "disconnect":
            return _ABORT
        if opts.fault == "malformed":
            body = _MALFORMED
        else:
            body = reply.completion()
        rec.status = 200
        await self.resp.whole(200, body)
        rec.payloads.append(body)
        rec.sent_at.append(_perf_counter())
        rec.completed = True
        rec._finish()
        return _COMPLETED


async def serve_sim(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    options: SimOptions | None = None,
    models: list[str] | None = None,
    require_key: str | None = None,
    record: bool = True,
    context: int | None = None,
    task_status: trio.TaskStatus[Simulator] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Bind, report the ``Simulator`` through ``task_status``, and serve until cancelled.

    With ``record=False`` nothing is kept in ``requests`` / ``streams`` (for long runs).
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    ports = {listener.socket.getsockname()[1] for listener in listeners}
    if len(ports) > 1:  # port 0 on several addresses: keep the first one only
        for extra in listeners[1:]:
            await extra.aclose()
        listeners = listeners[:1]
    bound = listeners[0].socket.getsockname()
    sim = Simulator(
        host=host or bound[0],
        port=bound[1],
        options=options if options is not None else SimOptions(),
        models=list(models) if models is not None else ["sim-model"],
        require_key=require_key,
        record=record,
        context=context,
    )
    task_status.started(sim)
    await Server(sim, limits=_LIMITS).serve_listeners(listeners)


@contextlib.asynccontextmanager
async def open_sim(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    options: SimOptions | None = None,
    models: list[str] | None = None,
    require_key: str | None = None,
    record: bool = True,
    context: int | None = None,
) -> AsyncIterator[Simulator]:
    """Run ``serve_sim`` in a nursery for the duration of the block, yielding the ``Simulator``."""
    async with trio.open_nursery() as nursery:
        sim: Simulator = await nursery.start(
            partial(
                serve_sim,
                host=host,
                port=port,
                options=options,
                models=models,
                require_key=require_key,
                record=record,
                context=context,
            )
        )
        try:
            yield sim
        finally:
            nursery.cancel_scope.cancel()
