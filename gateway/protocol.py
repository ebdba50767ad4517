"""Chat Channel frames (docs/protocol.md §4, §6): typed, decoded and encoded without I/O.

Inbound frames are decoded with msgspec straight into small Structs; the
``body`` of a completion request stays a ``msgspec.Raw`` so it is forwarded
without being parsed. Outbound chunk frames are built by byte splicing: the
backend's ``data:`` payload goes into the frame unchanged, never re-encoded.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

CAPABILITY = "chat-llm:v1"

# Frame types, Server -> Runner.
COMPLETION_REQUEST = "chat.completion.request"
COMPLETION_CANCEL = "chat.completion.cancel"
MODELS_REQUEST = "chat.models.request"
END = "chat.end"
# Frame types, Runner -> Server.
COMPLETION_CHUNK = "chat.completion.chunk"
COMPLETION_DONE = "chat.completion.done"
COMPLETION_ERROR = "chat.completion.error"
MODELS_RESPONSE = "chat.models.response"

CANCELLED = "cancelled"


class FrameError(ValueError):
    """A frame that cannot be served; ``request_id`` is set when the frame named one."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class CompletionRequest(msgspec.Struct, frozen=True):
    """``chat.completion.request``: one turn. ``body`` is kept as raw JSON bytes."""

    requestId: str
    body: msgspec.Raw
    jobId: str | None = None
    model: str | None = None


class CompletionCancel(msgspec.Struct, frozen=True):
    """``chat.completion.cancel`` (extension, §6): stop that turn now."""

    requestId: str
    jobId: str | None = None


class ModelsRequest(msgspec.Struct, frozen=True):
    """``chat.models.request``: which models can this Runner serve?"""

    requestId: str
    jobId: str | None = None


class End(msgspec.Struct, frozen=True):
    """``chat.end``: the session is over."""

    reason: str | None = None
    jobId: str | None = None


class Unknown(msgspec.Struct, frozen=True):
    """A frame whose ``type`` this Runner does not know: ignored."""

    type: str


InboundFrame = CompletionRequest | CompletionCancel | ModelsRequest | End | Unknown


class _Envelope(msgspec.Struct):
    type: str
    requestId: Any = None


class _BodyModel(msgspec.Struct):
    model: Any = None


_envelope_decoder = msgspec.json.Decoder(_Envelope)
_decoders: dict[str, msgspec.json.Decoder[Any]] = {
    COMPLETION_REQUEST: msgspec.json.Decoder(CompletionRequest),
    COMPLETION_CANCEL: msgspec.json.Decoder(CompletionCancel),
    MODELS_REQUEST: msgspec.json.Decoder(ModelsRequest),
    END: msgspec.json.Decoder(End),
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
    if isinstance(frame, CompletionRequest):
        body = bytes(frame.body).lstrip()
        if not body.startswith(b"{"):
            raise FrameError("bad chat.completion.request frame: body is not an object", request_id)
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
    try:
        obj = msgspec.json.decode(body)
        obj["model"] = model
        return _encoder.encode(obj)
    except (msgspec.DecodeError, RecursionError, TypeError) as exc:
        raise FrameError(f"body cannot carry a model: {type(exc).__name__}") from None


def _json_str(value: str) -> bytes:
    return _encoder.encode(value)


def chunk_prefix(job_id: str, request_id: str) -> bytes:
    """The fixed head of every chunk frame of one turn; append payload + ``b"}"``."""
    return (
        b'{"type":"chat.completion.chunk","jobId":'
        + _json_str(job_id)
        + b',"requestId":'
        + _json_str(request_id)
        + b',"chunk":'
    )


def chunk_frame(prefix: bytes, payload: bytes | memoryview) -> str:
    """One ``chat.completion.chunk`` frame around an unparsed JSON payload."""
    return (prefix + payload + b"}").decode()


def chunk_frame_bytes(prefix: bytes, payload: bytes | memoryview) -> bytes:
    """The same frame as UTF-8 bytes, for a writer that sends them as a text message unchanged
    (``ws_text_frames``): the payload is copied once and never decoded."""
    return prefix + payload + b"}"


_FRAME_HEAD_16 = struct.Struct("!BBH")
_FRAME_HEAD_64 = struct.Struct("!BBQ")
_TEXT_FIN = 0x81  # FIN + opcode 1 (text)


def ws_text_frames(
    messages: Sequence[str | bytes], *, mask: bool, entropy: Callable[[int], bytes] = os.urandom
) -> bytes:
    """WebSocket text frames (RFC 6455 §5.2) holding ``messages``, one frame each, ready to go
    out in one write. ``bytes`` messages must be UTF-8 text; they are framed as they are.

    A client (``mask``) masks every frame with its own fresh key (§5.3), drawn from ``entropy``
    (a CSPRNG: ``os.urandom``) in one call for the whole batch.
    """
    keys = entropy(4 * len(messages)) if mask else b""
    parts: list[bytes] = []
    append = parts.append
    for i, message in enumerate(messages):
        data = message.encode() if isinstance(message, str) else message
        n = len(data)
        if n < 126:
            head = bytes((_TEXT_FIN, n | 0x80)) if mask else bytes((_TEXT_FIN, n))
        elif n < 65536:
            head = _FRAME_HEAD_16.pack(_TEXT_FIN, 0xFE if mask else 126, n)
        else:
            head = _FRAME_HEAD_64.pack(_TEXT_FIN, 0xFF if mask else 127, n)
        append(head)
        if mask:
            key = keys[4 * i : 4 * i + 4]
            append(key)
            if n:
                # XOR by whole-number arithmetic: one C-level pass, no per-byte Python work
                pad = (key * ((n >> 2) + 1))[:n]
                data = (int.from_bytes(data, "big") ^ int.from_bytes(pad, "big")).to_bytes(n, "big")
        append(data)
    return b"".join(parts)


def done_frame(job_id: str, request_id: str) -> str:
    return _encoder.encode(
        {"type": COMPLETION_DONE, "jobId": job_id, "requestId": request_id}
    ).decode()


def error_frame(job_id: str, request_id: str, error: str) -> str:
    return _encoder.encode(
        {"type": COMPLETION_ERROR, "jobId": job_id, "requestId": request_id, "error": error}
    ).decode()


def models_frame(job_id: str, request_id: str, models: list[str]) -> str:
    return _encoder.encode(
        {"type": MODELS_RESPONSE, "jobId": job_id, "requestId": request_id, "models": models}
    ).decode()


def end_frame(job_id: str, reason: str) -> str:
    return _encoder.encode({"type": END, "jobId": job_id, "reason": reason}).decode()


def encode(obj: Any) -> str:
    """Encode any frame-shaped object (the hub's side, tests) as a text message."""
    return _encoder.encode(obj).decode()
