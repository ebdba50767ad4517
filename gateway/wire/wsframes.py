"""WebSocket frames for both ends (RFC 6455 §5): read and validated, built and masked; pure, no I/O.

``FrameReader.feed`` takes the bytes the peer sent and returns its complete messages and control
frames, unmasked. A server's reader expects masked frames, a client's unmasked ones (``masked``).
Anything RFC 6455 says must fail the connection (§7.1.7) stops the reader with ``violation`` set
to the close code and reason to send: 1002 for a framing error (reserved bits or opcodes, a
frame masked the wrong way for its sender, a length not in its shortest form, a control frame
fragmented or over 125 bytes, a continuation with no message started, a data frame inside a
fragmented message, a bad close code), 1007 for text that is not UTF-8, 1009 for a message over
the size bound (refused from its header, before its payload is buffered) or in more fragments than
the fragment bound (empty continuation frames cost memory too: a bound in count as well as bytes).

Frames are built here too: ``server_frame`` and ``text_frame`` unmasked, as a server sends them;
``ClientFramer`` masked, each with a fresh key (§5.3), as a client sends them. wsproto reads and
writes the same bytes (tests/unit/test_wsframes.py holds them to it).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

OP_CONTINUATION = 0x0
OP_TEXT = 0x1
OP_BINARY = 0x2
OP_CLOSE = 0x8
OP_PING = 0x9
OP_PONG = 0xA

CLOSE_NO_STATUS = 1005  # a close frame without a code (§7.1.5); never sent
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_INVALID_DATA = 1007
CLOSE_TOO_BIG = 1009
MAX_FRAGMENTS = 1024  # frames of one fragmented message (a 16 MiB message in 16 KiB fragments)

_DATA_OPS = (OP_CONTINUATION, OP_TEXT, OP_BINARY)
_CONTROL_OPS = (OP_CLOSE, OP_PING, OP_PONG)
_unpack16 = struct.Struct("!H").unpack_from
_unpack64 = struct.Struct("!Q").unpack_from
_pack16 = struct.Struct("!BBH").pack
_pack64 = struct.Struct("!BBQ").pack


def valid_close_code(code: int) -> bool:
    """A close code a peer may send (RFC 6455 §7.4: 1000-1003, 1007-1014, 3000-4999)."""
    return code in (1000, 1001, 1002, 1003) or 1007 <= code <= 1014 or 3000 <= code <= 4999


def unmask(payload: bytes | bytearray, key: bytes | bytearray) -> bytes:
    """``payload`` XOR the repeated 4-byte ``key`` (one C-level pass over whole numbers); the
    same XOR masks and unmasks."""
    n = len(payload)
    if not n:
        return b""
    pad = (key * ((n >> 2) + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(pad, "big")).to_bytes(n, "big")


# -- building: a server's frames (unmasked) ---------------------------------------------------


def server_frame(opcode: int, payload: bytes) -> bytes:
    """One unmasked final frame as a server sends it."""
    n = len(payload)
    if n < 126:
        return bytes((0x80 | opcode, n)) + payload
    if n < 65536:
        return _pack16(0x80 | opcode, 126, n) + payload
    return _pack64(0x80 | opcode, 127, n) + payload


_TEXT_HEADS = [bytes((0x80 | OP_TEXT, n)) for n in range(126)]


def text_frame(payload: bytes) -> bytes:
    """One unmasked final text frame (``payload``: UTF-8 already)."""
    n = len(payload)
    if n < 126:
        return _TEXT_HEADS[n] + payload
    return server_frame(OP_TEXT, payload)


def close_payload(code: int, reason: str = "") -> bytes:
    """A close frame's payload: the code, then the reason cut to fit 125 bytes."""
    return code.to_bytes(2, "big") + reason.encode()[:123]


# -- building: a client's frames (masked) -----------------------------------------------------

_TEXT_FIN = 0x80 | OP_TEXT
_KEY_POOL = 4096  # bytes of masking keys drawn at a time
_MASKED_TEXT_HEADS = [bytes((_TEXT_FIN, 0x80 | n)) for n in range(126)]  # length < 126
# zeros under a frame's head and key: payload < 126 bytes, < 65536, larger
_ZEROS_7, _ZEROS_16, _ZEROS_64 = b"\0" * 6, b"\0" * 8, b"\0" * 14


class ClientFramer:
    """Frames as a client sends them (RFC 6455 §5.2): masked, each with its own fresh key
    (§5.3), the keys drawn from ``entropy`` (a CSPRNG: ``os.urandom``) a pool at a time.

    Masking is one XOR of whole numbers (a C-level pass, no per-byte Python work); for several
    text frames written together (``frames``), one XOR covers them all (zeros under their heads
    and keys)."""

    __slots__ = ("_entropy", "_pool", "_pos")

    def __init__(self, entropy: Callable[[int], bytes] = os.urandom) -> None:
        self._entropy = entropy
        self._pool = b""
        self._pos = _KEY_POOL

    def frame(self, data: bytes) -> bytes:
        """One masked text frame holding ``data`` (UTF-8 text, framed as it is)."""
        pos = self._pos
        if pos >= _KEY_POOL:
            self._pool = self._entropy(_KEY_POOL)
            pos = 0
        self._pos = pos + 4
        key = self._pool[pos : pos + 4]
        n = len(data)
        if n:
            pad = (key * ((n >> 2) + 1))[:n]
            data = (int.from_bytes(data, "big") ^ int.from_bytes(pad, "big")).to_bytes(n, "big")
        if n < 126:
            return _MASKED_TEXT_HEADS[n] + key + data
        if n < 65536:
            return _pack16(_TEXT_FIN, 0xFE, n) + key + data
        return _pack64(_TEXT_FIN, 0xFF, n) + key + data

    def frames(self, messages: list[bytes]) -> bytes:
        """Masked text frames holding ``messages``, one each, as one buffer to write."""
        plain: list[bytes] = []
        pads: list[bytes] = []
        for data in messages:
            n = len(data)
            if n < 126:
                head, zeros = _MASKED_TEXT_HEADS[n], _ZEROS_7
            elif n < 65536:
                head, zeros = _pack16(_TEXT_FIN, 0xFE, n), _ZEROS_16
            else:
                head, zeros = _pack64(_TEXT_FIN, 0xFF, n), _ZEROS_64
            pos = self._pos
            if pos >= _KEY_POOL:
                self._pool = self._entropy(_KEY_POOL)
                pos = 0
            self._pos = pos + 4
            key = self._pool[pos : pos + 4]
            plain += (head, key, data)
            pads += (zeros, (key * ((n >> 2) + 1))[:n])
        whole = b"".join(plain)
        size = len(whole)
        mask = int.from_bytes(b"".join(pads), "big")
        return (int.from_bytes(whole, "big") ^ mask).to_bytes(size, "big")

    def control(self, opcode: int, payload: bytes = b"") -> bytes:
        """One masked control frame: ``OP_PING``, ``OP_PONG`` or ``OP_CLOSE`` (``payload`` of
        at most 125 bytes: a ping's, or ``close_payload``)."""
        if len(payload) > 125:
            raise ValueError("a control frame's payload is at most 125 bytes")
        return self.message(opcode, payload)

    def message(self, opcode: int, payload: bytes, fin: bool = True) -> bytes:
        """One masked frame of any opcode (``fin`` False: a fragment, more to come)."""
        pos = self._pos
        if pos >= _KEY_POOL:
            self._pool = self._entropy(_KEY_POOL)
            pos = 0
        self._pos = pos + 4
        key = self._pool[pos : pos + 4]
        first = (0x80 if fin else 0) | opcode
        n = len(payload)
        if n < 126:
            head = bytes((first, 0x80 | n))
        elif n < 65536:
            head = _pack16(first, 0xFE, n)
        else:
            head = _pack64(first, 0xFF, n)
        return head + key + unmask(payload, key)


# -- reading -----------------------------------------------------------------------------------


class FrameReader:
    """Reads one peer's frames; ``feed`` returns ``(opcode, payload)`` per complete message
    (text or binary, defragmented) and per control frame, in order. ``masked``: the peer is a
    client, whose frames must be masked (a server's must not be).

    After a violation ``violation`` is ``(close code, reason)``: the frames before it were
    returned, nothing after it is read. A frame begun in one read and ended in a later one is
    kept in a buffer grown in place: a large message that comes in many reads is copied once.
    A message is bounded in bytes (``max_message``) and in frames (``max_fragments``);
    ``controls`` counts the control frames read (unchanged by a read of data frames only).
    """

    __slots__ = (
        "max_message",
        "max_fragments",
        "violation",
        "controls",
        "_mask_bit",
        "_rest",
        "_op",
        "_parts",
        "_size",
    )

    def __init__(
        self, max_message: int, *, masked: bool = True, max_fragments: int = MAX_FRAGMENTS
    ) -> None:
        self.max_message = max_message
        self.max_fragments = max_fragments
        self.violation: tuple[int, str] | None = None
        self.controls = 0
        self._mask_bit = 0x80 if masked else 0
        self._rest = bytearray()  # the start of a frame not complete yet
        self._op: int | None = None  # the opcode of a fragmented message in progress
        self._parts: list[bytes] = []
        self._size = 0

    def _fail(self, code: int, reason: str) -> None:
        self.violation = (code, reason)
        self._rest = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        if self.violation is not None:
            return []
        rest = self._rest
        buf: bytes | bytearray = data
        if rest:  # a frame begun in an earlier read: grown in place, never copied whole again
            rest += data
            buf = rest
        out: list[tuple[int, bytes]] = []
        mask_bit = self._mask_bit
        pos = 0
        end_of_data = len(buf)
        while end_of_data - pos >= 2:
            b0 = buf[pos]
            b1 = buf[pos + 1]
            if b1 == 0xFE and b0 == 0x81 and mask_bit and self._op is None:
                # a client's usual frame (a runner's chunk): a whole text message of 126 to
                # 65535 bytes, masked, taken here without the checks below (a third of their
                # cost); anything else about it (incomplete, too large, not UTF-8) goes on to
                # them, which decide
                end = pos + 8
                if end <= end_of_data:
                    (length,) = _unpack16(buf, pos + 2)
                    end += length
                    if end <= end_of_data and 126 <= length <= self.max_message:
                        payload = unmask(buf[pos + 8 : end], buf[pos + 4 : pos + 8])
                        if payload.isascii() or is_utf8(payload):
                            out.append((OP_TEXT, payload))
                            pos = end
                            continue
            op = b0 & 0x0F
            if b0 & 0x70:
                self._fail(CLOSE_PROTOCOL_ERROR, "reserved bits set without an extension")
                return out
            if b1 & 0x80 != mask_bit:
                self._fail(
                    CLOSE_PROTOCOL_ERROR,
                    "an unmasked frame from the client"
                    if mask_bit
                    else "a masked frame from the server",
                )
                return out
            length = b1 & 0x7F
            head = pos + 2
            if length == 126:
                if end_of_data - pos < 4:
                    break
                (length,) = _unpack16(buf, head)
                head += 2
                if length < 126:
                    self._fail(CLOSE_PROTOCOL_ERROR, "a length not in its shortest form")
                    return out
            elif length == 127:
                if end_of_data - pos < 10:
                    break
                (length,) = _unpack64(buf, head)
                head += 8
                if length < 65536 or length >> 63:
                    self._fail(CLOSE_PROTOCOL_ERROR, "a 64-bit length out of its range")
                    return out
            if op in _CONTROL_OPS:
                if not b0 & 0x80:
                    self._fail(CLOSE_PROTOCOL_ERROR, "a fragmented control frame")
                    return out
                if length > 125:
                    self._fail(CLOSE_PROTOCOL_ERROR, "a control frame over 125 bytes")
                    return out
            elif op not in _DATA_OPS:
                self._fail(CLOSE_PROTOCOL_ERROR, f"reserved opcode {op:#x}")
                return out
            elif length + (self._size if op == OP_CONTINUATION else 0) > self.max_message:
                self._fail(CLOSE_TOO_BIG, f"a message over {self.max_message} bytes")
                return out
            if mask_bit:
                end = head + 4 + length
                if end > end_of_data:
                    break
                payload = unmask(buf[head + 4 : end], buf[head : head + 4])
            else:
                end = head + length
                if end > end_of_data:
                    break
                if buf is rest:
                    payload = bytes(memoryview(rest)[head:end])
                else:
                    payload = data[head:end]
            pos = end
            if op == OP_TEXT or op == OP_BINARY:
                if self._op is not None:
                    self._fail(CLOSE_PROTOCOL_ERROR, "a new message inside a fragmented one")
                    return out
                if b0 & 0x80:
                    if op == OP_TEXT and not payload.isascii() and not is_utf8(payload):
                        self._fail(CLOSE_INVALID_DATA, "text that is not UTF-8")
                        return out
                    out.append((op, payload))
                else:
                    self._op, self._parts, self._size = op, [payload], length
            elif op == OP_CONTINUATION:
                if self._op is None:
                    self._fail(CLOSE_PROTOCOL_ERROR, "a continuation frame with no message")
                    return out
                if len(self._parts) >= self.max_fragments:
                    self._fail(CLOSE_TOO_BIG, f"a message in over {self.max_fragments} frames")
                    return out
                self._parts.append(payload)
                self._size += length
                if b0 & 0x80:
                    whole = b"".join(self._parts)
                    message_op, self._op, self._parts, self._size = self._op, None, [], 0
                    if message_op == OP_TEXT and not whole.isascii() and not is_utf8(whole):
                        self._fail(CLOSE_INVALID_DATA, "text that is not UTF-8")
                        return out
                    out.append((message_op, whole))
            else:  # a control frame
                self.controls += 1
                if op == OP_CLOSE and payload:
                    problem = _close_problem(payload)
                    if problem is not None:
                        self._fail(*problem)
                        return out
                out.append((op, payload))
        if buf is rest:
            if pos == end_of_data:
                rest.clear()
            elif pos:
                del rest[:pos]
        elif pos < end_of_data:
            rest += memoryview(buf)[pos:]
        return out


def is_utf8(data: bytes) -> bool:
    """Whether ``data`` is UTF-8, as a text frame's payload must be (RFC 6455 §5.6); JSON
    validation does not check it. Hot callers test ``isascii()`` first (no call for ASCII)."""
    if data.isascii():
        return True
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _close_problem(payload: bytes) -> tuple[int, str] | None:
    """Why a close frame's payload is invalid (the code and reason to fail with), or None."""
    if len(payload) == 1:
        return CLOSE_PROTOCOL_ERROR, "a close frame with a 1-byte payload"
    code = int.from_bytes(payload[:2], "big")
    if not valid_close_code(code):
        return CLOSE_PROTOCOL_ERROR, f"invalid close code {code}"
    if not is_utf8(payload[2:]):
        return CLOSE_INVALID_DATA, "a close reason that is not UTF-8"
    return None


def close_code_of(payload: bytes) -> int:
    """The code of a (valid) close frame's payload; 1005 when it has none (§7.1.5)."""
    return int.from_bytes(payload[:2], "big") if len(payload) >= 2 else CLOSE_NO_STATUS


def close_reason_of(payload: bytes) -> str:
    """The reason of a (valid) close frame's payload ("" when it has none)."""
    return payload[2:].decode()
