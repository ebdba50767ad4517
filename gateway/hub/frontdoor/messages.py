"""Anthropic's Messages API over OpenAI chat completions, sans-IO: dicts and bytes in, bytes out.

``to_chat`` turns a ``POST /v1/messages`` body into the chat-completions body the runners relay;
``MessagesStream`` turns the runner's ``chat.completion.chunk`` bytes back into Anthropic's SSE
events, one chunk at a time; ``fold`` makes one Anthropic ``message`` of a non-streamed turn;
``count_tokens`` answers ``POST /v1/messages/count_tokens`` with an estimate.

What is dropped on the way (never an error): ``thinking``, ``metadata``, ``cache_control``,
``service_tier``, ``container``, ``mcp_servers`` and any unknown top-level field; tools that are
not plain custom tools (Anthropic's server and client tools such as ``web_search_20250305``,
``bash_20250124``, ``text_editor_20250728``, ``computer_…``, which Claude Code may send: a
local model cannot run them) and tools marked ``defer_loading`` (Anthropic shows them to the
model only once its tool search found them; Claude Code sends a ``DeferredToolPlaceholder`` so
marked, "never call this tool"); content blocks a chat backend has no place for (``thinking``,
``redacted_thinking``, ``server_tool_use``, ``web_search_tool_result``, ``search_result``,
``document`` but for its plain-text source, images in assistant turns...). Consecutive
messages of one role are merged (Anthropic combines them into one turn).
A ``system`` message inside ``messages`` (text blocks only: Claude Code sends one mid-conversation,
and resends the turn without it when refused) becomes a chat ``system`` message in its place, as
the Responses API's ``system``/``developer`` input messages do (``responses``); consecutive ones
are merged, a leading one with the ``system`` field.
On the way back, ``reasoning_content``/``reasoning`` deltas are not turned into thinking blocks
(a thinking block needs a signature the client would send back; it was not asked for).
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import msgspec

from gateway.hub.frontdoor.chunks import (
    Chunk,
    ToolCallDelta,
    Usage,
    chunk_decoder,
)

__all__ = [
    "MessagesError",
    "ChatRequest",
    "MessagesStream",
    "count_tokens",
    "error_body",
    "error_type_for_status",
    "estimate_tokens",
    "fold",
    "new_message_id",
    "to_chat",
    "translate",
]

_encoder = msgspec.json.Encoder()
_encode = _encoder.encode

IMAGE_TOKENS = 1600  # count_tokens: an image counts as Anthropic's largest (~1.15 megapixels / 750)
CHARS_PER_TOKEN = 4

# -- errors ------------------------------------------------------------------------------------


class MessagesError(Exception):
    """A request refused: answered with ``status`` and ``error_body(type, message)``."""

    def __init__(self, status: int, type_: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message

    def body(self) -> bytes:
        return error_body(self.type, self.message)


def _invalid(message: str) -> MessagesError:
    return MessagesError(400, "invalid_request_error", message)


def error_body(type_: str, message: str) -> bytes:
    """``{"type": "error", "error": {"type", "message"}}`` as JSON bytes."""
    return _encode({"type": "error", "error": {"type": type_, "message": message}})


_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type_for_status(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status (``api_error`` for any other)."""
    return _TYPE_BY_STATUS.get(status, "api_error")


def new_message_id() -> str:
    """A fresh Anthropic-style message id (``msg_`` + 24 hex digits)."""
    return "msg_" + uuid.uuid4().hex[:24]


# -- the request -----------------------------------------------------------------------------


class ChatRequest(msgspec.Struct):
    """A Messages request translated: what ``to_chat`` returns, plus the token estimate."""

    body: bytes  # the chat-completions body
    stream: bool
    model: str | None  # as the client asked (None: absent)
    input_tokens_estimate: int  # estimate_tokens() of the Messages request
    chat: dict[str, Any]  # the chat body before encoding

    def body_for(self, model: str) -> bytes:
        """The chat body asking for ``model`` instead (a client's ``claude-…`` name mapped
        to a model the runners serve)."""
        if model == self.model:
            return self.body
        return _encode({"model": model, **{k: v for k, v in self.chat.items() if k != "model"}})


def to_chat(body: bytes) -> tuple[bytes, bool, str | None]:
    """A Messages request body → (the chat-completions body, stream?, its ``model`` or None).

    ``MessagesError(400, "invalid_request_error", ...)`` naming the field for what is invalid:
    not JSON, nested too deeply, ``max_tokens`` or ``messages`` missing, wrong types. The model
    is passed through as given (None when absent: the caller decides what that means)."""
    request = translate(body)
    return request.body, request.stream, request.model


def translate(body: bytes) -> ChatRequest:
    """``to_chat`` plus the request's ``estimate_tokens`` (one parse for both)."""
    obj = _decode_request(body)
    try:
        return _translate(obj)
    except RecursionError:
        raise _invalid("The request body is nested too deeply.") from None


def count_tokens(body: bytes) -> int:
    """``POST /v1/messages/count_tokens``: an ESTIMATE, not a tokenizer's count (the hub has no
    tokenizer for the runners' models): ``ceil(chars / 4)`` over the text of ``system``, every
    message (text, tool_use name and JSON input, tool_result text) and ``tools`` (name,
    description, JSON of ``input_schema``), plus 1600 tokens per image. ``max_tokens`` is not
    required here (the count_tokens body has none); what is present is checked as in
    ``to_chat`` (MessagesError 400)."""
    obj = _decode_request(body)
    try:
        _check_common(obj)
        return estimate_tokens(obj)
    except RecursionError:
        raise _invalid("The request body is nested too deeply.") from None


def _decode_request(body: bytes) -> dict[str, Any]:
    if not body.strip():
        raise _invalid("The request body is empty; expected a JSON object.")
    try:
        obj = msgspec.json.decode(body)
    except RecursionError:
        raise _invalid("The request body is not valid JSON: it is nested too deeply.") from None
    except msgspec.DecodeError as exc:
        raise _invalid(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _invalid(f"The request body must be a JSON object, not {_kind(obj)}.")
    return obj


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_common(obj: dict[str, Any]) -> None:
    """What both /v1/messages and count_tokens require: ``messages`` (an array of messages),
    a string ``model`` when present, ``system`` and ``tools`` of the right shapes."""
    if "messages" not in obj:
        raise _invalid("messages: Field required")
    messages = obj["messages"]
    if not isinstance(messages, list):
        raise _invalid(f"messages: Input should be an array, not {_kind(messages)}")
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise _invalid(f"{where}: Input should be an object, not {_kind(message)}")
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise _invalid(f"{where}.role: Input should be 'user', 'assistant' or 'system'")
        if "content" not in message:
            raise _invalid(f"{where}.content: Field required")
        content = message["content"]
        if role == "system":
            _system_text(content, f"{where}.content")
        elif isinstance(content, list):
            for j, block in enumerate(content):
                _check_block(block, f"{where}.content.{j}", role)
        elif not isinstance(content, str):
            raise _invalid(
                f"{where}.content: Input should be a string or an array of content blocks, "
                f"not {_kind(content)}"
            )
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise _invalid(f"model: Input should be a string, not {_kind(model)}")
    _system_text(obj.get("system"))
    _function_tools(obj.get("tools"))


def _check_block(block: Any, where: str, role: str) -> None:
    if not isinstance(block, dict):
        raise _invalid(f"{where}: Input should be a content block object, not {_kind(block)}")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise _invalid(f"{where}.type: Field required (a string)")
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise _invalid(f"{where}.text: Input should be a string")
    elif kind == "image":
        _image_url(block, where)
    elif kind == "tool_use":
        if role != "assistant":
            raise _invalid(f"{where}: tool_use blocks are only allowed in assistant messages")
        if not isinstance(block.get("id"), str):
            raise _invalid(f"{where}.id: Input should be a string")
        if not isinstance(block.get("name"), str):
            raise _invalid(f"{where}.name: Input should be a string")
        if "input" in block and not isinstance(block["input"], dict):
            raise _invalid(f"{where}.input: Input should be an object")
    elif kind == "tool_result":
        if role != "user":
            raise _invalid(f"{where}: tool_result blocks are only allowed in user messages")
        if not isinstance(block.get("tool_use_id"), str):
            raise _invalid(f"{where}.tool_use_id: Input should be a string")
        content = block.get("content")
        if isinstance(content, list):
            for k, inner in enumerate(content):
                if not isinstance(inner, dict):
                    raise _invalid(f"{where}.content.{k}: Input should be a content block object")
                if inner.get("type") == "text" and not isinstance(inner.get("text"), str):
                    raise _invalid(f"{where}.content.{k}.text: Input should be a string")
                if inner.get("type") == "image":
                    _image_url(inner, f"{where}.content.{k}")
        elif content is not None and not isinstance(content, str):
            raise _invalid(f"{where}.content: Input should be a string or an array of blocks")


def _image_url(block: dict[str, Any], where: str) -> str:
    """The ``image_url`` URL of an image block: a data URL for base64, the URL for ``url``."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise _invalid(f"{where}.source: Field required (an object)")
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str):
            raise _invalid(f"{where}.source.media_type: Input should be a string")
        if not isinstance(data, str):
            raise _invalid(f"{where}.source.data: Input should be a string")
        return f"data:{media_type};base64,{data}"
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise _invalid(f"{where}.source.url: Input should be a string")
        return url
    raise _invalid(
        f"{where}.source.type: only 'base64' and 'url' image sources are supported "
        f"(got {kind!r}; the Files API is not)"
    )


def _system_text(system: Any, where: str = "system") -> str:
    """The text of ``system`` (or of a system message's content, at ``where``): a string, or
    text blocks joined by newlines (``cache_control`` dropped)."""
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        texts = []
        for i, block in enumerate(system):
            if not isinstance(block, dict) or not isinstance(block.get("text"), str):
                raise _invalid(f"{where}.{i}: Input should be a text block with a string 'text'")
            texts.append(block["text"])
        return "\n".join(texts)
    raise _invalid(
        f"{where}: Input should be a string or an array of text blocks, not {_kind(system)}"
    )


def _function_tools(tools: Any) -> list[dict[str, Any]]:
    """The custom tools as chat ``tools``; server tools (any ``type`` but ``custom``) and
    deferred ones (``defer_loading: true``) dropped."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _invalid(f"tools: Input should be an array, not {_kind(tools)}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _invalid(f"tools.{i}: Input should be an object, not {_kind(tool)}")
        if tool.get("type") not in (None, "custom"):
            continue  # a server or Anthropic-defined tool: no local model runs it
        if tool.get("defer_loading") is True:
            continue  # not in the model's context until a tool search loads it
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _invalid(f"tools.{i}.name: Field required (a string)")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _invalid(f"tools.{i}.input_schema: Field required (a JSON schema object)")
        function: dict[str, Any] = {"name": name}
        description = tool.get("description")
        if isinstance(description, str):
            function["description"] = description
        function["parameters"] = schema
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool]:
    """(the chat ``tool_choice`` or None, parallel tool calls disabled?)."""
    if choice is None:
        return None, False
    if not isinstance(choice, dict):
        raise _invalid(f"tool_choice: Input should be an object, not {_kind(choice)}")
    kind = choice.get("type")
    serial = choice.get("disable_parallel_tool_use") is True
    if kind == "auto":
        return "auto", serial
    if kind == "any":
        return "required", serial
    if kind == "none":
        return "none", False
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise _invalid("tool_choice.name: Field required (a string) for type 'tool'")
        return {"type": "function", "function": {"name": name}}, serial
    raise _invalid("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'")


def _tool_result_content(block: dict[str, Any], where: str) -> tuple[str, list[dict[str, Any]]]:
    """(the text of a tool_result, its images as chat image parts)."""
    content = block.get("content")
    images: list[dict[str, Any]] = []
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        texts = []
        for k, inner in enumerate(content):
            kind = inner.get("type")
            if kind == "text":
                texts.append(inner["text"])
            elif kind == "image":
                url = _image_url(inner, f"{where}.content.{k}")
                images.append({"type": "image_url", "image_url": {"url": url}})
        text = "\n".join(texts)
    if block.get("is_error") is True:
        text = f"Error: {text}" if text else "Error"
    return text, images


def _user_content(parts: list[dict[str, Any]]) -> Any:
    """A string when the parts are all text (joined by newlines), else the list of parts."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role == "system":
            text = _system_text(content)
            if text:
                out.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if role == "assistant":
            texts: list[str] = []
            calls: list[dict[str, Any]] = []
            for block in content:
                kind = block["type"]
                if kind == "text":
                    texts.append(block["text"])
                elif kind == "tool_use":
                    arguments = _encode(block.get("input") or {}).decode()
                    function = {"name": block["name"], "arguments": arguments}
                    calls.append({"id": block["id"], "type": "function", "function": function})
            assistant: dict[str, Any] = {
                "role": "assistant",
                "content": "\n".join(texts) if texts or not calls else None,
            }
            if calls:
                assistant["tool_calls"] = calls
            out.append(assistant)
            continue
        # a user turn: its tool results first (right after the assistant's calls), then the rest
        parts: list[dict[str, Any]] = []
        tool_images: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            kind = block["type"]
            if kind == "text":
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image":
                url = _image_url(block, f"messages.{i}.content.{j}")
                parts.append({"type": "image_url", "image_url": {"url": url}})
            elif kind == "tool_result":
                text, images = _tool_result_content(block, f"messages.{i}.content.{j}")
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
                tool_images.extend(images)
            elif kind == "document":
                source = block.get("source")
                if isinstance(source, dict) and isinstance(source.get("data"), str):
                    if source.get("type") == "text":
                        parts.append({"type": "text", "text": source["data"]})
        parts = tool_images + parts
        if parts or not any(b["type"] == "tool_result" for b in content):
            out.append({"role": "user", "content": _user_content(parts)})
    return _merge_adjacent(out)


def _as_parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    parts: list[dict[str, Any]] = content
    return parts


def _merge_adjacent(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user (or assistant, or system) messages made one, as Anthropic combines
    consecutive turns of a role (and chat templates that insist on alternating roles refuse
    them, many allow one system message only)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        prev = out[-1] if out else None
        if prev is None or prev["role"] != message["role"] or message["role"] == "tool":
            out.append(message)
        elif message["role"] == "system":
            prev["content"] = "\n".join(t for t in (prev["content"], message["content"]) if t)
        elif message["role"] == "user":
            a, b = prev["content"], message["content"]
            if isinstance(a, str) and isinstance(b, str):
                prev["content"] = "\n".join(t for t in (a, b) if t)
            else:
                prev["content"] = _as_parts(a) + _as_parts(b)
        else:
            texts = [t for t in (prev["content"], message["content"]) if t]
            calls = prev.get("tool_calls", []) + message.get("tool_calls", [])
            prev["content"] = "\n".join(texts) if texts or not calls else None
            if calls:
                prev["tool_calls"] = calls
    return out


def _translate(obj: dict[str, Any]) -> ChatRequest:
    _check_common(obj)
    if "max_tokens" not in obj:
        raise _invalid("max_tokens: Field required")
    max_tokens = obj["max_tokens"]
    if not _is_int(max_tokens) or max_tokens < 1:
        raise _invalid("max_tokens: Input should be an integer greater than or equal to 1")
    stream = obj.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _invalid(f"stream: Input should be a boolean, not {_kind(stream)}")
    model = obj.get("model")

    chat: dict[str, Any] = {}
    if model is not None:
        chat["model"] = model
    system = _system_text(obj.get("system"))
    leading = [{"role": "system", "content": system}] if system else []
    chat["messages"] = _merge_adjacent(leading + _chat_messages(obj["messages"]))
    chat["max_tokens"] = max_tokens
    stops = obj.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _invalid("stop_sequences: Input should be an array of strings")
        if stops:
            chat["stop"] = stops
    for name in ("temperature", "top_p"):
        value = obj.get(name)
        if value is not None:
            if not _is_number(value):
                raise _invalid(f"{name}: Input should be a number, not {_kind(value)}")
            chat[name] = value
    top_k = obj.get("top_k")
    if top_k is not None:
        if not _is_int(top_k):
            raise _invalid(f"top_k: Input should be an integer, not {_kind(top_k)}")
        chat["top_k"] = top_k
    tools = _function_tools(obj.get("tools"))
    choice, serial = _tool_choice(obj.get("tool_choice"))
    if tools:  # a tool_choice without tools is refused by OpenAI-style servers: left out
        chat["tools"] = tools
        if choice is not None:
            chat["tool_choice"] = choice
        if serial:
            chat["parallel_tool_calls"] = False
    chat["stream"] = bool(stream)
    if stream:
        chat["stream_options"] = {"include_usage": True}
    return ChatRequest(_encode(chat), bool(stream), model, estimate_tokens(obj), chat)


# -- the token estimate -----------------------------------------------------------------------


def _block_chars(block: Any) -> tuple[int, int]:
    """(characters, images) of one content block."""
    if not isinstance(block, dict):
        return 0, 0
    kind = block.get("type")
    if kind == "text" and isinstance(block.get("text"), str):
        return len(block["text"]), 0
    if kind == "image":
        return 0, 1
    if kind == "tool_use":
        name = block.get("name")
        return (len(name) if isinstance(name, str) else 0) + len(_encode(block.get("input"))), 0
    if kind == "tool_result":
        content = block.get("content")
        if isinstance(content, str):
            return len(content), 0
        chars = images = 0
        if isinstance(content, list):
            for inner in content:
                c, n = _block_chars(inner)
                chars, images = chars + c, images + n
        return chars, images
    if kind == "document":
        source = block.get("source")
        if isinstance(source, dict) and source.get("type") == "text":
            data = source.get("data")
            return (len(data) if isinstance(data, str) else 0), 0
    return 0, 0


def estimate_tokens(request: dict[str, Any]) -> int:
    """The input tokens of a (checked) Messages request, estimated as ``count_tokens`` says:
    ``ceil(chars / 4)`` over the text of system, messages and tools, plus 1600 per image."""
    chars = len(_system_text(request.get("system")))
    images = 0
    for message in request.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for block in content:
                c, n = _block_chars(block)
                chars, images = chars + c, images + n
    for tool in _function_tools(request.get("tools")):
        function = tool["function"]
        chars += len(function["name"]) + len(function.get("description", ""))
        chars += len(_encode(function["parameters"]))
    return math.ceil(chars / CHARS_PER_TOKEN) + IMAGE_TOKENS * images


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
