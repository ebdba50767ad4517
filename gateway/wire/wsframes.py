"""WebSocket frames as a server reads and writes them (RFC 6455 §5), validated; pure, no I/O.

``FrameReader.feed`` takes the bytes a client sent and returns its complete messages and control
frames, unmasked. Anything RFC 6455 says must fail the connection (§7.1.7) stops the reader with
``violation`` set to the close code and reason to send: 1002 for a framing error (reserved bits
or opcodes, an unmasked frame, a control frame fragmented or over 125 bytes, a continuation with
no message started, a data frame inside a fragmented message, a bad close code), 1007 for text
that is not UTF-8, 1009 for a message over the size bound (refused from its header, before its
payload is buffered).
"""

from __future__ import annotations

import struct

OP_CONTINUATION = 0x0
OP_TEXT = 0x1
OP_BINARY = 0x2
OP_CLOSE = 0x8
OP_PING = 0x9
OP_PONG = 0xA

CLOSE_PROTOCOL_ERROR = 1002
CLOSE_INVALID_DATA = 1007
CLOSE_TOO_BIG = 1009

_DATA_OPS = (OP_CONTINUATION, OP_TEXT, OP_BINARY)
_CONTROL_OPS = (OP_CLOSE, OP_PING, OP_PONG)
_unpack16 = struct.Struct("!H").unpack_from
_unpack64 = struct.Struct("!Q").unpack_from


def valid_close_code(code: int) -> bool:
    """A close code a peer may send (RFC 6455 §7.4: 1000-1003, 1007-1014, 3000-4999)."""
    return code in (1000, 1001, 1002, 1003) or 1007 <= code <= 1014 or 3000 <= code <= 4999


def unmask(payload: bytes, key: bytes) -> bytes:
    """``payload`` XOR the repeated 4-byte ``key`` (one C-level pass over whole numbers)."""
    n = len(payload)
    if not n:
        return payload
    pad = (key * ((n >> 2) + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(pad, "big")).to_bytes(n, "big")


def server_frame(opcode: int, payload: bytes) -> bytes:
    """One unmasked final frame as a server sends it."""
    n = len(payload)
    if n < 126:
        return bytes((0x80 | opcode, n)) + payload
    if n < 65536:
        return struct.pack("!BBH", 0x80 | opcode, 126, n) + payload
    return struct.pack("!BBQ", 0x80 | opcode, 127, n) + payload


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


class FrameReader:
    """Reads one client's frames; ``feed`` returns ``(opcode, payload)`` per complete message
    (text or binary, defragmented) and per control frame, in order.

    After a violation ``violation`` is ``(close code, reason)``: the frames before it were
    returned, nothing after it is read.
    """

    __slots__ = ("max_message", "violation", "_rest", "_op", "_parts", "_size")

    def __init__(self, max_message: int) -> None:
        self.max_message = max_message
        self.violation: tuple[int, str] | None = None
        self._rest = b""  # the start of a frame not complete yet
        self._op: int | None = None  # the opcode of a fragmented message in progress
        self._parts: list[bytes] = []
        self._size = 0

    def _fail(self, code: int, reason: str) -> None:
        self.violation = (code, reason)
        self._rest = b""

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        if self.violation is not None:
            return []
        if self._rest:
            data = self._rest + data
            self._rest = b""
        out: list[tuple[int, bytes]] = []
        pos = 0
        end_of_data = len(data)
        while end_of_data - pos >= 2:
            b0 = data[pos]
            b1 = data[pos + 1]
            op = b0 & 0x0F
            if b0 & 0x70:
                self._fail(CLOSE_PROTOCOL_ERROR, "reserved bits set without an extension")
                return out
            if not b1 & 0x80:
                self._fail(CLOSE_PROTOCOL_ERROR, "an unmasked frame from the client")
                return out
            length = b1 & 0x7F
            head = pos + 2
            if length == 126:
                if end_of_data - pos < 4:
                    break
                (length,) = _unpack16(data, head)
                head += 2
            elif length == 127:
                if end_of_data - pos < 10:
                    break
                (length,) = _unpack64(data, head)
                head += 8
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
            end = head + 4 + length
            if end > end_of_data:
                break
            payload = unmask(data[head + 4 : end], data[head : head + 4])
            pos = end
            if op == OP_TEXT or op == OP_BINARY:
                if self._op is not None:
                    self._fail(CLOSE_PROTOCOL_ERROR, "a new message inside a fragmented one")
                    return out
                if b0 & 0x80:
                    if op == OP_TEXT and not payload.isascii() and not _utf8(payload):
                        self._fail(CLOSE_INVALID_DATA, "text that is not UTF-8")
                        return out
                    out.append((op, payload))
                else:
                    self._op, self._parts, self._size = op, [payload], length
            elif op == OP_CONTINUATION:
                if self._op is None:
                    self._fail(CLOSE_PROTOCOL_ERROR, "a continuation frame with no message")
                    return out
                self._parts.append(payload)
                self._size += length
                if b0 & 0x80:
                    whole = b"".join(self._parts)
                    message_op, self._op, self._parts, self._size = self._op, None, [], 0
                    if message_op == OP_TEXT and not whole.isascii() and not _utf8(whole):
                        self._fail(CLOSE_INVALID_DATA, "text that is not UTF-8")
                        return out
                    out.append((message_op, whole))
            else:  # a control frame
                if op == OP_CLOSE and payload:
                    problem = _close_problem(payload)
                    if problem is not None:
                        self._fail(*problem)
                        return out
                out.append((op, payload))
        if pos < end_of_data:
            self._rest = data[pos:]
        return out


def _utf8(data: bytes) -> bool:
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
    if not _utf8(payload[2:]):
        return CLOSE_INVALID_DATA, "a close reason that is not UTF-8"
    return None


def close_code_of(payload: bytes) -> int:
    """The code of a (valid) close frame's payload; 1005 when it has none (§7.1.5)."""
    return int.from_bytes(payload[:2], "big") if len(payload) >= 2 else 1005
