"""The sans-IO backend stream (gateway.wire.stream): bytes in; payloads, done or a typed error out.

No socket and no clock: each test feeds bytes as reads would bring them. Properties: a whole
answer split at random points gives the same payloads, in order, whatever the body's framing
(chunked, content-length, until the close) and wherever the head read stops; a response that
is not HTTP/1.1 gives ``ProtocolError``, one cut short ``ConnectionLost``, an event that cannot go
into a frame ``BadPayload``; and never any other error.
"""

from __future__ import annotations

import gc
import json
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.wire.stream import (
    BadPayload,
    ConnectionLost,
    EventStream,
    ExchangeFailed,
    ProtocolError,
    ResponseParser,
)

_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"], max_codepoint=0x1F600), max_size=12
)
_PAYLOADS = st.lists(
    st.builds(
        lambda text, i: json.dumps(
            {"id": "c", "choices": [{"index": i, "delta": {"content": text}}]},
            ensure_ascii=False,
        ).encode(),
        _TEXT,
        st.integers(0, 3),
    ),
    max_size=12,
)
_EVENT_STYLE = st.sampled_from(["plain", "crlf", "comment", "fields"])
_FRAMING = st.sampled_from(["chunked", "length", "close"])


def _event(payload: bytes, style: str) -> bytes:
    if style == "crlf":
        return b"data: " + payload + b"\r\n\r\n"
    if style == "comment":
        return b": keep-alive\n\ndata:" + payload + b"\n\n"
    if style == "fields":
        return b"event: chunk\nid: 1\ndata: " + payload + b"\n\n"
    return b"data: " + payload + b"\n\n"


def _answer(body: bytes, framing: str, pieces: int = 3) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    if framing == "length":
        return head + b"content-length: %d\r\n\r\n" % len(body) + body
    if framing == "close":
        return head + b"connection: close\r\n\r\n" + body
    step = max(1, len(body) // pieces)
    chunks = [body[i : i + step] for i in range(0, len(body), step)]
    framed = b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in chunks)
    return head + b"transfer-encoding: chunked\r\n\r\n" + framed + b"0\r\n\r\n"


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c for c in cuts if 0 < c < len(data)})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def _read(reads: list[bytes], closed: bool) -> tuple[list[bytes], EventStream]:
    """As the runner reads an answer: ``http1`` feeds the parser until the head is in (the
    last of those reads may carry body bytes), then the relay feeds an ``EventStream``, one
    read at a time; ``closed``: the peer closes after the last read."""
    parser = ResponseParser()
    reads = list(reads)
    while not parser.head_done:  # the reads ran out: the peer closed (ConnectionLost)
        parser.feed(reads.pop(0) if reads else b"")
    stream = EventStream(parser)
    got = stream.feed(None)  # what came with the head
    for data in reads:
        if stream.done or stream.ended:
            break
        got += stream.feed(data)
    if closed and not (stream.done or stream.ended):
        got += stream.feed(b"")
    if not stream.done:
        got += stream.finish()
    return got, stream


@settings(max_examples=300, deadline=None)
@given(
    _PAYLOADS,
    st.lists(_EVENT_STYLE, min_size=1),
    _FRAMING,
    st.integers(1, 5),
    st.booleans(),
    st.lists(st.integers(0, 4000), max_size=12),
)
def test_any_split_gives_the_same_payloads(
    payloads: list[bytes],
    styles: list[str],
    framing: str,
    pieces: int,
    done: bool,
    cuts: list[int],
) -> None:
    body = b"".join(_event(p, styles[i % len(styles)]) for i, p in enumerate(payloads))
    if done:
        body += b"data: [DONE]\n\n"
    data = _answer(body, framing, pieces)
    got, stream = _read(_split(data, cuts), closed=framing == "close")
    assert got == payloads
    assert stream.done is done
    assert stream.done or stream.ended


@settings(max_examples=200, deadline=None)
@given(_PAYLOADS, st.lists(st.integers(0, 4000), max_size=8))
def test_nothing_after_done(payloads: list[bytes], cuts: list[int]) -> None:
    body = b"".join(_event(p, "plain") for p in payloads)
    body += b"data: [DONE]\n\n" + b'data: {"after":1}\n\n'
    got, stream = _read(_split(_answer(body, "chunked"), cuts), closed=False)
    assert got == payloads and stream.done


_GOOD = _answer(b'data: {"a":1}\n\ndata: {"b":2}\n\n', "chunked")


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, len(_GOOD) - 1),
    st.binary(min_size=1, max_size=4),
    st.lists(st.integers(0, 200), max_size=6),
)
def test_malformed_http_is_a_protocol_error(at: int, junk: bytes, cuts: list[int]) -> None:
    """Any bytes put into a good answer: the payloads it still has, or a typed error."""
    data = _GOOD[:at] + junk + _GOOD[at:]
    try:
        got, _ = _read(_split(data, cuts), closed=True)
    except (ExchangeFailed, BadPayload):
        return
    assert all(isinstance(p, bytes) for p in got)


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",  # a chunk size not hex
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\ndata:XYZ",  # no CRLF after
        b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",
    ],
)
def test_a_broken_body_is_a_protocol_error(data: bytes) -> None:
    parser = ResponseParser()
    with pytest.raises(ProtocolError):
        parser.feed(data)
        EventStream(parser).feed(b"0\r\n\r\n")


def test_a_bad_status_line_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="malformed HTTP response"):
        ResponseParser().feed(b"HTTP/1.1 abc\r\n\r\n")


@settings(max_examples=100, deadline=None)
@given(_PAYLOADS, st.integers(1, 400), st.sampled_from(["chunked", "length"]))
def test_an_answer_cut_short_is_connection_lost(
    payloads: list[bytes], keep: int, framing: str
) -> None:
    body = b"".join(_event(p, "plain") for p in payloads) + b'data: {"last":1}\n\n'
    data = _answer(body, framing)
    head_end = data.index(b"\r\n\r\n") + 4
    cut = data[: min(len(data) - 1, head_end + keep)]
    with pytest.raises(ConnectionLost):
        _read([cut], closed=True)


@pytest.mark.parametrize(
    ("event", "why"),
    [
        (b"data: {not json\n\n", "malformed SSE event"),
        (b'data: {"c":"\xff"}\n\n', "not UTF-8"),
    ],
)
def test_an_event_that_cannot_be_framed_is_a_bad_payload(event: bytes, why: str) -> None:
    data = _answer(b'data: {"ok":1}\n\n' + event, "chunked", pieces=1)
    with pytest.raises(BadPayload, match=why):
        _read([data], closed=False)


def test_a_last_event_without_its_blank_line_is_checked_too() -> None:
    got, stream = _read([_answer(b'data: {"a":1}\n\ndata: {"b":2}', "length")], closed=False)
    assert got == [b'{"a":1}', b'{"b":2}'] and stream.ended and not stream.done
    with pytest.raises(BadPayload, match="malformed"):
        _read([_answer(b'data: {"a":1}\n\ndata: {oops', "length")], closed=False)


def test_the_head_and_its_keep_alive() -> None:
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Type: a/b\r\n")
    assert not parser.head_done and parser.started
    parser.feed(b"content-length: 2\r\n\r\nhi")
    assert parser.status == 200 and parser.header(b"content-type") == b"a/b"
    assert parser.complete and parser.keep_alive and parser.take_body() == b"hi"
    parser.feed(b"more")  # bytes after the whole message: the connection is not kept
    assert not parser.keep_alive


class _Watched(ResponseParser):
    __slots__ = ("__weakref__",)  # (the parser has none: a turn makes one)


def test_a_whole_response_is_freed_at_once_not_by_the_cyclic_collector() -> None:
    """llhttp's parser and ours hold each other while a response is read; once it is whole the
    pair is broken, so a runner's every backend answer is freed as its turn lets it go, not
    by the cyclic collector (which then had most of the runner's collections' work)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        for framing in ("chunked", "length"):
            parser = _Watched()
            parser.feed(_answer(b'data: {"a":1}\n\n', framing))
            assert parser.complete and parser.keep_alive
            gone = weakref.ref(parser)
            del parser
            assert gone() is None, framing
        parser = _Watched()  # read through the relay's stream, head and body apart
        parser.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 15\r\n\r\n")
        stream = EventStream(parser)
        assert stream.feed(b'data: {"a":1}\n\n') == [b'{"a":1}'] and stream.ended
        gone = weakref.ref(parser)
        del parser, stream
        assert gone() is None
    finally:
        if enabled:
            gc.enable()


def test_bytes_after_a_whole_streamed_answer_are_not_parsed_and_the_connection_not_kept() -> None:
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 15\r\n\r\n")
    stream = EventStream(parser)
    assert stream.feed(b'data: {"a":1}\n\n') == [b'{"a":1}'] and parser.keep_alive
    assert stream.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n") == []
    assert stream.ended and not parser.keep_alive and parser.status == 200


def test_a_second_message_in_the_last_read_is_not_parsed_and_the_connection_not_kept() -> None:
    """What a broken backend sends after its whole answer, in the same read, is not taken for
    the answer (its status, headers or body) nor an error: the answer stands, the connection
    goes."""
    extra = b"HTTP/1.1 201 Created\r\nx-extra: 1\r\ncontent-length: 3\r\n\r\nbad"
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi" + extra)
    assert parser.complete and not parser.keep_alive and parser.status == 200
    assert parser.header(b"x-extra") is None and parser.take_body() == b"hi"
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 15\r\n\r\n")
    stream = EventStream(parser)
    assert stream.feed(b'data: {"a":1}\n\n' + extra) == [b'{"a":1}']
    assert stream.ended and not parser.keep_alive and parser.status == 200


def test_bytes_after_a_whole_answer_that_closes_in_the_same_read_are_not_an_error() -> None:
    """A backend that says ``Connection: close`` and sends anything after its whole answer, in
    the same read: the answer stands (llhttp's "data after close" is not a malformed answer)."""
    head = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nhi"
    for extra in (b"garbage", b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n"):
        parser = ResponseParser()
        parser.feed(head + extra)
        assert parser.complete and not parser.keep_alive and parser.take_body() == b"hi"
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 15\r\n\r\n")
    stream = EventStream(parser)
    assert stream.feed(b'data: {"a":1}\n\ngarbage') == [b'{"a":1}']
    assert stream.ended and not parser.keep_alive
