"""The runner's poller (``gateway/runner/poller.py``): one task reading every streaming turn's backend.

Over the hot-path rig (a real ``Channel`` on a socket pair, the Server's end on a thread, each
backend a socket pair written from here): a turn whose backend goes wrong fails alone while the
others in the poller stream on, and a cancelled turn leaves the poller and writes nothing more;
and a turn stopped once its done frame went out is whole all the same.
"""

from __future__ import annotations

import socket

import trio
import trio.testing
from test_hotpath import HEAD, Rig, _rig, chunked, payload

from gateway.observe import Histogram
from gateway.runner.relay import Relay
from gateway.runner.turn import Ending, Turn, TurnEnd
from gateway.wire import http1, netio, protocol


def _event(i: int) -> bytes:
    return chunked(b"data: %b\n\n" % payload(i))


def _ids(rig: Rig, request_id: str, kind: str = protocol.COMPLETION_CHUNK) -> int:
    return sum(
        1 for f in rig.server.frames() if f.get("requestId") == request_id and f["type"] == kind
    )


async def test_a_failing_turn_leaves_the_others_streaming() -> None:
    async with trio.open_nursery() as nursery:
        rig = await _rig(nursery)
        poller = rig.channel.relay.poller
        assert poller is not None
        names = ["a", "bad", "c"]
        backends = {name: rig.backend(name) for name in names}
        errors: dict[str, str | None] = {}

        async def turn(name: str) -> None:
            errors[name] = await rig.relay_response(name, backends[name][0])

        async with trio.open_nursery() as turns:
            for name in names:
                turns.start_soon(turn, name)
            await _in_the_poller(rig, [far for _, _, far in backends.values()])
            backends["bad"][2].send(chunked(b"data: {not json\n\n"))
            for name in ("a", "c"):
                far = backends[name][2]
                far.send(_event(2))
                far.send(chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        assert errors["a"] is None and errors["c"] is None
        assert errors["bad"] is not None and "malformed SSE event" in errors["bad"]
        # a and c: their third chunk and their done frame
        await trio.to_thread.run_sync(rig.server.wait_for, 6 + 2 + 2)
        assert _ids(rig, "a") == 3 and _ids(rig, "c") == 3 and _ids(rig, "bad") == 2
        assert _ids(rig, "a", protocol.COMPLETION_DONE) == 1
        assert poller.following == 0
        assert rig.channel.ws.closed is None  # the channel itself is untouched
        nursery.cancel_scope.cancel()


async def test_a_cancelled_turn_leaves_the_poller_and_writes_nothing_more() -> None:
    async with trio.open_nursery() as nursery:
        rig = await _rig(nursery)
        poller = rig.channel.relay.poller
        assert poller is not None
        response, _, far = rig.backend("gone")
        streaming, _, other = rig.backend("other")  # streaming too: the poller relays "gone"
        result: list[str | None] = []

        async def turn() -> None:
            result.append(await rig.relay_response("gone", response))

        async with trio.open_nursery() as turns:
            turns.start_soon(turn)
            turns.start_soon(rig.relay_response, "other", streaming)
            await _in_the_poller(rig, [far, other])
            far.send(_event(2))  # ready in the same pass as the cancel below
            rig.turns["gone"].stop(TurnEnd(Ending.CANCELLED, "cancelled"))
            await trio.testing.wait_all_tasks_blocked()
            turns.cancel_scope.cancel()  # "other" is done with
        assert result == [None]  # cancelled, not failed
        assert poller.following == 0
        assert response.transport.closed  # the connection is closed: the generation stops
        # a frame written after the cancel would come before this one, on the same channel
        error = await rig.relay_response("after", _answered(rig))
        assert error is None
        await trio.to_thread.run_sync(rig.server.wait_for, 4 + 1)
        assert _ids(rig, "gone") == 2
        assert _ids(rig, "gone", protocol.COMPLETION_DONE) == 0
        nursery.cancel_scope.cancel()


async def _in_the_poller(rig: Rig, fars: list[socket.socket]) -> None:
    """Start the turns on ``fars`` streaming, two chunks each: the first turn to stream was
    alone and waited on its own socket; at its second read it joins the poller too."""
    poller = rig.channel.relay.poller
    assert poller is not None
    base = len(rig.server.messages)
    for far in fars:
        far.send(HEAD + _event(0))
    await trio.to_thread.run_sync(rig.server.wait_for, base + len(fars))
    for far in fars:
        far.send(_event(1))
    await trio.to_thread.run_sync(rig.server.wait_for, base + 2 * len(fars))
    await trio.testing.wait_all_tasks_blocked()
    assert poller.following == len(fars)


def _answered(rig: Rig) -> http1.ClientResponse:
    """A backend that has its whole answer written already: one chunk, [DONE], the end."""
    response, _, far = rig.backend("after")
    far.send(HEAD + _event(0) + chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    return response


class _StopAtDone:
    """An outlet that takes every frame, and stops the turn as its done frame goes out: the
    Server's cancel crossing the done frame on the wire."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.turn: Turn | None = None

    def offer(self, message: bytes) -> bool:
        self.frames.append(message)
        if self.turn is not None and message == self.turn.frames.done:
            self.turn.stop(TurnEnd(Ending.CANCELLED, protocol.CANCELLED))
        return True

    def offer_batch(self, messages: list[bytes]) -> bool:
        return all([self.offer(m) for m in messages])

    async def wait_room(self) -> None:
        pass

    async def send(self, message: bytes | str) -> None:
        self.offer(message.encode() if isinstance(message, str) else message)


async def test_a_stop_after_the_done_frame_is_too_late() -> None:
    """A turn whose done frame went out is whole: a stop that comes after it does not cancel
    its relay (the Server would get a second terminal frame, ``cancelled``, after done)."""
    near, far = socket.socketpair()
    response = http1.ClientResponse(netio.Transport(near))
    far.send(HEAD + _event(0) + chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    out = _StopAtDone()
    turn = out.turn = Turn("late", protocol.TurnFrames("job", "late"), trio.current_time())
    relay = Relay(out, None, Histogram(), Histogram())
    with turn.scope:
        await response.read_head()
        await relay.answer(turn, response)
    assert not turn.scope.cancelled_caught and turn.stopped is not None
    assert out.frames == [turn.frames.chunk(payload(0)), turn.frames.done]
    response.close()
    far.close()
