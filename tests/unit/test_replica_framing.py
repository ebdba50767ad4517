"""The framing of a forwarded turn between replicas (``gateway.hub.replicas.framing``), pure: frames
framed and read back whole however the body is cut, a frame's type and request id read from its
head without parsing the rest, and what is not a frame of ours read as nothing."""

from __future__ import annotations

import struct

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.hub.replicas.framing import HEAD, Records, frame_head, record
from gateway.wire.protocol import ChunkFrame, CompletionRequest, DoneFrame, encode_frame


def _cut(data: bytes, cuts: list[int]) -> list[bytes]:
    at = sorted({min(c, len(data)) for c in cuts})
    edges = [0, *at, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=12), st.lists(st.integers(0, 4000)))
def test_frames_come_back_whole_and_in_order_however_the_body_is_cut(
    frames: list[bytes], cuts: list[int]
) -> None:
    body = b"".join(record(f) for f in frames)
    assert len(body) == sum(HEAD + len(f) for f in frames)
    records = Records()
    got: list[bytes] = []
    for piece in _cut(body, cuts):
        got += records.feed([piece])
    assert got == frames and records.pending == 0


def test_a_frame_not_whole_yet_is_kept_until_its_rest_comes() -> None:
    records = Records()
    framed = record(b'{"type":"chat.completion.done"}')
    assert records.feed([framed[:2]]) == []  # half a length
    assert records.pending == 2
    assert records.feed([framed[2:9]]) == []  # the length and part of the frame
    assert records.feed([framed[9:], record(b"")]) == [framed[HEAD:], b""]
    assert records.pending == 0


def test_a_length_past_the_body_yields_nothing() -> None:
    records = Records()
    lying = struct.pack(">I", 1_000) + b"short"
    assert records.feed([lying]) == []
    assert records.pending == len(lying)


def test_the_head_of_a_frame_the_hub_encoded() -> None:
    chunk = encode_frame(ChunkFrame("job-1", "req-7", msgspec.Raw(b'{"x":"\\"requestId\\""}')))
    assert frame_head(chunk) == (b"chat.completion.chunk", "req-7")
    done = encode_frame(DoneFrame("job-1", "req-8"))
    assert frame_head(done) == (b"chat.completion.done", "req-8")
    request = encode_frame(CompletionRequest("req-9", msgspec.Raw(b"{}" + b" " * 100_000)))
    assert frame_head(request) == (b"chat.completion.request", "req-9")


def test_what_is_not_a_frame_of_ours_reads_as_nothing() -> None:
    assert frame_head(b"") == (b"", None)
    assert frame_head(b"not json at all") == (b"", None)
    assert frame_head(b" " * 64 + b'{"type":"late"}') == (b"", None)  # type past its window
    assert frame_head(b'{"type":"chat.end","jobId":"j","reason":"r"}') == (b"chat.end", None)
    unterminated = b'{"type":"chat.completion.done","requestId":"' + b"r" * 300
    assert frame_head(unterminated) == (b"chat.completion.done", None)
