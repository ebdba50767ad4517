"""The frames of a forwarded turn between two replicas, framed for an HTTP body: each runner
frame as it was read (never re-encoded), after its length (4 bytes, big-endian). Pure: bytes
only, no I/O."""

from __future__ import annotations

import struct

_LENGTH = struct.Struct(">I")
HEAD = _LENGTH.size
MAX_FRAME = (1 << 32) - 1


def record(frame: bytes) -> bytes:
    """One frame, framed (its length, then the frame)."""
    return _LENGTH.pack(len(frame)) + frame


def frame_head(frame: bytes) -> tuple[bytes, str | None]:
    """A frame the hub encoded (``protocol.encode_frame``: ``type``, ``jobId``, then
    ``requestId`` first, in that order): its type and request id, read from its first bytes
    without parsing the rest (a request's body may be large)."""
    type_at = frame.find(b'"type":"', 0, 64)
    if type_at < 0:
        return b"", None
    start = type_at + 8
    kind = frame[start : frame.find(b'"', start, start + 64)]
    rid_at = frame.find(b'"requestId":"', start, 512)
    if rid_at < 0:
        return kind, None
    rid_start = rid_at + 13
    rid_end = frame.find(b'"', rid_start, rid_start + 256)
    if rid_end < 0:
        return kind, None
    return kind, frame[rid_start:rid_end].decode("ascii", "replace")


class Records:
    """Frames out of a body's pieces as they arrive (a frame may span pieces)."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, pieces: list[bytes]) -> list[bytes]:
        """The whole frames the pieces complete, in order (the rest is kept for later)."""
        buffer = self._buffer
        for piece in pieces:
            buffer += piece
        frames: list[bytes] = []
        at = 0
        size = len(buffer)
        while size - at >= HEAD:
            (length,) = _LENGTH.unpack_from(buffer, at)
            end = at + HEAD + length
            if end > size:
                break
            frames.append(bytes(buffer[at + HEAD : end]))
            at = end
        if at:
            del buffer[:at]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of a frame not whole yet."""
        return len(self._buffer)
