"""The front door's three APIs side by side: each request becomes the spec of one chat turn
(``TurnSpec``), and each dialect says how that turn's chunks, end and errors are written in its
own API (``Dialect``).

Chat completions passes the runner's chunks through as SSE events, bytes verbatim; Anthropic
Messages and the Responses API translate them, each chunk into its events at once. Pure: no
I/O, no trio.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Protocol

import msgspec

from gateway.apis import messages, responses
from gateway.apis.shapes import (
    DONE_EVENT,
    KEEPALIVE,
    ChatBody,
    estimate_prompt_tokens,
    sse_data,
    stream_error_event,
    whole_completion,
)
from gateway.wire.errors import HTTPError
from gateway.wire.protocol import with_model


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


class Dialect(Protocol):
    """How one API answers a chat turn: its stream's events, a non-streamed answer, errors."""

    api: str  # "chat", "messages" or "responses" (usage rows and metrics name it)

    def stream(self) -> Translation:
        """A new translation for one streamed answer."""

    def fold(self, chunks: list[bytes]) -> bytes:
        """A non-streamed turn's chunks (or one whole completion) → the answer's body."""

    def error_body(self, err: HTTPError) -> bytes:
        """An error in this API's shape."""

    def prompt_estimate(self, body: bytes) -> int:
        """The prompt's tokens, estimated (when the backend did not say)."""


class TurnSpec(msgspec.Struct, frozen=True):
    """A client's request as one chat turn: the chat body for the channel, whether it streams,
    the model asked of the runner, and its dialect. (A frozen Struct, as ``ChatBody``: one is
    built per turn, and a frozen dataclass sets each field through ``object.__setattr__``.)"""

    body: bytes  # the chat-completions body sent down the channel
    stream: bool
    model: str | None  # the model asked of the runner (None: the runner's default)
    dialect: Dialect
    strip_usage: bool = False  # the hub asked for usage the client did not: keep it from it
    max_tokens: int | None = None  # the answer's bound the client set (token reservations)


# -- chat completions ------------------------------------------------------------------


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


class ChatDialect:
    """Chat completions: chunks verbatim, errors in OpenAI's envelope."""

    __slots__ = ()
    api = "chat"

    def stream(self) -> Translation:
        return ChatStream()

    def fold(self, chunks: list[bytes]) -> bytes:
        return whole_completion(chunks)

    def error_body(self, err: HTTPError) -> bytes:
        return err.body()

    def prompt_estimate(self, body: bytes) -> int:
        return estimate_prompt_tokens(body)


CHAT = ChatDialect()
_USAGE_OPTION = b'{"stream_options":{"include_usage":true},'


def chat_spec(parsed: ChatBody, model: str | None, count_usage: bool = True) -> TurnSpec:
    """A chat-completions turn asking the runner for ``model`` (the client's own unless the hub
    maps it); when it streams without asking for usage and ``count_usage``, the body asks for
    it (``stream_options.include_usage``) and the usage chunk is kept from the client (the hub
    counts the tokens)."""
    body = parsed.body
    if model is not None and model != parsed.model:
        body = with_model(body, model)
    strip = False
    if parsed.stream and count_usage and not parsed.usage_asked:
        strip = True
        if parsed.stream_options is None:  # the common case: a splice, no re-encoding
            body = _USAGE_OPTION + body.lstrip()[1:]
        else:
            obj = msgspec.json.decode(body)
            options = obj.get("stream_options")
            obj["stream_options"] = {
                **(options if isinstance(options, dict) else {}),
                "include_usage": True,
            }
            body = msgspec.json.encode(obj)
    return TurnSpec(body, parsed.stream, model or parsed.model, CHAT, strip, parsed.max_tokens)


# -- Anthropic Messages ----------------------------------------------------------------


_ANTHROPIC_TYPE_OF_CODE = {"channel_lost": "overloaded_error", "client_too_slow": "api_error"}
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


def anthropic_error_body(err: HTTPError) -> bytes:
    """An error in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``)."""
    own = err.type in _ANTHROPIC_TYPES and err.type != "invalid_request_error"
    type_ = err.type if own else messages.error_type_for_status(err.status)
    return messages.error_body(type_, err.message)


class MessagesEvents:
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


class MessagesDialect:
    """Anthropic Messages: translated events, errors in Anthropic's shape."""

    __slots__ = ("shown", "estimate")
    api = "messages"

    def __init__(self, shown: str, estimate: int) -> None:
        self.shown = shown  # the model the client sees named
        self.estimate = estimate  # the request's input tokens, estimated

    def stream(self) -> Translation:
        return MessagesEvents(self.shown, self.estimate)

    def fold(self, chunks: list[bytes]) -> bytes:
        return messages.fold(chunks, self.shown, messages.new_message_id(), self.estimate)

    def error_body(self, err: HTTPError) -> bytes:
        return anthropic_error_body(err)

    def prompt_estimate(self, body: bytes) -> int:
        return self.estimate


# -- embeddings (issue 37, point 6): one non-streamed answer, verbatim -------------------


class _EmbeddingsFields(msgspec.Struct):
    model: Any = None
    input: Any = None


_embeddings_decoder = msgspec.json.Decoder(_EmbeddingsFields)


class EmbeddingsDialect:
    """``/v1/embeddings``: the runner's one chunk (the backend's answer) is the answer, its bytes
    verbatim; errors in OpenAI's envelope."""

    __slots__ = ("estimate",)
    api = "embeddings"

    def __init__(self, estimate: int) -> None:
        self.estimate = estimate  # the input's tokens, estimated (characters / 4)

    def stream(self) -> Translation:
        raise AssertionError("embeddings are never streamed")

    def fold(self, chunks: list[bytes]) -> bytes:
        if len(chunks) != 1:
            raise ValueError(f"{len(chunks)} chunks for one embeddings answer")
        return chunks[0]

    def error_body(self, err: HTTPError) -> bytes:
        return err.body()

    def prompt_estimate(self, body: bytes) -> int:
        return self.estimate


def embeddings_spec(body: bytes, model: str | None) -> TurnSpec:
    """A ``/v1/embeddings`` request as one turn, its body verbatim (the model set only when the
    hub maps it to another); 400 for a body that is not a JSON object with a ``model`` string
    and an ``input``."""
    try:
        fields = _embeddings_decoder.decode(body)
        body.decode("utf-8")
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        reason = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise HTTPError(400, f"Invalid embeddings request: {reason}", "invalid_request") from None
    if not isinstance(fields.model, str) or not fields.model:
        raise HTTPError(
            400, "Invalid embeddings request: 'model' must be a string", "invalid_request"
        )
    if not isinstance(fields.input, str | list) or not fields.input:
        raise HTTPError(
            400,
            "Invalid embeddings request: 'input' must be a string or a non-empty list",
            "invalid_request",
        )
    if model is not None and model != fields.model:
        body = with_model(body, model)
    return TurnSpec(
        body, False, model or fields.model, EmbeddingsDialect(_input_tokens(fields.input))
    )


def _input_tokens(value: Any) -> int:
    """An embeddings input's tokens, estimated: characters / 4, a token array's length."""
    if isinstance(value, str):
        return -(-len(value) // 4)
    if isinstance(value, int):
        return 1
    if isinstance(value, list):
        return sum(_input_tokens(item) for item in value)
    return 0


def messages_request(body: bytes) -> messages.MessagesAsChat:
    """The Messages request translated; HTTPError (Anthropic's type) when it is refused."""
    try:
        return messages.translate(body)
    except messages.MessagesError as exc:
        raise HTTPError(exc.status, exc.message, None, type_=exc.type) from None


def messages_spec(request: messages.MessagesAsChat, model: str | None) -> TurnSpec:
    """A Messages turn asking the runner for ``model`` (None: as the client asked); the client
    sees the model it named (or the runner's when it named none)."""
    body = request.body if model is None else request.body_for(model)
    dialect = MessagesDialect(request.model or model or "", request.input_tokens_estimate)
    limit = request.chat.get("max_tokens")
    return TurnSpec(
        body, request.stream, model or request.model, dialect, False, _whole_number(limit)
    )


# -- the Responses API -----------------------------------------------------------------


class ResponsesEvents:
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


class ResponsesDialect:
    """The Responses API: translated events, errors in OpenAI's envelope."""

    __slots__ = ("shown", "request")
    api = "responses"

    def __init__(self, shown: str, request: dict[str, Any]) -> None:
        self.shown = shown
        self.request = request  # the Responses request as decoded

    def stream(self) -> Translation:
        return ResponsesEvents(self.shown, self.request)

    def fold(self, chunks: list[bytes]) -> bytes:
        return responses.fold(chunks, self.shown, _response_id(), int(time.time()), self.request)

    def error_body(self, err: HTTPError) -> bytes:
        return err.body()

    def prompt_estimate(self, body: bytes) -> int:
        return estimate_prompt_tokens(body)


def responses_request(body: bytes) -> responses.ResponsesAsChat:
    """The Responses request translated; HTTPError (OpenAI's shape) when it is refused."""
    try:
        return responses.translate(body)
    except responses.ResponsesError as exc:
        raise HTTPError(exc.status, exc.message, exc.code) from None


def responses_spec(request: responses.ResponsesAsChat, model: str | None) -> TurnSpec:
    """A Responses turn asking the runner for ``model`` (None: as the client asked)."""
    chat = request.chat if model is None else with_model(request.chat, model)
    dialect = ResponsesDialect(request.model or model or "", request.request)
    limit = request.request.get("max_output_tokens")
    return TurnSpec(
        chat, request.stream, model or request.model, dialect, False, _whole_number(limit)
    )


def _whole_number(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _response_id() -> str:
    return "resp_" + uuid.uuid4().hex
