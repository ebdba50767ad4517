"""The WebSocket frame codec (gateway.wire.wsframes) against wsproto as the oracle.

Random sequences of frames (text and binary messages, whole or fragmented with control frames
between the fragments, pings, pongs, a close; lengths in the 7-, 16- and 64-bit forms), masked
as a client sends them or unmasked as a server does:

- encoded by wsproto, concatenated and cut at random points, ``FrameReader`` reads the same
  messages and control frames from them as wsproto reads;
- encoded by our builders (``ClientFramer``, ``server_frame``), wsproto reads back the messages
  they were built from;
- a bad frame (one per rule of RFC 6455 that fails a connection) fails both readers with the
  same close code.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wsproto import ConnectionState, ConnectionType
from wsproto.connection import Connection
from wsproto.events import BytesMessage, CloseConnection, Event, Ping, Pong, TextMessage

from gateway.wire import wsframes
from gateway.wire.wsframes import (
    OP_BINARY,
    OP_CLOSE,
    OP_CONTINUATION,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    ClientFramer,
    FrameReader,
)

MAX = 1 << 20
# lengths on either side of each boundary of the length's forms: 7 bits, 16 bits, 64 bits
LENGTHS = st.one_of(st.integers(0, 140), st.sampled_from([125, 126, 127, 65535, 65536, 70000]))
CONTROL_PAYLOAD = st.binary(max_size=125)


@dataclass(frozen=True)
class Msg:
    """A data message: ``parts`` are its fragments (one: unfragmented); ``between`` the control
    frames sent after each fragment but the last (``(opcode, payload)``)."""

    opcode: int
    parts: tuple[bytes, ...]
    between: tuple[tuple[int, bytes], ...]


@dataclass(frozen=True)
class Control:
    opcode: int
    payload: bytes


Item = Msg | Control
Read = tuple[int, bytes | tuple[int, str]]  # what a reader got: close frames as (code, reason)


def _filler(size: int, seed: int, text: bool) -> bytes:
    """``size`` bytes of varied content (text: UTF-8, some characters of 2 to 4 bytes)."""
    rng = random.Random(seed)
    if not text:
        return rng.randbytes(size)
    alphabet = 'ab{}":,x é€😀'
    out = "".join(rng.choice(alphabet) for _ in range(size))
    data = out.encode()
    while len(data) > size:  # cut to at most size bytes, on a character boundary
        out = out[:-1]
        data = out.encode()
    return data


T = TypeVar("T", str, bytes)


def _cut(whole: T, cuts: list[int]) -> list[T]:
    """``whole`` cut at ``cuts`` (positions, any order, repeats allowed)."""
    at: list[int] = sorted(set(cuts))
    return [whole[a:b] for a, b in zip([0, *at], [*at, len(whole)], strict=True)]


@st.composite
def messages(draw: st.DrawFn) -> Msg:
    opcode = draw(st.sampled_from([OP_TEXT, OP_BINARY]))
    body = _filler(draw(LENGTHS), draw(st.integers(0, 1 << 30)), opcode == OP_TEXT)
    if opcode == OP_TEXT:  # fragments on character boundaries (wsproto sends str)
        text = body.decode()
        cuts = draw(st.lists(st.integers(0, len(text)), max_size=3))
        parts = tuple(p.encode() for p in _cut(text, cuts))
    else:
        parts = tuple(_cut(body, draw(st.lists(st.integers(0, len(body)), max_size=3))))
    between = tuple(
        (draw(st.sampled_from([OP_PING, OP_PONG])), draw(CONTROL_PAYLOAD))
        for _ in parts[1:]
        if draw(st.booleans())
    )
    return Msg(opcode, parts, between)


controls = st.builds(Control, st.sampled_from([OP_PING, OP_PONG]), CONTROL_PAYLOAD)
closes = st.builds(
    lambda code, reason: Control(OP_CLOSE, wsframes.close_payload(code, reason)),
    # every code both accept (1014, IANA's "Bad Gateway", is ours alone: see the test below)
    st.sampled_from([1000, 1001, 1003, 1007, 1008, 1011, 1012, 1013, 3000, 4000, 4999]),
    st.text(max_size=40),
)
sequences = st.tuples(
    st.lists(st.one_of(messages(), controls), min_size=1, max_size=8),
    st.one_of(st.none(), closes),
)


def _expected(items: list[Item], close: Control | None) -> list[Read]:
    """What a reader must get: each message whole, each control frame where it was sent."""
    out: list[Read] = []
    for item in items:
        if isinstance(item, Control):
            out.append((item.opcode, item.payload))
            continue
        out += [(op, payload) for op, payload in item.between]
        out.append((item.opcode, b"".join(item.parts)))
    if close is not None:
        out.append((OP_CLOSE, _close_of(close.payload)))
    return out


def _close_of(payload: bytes) -> tuple[int, str]:
    return wsframes.close_code_of(payload), wsframes.close_reason_of(payload)


def _control_event(opcode: int, payload: bytes) -> Event:
    if opcode == OP_PING:
        return Ping(payload)
    if opcode == OP_PONG:
        return Pong(payload)
    return CloseConnection(*_close_of(payload))


def _data_event(opcode: int, part: bytes, finished: bool) -> Event:
    if opcode == OP_TEXT:
        return TextMessage(part.decode(), message_finished=finished)
    return BytesMessage(part, message_finished=finished)


def wsproto_encode(items: list[Item], close: Control | None, masked: bool) -> bytes:
    """The frames as wsproto sends them (masked: as a client)."""
    conn = Connection(ConnectionType.CLIENT if masked else ConnectionType.SERVER)
    out = []
    for item in items:
        if isinstance(item, Control):
            out.append(conn.send(_control_event(item.opcode, item.payload)))
            continue
        controls_after = list(item.between)
        last = len(item.parts) - 1
        for i, part in enumerate(item.parts):
            out.append(conn.send(_data_event(item.opcode, part, i == last)))
            if i < last and controls_after:
                out.append(conn.send(_control_event(*controls_after.pop(0))))
    if close is not None:
        out.append(conn.send(_control_event(OP_CLOSE, close.payload)))
    return b"".join(out)


def our_encode(items: list[Item], close: Control | None, masked: bool) -> bytes:
    """The same frames as our builders make them (masked: ``ClientFramer``; else
    ``server_frame``); whole text messages in a row go through ``frames``, as the channel's
    writer sends them."""
    framer = ClientFramer()
    out: list[bytes] = []
    texts: list[bytes] = []

    def frame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
        if masked:
            if opcode in (OP_PING, OP_PONG, OP_CLOSE):
                return framer.control(opcode, payload)
            return framer.message(opcode, payload, fin)
        first = (0x80 if fin else 0) | opcode
        return bytes((first,)) + wsframes.server_frame(0, payload)[1:]

    def flush_texts() -> None:
        if texts:
            out.append(
                framer.frames(texts) if masked else b"".join(map(wsframes.text_frame, texts))
            )
            texts.clear()

    for item in items:
        if isinstance(item, Msg) and item.opcode == OP_TEXT and len(item.parts) == 1:
            texts.append(item.parts[0])
            continue
        flush_texts()
        if isinstance(item, Control):
            out.append(frame(item.opcode, item.payload))
            continue
        controls_after = list(item.between)
        last = len(item.parts) - 1
        for i, part in enumerate(item.parts):
            out.append(frame(item.opcode if i == 0 else OP_CONTINUATION, part, i == last))
            if i < last and controls_after:
                out.append(frame(*controls_after.pop(0)))
    flush_texts()
    if close is not None:
        out.append(frame(OP_CLOSE, close.payload))
    return b"".join(out)


def _pieces(wire: bytes, cuts: list[float]) -> list[bytes]:
    return _cut(wire, [int(c * len(wire)) for c in cuts])


def read_ours(pieces: list[bytes], masked: bool) -> tuple[list[Read], tuple[int, str] | None]:
    reader = FrameReader(MAX, masked=masked)
    got: list[Read] = []
    for piece in pieces:
        for op, payload in reader.feed(piece):
            got.append((op, _close_of(payload)) if op == OP_CLOSE else (op, payload))
    return got, reader.violation


def read_wsproto(pieces: list[bytes], masked: bool) -> tuple[list[Read], int | None]:
    """What wsproto reads from ``pieces`` (sent masked: read as a server); the close code it
    fails with, if it does (a close frame it read stops it too)."""
    conn = Connection(ConnectionType.SERVER if masked else ConnectionType.CLIENT)
    got: list[Read] = []
    parts: list[bytes | bytearray] = []
    for piece in pieces:
        conn.receive_data(piece)
        for event in conn.events():
            if isinstance(event, (TextMessage, BytesMessage)):
                data = event.data
                parts.append(data.encode() if isinstance(data, str) else data)
                if event.message_finished:
                    op = OP_TEXT if isinstance(event, TextMessage) else OP_BINARY
                    got.append((op, b"".join(parts)))
                    parts = []
            elif isinstance(event, Ping):
                got.append((OP_PING, event.payload))
            elif isinstance(event, Pong):
                got.append((OP_PONG, event.payload))
            elif isinstance(event, CloseConnection):
                if conn.state is ConnectionState.OPEN:  # a violation, reported as a close
                    return got, int(event.code)
                got.append((OP_CLOSE, (int(event.code), event.reason or "")))
                return got, None
    return got, None


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(sequences, st.booleans(), st.lists(st.floats(0, 1), max_size=24))
def test_reader_reads_what_wsproto_wrote_cut_anywhere(
    sequence: tuple[list[Item], Control | None], masked: bool, cuts: list[float]
) -> None:
    items, close = sequence
    pieces = _pieces(wsproto_encode(items, close, masked), cuts)
    ours, violation = read_ours(pieces, masked)
    theirs, failed = read_wsproto(pieces, masked)
    assert violation is None and failed is None
    assert ours == theirs == _expected(items, close)


@SETTINGS
@given(sequences, st.booleans(), st.lists(st.floats(0, 1), max_size=24))
def test_wsproto_reads_what_we_built(
    sequence: tuple[list[Item], Control | None], masked: bool, cuts: list[float]
) -> None:
    items, close = sequence
    pieces = _pieces(our_encode(items, close, masked), cuts)
    theirs, failed = read_wsproto(pieces, masked)
    assert failed is None
    assert theirs == _expected(items, close)
    assert read_ours(pieces, masked) == (theirs, None)


def test_every_frame_gets_a_fresh_masking_key() -> None:
    framer = ClientFramer()
    batch = framer.frames([b"a"] * 8)
    keys = {batch[i * 7 + 2 : i * 7 + 6] for i in range(8)}
    keys |= {framer.frame(b"a")[2:6] for _ in range(2000)}
    keys |= {framer.control(OP_PING, b"")[2:6] for _ in range(10)}
    assert len(keys) > 2000  # RFC 6455 §5.3; the pool of keys is refilled (4096 bytes a draw)


def _raw(first: int, payload: bytes, masked: bool, length: bytes | None = None) -> bytes:
    """One frame written by hand: ``first`` byte as given, ``length`` bytes as given."""
    key = b"\x01\x02\x03\x04"
    bit = 0x80 if masked else 0
    if length is None:
        length = bytes((len(payload),)) if len(payload) < 126 else None
        assert length is not None
    head = bytes((first, bit | length[0])) + length[1:]
    return head + (key + wsframes.unmask(payload, key) if masked else payload)


BAD = {
    "reserved bit": lambda m: _raw(0x80 | 0x40 | OP_TEXT, b"x", m),
    "reserved opcode": lambda m: _raw(0x83, b"x", m),
    "reserved control opcode": lambda m: _raw(0x8B, b"", m),
    "16-bit length under 126": lambda m: _raw(0x82, b"x" * 5, m, bytes((126,)) + b"\0\5"),
    "64-bit length under 65536": lambda m: _raw(
        0x82, b"x" * 200, m, bytes((127,)) + (200).to_bytes(8, "big")
    ),
    "64-bit length with its top bit set": lambda m: _raw(
        0x82, b"", m, bytes((127,)) + (1 << 63 | 70000).to_bytes(8, "big")
    ),
    "a fragmented ping": lambda m: _raw(OP_PING, b"x", m),
    "a ping over 125 bytes": lambda m: _raw(0x89, b"x" * 126, m, bytes((126,)) + b"\0\x7e"),
    "a continuation with no message": lambda m: _raw(0x80, b"x", m),
    "a message inside a fragmented one": lambda m: _raw(0x01, b"a", m) + _raw(0x81, b"b", m),
    "text not UTF-8": lambda m: _raw(0x81, b"a\xff", m),
    "fragmented text not UTF-8": lambda m: _raw(0x01, b"\xe2\x82", m) + _raw(0x80, b"a", m),
    "a close of 1 byte": lambda m: _raw(0x88, b"\x03", m),
    "close code 999": lambda m: _raw(0x88, (999).to_bytes(2, "big"), m),
    "close code 1004": lambda m: _raw(0x88, (1004).to_bytes(2, "big"), m),
    "close code 1005": lambda m: _raw(0x88, (1005).to_bytes(2, "big"), m),
    "close code 1006": lambda m: _raw(0x88, (1006).to_bytes(2, "big"), m),
    "close code 1015": lambda m: _raw(0x88, (1015).to_bytes(2, "big"), m),
    "close code 2999": lambda m: _raw(0x88, (2999).to_bytes(2, "big"), m),
    "close code 5000": lambda m: _raw(0x88, (5000).to_bytes(2, "big"), m),
    "a close reason not UTF-8": lambda m: _raw(0x88, b"\x03\xe8\xff", m),
}


@pytest.mark.parametrize("masked", [True, False], ids=["from a client", "from a server"])
@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_frame_fails_both_readers_with_the_same_code(case: str, masked: bool) -> None:
    good = _raw(0x81, b"ok", masked)
    wire = good + BAD[case](masked) + good
    for split in (len(wire), 1):  # whole, and a byte at a time
        pieces = [wire[i : i + split] for i in range(0, len(wire), split)]
        ours, violation = read_ours(pieces, masked)
        theirs, failed = read_wsproto(pieces, masked)
        assert ours == theirs == [(OP_TEXT, b"ok")]
        assert violation is not None and violation[0] == failed


@pytest.mark.parametrize("masked", [True, False])
def test_a_frame_masked_the_wrong_way_fails_both_readers(masked: bool) -> None:
    wire = _raw(0x81, b"ok", not masked)
    ours, violation = read_ours([wire], masked)
    theirs, failed = read_wsproto([wire], masked)
    assert ours == theirs == [] and violation is not None and violation[0] == failed == 1002


def test_close_code_1014_is_valid_here_and_not_in_wsproto() -> None:
    """The one known disagreement: IANA registered 1014 ("Bad Gateway") after wsproto's list of
    codes was written; a peer may send it (RFC 6455 §7.4.2), so it is read as a close."""
    wire = _raw(0x88, (1014).to_bytes(2, "big"), False)
    assert read_ours([wire], False) == ([(OP_CLOSE, (1014, ""))], None)
    assert read_wsproto([wire], False) == ([], 1002)


def test_a_message_over_the_bound_is_refused_from_its_header() -> None:
    reader = FrameReader(1000, masked=False)
    assert reader.feed(_raw(0x01, b"x" * 60, False)) == []
    head = bytes((0x80, 126)) + (941).to_bytes(2, "big")  # 60 + 941 > 1000; no payload came
    assert reader.feed(head) == [] and reader.violation == (1009, "a message over 1000 bytes")


def test_a_large_message_in_many_reads_is_kept_in_one_growing_buffer() -> None:
    body = b"y" * 300_000
    wire = wsframes.server_frame(OP_BINARY, body)
    reader = FrameReader(MAX, masked=False)
    got = []
    for i in range(0, len(wire), 1000):
        got += reader.feed(wire[i : i + 1000])
    assert got == [(OP_BINARY, body)]
    assert not reader._rest  # nothing left behind
