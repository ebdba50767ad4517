"""The front door's three APIs side by side: each request becomes one chat turn (``Turn``),
and each turn's chunks, end and errors become that API's own answer.

Chat completions passes the runner's chunks through as SSE events, bytes verbatim; Anthropic
Messages (``messages``) and the Responses API (``responses``) translate them, each chunk into
its events at once. Pure: no I/O, no trio.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from gateway.hub.frontdoor import messages, responses
from gateway.hub.frontdoor.shapes import (
    DONE_EVENT,
    KEEPALIVE,
    sse_data,
    stream_error_event,
    whole_completion,
)
from gateway.wire.errors import HTTPError


class Translation(Protocol):
    """One streamed turn's answer in its client's API: chunk bytes in, event bytes out."""

    def chunk(self, raw: Any) -> bytes:
        """One ``chat.completion.chunk`` (raw JSON) → its events (``b""``: none)."""

    def done(self) -> bytes:
        """The events that end a turn the runner finished."""

    def error(self, message: str, code: str) -> bytes:
        """The event that ends a stream with an error (``code``: the hub's code for it)."""

    def keepalive(self) -> bytes:
        """What keeps the client patient while no token has come yet."""


class ChatStream:
    """Chat completions: each chunk one ``data:`` event around its bytes, verbatim."""

    __slots__ = ()

    chunk = staticmethod(sse_data)

    def done(self) -> bytes:
        return DONE_EVENT

    def error(self, message: str, code: str) -> bytes:
        return stream_error_event(message, code)

    def keepalive(self) -> bytes:
        return KEEPALIVE


_ANTHROPIC_TYPE_OF_CODE = {"channel_lost": "overloaded_error", "client_too_slow": "api_error"}


class MessagesStream:
    """Anthropic Messages events (``messages.MessagesStream``), ``ping`` while waiting."""

    __slots__ = ("_stream",)

    def __init__(self, model: str, estimate: int) -> None:
        self._stream = messages.MessagesStream(model, messages.new_message_id(), estimate)

    def chunk(self, raw: Any) -> bytes:
        return self._stream.chunk(raw)

    def done(self) -> bytes:
        return self._stream.done()

    def error(self, message: str, code: str) -> bytes:
        return self._stream.error(message, _ANTHROPIC_TYPE_OF_CODE.get(code, "api_error"))

    def keepalive(self) -> bytes:
        return self._stream.ping()


class ResponsesStream:
    """Responses API events (``responses.ResponsesStream``), an SSE comment while waiting."""

    __slots__ = ("_stream",)

    def __init__(self, model: str, request: dict[str, Any]) -> None:
        self._stream = responses.ResponsesStream(model, _response_id(), int(time.time()), request)

    def chunk(self, raw: Any) -> bytes:
        return self._stream.chunk(raw)

    def done(self) -> bytes:
        return self._stream.done()

    def error(self, message: str, code: str) -> bytes:
        return self._stream.error(message, code)

    def keepalive(self) -> bytes:
        return self._stream.keepalive()


@dataclass
class Turn:
    """A request as one chat turn: the chat body for the channel, and how its answer is
    written in the client's API."""

    body: str  # the chat-completions body text sent down the channel
    stream: bool
    new_stream: Callable[[], Translation]  # one per turn
    fold: Callable[[list[bytes]], bytes]  # a non-streamed turn's chunks → the answer
    error_body: Callable[[HTTPError], bytes]  # an error before anything was sent
    api: str = "chat"  # "chat", "messages" or "responses"
    model: str | None = None  # the model asked of the runner (None: the runner's default)
    strip_usage: bool = False  # the hub asked for usage the client did not: keep it from it


def chat_turn(body: str, stream: bool, model: str | None, count_usage: bool = True) -> Turn:
    """A chat-completions turn; when it streams without asking for usage and ``count_usage``,
    the body asks for it (``stream_options.include_usage``) and the usage chunk is kept from
    the client (the hub counts the tokens)."""
    strip = False
    if stream and count_usage:
        obj = msgspec.json.decode(body)
        options = obj.get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage") is True):
            obj["stream_options"] = {
                **(options if isinstance(options, dict) else {}),
                "include_usage": True,
            }
            body = msgspec.json.encode(obj).decode()
            strip = True
    return Turn(body, stream, ChatStream, whole_completion, HTTPError.body, "chat", model, strip)


def anthropic_error_body(err: HTTPError) -> bytes:
    """An error in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``)."""
    own = err.type in _ANTHROPIC_TYPES and err.type != "invalid_request_error"
    type_ = err.type if own else messages.error_type_for_status(err.status)
    return messages.error_body(type_, err.message)


_ANTHROPIC_TYPES = {
    "authentication_error",
    "invalid_request_error",
    "not_found_error",
    "overloaded_error",
    "rate_limit_error",
    "api_error",
    "permission_error",
    "request_too_large",
}


def messages_request(body: bytes) -> messages.ChatRequest:
    """The Messages request translated; HTTPError (Anthropic's type) when it is refused."""
    try:
        return messages.translate(body)
    except messages.MessagesError as exc:
        raise HTTPError(exc.status, exc.message, None, type_=exc.type) from None


def messages_turn(request: messages.ChatRequest, model: str | None, shown: str) -> Turn:
    """A Messages turn asking the runner for ``model`` (None: as the client asked); the client
    sees ``shown`` as the model."""
    body = request.body if model is None else request.body_for(model)
    estimate = request.input_tokens_estimate
    return Turn(
        body.decode(),
        request.stream,
        lambda: MessagesStream(shown, estimate),
        lambda chunks: messages.fold(chunks, shown, messages.new_message_id(), estimate),
        anthropic_error_body,
        "messages",
        model or request.model,
    )


def responses_request(body: bytes) -> responses.ChatRequest:
    """The Responses request translated; HTTPError (OpenAI's shape) when it is refused."""
    try:
        return responses.translate(body)
    except responses.ResponsesError as exc:
        raise HTTPError(exc.status, exc.message, exc.code) from None


def responses_turn(request: responses.ChatRequest, model: str | None, shown: str) -> Turn:
    """A Responses turn asking the runner for ``model`` (None: as the client asked)."""
    chat = request.chat if model is None else with_model(request.chat, model)
    return Turn(
        chat.decode(),
        request.stream,
        lambda: ResponsesStream(shown, request.request),
        lambda chunks: responses.fold(
            chunks, shown, _response_id(), int(time.time()), request.request
        ),
        HTTPError.body,
        "responses",
        model or request.model,
    )


def with_model(body: bytes, model: str) -> bytes:
    """A chat body asking for ``model`` instead (re-encoded: not on the per-chunk path)."""
    obj = msgspec.json.decode(body)
    obj["model"] = model
    return msgspec.json.encode(obj)


def _response_id() -> str:
    return "resp_" + uuid.uuid4().hex
