"""Messages requests into chat-completions bodies, sans-IO: checked field by field, then translated.

``translate`` turns a ``POST /v1/messages`` body into the chat-completions body the runners
relay, with its token estimate (``to_chat``: the same without it);
``count_tokens`` answers ``POST /v1/messages/count_tokens`` with an estimate (``estimate_tokens``).
A request refused raises ``MessagesError`` (``messages.errors``), naming the field.

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
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from gateway.apis.messages.errors import MessagesError

__all__ = [
    "CHARS_PER_TOKEN",
    "IMAGE_TOKENS",
    "MessagesAsChat",
    "count_tokens",
    "estimate_tokens",
    "to_chat",
    "translate",
]

_encoder = msgspec.json.Encoder()
_encode = _encoder.encode

IMAGE_TOKENS = 1600  # count_tokens: an image counts as Anthropic's largest (~1.15 megapixels / 750)
CHARS_PER_TOKEN = 4


def _invalid(message: str) -> MessagesError:
    return MessagesError(400, "invalid_request_error", message)


# -- the request -----------------------------------------------------------------------------


class MessagesAsChat(msgspec.Struct):
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


def translate(body: bytes) -> MessagesAsChat:
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


def _translate(obj: dict[str, Any]) -> MessagesAsChat:
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
    return MessagesAsChat(_encode(chat), bool(stream), model, estimate_tokens(obj), chat)


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
