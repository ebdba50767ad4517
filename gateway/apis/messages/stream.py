"""Chat chunks back into Anthropic's Messages answer, sans-IO: SSE events as they come, or one
message folded.

``MessagesStream`` turns a streamed turn's ``chat.completion.chunk`` bytes into Anthropic's SSE
events, one chunk at a time; ``fold`` makes one Anthropic ``message`` of a non-streamed turn;
``new_message_id`` names an answer. ``reasoning_content``/``reasoning`` deltas are not turned
into thinking blocks (a thinking block needs a signature the client would send back; it was not
asked for).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from gateway.apis.chunks import (
    Chunk,
    ToolCallDelta,
    Usage,
    chunk_decoder,
)
from gateway.apis.messages.errors import error_body

__all__ = ["MessagesStream", "fold", "new_message_id"]

_encoder = msgspec.json.Encoder()
_encode = _encoder.encode


def new_message_id() -> str:
    """A fresh Anthropic-style message id (``msg_`` + 24 hex digits)."""
    return "msg_" + uuid.uuid4().hex[:24]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- the answer: decoding chat chunks ------------------------------------------------------------


def _decode_chunk(raw: bytes) -> Chunk | None:
    try:
        return chunk_decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError):  # ValidationError is a DecodeError
        return None


def _text_of(content: Any) -> str:
    """A delta's text: a string, or the text parts of a list (some servers send parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def _arguments_of(arguments: Any) -> str:
    """An arguments piece: a string, or an object some servers send whole (encoded)."""
    if isinstance(arguments, str):
        return arguments
    if arguments is None:
        return ""
    return _encode(arguments).decode()


_STOP_REASONS = {
    "stop": "end_turn",
    "eos": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}


def _stop_reason(
    finish: str | None, stop_string: str | None, any_tool: bool
) -> tuple[str, str | None]:
    """(Anthropic ``stop_reason``, ``stop_sequence``) of a turn that ended with ``finish``.

    A turn that called tools and did not end by ``length`` or a content filter is ``tool_use``
    whatever its finish reason said (some servers answer ``stop`` with tool calls, and a client
    runs its tools on ``tool_use``); one that called none is never ``tool_use``. ``stop`` with
    a known stop string (vLLM's ``stop_reason``) is ``stop_sequence``; a missing or unknown
    finish reason is ``end_turn``; ``content_filter`` is ``refusal``."""
    reason = _STOP_REASONS.get(finish or "stop", "end_turn")
    if reason == "tool_use" and not any_tool:
        return "end_turn", None  # no tool_use block to act on: a client would look for one
    if any_tool and reason == "end_turn":
        return "tool_use", None
    if reason == "end_turn" and stop_string is not None:
        return "stop_sequence", stop_string
    return reason, None


def _tool_id(message_id: str, index: int) -> str:
    """A stable tool_use id for a call the backend sent without one."""
    base = message_id[4:] if message_id.startswith("msg_") else message_id
    return f"toolu_{base}_{index}"


def _call_key(calls: dict[int, _Block], call: ToolCallDelta, position: int) -> int:
    """Which call a tool_calls delta continues: its ``index``; without one (older Ollama sends
    whole calls without it), the call with the same ``id``, else a new call when the one at its
    position in the delta has another id, else that position."""
    if _is_int(call.index):
        index: int = call.index
        return index
    call_id = call.id if isinstance(call.id, str) and call.id else None
    if call_id is not None:
        for key, block in calls.items():
            if block.id == call_id:
                return key
        taken = calls.get(position)
        if taken is not None and taken.id is not None:
            return max(calls) + 1
    return position


def _is_complete_json(text: str) -> bool:
    try:
        msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):
        return False
    return True


# -- the answer: streamed ----------------------------------------------------------------------

_TEXT = 0
_TOOL = 1


class _Block:
    """One content block of the answer: the text run, or one tool call (by its chat index)."""

    __slots__ = ("kind", "key", "id", "name", "pieces", "index", "closed")

    def __init__(self, kind: int, key: int) -> None:
        self.kind = kind
        self.key = key  # a tool call's chat index
        self.id: str | None = None
        self.name: str | None = None
        self.pieces: list[str] = []  # text or arguments, kept while the block waits to start
        self.index = -1  # its Anthropic content index once started
        self.closed = False


def _event(name: bytes, data: bytes) -> bytes:
    return b"event: " + name + b"\ndata: " + data + b"\n\n"


_PING = _event(b"ping", b'{"type":"ping"}')
_STOP_EVENT = _event(b"message_stop", b'{"type":"message_stop"}')


class MessagesStream:
    """One streamed turn: chat chunks in, Anthropic SSE bytes out, each chunk's events at once.

    Blocks stream as Anthropic streams them: one open at a time, indices in order. Text opens a
    text block; each tool call (by its chat ``index``) a ``tool_use`` block whose arguments
    pieces are ``input_json_delta``s. A block is closed when the next one starts, but a tool
    call is closed only once its arguments so far form a complete JSON value: while it is still
    incomplete, pieces of OTHER calls (interleaved by index) or text are held, in the order they
    first came, and each held block is sent whole (start, its pieces as one delta) as soon as
    the open call completes, or at ``done()``. Sequential calls (what servers send) therefore
    stream live; interleaved ones come out complete and in order. A piece for a call already
    closed (after its arguments were complete JSON: only whitespace or garbage can follow) is
    dropped. A call whose name has not come yet waits for it (sent at ``done()`` with the name
    ``""`` if it never comes). Calls without an ``id`` get ``toolu_<message id>_<n>``.

    ``output_tokens``: the backend's ``completion_tokens`` when usage came, else the count of
    chunks that carried text or arguments (about one token each on the servers we know).
    Only choice 0 is read (a Messages turn has one answer).
    """

    __slots__ = (
        "model",
        "message_id",
        "input_tokens",
        "_started",
        "_ended",
        "_open",
        "_waiting",
        "_tools",
        "_text",
        "_next_index",
        "_finish",
        "_stop_string",
        "_prompt_tokens",
        "_completion_tokens",
        "_pieces_seen",
        "_any_tool",
        "_tool_count",
    )

    def __init__(self, model: str, message_id: str, input_tokens_estimate: int = 0) -> None:
        self.model = model
        self.message_id = message_id
        self.input_tokens = input_tokens_estimate
        self._started = False
        self._ended = False
        self._open: _Block | None = None
        self._waiting: list[_Block] = []
        self._tools: dict[int, _Block] = {}
        self._text: _Block | None = None  # the text block taking text now (open or waiting)
        self._next_index = 0
        self._finish: str | None = None
        self._stop_string: str | None = None
        self._prompt_tokens: int | None = None
        self._completion_tokens: int | None = None
        self._pieces_seen = 0
        self._any_tool = False
        self._tool_count = 0

    # -- the public calls ------------------------------------------------------------------

    def ping(self) -> bytes:
        """``event: ping`` (sent while waiting for the first token)."""
        return _PING

    def start(self) -> bytes:
        """``message_start`` if not sent yet (``chunk`` and ``done`` send it first otherwise):
        for a caller that wants it out before the first chunk."""
        if self._started or self._ended:
            return b""
        self._started = True
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return _event(b"message_start", _encode({"type": "message_start", "message": message}))

    def chunk(self, raw: bytes) -> bytes:
        """One ``chat.completion.chunk`` (JSON bytes) → the SSE bytes of its events (b"" when
        none); an undecodable chunk is skipped. The first call sends ``message_start`` too."""
        if self._ended:
            return b""
        parsed = _decode_chunk(raw)
        if parsed is None:
            return b""
        out: list[bytes] = []
        if not self._started:
            out.append(self.start())
        if parsed.usage is not None:
            self._take_usage(parsed.usage)
        for choice in parsed.choices or ():
            if choice.index not in (0, None):
                continue
            delta = choice.delta if choice.delta is not None else choice.message
            if delta is not None:
                if delta.content is not None:
                    text = _text_of(delta.content)
                    if text:
                        self._pieces_seen += 1
                        self._on_text(text, out)
                if delta.tool_calls:
                    self._pieces_seen += 1
                    for position, call in enumerate(delta.tool_calls):
                        self._on_tool(call, position, out)
            if isinstance(choice.finish_reason, str):
                self._finish = choice.finish_reason
                if isinstance(choice.stop_reason, str):
                    self._stop_string = choice.stop_reason
        return b"".join(out)

    def done(self) -> bytes:
        """The end: every block closed (held ones sent), ``message_delta`` (stop_reason,
        usage), ``message_stop``. Nothing after it."""
        if self._ended:
            return b""
        out: list[bytes] = []
        if not self._started:
            out.append(self.start())
        self._close_open(out)
        for block in self._waiting:
            self._start_block(block, out)
            self._close(block, out)
        self._waiting.clear()
        self._ended = True
        stop_reason, stop_sequence = _stop_reason(self._finish, self._stop_string, self._any_tool)
        usage: dict[str, int] = {"output_tokens": self.output_tokens}
        if self._prompt_tokens is not None:
            usage["input_tokens"] = self._prompt_tokens
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        out.append(
            _event(
                b"message_delta", _encode({"type": "message_delta", "delta": delta, "usage": usage})
            )
        )
        out.append(_STOP_EVENT)
        return b"".join(out)

    def error(self, message: str, type_: str = "api_error") -> bytes:
        """``event: error`` with Anthropic's error shape; the stream ends with it."""
        if self._ended:
            return b""
        self._ended = True
        return _event(b"error", error_body(type_, message))

    @property
    def output_tokens(self) -> int:
        if self._completion_tokens is not None:
            return self._completion_tokens
        return self._pieces_seen

    # -- the blocks --------------------------------------------------------------------------

    def _take_usage(self, usage: Usage) -> None:
        if _is_int(usage.prompt_tokens):
            self._prompt_tokens = usage.prompt_tokens
        if _is_int(usage.completion_tokens):
            self._completion_tokens = usage.completion_tokens

    def _on_text(self, text: str, out: list[bytes]) -> None:
        block = self._text
        if block is not None and block is self._open:
            out.append(self._text_delta(block.index, text))
            return
        if block is None:
            block = self._text = _Block(_TEXT, -1)
            self._waiting.append(block)
        block.pieces.append(text)
        self._advance(out)

    def _on_tool(self, call: ToolCallDelta, position: int, out: list[bytes]) -> None:
        key = _call_key(self._tools, call, position)
        block = self._tools.get(key)
        function = call.function
        if block is None:
            block = self._tools[key] = _Block(_TOOL, key)
            self._any_tool = True
            self._text = None  # text after this call is a new text block
            self._waiting.append(block)
        if block.closed:
            return  # only whitespace or garbage can follow a complete JSON value
        if block.id is None and isinstance(call.id, str) and call.id:
            block.id = call.id
        if function is None:
            return
        if block.name is None and isinstance(function.name, str) and function.name:
            block.name = function.name
        piece = _arguments_of(function.arguments)
        if block is self._open:
            if piece:
                block.pieces.append(piece)
                out.append(self._json_delta(block.index, piece))
                if self._waiting:
                    self._advance(out)
            return
        if piece:
            block.pieces.append(piece)
        self._advance(out)

    def _closable(self, block: _Block) -> bool:
        if block.kind == _TEXT:
            return True
        return _is_complete_json("".join(block.pieces))

    def _advance(self, out: list[bytes]) -> None:
        """Start the held blocks, in order, while the open one can be closed."""
        while self._waiting:
            head = self._waiting[0]
            if head.kind == _TOOL and head.name is None:
                return
            if self._open is not None:
                if not self._closable(self._open):
                    return
                self._close_open(out)
            self._waiting.pop(0)
            self._start_block(head, out)
            self._open = head

    def _close_open(self, out: list[bytes]) -> None:
        if self._open is not None:
            self._close(self._open, out)
            self._open = None

    def _close(self, block: _Block, out: list[bytes]) -> None:
        block.closed = True
        if block is self._text:
            self._text = None
        out.append(
            _event(
                b"content_block_stop",
                b'{"type":"content_block_stop","index":%d}' % block.index,
            )
        )

    def _start_block(self, block: _Block, out: list[bytes]) -> None:
        block.index = self._next_index
        self._next_index += 1
        if block.kind == _TEXT:
            content: dict[str, Any] = {"type": "text", "text": ""}
        else:
            if block.id is None:
                block.id = _tool_id(self.message_id, self._tool_count)
            self._tool_count += 1
            content = {"type": "tool_use", "id": block.id, "name": block.name or "", "input": {}}
        event = {"type": "content_block_start", "index": block.index, "content_block": content}
        out.append(_event(b"content_block_start", _encode(event)))
        if block.pieces:
            joined = "".join(block.pieces)
            if block.kind == _TEXT:
                block.pieces = []
                out.append(self._text_delta(block.index, joined))
            else:
                block.pieces = [joined]
                out.append(self._json_delta(block.index, joined))

    @staticmethod
    def _text_delta(index: int, text: str) -> bytes:
        return (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
            b'"delta":{"type":"text_delta","text":%b}}\n\n' % (index, _encode(text))
        )

    @staticmethod
    def _json_delta(index: int, piece: str) -> bytes:
        return (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
            b'"delta":{"type":"input_json_delta","partial_json":%b}}\n\n' % (index, _encode(piece))
        )


# -- the answer: whole -------------------------------------------------------------------------


def fold(chunks: list[bytes], model: str, message_id: str, input_tokens_estimate: int = 0) -> bytes:
    """A non-streamed turn's answer: one Anthropic ``message`` object (JSON bytes).

    ``chunks``: the turn's chat chunks, or one whole ``chat.completion`` (its
    ``choices[0].message``). Content: one text block (all text, when there is any), then a
    ``tool_use`` block per call in index order, its ``input`` the parsed arguments (``{}`` for
    arguments that are not a JSON object). ``input_tokens``: the backend's ``prompt_tokens``,
    else ``input_tokens_estimate``; ``output_tokens`` as in ``MessagesStream``."""
    texts: list[str] = []
    calls: dict[int, _Block] = {}
    finish: str | None = None
    stop_string: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    pieces_seen = 0
    for raw in chunks:
        parsed = _decode_chunk(raw)
        if parsed is None:
            continue
        usage = parsed.usage
        if usage is not None:
            if _is_int(usage.prompt_tokens):
                prompt_tokens = usage.prompt_tokens
            if _is_int(usage.completion_tokens):
                completion_tokens = usage.completion_tokens
        for choice in parsed.choices or ():
            if choice.index not in (0, None):
                continue
            delta = choice.delta if choice.delta is not None else choice.message
            if delta is not None:
                text = _text_of(delta.content)
                if text:
                    pieces_seen += 1
                    texts.append(text)
                if delta.tool_calls:
                    pieces_seen += 1
                    for position, call in enumerate(delta.tool_calls):
                        key = _call_key(calls, call, position)
                        block = calls.get(key)
                        if block is None:
                            block = calls[key] = _Block(_TOOL, key)
                        if block.id is None and isinstance(call.id, str) and call.id:
                            block.id = call.id
                        function = call.function
                        if function is not None:
                            if block.name is None and isinstance(function.name, str):
                                block.name = function.name or None
                            piece = _arguments_of(function.arguments)
                            if piece:
                                block.pieces.append(piece)
            if isinstance(choice.finish_reason, str):
                finish = choice.finish_reason
                if isinstance(choice.stop_reason, str):
                    stop_string = choice.stop_reason
    content: list[dict[str, Any]] = []
    text = "".join(texts)
    if text:
        content.append({"type": "text", "text": text})
    for n, key in enumerate(sorted(calls)):
        block = calls[key]
        try:
            parsed_input = msgspec.json.decode("".join(block.pieces)) if block.pieces else {}
        except (msgspec.DecodeError, RecursionError):
            parsed_input = {}
        if not isinstance(parsed_input, dict):
            parsed_input = {}
        content.append(
            {
                "type": "tool_use",
                "id": block.id or _tool_id(message_id, n),
                "name": block.name or "",
                "input": parsed_input,
            }
        )
    stop_reason, stop_sequence = _stop_reason(finish, stop_string, bool(calls))
    message = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": prompt_tokens if prompt_tokens is not None else input_tokens_estimate,
            "output_tokens": completion_tokens if completion_tokens is not None else pieces_seen,
        },
    }
    return _encode(message)
