"""The hub's ``Turn`` driven in memory over a socket pair, as h11's tests drive a Connection:
every path to every outcome (done, failed, lost, client gone, overrun, refused, cut), each set in
one place and once, and what the client's socket gets on each path, in each API; and the table
of its moves (``turnstate.NEXT``): every move in it accepted, every other refused, a real turn's
paths made of its moves only, its state read-only."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import h11
import msgspec
import pytest
import trio

from gateway.apis.dialects import CHAT, MessagesDialect
from gateway.hub.turn import Turn
from gateway.hub.turnstate import NEXT, BadMove, State, TurnLost, TurnState, TurnSuspended
from gateway.wire import netio, protocol
from gateway.wire.errors import HTTPError
from gateway.wire.http import Response
from gateway.wire.park import Park

JOB, RID = "job-1", "req-1"


def chunk(i: int, text: str | None = None) -> bytes:
    delta = {"content": text if text is not None else f"tok{i}"}
    return json.dumps(
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
        }
    ).encode()


class _Conn:
    """What a turn needs of its client's connection: a wait for it to leave (never, here)."""

    async def wait_disconnect(self, park: Park | None = None) -> bool:
        if park is None:
            await trio.sleep_forever()
        await park.wait(None)  # until woken
        return False


class Rig:
    """A turn whose client is the far end of a socket pair; ``ended``: what ``on_end`` got."""

    def __init__(
        self,
        stream: bool = True,
        dialect: Any = CHAT,
        bound: int = 1 << 20,
        cls: type[Turn] = Turn,
        **kw: Any,
    ):
        ours, self.client = socket.socketpair()
        self.client.setblocking(False)
        self.transport = netio.Transport(ours)
        request = SimpleNamespace(body_pending=False, keep_alive=True)  # its body was read
        self.resp = Response(request, self.transport, False, b"POST")
        self.ended: list[State] = []
        self.turn = cls(
            "turn-1",
            "key-id",
            "key",
            "s",
            b'{"messages":[{"role":"user","content":"hello there"}]}',
            dialect,
            self.resp,
            model="m",
            stream=stream,
            bound=bound,
            max_answer=kw.pop("max_answer", 1 << 20),
            on_end=lambda turn: self.ended.append(turn.state),
            now=0.0,
            **kw,
        )

    def send(self) -> None:
        self.turn.sent(RID, "runner-1", JOB)

    def chunks(self, *payloads: bytes) -> None:
        for payload in payloads:
            frame = protocol.TurnFrames(JOB, RID).chunk(payload)
            self.turn.chunk(msgspec.json.decode(frame, type=protocol.ChunkFrame).chunk, frame)
        self.turn.flush()

    def received(self) -> bytes:
        out = b""
        while True:
            try:
                data = self.client.recv(1 << 20)
            except BlockingIOError:
                return out
            if not data:
                return out
            out += data

    def events(self) -> list[bytes]:
        """The SSE events of the response body, as a client reads them."""
        client = h11.Connection(h11.CLIENT)
        client.send(
            h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")])
        )
        client.send(h11.EndOfMessage())
        client.receive_data(self.received())
        body = b""
        self.status = 0
        while not isinstance(ev := client.next_event(), h11.EndOfMessage | type(h11.NEED_DATA)):
            if isinstance(ev, h11.Response):
                self.status = ev.status_code
            if isinstance(ev, h11.Data):
                body += ev.data
        self.body = body
        return body.split(b"\n\n")[:-1]


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = Rig()
    yield made
    made.client.close()


async def test_a_streamed_turn_done_writes_its_chunks_the_end_and_ends_ok_once(rig: Rig) -> None:
    rig.send()
    assert rig.turn.state is State.SENT
    rig.chunks(chunk(0), chunk(1))
    assert rig.turn.state is State.ANSWERING and rig.turn.first_token is not None
    rig.turn.reply(protocol.DoneFrame(JOB, RID))
    rig.turn.reply(protocol.ErrorFrame(JOB, RID, "late"))  # after the end: nothing changes
    rig.turn.lost()
    assert rig.turn.state is State.DONE and rig.ended == [State.DONE]
    assert rig.turn.outcome == "ok" and rig.resp.finished
    assert rig.events() == [b"data: " + chunk(0), b"data: " + chunk(1), b"data: [DONE]"]


async def test_an_error_before_any_chunk_is_a_whole_error_answer(rig: Rig) -> None:
    rig.send()
    rig.turn.reply(protocol.ErrorFrame(JOB, RID, "backend returned 404: model missing-model"))
    assert rig.turn.state is State.FAILED and rig.turn.status == 404
    rig.events()
    assert rig.status == 404 and json.loads(rig.body)["error"]["code"] == "model_not_found"


async def test_an_error_after_chunks_ends_the_stream_with_an_error_event(rig: Rig) -> None:
    rig.send()
    rig.chunks(chunk(0))
    rig.turn.reply(protocol.ErrorFrame(JOB, RID, "backend returned 500: boom"))
    assert rig.turn.state is State.FAILED and rig.ended == [State.FAILED]
    events = rig.events()
    assert events[0] == b"data: " + chunk(0)
    assert json.loads(events[1].removeprefix(b"data: "))["error"]["code"] == "upstream_error"


async def test_a_channel_lost_before_any_chunk_lets_the_turn_be_served_again(rig: Rig) -> None:
    rig.send()
    rig.turn.lost()
    assert rig.turn.state is State.WAITING and rig.ended == []
    with pytest.raises(TurnLost):
        await rig.turn.relay(_Conn(), keepalive=0, first_within=100)


async def test_a_channel_lost_mid_answer_suspends_it_then_resumed_it_goes_on(rig: Rig) -> None:
    rig.send()
    rig.chunks(chunk(0), chunk(1))
    assert rig.turn.lost() and rig.turn.state is State.SUSPENDED and rig.ended == []
    with pytest.raises(TurnSuspended):  # its task waits for the redial (``Serving._resume``)
        await rig.turn.relay(_Conn(), keepalive=0, first_within=100)
    assert rig.turn.resume_count() == 2  # what the hello names: the chunk frames it got
    rig.turn.resumed()
    assert rig.turn.state is State.ANSWERING and rig.turn.resumes == 1
    rig.chunks(chunk(2))
    rig.turn.reply(protocol.DoneFrame(JOB, RID))
    assert rig.turn.state is State.DONE and rig.turn.frames == 3
    events = rig.events()
    assert events[:3] == [b"data: " + chunk(i) for i in range(3)]  # none lost, none twice


async def test_a_channel_lost_mid_answer_and_never_resumed_ends_it_lost(rig: Rig) -> None:
    rig.send()
    rig.chunks(chunk(0), chunk(1), chunk(2))
    assert rig.turn.lost()
    rig.turn.lose()  # neither resumed nor continued
    assert rig.turn.state is State.LOST and rig.turn.outcome == "lost"
    # the tokens it delivered are charged: a chunk a token, marked estimated
    assert (rig.turn.completion_tokens, rig.turn.estimated) == (3, True)
    events = rig.events()
    assert json.loads(events[-1].removeprefix(b"data: "))["error"]["code"] == "channel_lost"


async def test_a_client_that_is_gone_ends_the_turn_client_gone(rig: Rig) -> None:
    rig.send()
    rig.client.close()
    for i in range(50):  # until a write fails (the peer's reset)
        rig.chunks(chunk(i))
        if rig.turn.state.final:
            break
    assert rig.turn.state is State.CLIENT_GONE and rig.ended == [State.CLIENT_GONE]


async def test_a_client_too_slow_ends_its_turn_overrun_and_its_connection() -> None:
    rig = Rig(bound=1024)
    rig.send()
    big = chunk(0, "x" * 4096)
    for _ in range(200):  # the client never reads: the socket's buffer fills, then the bound
        rig.chunks(big)
        if rig.turn.state.final:
            break
    assert rig.turn.state is State.OVERRUN and rig.turn.outcome == "client_gone"
    assert rig.resp.gone
    rig.client.close()


async def test_a_big_last_chunk_then_done_stays_done_no_write_after_the_end() -> None:
    """Issue 30 row 8: one 4 MiB chunk then done to a fast client; the body's end is the last
    thing written (no error event after it) and the turn is done."""
    rig = Rig(bound=1024)
    rig.send()
    frame_chunk = chunk(0, "y" * (4 << 20))
    frame = protocol.TurnFrames(JOB, RID).chunk(frame_chunk)
    rig.turn.chunk(msgspec.json.decode(frame, type=protocol.ChunkFrame).chunk, frame)
    rig.turn.reply(protocol.DoneFrame(JOB, RID))  # chunk and done in one read, one write
    assert rig.turn.state is State.DONE and rig.resp.finished and not rig.resp.gone
    got = b""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rig.turn.flush_backlog)
        while not got.endswith(b"0\r\n\r\n"):
            await trio.lowlevel.wait_readable(rig.client)
            got += rig.client.recv(1 << 20)
    assert got.count(b"data: [DONE]") == 1 and b"client_too_slow" not in got
    rig.client.close()


async def test_a_non_streamed_turn_gathers_and_answers_once() -> None:
    rig = Rig(stream=False)
    rig.send()
    rig.chunks(chunk(0), chunk(1))
    assert not rig.received()  # nothing until the whole answer
    rig.turn.reply(protocol.DoneFrame(JOB, RID))
    assert rig.turn.state is State.DONE
    rig.events()
    answer = json.loads(rig.body)
    assert rig.status == 200 and answer["choices"][0]["message"]["content"] == "tok0tok1"
    rig.client.close()


async def test_a_non_streamed_answer_past_the_bound_is_a_clean_error() -> None:
    """Issue 30 row 4: an answer gathered without a cap grew the hub; now one over max_answer
    ends the turn with a 502 at once."""
    rig = Rig(stream=False, max_answer=10_000)
    rig.send()
    for i in range(100):
        rig.chunks(chunk(i, "z" * 500))
        if rig.turn.state.final:
            break
    assert rig.turn.state is State.FAILED and rig.turn.gathered_bytes <= 10_000
    rig.events()
    assert rig.status == 502 and json.loads(rig.body)["error"]["code"] == "answer_too_large"
    rig.client.close()


async def test_done_without_a_completion_is_an_error(rig: Rig) -> None:
    stream = Rig(stream=False)
    stream.send()
    stream.turn.reply(protocol.DoneFrame(JOB, RID))
    assert stream.turn.state is State.FAILED
    stream.events()
    assert json.loads(stream.body)["error"]["code"] == "empty_completion"
    stream.client.close()


async def test_refused_before_a_runner_is_refused_and_in_the_callers_api() -> None:
    rig = Rig(dialect=MessagesDialect("claude-x", 10))
    rig.turn.refuse(HTTPError(429, "slow down", "rate_limit_exceeded", type_="rate_limit_error"))
    assert rig.turn.state is State.REFUSED and rig.turn.status == 429
    assert rig.ended == [State.REFUSED]  # its ``on_end`` told (the accounting's ``refused``)
    rig.events()
    assert json.loads(rig.body) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    rig.client.close()


async def test_keepalives_start_the_stream_then_an_error_ends_it_as_an_event() -> None:
    rig = Rig()
    rig.turn.keepalive()
    rig.turn.refuse(HTTPError(503, "no runner", "no_runner"))
    assert rig.turn.state is State.REFUSED
    events = rig.events()
    assert rig.status == 200 and events[0] == b": keepalive"
    assert json.loads(events[1].removeprefix(b"data: "))["error"]["code"] == "no_runner"
    rig.client.close()


async def test_cut_by_the_hub_stopping(rig: Rig) -> None:
    rig.send()
    rig.chunks(chunk(0))
    rig.turn.cut()
    rig.turn.cut()
    assert rig.turn.state is State.CUT and rig.ended == [State.CUT]
    assert rig.turn.outcome == "cut" and rig.turn.estimated


async def test_the_usage_chunk_is_taken_at_the_end_and_not_estimated(rig: Rig) -> None:
    rig.send()
    usage = (
        b'{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
        b'"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}'
    )
    rig.chunks(chunk(0), chunk(1), usage)
    rig.turn.reply(protocol.DoneFrame(JOB, RID))
    assert (rig.turn.prompt_tokens, rig.turn.completion_tokens) == (7, 2)
    assert not rig.turn.estimated and rig.turn.tokens == 9


# -- the table of its moves ------------------------------------------------------------------


class _At(TurnState):
    """The table alone: a bare ``TurnState`` put at ``state``."""

    __slots__ = ()

    def __init__(self, state: State) -> None:
        self._state = state


class _Logged(Turn):
    """A ``Turn`` that notes each of its moves (from, to), by label."""

    __slots__ = ("moves",)

    def _move(self, to: State) -> None:
        if not hasattr(self, "moves"):
            self.moves: list[tuple[str, str]] = []
        self.moves.append((self.state.label, to.label))
        super()._move(to)


@pytest.mark.parametrize("current", list(State), ids=lambda state: state.label)
def test_the_table_accepts_every_move_it_has_and_refuses_every_other(current: State) -> None:
    accepted = []
    for to in State:
        machine = _At(current)
        if to in NEXT[current]:
            machine._move(to)
            assert machine.state is to
            accepted.append(to)
        else:
            with pytest.raises(BadMove, match=f"no move from {current.label} to {to.label} "):
                machine._move(to)
            assert machine.state is current  # refused: nothing written
    assert set(accepted) == NEXT[current] and len(accepted) == len(current.moves)


def test_the_table_has_a_way_out_of_every_state_but_the_final_ones_each_with_its_outcome() -> None:
    assert {s.label: s.outcome for s in State if s.final} == {
        "done": "ok",
        "failed": "error",
        "lost": "lost",
        "client_gone": "client_gone",
        "overrun": "client_gone",
        "refused": "refused",
        "cut": "cut",
    }
    for state in State:
        if state.final:
            assert NEXT[state] == frozenset() and state.moves == ()
        else:  # the hub stops, the client leaves or reads too slowly: from anywhere
            assert {State.CUT, State.CLIENT_GONE, State.OVERRUN} <= NEXT[state]
            assert state not in NEXT[state]  # staying put is no move
    # refused only before any runner had it; lost only once it answered
    assert [s.label for s in State if State.REFUSED in NEXT[s]] == ["waiting"]
    assert [s.label for s in State if State.LOST in NEXT[s]] == ["answering", "suspended"]
    assert sum(len(moves) for moves in NEXT.values()) == 28


async def test_a_move_the_table_lacks_is_refused_with_a_clear_error(rig: Rig) -> None:
    with pytest.raises(BadMove) as caught:
        rig.turn._move(State.DONE)  # done before any runner had it
    assert str(caught.value) == (
        "<Turn turn-1 chat waiting>: no move from waiting to done (from waiting: sent, failed,"
        " client_gone, overrun, refused, cut)"
    )
    assert rig.turn.state is State.WAITING and rig.ended == []
    rig.send()
    rig.turn.reply(protocol.DoneFrame(JOB, RID))
    with pytest.raises(BadMove, match="from done: none, it has ended"):
        rig.turn._move(State.ANSWERING)
    rig.turn.cut()  # a later end is no move: the first one is its outcome
    assert rig.turn.state is State.DONE and rig.ended == [State.DONE]


async def test_its_state_is_read_only_from_outside(rig: Rig) -> None:
    with pytest.raises(AttributeError):
        rig.turn.state = State.DONE  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del rig.turn.state  # type: ignore[misc]
    assert rig.turn.state is State.WAITING and rig.ended == []


async def test_a_streamed_turn_resumed_then_continued_moves_by_the_table_only() -> None:
    rig = Rig(cls=_Logged)
    turn = rig.turn
    assert isinstance(turn, _Logged)
    rig.send()
    rig.chunks(chunk(0), chunk(1))
    assert turn.lost()  # its channel went mid-answer
    turn.resumed()  # the redialled channel took it back
    assert turn.lost()  # and went too
    before = json.loads(turn.body)["messages"]
    body = turn.continuation("tok0tok1")  # another runner goes on with it
    assert body is not None
    turn.continue_as("c1", body)
    assert json.loads(turn.body)["messages"] == [
        *before,
        {"role": "assistant", "content": "tok0tok1"},
    ]
    assert turn.continued and turn.prior_completion == 2 and turn.prior_prompt > 0
    turn.sent("req-2", "runner-2", "job-2")  # it goes on answering: no move
    rig.chunks(chunk(2))
    turn.reply(protocol.DoneFrame(JOB, RID))
    assert turn.moves == [
        ("waiting", "sent"),
        ("sent", "answering"),
        ("answering", "suspended"),
        ("suspended", "answering"),
        ("answering", "suspended"),
        ("suspended", "answering"),
        ("answering", "done"),
    ]
    assert all(State[to.upper()] in NEXT[State[at.upper()]] for at, to in turn.moves)
    assert rig.ended == [State.DONE] and turn.attempts == 2
    events = [json.loads(event.removeprefix(b"data: ")) for event in rig.events()[:3]]
    assert events == [json.loads(chunk(i)) for i in range(3)]  # one answer: the first part's id
    rig.client.close()


async def test_a_non_streamed_turn_whose_channel_goes_is_served_again_from_the_start() -> None:
    rig = Rig(stream=False, cls=_Logged)
    turn = rig.turn
    assert isinstance(turn, _Logged)
    rig.send()
    rig.chunks(chunk(0))
    assert not turn.lost()  # nothing reached its client: served again
    assert turn.gathered == [] and turn.chunks == 0
    rig.send()
    rig.chunks(chunk(1))
    turn.reply(protocol.DoneFrame(JOB, RID))
    assert turn.moves == [
        ("waiting", "sent"),
        ("sent", "answering"),
        ("answering", "waiting"),
        ("waiting", "sent"),
        ("sent", "answering"),
        ("answering", "done"),
    ]
    rig.events()
    assert json.loads(rig.body)["choices"][0]["message"]["content"] == "tok1"
    rig.client.close()


def test_a_second_continuation_is_built_from_the_client_s_request_not_the_first_continuation() -> (
    None
):
    """Cut twice: the second runner is asked with the client's messages and the whole answer so
    far once, never the first part twice (an assistant message per continuation)."""
    rig = Rig()
    turn = rig.turn
    asked = json.loads(turn.body)["messages"]
    first = turn.continuation("A")
    assert first is not None
    turn.continue_as("c1", first)
    second = turn.continuation("AB")
    assert second is not None
    assert json.loads(second)["messages"] == [*asked, {"role": "assistant", "content": "AB"}]
