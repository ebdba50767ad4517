"""Chat chunks back into a Responses answer, sans-IO: SSE events as they come, or one response
folded.

``ResponsesStream`` turns a streamed turn's chat chunks into Responses SSE events, one chunk at a
time; ``fold`` makes one ``response`` object of a non-streamed turn's chunks (or of one whole
``chat.completion``). Bytes in, bytes out: no I/O, no clock, no randomness but what the caller
passes (the response id, its creation time, the decoded request).

* No response state: every answer says ``store: false``.
* Reasoning a backend streams (``reasoning_content``/``reasoning``) becomes a ``reasoning``
  output item with ``reasoning_text`` content, so Codex shows it and the stream is not idle
  while a model thinks.
* A call to a ``custom`` tool comes back as a ``custom_tool_call`` item with its ``input``, one
  to a ``namespace`` tool as a ``function_call`` item with ``namespace`` set (``tools``).
* ``finish_reason`` ``length`` ends in ``response.incomplete`` (``max_output_tokens``),
  ``content_filter`` in ``response.incomplete`` (``content_filter``); anything else in
  ``response.completed``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.apis.chunks import (
    ToolCallDelta,
    Usage,
    chunk_decoder,
)
from gateway.apis.responses.items import CallItem, TextItem
from gateway.apis.responses.tools import tool_names

__all__ = ["ENDED", "KEEPALIVE", "STARTED", "ResponsesStream", "fold", "output_text"]

KEEPALIVE = b": keepalive\n\n"

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
        self._items: list[TextItem | CallItem] = []  # in output_index order
        self._message: TextItem | None = None
        self._reasoning: TextItem | None = None
        self._calls: dict[Any, CallItem] = {}
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

    def _open_text(self, kind: str) -> tuple[TextItem, bytes]:
        index = len(self._items)
        prefix = "msg" if kind == "message" else "rs"
        item = TextItem(kind, f"{prefix}_{self._suffix}_{index}", index)
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

    def _add_call(self, call: CallItem, call_id: Any) -> bytes:
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

    def _arguments_delta(self, call: CallItem, delta: str) -> bytes:
        return self._event(
            "response.function_call_arguments.delta",
            {"item_id": call.item_id, "output_index": call.output_index, "delta": delta},
        )

    def _tool_call(self, position: int, delta: ToolCallDelta) -> bytes:
        key = delta.index if isinstance(delta.index, int) else position
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = CallItem()
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
            if isinstance(item, TextItem):
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
            if isinstance(item, TextItem):
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
