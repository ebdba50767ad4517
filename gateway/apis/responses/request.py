"""Responses requests (``POST /v1/responses``) into chat-completions bodies, sans-IO: checked,
then translated.

``translate`` turns a Responses request body into the chat-completions body the runners relay
and what the hub needs of it (``ResponsesAsChat``; ``to_chat``: the body, stream? and model only).
A request that is invalid or asks what the hub cannot do raises ``ResponsesError`` (400).
Dicts and bytes in, bytes out: no I/O, no clock.

Decisions where the Responses API asks for more than a chat backend has (tools: ``tools``):

* No response state. The hub keeps nothing after a turn, so ``previous_response_id`` is refused
  (400 ``unsupported_parameter``): the client sends the whole conversation in ``input``, as
  Codex does with ``store: false``. ``item_reference`` input items are refused for the same
  reason.
* ``developer`` messages become ``system`` messages (local chat templates know no
  ``developer``); consecutive system messages are merged (many templates allow only one).
  Several text parts of a message are joined with ``\\n`` (as vLLM and Codex's chat client do).
* ``input_image`` passes on as an ``image_url`` part (URL or data URL); by ``file_id`` it is
  refused (the hub holds no files), as is ``input_file``. An image in a
  ``function_call_output`` (chat tool messages carry text only) follows the tool messages as a
  user message.
* ``text.format`` (``json_schema``/``json_object``) becomes ``response_format``: it changes the
  answer's shape, so dropping it would break structured output silently. ``text.verbosity``,
  ``store``, ``reasoning``, ``include``, ``metadata``, ``prompt_cache_key``, ``truncation``,
  ``user``, ``service_tier`` and unknown fields are ignored; so are ``reasoning`` input items.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from gateway.apis.responses.errors import ResponsesError, invalid, unsupported
from gateway.apis.responses.tools import (
    qualified_name,
    tool_choice,
    tool_name,
    translate_tools,
)

__all__ = ["ResponsesAsChat", "decode_request", "to_chat", "translate"]

# -- input items ------------------------------------------------------------------------

_IGNORED_ITEM_TYPES = frozenset(
    {
        "reasoning",
        "web_search_call",
        "file_search_call",
        "code_interpreter_call",
        "image_generation_call",
        "computer_call",
        "computer_call_output",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
        "tool_search_call",
        "tool_search_output",
        "compaction",
    }
)


def _text_of(part: dict[str, Any], where: str) -> str:
    text = part.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}.text", "expected a string.")
    return text


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    url = part.get("image_url")
    if url is None and part.get("file_id") is not None:
        raise unsupported(
            f"{where}.file_id",
            "input_image by file_id is not supported: the hub holds no files; send the image "
            "as image_url (a URL or a data: URL).",
        )
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise invalid(f"{where}.image_url", "expected a URL or a data: URL.")
    image: dict[str, Any] = {"url": url}
    detail = part.get("detail")
    if isinstance(detail, str):
        image["detail"] = detail
    return {"type": "image_url", "image_url": image}


def _parts(content: Any, where: str) -> tuple[list[str], list[dict[str, Any]]]:
    """(texts, image parts) of a message's or tool output's content."""
    if isinstance(content, str):
        return [content], []
    if not isinstance(content, list):
        raise invalid(where, "expected a string or an array of content parts.")
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        if not isinstance(part, dict):
            raise invalid(at, "expected a content part object.")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            texts.append(_text_of(part, at))
        elif kind == "refusal":
            refusal = part.get("refusal")
            if not isinstance(refusal, str):
                raise invalid(f"{at}.refusal", "expected a string.")
            texts.append(refusal)
        elif kind == "input_image":
            images.append(_image_part(part, at))
        elif kind == "input_file":
            raise unsupported(
                at, "input_file is not supported: send the file's text as input_text."
            )
        else:
            raise invalid(f"{at}.type", f"unknown content part type {kind!r}.")
    return texts, images


_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class _Messages:
    """The chat messages being built from the input items, in order."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.pending_images: list[dict[str, Any]] = []  # from tool outputs: after the tool run

    def _flush_images(self) -> None:
        if self.pending_images:
            self.messages.append({"role": "user", "content": self.pending_images})
            self.pending_images = []

    def add(self, message: dict[str, Any]) -> None:
        if message["role"] != "tool":
            self._flush_images()
        last = self.messages[-1] if self.messages else None
        if (
            message["role"] == "system"
            and last is not None
            and last["role"] == "system"
            and isinstance(last["content"], str)
            and isinstance(message["content"], str)
        ):
            last["content"] += "\n\n" + message["content"]
            return
        self.messages.append(message)

    def tool_call(self, call: dict[str, Any]) -> None:
        """A call joins the assistant message just before it (text or calls), else starts one."""
        self._flush_images()
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            return
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [call]})

    def done(self) -> list[dict[str, Any]]:
        self._flush_images()
        return self.messages


def _message(item: dict[str, Any], where: str, messages: _Messages) -> None:
    role = item.get("role")
    chat_role = _ROLES.get(role) if isinstance(role, str) else None
    if chat_role is None:
        raise invalid(f"{where}.role", "expected user, system, developer or assistant.")
    texts, images = _parts(item.get("content"), f"{where}.content")
    content: Any
    if images:
        if chat_role != "user":
            raise invalid(f"{where}.content", f"images are accepted in user messages, not {role}.")
        content = [{"type": "text", "text": t} for t in texts] + images
    else:
        content = "\n".join(texts)
    messages.add({"role": chat_role, "content": content})


def _call_id(item: dict[str, Any], where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where}.call_id", "expected a non-empty string.")
    return call_id


def _function_call(item: dict[str, Any], where: str, messages: _Messages) -> None:
    name = tool_name(item, where)
    namespace = item.get("namespace")
    if isinstance(namespace, str) and namespace:
        name = qualified_name(namespace, name)
    arguments = item.get("arguments", "")
    if not isinstance(arguments, str):
        if not isinstance(arguments, dict):
            raise invalid(f"{where}.arguments", "expected a JSON string.")
        arguments = msgspec.json.encode(arguments).decode()
    _add_call(item, where, name, arguments, messages)


def _custom_tool_call(item: dict[str, Any], where: str, messages: _Messages) -> None:
    name = tool_name(item, where)
    text = item.get("input", "")
    if not isinstance(text, str):
        raise invalid(f"{where}.input", "expected a string.")
    _add_call(item, where, name, msgspec.json.encode({"input": text}).decode(), messages)


def _add_call(
    item: dict[str, Any], where: str, name: str, arguments: str, messages: _Messages
) -> None:
    """The chat tool call of a ``function_call`` or ``custom_tool_call`` item."""
    call = {
        "id": _call_id(item, where),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
    messages.tool_call(call)


def _call_output(item: dict[str, Any], where: str, messages: _Messages) -> None:
    call_id = _call_id(item, where)
    output = item.get("output", "")
    texts, images = _parts(output, f"{where}.output")
    messages.add({"role": "tool", "tool_call_id": call_id, "content": "\n".join(texts)})
    messages.pending_images.extend(images)


def _input_items(items: list[Any], messages: _Messages) -> None:
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, "expected an input item object.")
        kind = item.get("type")
        if kind is None or kind == "message":
            _message(item, where, messages)
        elif kind == "function_call":
            _function_call(item, where, messages)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            _call_output(item, where, messages)
        elif kind == "custom_tool_call":
            _custom_tool_call(item, where, messages)
        elif kind == "item_reference":
            raise unsupported(
                f"{where}.type",
                "item_reference is not supported: the hub keeps no response state; send the "
                "whole conversation in input (store: false).",
            )
        elif kind in _IGNORED_ITEM_TYPES:
            continue
        else:
            raise invalid(f"{where}.type", f"unknown input item type {kind!r}.")


# -- the request ------------------------------------------------------------------------------


class ResponsesAsChat(NamedTuple):
    """A translated Responses request."""

    chat: bytes  # the chat-completions body
    stream: bool
    model: str | None
    request: dict[str, Any]  # the Responses request as decoded (for ResponsesStream / fold)


def _number(request: dict[str, Any], field: str) -> float | int | None:
    value = request.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(field, "expected a number.")
    return value


def _response_format(text: Any) -> dict[str, Any] | None:
    if not isinstance(text, dict):
        return None
    fmt = text.get("format")
    if not isinstance(fmt, dict):
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema: dict[str, Any] = {"name": fmt.get("name") or "response"}
        for key in ("schema", "strict", "description"):
            if fmt.get(key) is not None:
                schema[key] = fmt[key]
        return {"type": "json_schema", "json_schema": schema}
    return None


def _invalid_json(why: str) -> ResponsesError:
    return ResponsesError(
        400, f"We could not parse the JSON body of your request: {why}", "invalid_json"
    )


def decode_request(body: bytes) -> dict[str, Any]:
    """The Responses request body as a dict; ResponsesError 400 if it is not a JSON object."""
    if not body.strip():
        raise _invalid_json("it is empty.")
    try:
        request = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise _invalid_json(str(exc)) from None
    except RecursionError:
        raise _invalid_json("it is nested too deeply.") from None
    if not isinstance(request, dict):
        raise ResponsesError(400, "The request body must be a JSON object.", "invalid_request")
    return request


def translate(body: bytes) -> ResponsesAsChat:
    """The Responses request body → its chat-completions body and what the hub needs of it."""
    request = decode_request(body)
    try:
        return _translate(request)
    except RecursionError:
        raise _invalid_json("it is nested too deeply.") from None


def _translate(request: dict[str, Any]) -> ResponsesAsChat:
    if request.get("previous_response_id") is not None:
        raise unsupported(
            "previous_response_id",
            "previous_response_id is not supported: send the whole conversation in input (store: false)",
        )
    if request.get("conversation") is not None:
        raise unsupported(
            "conversation",
            "conversation is not supported: send the whole conversation in input (store: false)",
        )
    model = request.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "expected a string.")
    stream = request.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream", "expected a boolean.")
    messages = _Messages()
    instructions = request.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions", "expected a string.")
        if instructions:
            messages.add({"role": "system", "content": instructions})
    items = request.get("input")
    if isinstance(items, str):
        messages.add({"role": "user", "content": items})
    elif isinstance(items, list):
        _input_items(items, messages)
    elif items is not None:
        raise invalid("input", "expected a string or an array of input items.")
    chat_messages = messages.done()
    if not chat_messages:
        raise ResponsesError(
            400, "Missing required parameter: 'input'.", "missing_required_parameter", "input"
        )
    chat: dict[str, Any] = {}
    if model is not None:
        chat["model"] = model
    chat["messages"] = chat_messages
    tools, names = translate_tools(request.get("tools"))
    if tools:
        chat["tools"] = tools
        if request.get("tool_choice") is not None:
            chat["tool_choice"] = tool_choice(request["tool_choice"], names)
        parallel = request.get("parallel_tool_calls")
        if parallel is not None:
            if not isinstance(parallel, bool):
                raise invalid("parallel_tool_calls", "expected a boolean.")
            chat["parallel_tool_calls"] = parallel
    elif request.get("tool_choice") not in (None, "auto", "none"):
        tool_choice(request["tool_choice"], names)  # names the tool that is not there
    max_tokens = request.get("max_output_tokens")
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise invalid("max_output_tokens", "expected a positive integer.")
        chat["max_tokens"] = max_tokens
    for field in ("temperature", "top_p"):
        value = _number(request, field)
        if value is not None:
            chat[field] = value
    response_format = _response_format(request.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    chat["stream"] = bool(stream)
    if stream:
        chat["stream_options"] = {"include_usage": True}
    return ResponsesAsChat(msgspec.json.encode(chat), bool(stream), model, request)


def to_chat(body: bytes) -> tuple[bytes, bool, str | None]:
    """The Responses request body → (chat-completions body, stream?, model or None);
    ResponsesError 400 for a request that is invalid or asks what the hub cannot do."""
    translated = translate(body)
    return translated.chat, translated.stream, translated.model
