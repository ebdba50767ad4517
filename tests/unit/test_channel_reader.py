"""The Server's end of a Chat Channel reading (``gateway.hub.channel.ServerChannel.on_texts``),
in memory: no WebSocket, the texts of one read handed to it as its connection would. Each frame
goes to the sink its request id names, in order, a request's chunks flushed once per read (or
written with its end); frames for no open request, frames that are not ours and ``chat.end``
go to ``unrouted``, and nothing else is disturbed."""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.hub.board import Changes, JobBoard
from gateway.hub.channel import Channels, ServerChannel
from gateway.hub.counters import HubCounters
from gateway.hub.settings import HubSettings
from gateway.hub.store import open_store
from gateway.wire.protocol import ChunkFrame, DoneFrame, ErrorFrame, ModelsFrame


class Sink:
    """A request's sink that writes down what it is told, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def chunk(self, chunk: msgspec.Raw, frame: bytes) -> None:
        self.calls.append(("chunk", bytes(chunk)))

    def flush(self) -> None:
        self.calls.append(("flush", None))

    def reply(self, frame: Any) -> None:
        self.calls.append(("reply", frame))

    def lost(self) -> bool:
        self.calls.append(("lost", None))
        return False

    def resume_count(self) -> int | None:
        return None

    def resumed(self) -> None:
        self.calls.append(("resumed", None))


def channel() -> tuple[ServerChannel, Channels]:
    changes = Changes()
    board = JobBoard(open_store(None), HubSettings(), changes)
    channels = Channels(board, changes, HubCounters())
    return ServerChannel("job", "runner-1", None, channels), channels


def chunk(rid: str, payload: bytes) -> bytes:
    return b'{"type":"chat.completion.chunk","jobId":"job","requestId":"%s","chunk":%s}' % (
        rid.encode(),
        payload,
    )


def done(rid: str) -> bytes:
    return b'{"type":"chat.completion.done","jobId":"job","requestId":"%s"}' % rid.encode()


async def test_each_frame_goes_to_the_sink_of_its_request_id_in_order() -> None:
    ch, channels = channel()
    a, b = Sink(), Sink()
    ch.open("a", a)
    ch.open("b", b)
    await ch.on_texts([chunk("a", b'{"n":1}'), chunk("b", b'{"n":1}'), chunk("a", b'{"n":2}')])
    assert a.calls == [("chunk", b'{"n":1}'), ("chunk", b'{"n":2}'), ("flush", None)]
    assert b.calls == [("chunk", b'{"n":1}'), ("flush", None)]  # one flush per read
    assert channels.board.alive("runner-1")  # a read is a sign of life
    assert ch.requests == 2


async def test_a_requests_end_comes_after_its_chunks_and_closes_its_route() -> None:
    ch, _ = channel()
    a, b = Sink(), Sink()
    ch.open("a", a)
    ch.open("b", b)
    await ch.on_texts([chunk("a", b'"x"'), done("a"), chunk("b", b'"y"')])
    # the end writes what the read gave it, with it: no flush of its own
    assert a.calls == [("chunk", b'"x"'), ("reply", DoneFrame("job", "a"))]
    assert b.calls == [("chunk", b'"y"'), ("flush", None)]
    assert not ch.routes("a") and ch.routes("b")
    late: list[tuple[Any, bytes]] = []
    ch.unrouted = lambda frame, text: late.append((frame, text))
    await ch.on_texts([chunk("a", b'"late"')])  # after its end: nobody's
    assert late == [(ChunkFrame("job", "a", msgspec.Raw(b'"late"')), chunk("a", b'"late"'))]
    assert a.calls[-1] == ("reply", DoneFrame("job", "a"))


async def test_frames_for_no_request_and_frames_not_ours_are_unrouted() -> None:
    ch, _ = channel()
    a = Sink()
    ch.open("a", a)
    unrouted: list[tuple[Any, bytes]] = []
    ch.unrouted = lambda frame, text: unrouted.append((frame, text))
    texts = [
        chunk("nobody", b"1"),
        b"not json",
        b'{"type":"chat.completion.chunk"}',  # no request id
        b'{"type":"something.else","requestId":"a"}',
        b"[" * 100_000,  # nested past what a decoder recurses into
        chunk("a", b"2"),
    ]
    await ch.on_texts(texts)
    assert [frame for frame, _ in unrouted] == [
        ChunkFrame("job", "nobody", msgspec.Raw(b"1")),
        None,
        None,
        None,
        None,
    ]
    assert [text for _, text in unrouted] == texts[:5]
    assert a.calls == [("chunk", b"2"), ("flush", None)]  # its request untouched


async def test_a_frame_of_the_wrong_shape_is_read_as_the_frame_it_meant() -> None:
    ch, _ = channel()
    sinks = {rid: Sink() for rid in ("e1", "e2", "m")}
    for rid, sink in sinks.items():
        ch.open(rid, sink)
    await ch.on_texts(
        [
            b'{"type":"chat.completion.error","requestId":"e1","error":{"code":5}}',  # no jobId
            b'{"type":"chat.completion.error","jobId":"job","requestId":"e2","error":""}',
            b'{"type":"chat.models.response","jobId":"job","requestId":"m",'
            b'"models":["a",{"id":"b"},7]}',
        ]
    )
    assert sinks["e1"].calls == [("reply", ErrorFrame("", "e1", '{"code":5}'))]
    assert sinks["e2"].calls == [("reply", ErrorFrame("job", "e2", ""))]
    assert sinks["m"].calls == [("reply", ModelsFrame("job", "m", ["a", "b"]))]


async def test_lenient_frames_say_why_they_failed_when_they_give_no_reason() -> None:
    ch, _ = channel()
    sink = Sink()
    ch.open("e", sink)
    await ch.on_texts([b'{"type":"chat.completion.error","jobId":"job","requestId":"e"}'])
    assert sink.calls == [("reply", ErrorFrame("job", "e", "the runner reported an error"))]


async def test_chat_end_and_undecodable_frames_are_noted_by_default() -> None:
    ch, channels = channel()
    await ch.on_texts([b"\xff\xfe", b"{}", b'{"type":"chat.end","jobId":"job","reason":"bye"}'])
    assert ch.undecodable == 2
    assert ch.runner_ended and "job" in channels.runner_ended


async def test_a_request_opened_on_a_closed_channel_is_lost_at_once() -> None:
    ch, _ = channel()
    open_one = Sink()
    ch.open("a", open_one)
    ch.request_close(1006)
    assert open_one.calls == [("lost", None)] and ch.closed.is_set()
    late = Sink()
    ch.open("b", late)
    assert late.calls == [("lost", None)] and not ch.routes("b")
