"""The incremental SSE splitter (gateway.wire.sse)."""

from hypothesis import given
from hypothesis import strategies as st

from gateway.wire.sse import SSESplitter

STREAM = b'data: {"a":1}\n\n: comment\n\nevent: x\ndata: {"b":2}\n\ndata: [DONE]\n\n'


def test_whole_stream() -> None:
    assert SSESplitter().feed(STREAM) == [b'{"a":1}', b'{"b":2}', b"[DONE]"]


def test_crlf_and_multiline_and_no_space() -> None:
    s = SSESplitter()
    assert s.feed(b"data:x\r\ndata: y\r\n\r\ndata: z\r") == [b"x\ny"]
    assert s.feed(b"\n\r\n") == [b"z"]


def test_flush_returns_unterminated_event() -> None:
    s = SSESplitter()
    assert s.feed(b"data: tail") == []
    assert s.pending()
    assert s.flush() == [b"tail"]


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=12))
def test_any_split_gives_the_same_events(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    pieces = [STREAM[a:b] for a, b in zip([0, *points], [*points, len(STREAM)], strict=True)]
    s = SSESplitter()
    out: list[bytes] = []
    for piece in pieces:
        out += s.feed(piece)
    assert out == [b'{"a":1}', b'{"b":2}', b"[DONE]"]


@given(st.lists(st.integers(min_value=1, max_value=30), max_size=12))
def test_any_split_crlf(cuts: list[int]) -> None:
    stream = STREAM.replace(b"\n", b"\r\n")
    points = sorted({c for c in cuts if c < len(stream)})
    s = SSESplitter()
    out: list[bytes] = []
    for a, b in zip([0, *points], [*points, len(stream)], strict=True):
        out += s.feed(stream[a:b])
    assert out == [b'{"a":1}', b'{"b":2}', b"[DONE]"]
