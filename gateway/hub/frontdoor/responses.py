"""OpenAI Responses API (``POST /v1/responses``) ⇄ chat completions, sans-IO.

The hub's runners speak chat completions only; this module translates a Responses request into
a chat-completions body (``to_chat``), a streamed turn's chat chunks into Responses SSE events
(``ResponsesStream``) and a non-streamed turn's chunks into one ``response`` object (``fold``).
Dicts and bytes in, bytes out: no I/O, no clock, no randomness but what the caller passes.

Decisions where the Responses API asks for more than a chat backend has:

* No response state. The hub keeps nothing after a turn, so ``previous_response_id`` is refused
  (400 ``unsupported_parameter``): the client sends the whole conversation in ``input``, as
  Codex does with ``store: false``. ``item_reference`` input items are refused for the same
  reason. Every answer says ``store: false``.
* Tools. ``function`` tools pass on as chat function tools. Codex also sends tools a local model
  cannot serve as such: hosted tools OpenAI runs itself (``web_search``, ``file_search``,
  ``code_interpreter``, ``image_generation``, ``mcp``, ``computer_use*``, ``tool_search``) and
  ``local_shell`` (a tool only OpenAI's own models were trained on). These are dropped, not
  refused, as Codex's own chat-completions client drops them: refusing would make Codex
  unusable against the hub (``web_search`` is on by default in recent Codex), and the model
  simply never sees the tool. A tool ``type`` nobody knows (a typo) is refused, naming it.
  ``custom`` (freeform) tools, e.g. Codex's ``apply_patch``, become a function with one string
  parameter ``input`` (as Codex's chat client does), and a call to one comes back as a
  ``custom_tool_call`` item with that ``input``; ``namespace`` tools (Codex's MCP tools) are
  flattened into functions named ``<namespace><name>`` (``__`` between them unless the
  namespace ends with it) and come back as ``function_call`` items with ``namespace`` set.
  Both round trips need the request: pass it to ``ResponsesStream``/``fold`` (``request=``).
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
  ``user``, ``service_tier`` and unknown fields are ignored.
* Reasoning a backend streams (``reasoning_content``/``reasoning``) becomes a ``reasoning``
  output item with ``reasoning_text`` content, so Codex shows it and the stream is not idle
  while a model thinks; ``reasoning`` input items are ignored.
* ``finish_reason`` ``length`` ends in ``response.incomplete`` (``max_output_tokens``),
  ``content_filter`` in ``response.incomplete`` (``content_filter``); anything else in
  ``response.completed``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from gateway.hub.frontdoor.chunks import (
    ToolCallDelta,
    Usage,
    chunk_decoder,
)

KEEPALIVE = b": keepalive\n\n"

# -- errors ------------------------------------------------------------------------------


class ResponsesError(Exception):
    """A Responses request we refuse, in OpenAI's error shape (the hub's HTTPError wraps it)."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def _invalid(param: str, why: str) -> ResponsesError:
    return ResponsesError(400, f"Invalid '{param}': {why}", "invalid_request", param)


def _unsupported(param: str, message: str) -> ResponsesError:
    return ResponsesError(400, message, "unsupported_parameter", param)


# -- tools ------------------------------------------------------------------------------------

# tool types a local chat model cannot be given: hosted by OpenAI, or native to its own models
DROPPED_TOOL_TYPES = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "code_interpreter",
        "image_generation",
        "mcp",
        "computer_use",
        "computer_use_preview",
        "computer",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)

_CUSTOM_INPUT_DESCRIPTION = "The whole input of the tool, as free text"


class _ToolName(NamedTuple):
    """How a chat function name maps back to a Responses tool."""

    kind: str  # "function" or "custom"
    name: str
    namespace: str | None


def _qualified(namespace: str, name: str) -> str:
    return namespace + name if namespace.endswith("__") else f"{namespace}__{name}"


def _function_tool(tool: dict[str, Any], where: str, name: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    description = tool.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise _invalid(f"{where}.description", "expected a string.")
        function["description"] = description
    parameters = tool.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise _invalid(f"{where}.parameters", "expected a JSON schema object.")
        function["parameters"] = parameters
    strict = tool.get("strict")
    if strict is not None:
        if not isinstance(strict, bool):
            raise _invalid(f"{where}.strict", "expected a boolean.")
        function["strict"] = strict
    return {"type": "function", "function": function}


def _tool_name(tool: dict[str, Any], where: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise _invalid(f"{where}.name", "expected a non-empty string.")
    return name


def _translate_tools(tools: Any) -> tuple[list[dict[str, Any]], dict[str, _ToolName]]:
    """(chat tools, chat function name → Responses tool) for a request's ``tools``."""
    if tools is None:
        return [], {}
    if not isinstance(tools, list):
        raise _invalid("tools", "expected an array of tools.")
    chat: list[dict[str, Any]] = []
    names: dict[str, _ToolName] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _invalid(where, "expected a tool object.")
        kind = tool.get("type")
        if kind == "function":
            name = _tool_name(tool, where)
            chat.append(_function_tool(tool, where, name))
            names[name] = _ToolName("function", name, None)
        elif kind == "custom":
            name = _tool_name(tool, where)
            params = {
                "type": "object",
                "properties": {
                    "input": {"type": "string", "description": _CUSTOM_INPUT_DESCRIPTION}
                },
                "required": ["input"],
                "additionalProperties": False,
            }
            chat.append(_function_tool({**tool, "parameters": params, "strict": None}, where, name))
            names[name] = _ToolName("custom", name, None)
        elif kind == "namespace":
            namespace = _tool_name(tool, where)
            members = tool.get("tools")
            if not isinstance(members, list):
                raise _invalid(f"{where}.tools", "expected an array of function tools.")
            for j, member in enumerate(members):
                inner = f"{where}.tools[{j}]"
                if not isinstance(member, dict) or member.get("type", "function") != "function":
                    raise _invalid(inner, "a namespace holds function tools only.")
                name = _tool_name(member, inner)
                qualified = _qualified(namespace, name)
                chat.append(_function_tool(member, inner, qualified))
                names[qualified] = _ToolName("function", name, namespace)
        elif kind in DROPPED_TOOL_TYPES:
            continue
        else:
            raise _unsupported(
                f"{where}.type",
                f"Tool type {kind!r} is not supported: the hub serves function and custom tools "
                "(hosted tools such as web_search are left out).",
            )
    return chat, names


def _tool_choice(choice: Any, names: dict[str, _ToolName]) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind in ("function", "custom"):
            name = choice.get("name")
            if not isinstance(name, str):
                raise _invalid("tool_choice.name", "expected a string.")
            namespace = choice.get("namespace")
            if isinstance(namespace, str):
                name = _qualified(namespace, name)
            if name not in names:
                raise _invalid("tool_choice.name", f"no function tool named {name!r} in tools.")
            return {"type": "function", "function": {"name": name}}
        raise _unsupported(
            "tool_choice",
            f"tool_choice of type {kind!r} is not supported: use auto, none, required or "
            '{"type": "function", "name": ...}.',
        )
    raise _invalid("tool_choice", 'expected "auto", "none", "required" or a function choice.')


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
        raise _invalid(f"{where}.text", "expected a string.")
    return text


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    url = part.get("image_url")
    if url is None and part.get("file_id") is not None:
        raise _unsupported(
            f"{where}.file_id",
            "input_image by file_id is not supported: the hub holds no files; send the image "
            "as image_url (a URL or a data: URL).",
        )
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise _invalid(f"{where}.image_url", "expected a URL or a data: URL.")
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
        raise _invalid(where, "expected a string or an array of content parts.")
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        if not isinstance(part, dict):
            raise _invalid(at, "expected a content part object.")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            texts.append(_text_of(part, at))
        elif kind == "refusal":
            refusal = part.get("refusal")
            if not isinstance(refusal, str):
                raise _invalid(f"{at}.refusal", "expected a string.")
            texts.append(refusal)
        elif kind == "input_image":
            images.append(_image_part(part, at))
        elif kind == "input_file":
            raise _unsupported(
                at, "input_file is not supported: send the file's text as input_text."
            )
        else:
            raise _invalid(f"{at}.type", f"unknown content part type {kind!r}.")
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
        raise _invalid(f"{where}.role", "expected user, system, developer or assistant.")
    texts, images = _parts(item.get("content"), f"{where}.content")
    content: Any
    if images:
        if chat_role != "user":
            raise _invalid(f"{where}.content", f"images are accepted in user messages, not {role}.")
        content = [{"type": "text", "text": t} for t in texts] + images
    else:
        content = "\n".join(texts)
    messages.add({"role": chat_role, "content": content})


def _call_id(item: dict[str, Any], where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise _invalid(f"{where}.call_id", "expected a non-empty string.")
    return call_id


def _function_call(item: dict[str, Any], where: str, messages: _Messages) -> None:
    name = _tool_name(item, where)
    namespace = item.get("namespace")
    if isinstance(namespace, str) and namespace:
        name = _qualified(namespace, name)
    arguments = item.get("arguments", "")
    if not isinstance(arguments, str):
        if not isinstance(arguments, dict):
            raise _invalid(f"{where}.arguments", "expected a JSON string.")
        arguments = msgspec.json.encode(arguments).decode()
    _add_call(item, where, name, arguments, messages)


def _custom_tool_call(item: dict[str, Any], where: str, messages: _Messages) -> None:
    name = _tool_name(item, where)
    text = item.get("input", "")
    if not isinstance(text, str):
        raise _invalid(f"{where}.input", "expected a string.")
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
            raise _invalid(where, "expected an input item object.")
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
            raise _unsupported(
                f"{where}.type",
                "item_reference is not supported: the hub keeps no response state; send the "
                "whole conversation in input (store: false).",
            )
        elif kind in _IGNORED_ITEM_TYPES:
            continue
        else:
            raise _invalid(f"{where}.type", f"unknown input item type {kind!r}.")


# -- the request ------------------------------------------------------------------------------


class ChatRequest(NamedTuple):
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
        raise _invalid(field, "expected a number.")
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


def translate(body: bytes) -> ChatRequest:
    """The Responses request body → its chat-completions body and what the hub needs of it."""
    request = decode_request(body)
    try:
        return _translate(request)
    except RecursionError:
        raise _invalid_json("it is nested too deeply.") from None


def _translate(request: dict[str, Any]) -> ChatRequest:
    if request.get("previous_response_id") is not None:
        raise _unsupported(
            "previous_response_id",
            "previous_response_id is not supported: send the whole conversation in input (store: false)",
        )
    if request.get("conversation") is not None:
        raise _unsupported(
            "conversation",
            "conversation is not supported: send the whole conversation in input (store: false)",
        )
    model = request.get("model")
    if model is not None and not isinstance(model, str):
        raise _invalid("model", "expected a string.")
    stream = request.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _invalid("stream", "expected a boolean.")
    messages = _Messages()
    instructions = request.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _invalid("instructions", "expected a string.")
        if instructions:
            messages.add({"role": "system", "content": instructions})
    items = request.get("input")
    if isinstance(items, str):
        messages.add({"role": "user", "content": items})
    elif isinstance(items, list):
        _input_items(items, messages)
    elif items is not None:
        raise _invalid("input", "expected a string or an array of input items.")
    chat_messages = messages.done()
    if not chat_messages:
        raise ResponsesError(
            400, "Missing required parameter: 'input'.", "missing_required_parameter", "input"
        )
    chat: dict[str, Any] = {}
    if model is not None:
        chat["model"] = model
    chat["messages"] = chat_messages
    tools, names = _translate_tools(request.get("tools"))
    if tools:
        chat["tools"] = tools
        if request.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(request["tool_choice"], names)
        parallel = request.get("parallel_tool_calls")
        if parallel is not None:
            if not isinstance(parallel, bool):
                raise _invalid("parallel_tool_calls", "expected a boolean.")
            chat["parallel_tool_calls"] = parallel
    elif request.get("tool_choice") not in (None, "auto", "none"):
        _tool_choice(request["tool_choice"], names)  # names the tool that is not there
    max_tokens = request.get("max_output_tokens")
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise _invalid("max_output_tokens", "expected a positive integer.")
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
    return ChatRequest(msgspec.json.encode(chat), bool(stream), model, request)


def to_chat(body: bytes) -> tuple[bytes, bool, str | None]:
    """The Responses request body → (chat-completions body, stream?, model or None);
    ResponsesError 400 for a request that is invalid or asks what the hub cannot do."""
    translated = translate(body)
    return translated.chat, translated.stream, translated.model


def tool_names(request: dict[str, Any] | None) -> dict[str, _ToolName]:
    """Chat function name → Responses tool, for a (valid) request; {} when it has none."""
    if not request:
        return {}
    try:
        return _translate_tools(request.get("tools"))[1]
    except (ResponsesError, RecursionError):
        return {}


# -- chat chunks -----------------------------------------------------------------------------


_encoder = msgspec.json.Encoder()


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _usage(usage: Usage) -> dict[str, Any]:
    prompt = _int(usage.prompt_tokens)
    completion = _int(usage.completion_tokens)
    total = usage.total_tokens
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else None
    reasoning = (
        usage.completion_tokens_details.reasoning_tokens
        if usage.completion_tokens_details
        else None
    )
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": _int(cached)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": _int(reasoning)},
        "total_tokens": _int(total) if isinstance(total, int) else prompt + completion,
    }


def _error_message(error: Any) -> tuple[str, str]:
    if isinstance(error, dict):
        message = error.get("message")
        code = error.get("code")
        return (
            message if isinstance(message, str) else _encoder.encode(error).decode(),
            code if isinstance(code, str) else "server_error",
        )
    return (error if isinstance(error, str) else _encoder.encode(error).decode()), "server_error"


# -- the stream ------------------------------------------------------------------------


class _TextItem:
    """An output item with one text part: a ``message`` (output_text) or ``reasoning``."""

    __slots__ = ("kind", "item_id", "output_index", "pieces", "delta_head")

    def __init__(self, kind: str, item_id: str, output_index: int) -> None:
        self.kind = kind  # "message" or "reasoning"
        self.item_id = item_id
        self.output_index = output_index
        self.pieces: list[str] = []
        # the bytes of a delta event after its sequence number, up to its delta
        self.delta_head = (
            b',"item_id":'
            + _encoder.encode(item_id)
            + b',"output_index":'
            + str(output_index).encode()
            + b',"content_index":0,"delta":'
        )

    @property
    def part_type(self) -> str:
        return "output_text" if self.kind == "message" else "reasoning_text"

    def part(self, text: str) -> dict[str, Any]:
        if self.kind == "message":
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "reasoning_text", "text": text}

    def item(self, status: str, text: str | None) -> dict[str, Any]:
        content: list[dict[str, Any]] = [] if text is None else [self.part(text)]
        if self.kind == "message":
            return {
                "id": self.item_id,
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": content,
            }
        return {
            "id": self.item_id,
            "type": "reasoning",
            "status": status,
            "summary": [],
            "content": content,
        }


class _CallItem:
    """A ``function_call`` (or ``custom_tool_call``) item, from one chat tool call index."""

    __slots__ = (
        "item_id",
        "output_index",
        "call_id",
        "wanted_id",
        "chat_name",
        "pieces",
        "added",
        "tool",
    )

    def __init__(self) -> None:
        self.item_id = ""
        self.output_index = -1
        self.call_id: str | None = None
        self.wanted_id: str | None = None  # the backend's id for the call
        self.chat_name = ""
        self.pieces: list[str] = []
        self.added = False
        self.tool: _ToolName | None = None

    @property
    def custom(self) -> bool:
        return self.tool is not None and self.tool.kind == "custom"

    def arguments(self) -> str:
        return "".join(self.pieces)

    def custom_input(self) -> str:
        arguments = self.arguments()
        try:
            decoded = msgspec.json.decode(arguments)
        except (msgspec.DecodeError, RecursionError):
            return arguments
        if isinstance(decoded, dict) and isinstance(decoded.get("input"), str):
            return str(decoded["input"])
        return arguments

    def item(self, status: str, done: bool) -> dict[str, Any]:
        name = self.tool.name if self.tool is not None else self.chat_name
        if self.custom:
            return {
                "id": self.item_id,
                "type": "custom_tool_call",
                "status": status,
                "call_id": self.call_id,
                "name": name,
                "input": self.custom_input() if done else "",
            }
        item = {
            "id": self.item_id,
            "type": "function_call",
            "status": status,
            "call_id": self.call_id,
            "name": name,
            "arguments": self.arguments() if done else "",
        }
        if self.tool is not None and self.tool.namespace is not None:
            item["namespace"] = self.tool.namespace
        return item


_ECHO_DEFAULTS: dict[str, Any] = {
    "instructions": None,
    "max_output_tokens": None,
    "parallel_tool_calls": True,
    "temperature": None,
    "tool_choice": "auto",
    "tools": [],
    "top_p": None,
    "metadata": {},
    "text": {"format": {"type": "text"}},
    "reasoning": {"effort": None, "summary": None},
    "truncation": "disabled",
    "user": None,
}


def _echo(request: dict[str, Any] | None) -> dict[str, Any]:
    """The request's fields a response object repeats (defaults where the request had none)."""
    echo = dict(_ECHO_DEFAULTS)
    if request:
        for key in echo:
            value = request.get(key)
            if value is not None:
                echo[key] = value
    return echo


STARTED, ENDED = 1, 2


class ResponsesStream:
    """One streamed turn: chat chunks in, Responses SSE bytes out, each chunk's events at once.

    ``start()`` (or the first ``chunk()``) writes ``response.created`` and
    ``response.in_progress``; ``chunk()`` the events of one chat chunk; ``done()`` closes the
    open items and ends with ``response.completed`` or ``response.incomplete``; ``error()`` ends
    with ``response.failed``. After the end every call answers b"". ``request``: the decoded
    Responses request (``ChatRequest.request``), for the echoed fields and the custom and
    namespace tools' names."""

    def __init__(
        self, model: str, response_id: str, created_at: int, request: dict[str, Any] | None = None
    ) -> None:
        self.model = model
        self.response_id = response_id
        self.created_at = created_at
        self._echo = _echo(request)
        self._tools = tool_names(request)
        self._seq = 0
        self._state = 0
        self._quiet = False  # fold: state only, no events
        self._items: list[_TextItem | _CallItem] = []  # in output_index order
        self._message: _TextItem | None = None
        self._reasoning: _TextItem | None = None
        self._calls: dict[Any, _CallItem] = {}
        self._call_ids: set[str] = set()
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None
        self._suffix = response_id.removeprefix("resp_") or response_id
        self.final: dict[str, Any] | None = None  # the response object the stream ended with

    # -- events

    def _event(self, type_: str, fields: dict[str, Any]) -> bytes:
        seq = self._seq
        self._seq += 1
        if self._quiet:
            return b""
        payload = {"type": type_, "sequence_number": seq, **fields}
        return b"event: " + type_.encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"

    def _response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": output,
            "previous_response_id": None,
            "store": False,
            **self._echo,
            "usage": None,
        }

    def start(self) -> bytes:
        """``response.created`` and ``response.in_progress`` (once)."""
        if self._state:
            return b""
        self._state = STARTED
        created = self._event("response.created", {"response": self._response("in_progress", [])})
        progress = self._event(
            "response.in_progress", {"response": self._response("in_progress", [])}
        )
        return created + progress

    def keepalive(self) -> bytes:
        """An SSE comment, while waiting for the first token."""
        return KEEPALIVE if self._state != ENDED else b""

    # -- items

    def _open_text(self, kind: str) -> tuple[_TextItem, bytes]:
        index = len(self._items)
        prefix = "msg" if kind == "message" else "rs"
        item = _TextItem(kind, f"{prefix}_{self._suffix}_{index}", index)
        self._items.append(item)
        added = self._event(
            "response.output_item.added",
            {"output_index": index, "item": item.item("in_progress", None)},
        )
        part = self._event(
            "response.content_part.added",
            {
                "item_id": item.item_id,
                "output_index": index,
                "content_index": 0,
                "part": item.part(""),
            },
        )
        return item, added + part

    def _text(self, kind: str, text: str) -> bytes:
        item = self._message if kind == "message" else self._reasoning
        head = b""
        if item is None:
            item, head = self._open_text(kind)
            if kind == "message":
                self._message = item
            else:
                self._reasoning = item
        item.pieces.append(text)
        seq = self._seq
        self._seq += 1
        if self._quiet:
            return b""
        if kind == "message":
            return (
                head
                + b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
                b'"sequence_number":'
                + str(seq).encode()
                + item.delta_head
                + _encoder.encode(text)
                + b',"logprobs":[]}\n\n'
            )
        return (
            head
            + b'event: response.reasoning_text.delta\ndata: {"type":"response.reasoning_text.delta",'
            b'"sequence_number":'
            + str(seq).encode()
            + item.delta_head
            + _encoder.encode(text)
            + b"}\n\n"
        )

    def _unique_call_id(self, call_id: Any) -> str:
        if not isinstance(call_id, str) or not call_id or call_id in self._call_ids:
            call_id = f"call_{self._suffix}_{len(self._call_ids)}"
            while call_id in self._call_ids:
                call_id += "_"
        self._call_ids.add(call_id)
        return call_id

    def _add_call(self, call: _CallItem, call_id: Any) -> bytes:
        index = len(self._items)
        call.output_index = index
        call.item_id = f"{'ctc' if call.custom else 'fc'}_{self._suffix}_{index}"
        call.call_id = self._unique_call_id(call_id)
        call.added = True
        self._items.append(call)
        out = self._event(
            "response.output_item.added",
            {"output_index": index, "item": call.item("in_progress", done=False)},
        )
        if call.pieces and not call.custom:
            out += self._arguments_delta(call, "".join(call.pieces))
        return out

    def _arguments_delta(self, call: _CallItem, delta: str) -> bytes:
        return self._event(
            "response.function_call_arguments.delta",
            {"item_id": call.item_id, "output_index": call.output_index, "delta": delta},
        )

    def _tool_call(self, position: int, delta: ToolCallDelta) -> bytes:
        key = delta.index if isinstance(delta.index, int) else position
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = _CallItem()
        function = delta.function
        name = function.name if function is not None else None
        arguments = function.arguments if function is not None else None
        if arguments is not None and not isinstance(arguments, str):
            arguments = _encoder.encode(arguments).decode()  # an object, not a JSON string
        out = b""
        if call.wanted_id is None and isinstance(delta.id, str) and delta.id:
            call.wanted_id = delta.id
        if not call.added:
            if isinstance(name, str) and name:
                call.chat_name = name
                call.tool = self._tools.get(name)
            if arguments:
                call.pieces.append(arguments)
            if call.chat_name:
                out = self._add_call(call, call.wanted_id)
            return out
        if isinstance(name, str) and name and name != call.chat_name:
            # a name in pieces: the item's name was announced; it is completed at done
            call.chat_name += name
            call.tool = self._tools.get(call.chat_name)
        if arguments:
            call.pieces.append(arguments)
            if not call.custom:
                out = self._arguments_delta(call, arguments)
        return out

    def chunk(self, raw: bytes) -> bytes:
        """One ``chat.completion.chunk`` (or a whole ``chat.completion``) → its events."""
        if self._state == ENDED:
            return b""
        try:
            chunk = chunk_decoder.decode(raw)
        except (msgspec.DecodeError, RecursionError):
            return b""
        out = self.start()
        if chunk.error is not None and not chunk.choices:
            message, code = _error_message(chunk.error)
            return out + self.error(message, code)
        for choice in chunk.choices or ():
            if choice.index not in (0, None):
                continue  # n > 1: the first choice only
            delta = choice.delta if choice.delta is not None else choice.message
            if delta is not None:
                reasoning = delta.reasoning_content
                if not isinstance(reasoning, str):
                    reasoning = delta.reasoning
                if isinstance(reasoning, str) and reasoning:
                    out += self._text("reasoning", reasoning)
                content = delta.content
                if isinstance(content, str) and content:
                    out += self._text("message", content)
                refusal = delta.refusal
                if isinstance(refusal, str) and refusal:
                    out += self._text("message", refusal)
                for position, call in enumerate(delta.tool_calls or ()):
                    out += self._tool_call(position, call)
            if isinstance(choice.finish_reason, str) and choice.finish_reason:
                self._finish = choice.finish_reason
        if chunk.usage is not None:
            self._usage = _usage(chunk.usage)
        return out

    # -- the end

    def _close(self, status: str) -> tuple[bytes, list[dict[str, Any]]]:
        """The closing events of every item, in order, and the items as they end."""
        out = b""
        output: list[dict[str, Any]] = []
        for call in self._calls.values():
            if not call.added:  # a call that never got a name
                out += self._add_call(call, call.wanted_id)
        for item in self._items:
            if isinstance(item, _TextItem):
                text = "".join(item.pieces)
                fields = {
                    "item_id": item.item_id,
                    "output_index": item.output_index,
                    "content_index": 0,
                }
                done_type = (
                    "response.output_text.done"
                    if item.kind == "message"
                    else "response.reasoning_text.done"
                )
                extra: dict[str, Any] = {"logprobs": []} if item.kind == "message" else {}
                out += self._event(done_type, {**fields, "text": text, **extra})
                out += self._event(
                    "response.content_part.done", {**fields, "part": item.part(text)}
                )
                done = item.item(status, text)
            else:
                done = item.item(status, done=True)
                fields = {"item_id": item.item_id, "output_index": item.output_index}
                if item.custom:
                    out += self._event(
                        "response.custom_tool_call_input.delta", {**fields, "delta": done["input"]}
                    )
                    out += self._event(
                        "response.custom_tool_call_input.done", {**fields, "input": done["input"]}
                    )
                else:
                    out += self._event(
                        "response.function_call_arguments.done",
                        {**fields, "name": done["name"], "arguments": done["arguments"]},
                    )
            out += self._event(
                "response.output_item.done", {"output_index": item.output_index, "item": done}
            )
            output.append(done)
        return out, output

    def done(self) -> bytes:
        """Close the open items, then ``response.completed`` (``response.incomplete`` when the
        backend stopped at its token limit or filtered the answer)."""
        if self._state == ENDED:
            return b""
        out = self.start()
        reason = {"length": "max_output_tokens", "content_filter": "content_filter"}.get(
            self._finish or ""
        )
        status = "incomplete" if reason else "completed"
        closing, output = self._close(status)
        response = self._response(status, output)
        response["usage"] = self._usage
        if reason:
            response["incomplete_details"] = {"reason": reason}
        self._state = ENDED
        self.final = response
        return out + closing + self._event(f"response.{status}", {"response": response})

    def error(self, message: str, code: str = "server_error") -> bytes:
        """``response.failed`` with the error; ends the stream (open items are not closed)."""
        if self._state == ENDED:
            return b""
        out = self.start()
        output: list[dict[str, Any]] = []
        for item in self._items:
            if isinstance(item, _TextItem):
                output.append(item.item("incomplete", "".join(item.pieces)))
            else:
                output.append(item.item("incomplete", done=True))
        response = self._response("failed", output)
        response["usage"] = self._usage
        response["error"] = {"code": code, "message": message}
        self._state = ENDED
        self.final = response
        return out + self._event("response.failed", {"response": response})


def output_text(response: dict[str, Any]) -> str:
    """The text of a response's message items, joined (what the SDKs call ``output_text``)."""
    return "".join(
        part.get("text", "")
        for item in response.get("output", [])
        if item.get("type") == "message"
        for part in item.get("content", [])
        if part.get("type") == "output_text"
    )


def fold(
    chunks: list[bytes],
    model: str,
    response_id: str,
    created_at: int,
    request: dict[str, Any] | None = None,
) -> bytes:
    """A non-streamed turn's answer: its chat chunks (or one whole ``chat.completion``) → one
    ``response`` object as JSON bytes."""
    stream = ResponsesStream(model, response_id, created_at, request)
    stream._quiet = True
    for raw in chunks:
        stream.chunk(raw)
    stream.done()
    response = stream.final
    assert response is not None
    response["output_text"] = output_text(response)
    return _encoder.encode(response)
