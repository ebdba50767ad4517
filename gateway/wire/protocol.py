"""Chat Channel frames (docs/protocol.md §4, §6): typed, decoded and encoded without I/O.

Inbound frames are decoded with msgspec straight into small Structs; the
``body`` of a completion request stays a ``msgspec.Raw`` so it is forwarded
without being parsed. Outbound frames are Structs too, encoded by one encoder
(``encode_frame``); a chunk frame's ``chunk`` is a ``msgspec.Raw``: the backend's
``data:`` payload goes into the frame unchanged, never re-encoded, and a turn's
chunk frames come from its ``TurnFrames`` (the encoder's frame, made once per turn).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

CAPABILITY = "chat-llm:v1"
# extension (§6): in every poll's capabilities of a runner of the fallback tier (``--tier``)
FALLBACK_TIER = "tier:fallback"

# Frame types, Server -> Runner.
COMPLETION_REQUEST = "chat.completion.request"
COMPLETION_CANCEL = "chat.completion.cancel"
MODELS_REQUEST = "chat.models.request"
END = "chat.end"
HELLO = "chat.channel.hello"  # extension (§6): the first frame of a Server that has extensions
EMBEDDINGS_REQUEST = "chat.embeddings.request"  # extension (§6): one /v1/embeddings request
# Frame types, Runner -> Server.
COMPLETION_CHUNK = "chat.completion.chunk"
COMPLETION_DONE = "chat.completion.done"
COMPLETION_ERROR = "chat.completion.error"
MODELS_RESPONSE = "chat.models.response"

CANCELLED = "cancelled"
# The extensions of §6 a Server names in its hello, and the errors they add.
RESUME = "resume"  # a dropped channel's turns go on on its redial, from the counts named
CONTINUE = "continue"  # ``continuation: true`` on a request: continue its final assistant message
EMBEDDINGS = "embeddings"  # ``chat.embeddings.request``: a /v1/embeddings body for the backend
# the channel (its frames, pings and pongs) is its job's sign of life: no heartbeat while it is up
LIVENESS = "liveness"
RESUME_UNAVAILABLE = "resume_unavailable"  # a named turn's frames from its count are not kept
CONTINUATION_UNSUPPORTED = "continuation_unsupported"  # no backend can continue a message


class FrameError(ValueError):
    """A frame that cannot be served; ``request_id`` is set when the frame named one."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class CompletionRequest(msgspec.Struct, frozen=True, tag_field="type", tag=COMPLETION_REQUEST):
    """``chat.completion.request``: one turn. ``body`` is kept as raw JSON bytes."""

    requestId: str
    body: msgspec.Raw
    jobId: str | None = None
    model: str | None = None
    # extension (§6): the W3C trace context of this turn's request; checked only when tracing
    # is on (``gateway.wire.traceparent.valid_traceparent``), so any value is taken, none refused
    traceparent: Any = None
    # extension (§6): ``body.messages`` ends with the answer so far, to be continued
    continuation: bool = False


class CompletionCancel(msgspec.Struct, frozen=True, tag_field="type", tag=COMPLETION_CANCEL):
    """``chat.completion.cancel`` (extension, §6): stop that turn now."""

    requestId: str
    jobId: str | None = None


class ModelsRequest(msgspec.Struct, frozen=True, tag_field="type", tag=MODELS_REQUEST):
    """``chat.models.request``: which models can this Runner serve?"""

    requestId: str
    jobId: str | None = None


class End(msgspec.Struct, frozen=True, tag_field="type", tag=END):
    """``chat.end``: the session is over."""

    reason: str | None = None
    jobId: str | None = None


class Hello(msgspec.Struct, frozen=True, tag_field="type", tag=HELLO):
    """``chat.channel.hello`` (extension, §6): the Server's extensions, and on a redialled
    channel how many chunk frames of each turn it still has a client for it received."""

    extensions: list[Any] = []  # what the Server supports; entries not known here are ignored
    resume: dict[str, Annotated[int, msgspec.Meta(ge=0)]] | None = None
    jobId: str | None = None

    @property
    def resumes(self) -> bool:
        return RESUME in self.extensions


class EmbeddingsRequest(msgspec.Struct, frozen=True, tag_field="type", tag=EMBEDDINGS_REQUEST):
    """``chat.embeddings.request`` (extension, §6): a ``/v1/embeddings`` body (raw JSON bytes),
    posted to a backend that serves its model; answered as a non-streamed turn is."""

    requestId: str
    body: msgspec.Raw
    jobId: str | None = None


class Unknown(msgspec.Struct, frozen=True):
    """A frame whose ``type`` this Runner does not know: ignored."""

    type: str


InboundFrame = (
    CompletionRequest | CompletionCancel | ModelsRequest | End | Hello | EmbeddingsRequest | Unknown
)


class _Envelope(msgspec.Struct):
    type: str
    requestId: Any = None


class _BodyModel(msgspec.Struct):
    model: Any = None


# every known inbound frame in one pass (the ``type`` picks the Struct); a frame this fails
# (an unknown type, a field missing or mistyped) is decoded again the slow way, for its error
_frame_decoder = msgspec.json.Decoder(
    CompletionRequest | CompletionCancel | ModelsRequest | End | Hello | EmbeddingsRequest
)
_envelope_decoder = msgspec.json.Decoder(_Envelope)
_decoders: dict[str, msgspec.json.Decoder[Any]] = {
    COMPLETION_REQUEST: msgspec.json.Decoder(CompletionRequest),
    COMPLETION_CANCEL: msgspec.json.Decoder(CompletionCancel),
    MODELS_REQUEST: msgspec.json.Decoder(ModelsRequest),
    END: msgspec.json.Decoder(End),
    HELLO: msgspec.json.Decoder(Hello),
    EMBEDDINGS_REQUEST: msgspec.json.Decoder(EmbeddingsRequest),
}
_body_model_decoder = msgspec.json.Decoder(_BodyModel)
_encoder = msgspec.json.Encoder()


def decode_frame(data: str | bytes) -> InboundFrame:
    """Decode one inbound text message into a frame.

    Raises ``FrameError`` for anything that is not a JSON object with a string
    ``type``, or a known type with missing or mistyped fields; the error carries
    the frame's ``requestId`` when it had a usable one, so the turn can be answered.
    """
    try:
        frame: InboundFrame = _frame_decoder.decode(data)  # the usual case: parsed once
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return _decode_slowly(data)
    if type(frame) is CompletionRequest or type(frame) is EmbeddingsRequest:
        _check_body(frame)
    return frame


def _check_body(frame: CompletionRequest | EmbeddingsRequest) -> None:
    body = bytes(frame.body)
    if body[:1] != b"{" and not body.lstrip().startswith(b"{"):
        kind = COMPLETION_REQUEST if isinstance(frame, CompletionRequest) else EMBEDDINGS_REQUEST
        raise FrameError(f"bad {kind} frame: body is not an object", frame.requestId)


def _decode_slowly(data: str | bytes) -> InboundFrame:
    """``decode_frame`` for a frame of an unknown type or a bad one: its envelope first (for
    the ``requestId`` an error names), then its Struct."""
    try:
        envelope = _envelope_decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise FrameError(f"not a JSON frame object: {exc}") from None
    except RecursionError:
        raise FrameError("frame nested too deeply", _scan_request_id(data)) from None
    request_id = envelope.requestId if isinstance(envelope.requestId, str) else None
    decoder = _decoders.get(envelope.type)
    if decoder is None:
        return Unknown(envelope.type)
    try:
        frame = decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise FrameError(f"bad {envelope.type} frame: {exc}", request_id) from None
    except RecursionError:
        raise FrameError(f"bad {envelope.type} frame: nested too deeply", request_id) from None
    if isinstance(frame, CompletionRequest | EmbeddingsRequest):
        _check_body(frame)
    return frame


_REQUEST_ID = re.compile(r'"requestId"\s*:\s*"([^"\\]{1,256})"')


def _scan_request_id(data: str | bytes) -> str | None:
    """Best effort, on the error path only: the requestId of a frame too deep to decode."""
    text = data if isinstance(data, str) else data.decode(errors="replace")
    found = _REQUEST_ID.search(text)
    return found.group(1) if found else None


def body_model(body: bytes) -> str | None:
    """The ``model`` named inside a chat-completions body, if it is a string."""
    try:
        found = _body_model_decoder.decode(body).model
    except (msgspec.DecodeError, RecursionError):
        return None
    return found if isinstance(found, str) else None


def with_model(body: bytes, model: str) -> bytes:
    """``body`` with its ``model`` set to ``model`` (once per turn, never per chunk)."""
    if body_model(body) == model:
        return body
    return with_fields(body, {"model": model}, "a model")


def with_fields(body: bytes, fields: dict[str, Any], what: str = "its fields") -> bytes:
    """``body`` (a JSON object) with ``fields`` set (once per turn, never per chunk);
    ``FrameError`` naming ``what`` when it cannot take them."""
    try:
        obj = msgspec.json.decode(body)
        obj.update(fields)
        return _encoder.encode(obj)
    except (msgspec.DecodeError, RecursionError, TypeError, AttributeError) as exc:
        raise FrameError(f"body cannot carry {what}: {type(exc).__name__}") from None


# -- Runner -> Server frames: one encoder (msgspec), the chunk a ``Raw`` spliced in unparsed --


class ChunkFrame(msgspec.Struct, tag_field="type", tag=COMPLETION_CHUNK):
    """``chat.completion.chunk``: one backend event's payload, as the backend wrote it."""

    jobId: str
    requestId: str
    chunk: msgspec.Raw


class DoneFrame(msgspec.Struct, tag_field="type", tag=COMPLETION_DONE):
    """``chat.completion.done``: the turn's answer is whole."""

    jobId: str
    requestId: str


class ErrorFrame(msgspec.Struct, tag_field="type", tag=COMPLETION_ERROR):
    """``chat.completion.error``: the turn ended without its answer; ``error`` says why."""

    jobId: str
    requestId: str
    error: str


class ModelsFrame(msgspec.Struct, tag_field="type", tag=MODELS_RESPONSE, omit_defaults=True):
    """``chat.models.response``: the models this Runner serves; ``contexts`` (extension, §6):
    the context length of those whose backend says it, in tokens (absent when none does)."""

    jobId: str
    requestId: str
    models: list[str]
    contexts: dict[str, Annotated[int, msgspec.Meta(gt=0)]] | None = None
    # extension (§6): what of the Server's hello this runner takes up (``embeddings``); only
    # on a channel whose hello offered it
    extensions: list[str] | None = None


class EndFrame(msgspec.Struct, tag_field="type", tag=END):
    """``chat.end`` from the Runner: it ends the session; ``reason`` says why."""

    jobId: str
    reason: str


# -- Server -> Runner frames (the hub's side), through the same encoder --


class RequestFrame(msgspec.Struct, tag_field="type", tag=COMPLETION_REQUEST, omit_defaults=True):
    """``chat.completion.request``: the client's body, a ``Raw`` copied in as it came (never
    re-encoded), with the turn's ``traceparent`` when it has one, and ``continuation`` when its
    body ends with an answer so far to be continued (§6)."""

    jobId: str
    requestId: str
    body: msgspec.Raw
    traceparent: str | None = None
    continuation: bool = False


class EmbeddingsRequestFrame(msgspec.Struct, tag_field="type", tag=EMBEDDINGS_REQUEST):
    """``chat.embeddings.request``: the client's ``/v1/embeddings`` body, a ``Raw`` copied in as
    it came (never re-encoded), to a runner that took up the extension (§6)."""

    jobId: str
    requestId: str
    body: msgspec.Raw


class HelloFrame(msgspec.Struct, tag_field="type", tag=HELLO, omit_defaults=True):
    """``chat.channel.hello``: the first frame on a channel of a Server that has extensions;
    ``resume`` only on a channel that replaces a dropped one (§6)."""

    jobId: str
    extensions: list[str]
    resume: dict[str, int] | None = None


class CancelFrame(msgspec.Struct, tag_field="type", tag=COMPLETION_CANCEL):
    """``chat.completion.cancel``: nobody reads the turn any more."""

    jobId: str
    requestId: str


class ModelsRequestFrame(msgspec.Struct, tag_field="type", tag=MODELS_REQUEST):
    """``chat.models.request``: which models does this Runner serve?"""

    jobId: str
    requestId: str


OutboundFrame = (
    ChunkFrame
    | DoneFrame
    | ErrorFrame
    | ModelsFrame
    | EndFrame
    | RequestFrame
    | CancelFrame
    | ModelsRequestFrame
    | HelloFrame
    | EmbeddingsRequestFrame
)
_HOLE = b"\0"  # where a chunk goes: never in encoded JSON (a string escapes it as \u0000)


def encode_frame(frame: OutboundFrame) -> bytes:
    """One frame as UTF-8 JSON text: the one encoder every frame either end sends goes through
    (a chunk's payload or a request's body, a ``Raw``, is copied in as it is)."""
    return _encoder.encode(frame)


class TurnFrames:
    """One turn's chunk and done frames, encoded once per turn.

    ``template % payload`` is the chunk frame around ``payload`` (``chunk`` does it): the
    encoder's own frame with ``%b`` where the ``Raw`` chunk goes, so a chunk costs one C-level
    format, no JSON encoding and no parse; the payload must be JSON (it is not checked here).
    """

    __slots__ = ("template", "done")

    def __init__(self, job_id: str, request_id: str) -> None:
        frame = encode_frame(ChunkFrame(job_id, request_id, msgspec.Raw(_HOLE)))
        head, tail = frame.split(_HOLE)
        self.template = head.replace(b"%", b"%%") + b"%b" + tail.replace(b"%", b"%%")
        self.done = encode_frame(DoneFrame(job_id, request_id))

    def chunk(self, payload: bytes) -> bytes:
        """The chunk frame holding ``payload`` unchanged."""
        return self.template % payload


def done_frame(job_id: str, request_id: str) -> str:
    return encode_frame(DoneFrame(job_id, request_id)).decode()


def error_frame(job_id: str, request_id: str, error: str) -> str:
    return encode_frame(ErrorFrame(job_id, request_id, error)).decode()


def models_frame(
    job_id: str,
    request_id: str,
    models: list[str],
    contexts: dict[str, int] | None = None,
    extensions: list[str] | None = None,
) -> str:
    frame = ModelsFrame(job_id, request_id, models, contexts or None, extensions or None)
    return encode_frame(frame).decode()


def end_frame(job_id: str, reason: str) -> str:
    return encode_frame(EndFrame(job_id, reason)).decode()
