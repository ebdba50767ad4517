"""A channel that drops mid-answer resumes, byte for byte (issue 27 point 1, docs/protocol.md §6).

Real parts over loopback: the hub for the runner's REST calls, the simulator as its backend, and
a Server end of our own for the channel (``tests/support/channelserver.py``, wsproto) that sends the
hello, drops the connection mid-answer (a reset: frames the runner sent after it are lost) and
names on the redial how many chunk frames of each turn it received. What the client would see
(the chunk frames of the first connection up to the count, then the second's) is compared with
what the backend sent, payload for payload. Time-bound behaviour (the resume window, the wait
for a hello) runs on trio's autojump clock.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from channelserver import ChannelServer, Conn, channel_server, no_hello
from helpers import ADMIN, BACKEND_KEY, CHAT_DEFINITION, OWNER, PROJECT, runner_config, running
from pathproxy import path_proxy

from gateway.hub import Hub, open_hub
from gateway.runner.resume import ResumeBuffer
from gateway.runner.supervisor import Runner
from gateway.runner.turn import Ending, Turn
from gateway.runner.turns import HELLO_WAIT, Turns
from gateway.sim import Simulator, open_sim
from gateway.wire import protocol
from gateway.wire.stream import EventStream, ResponseParser

GUARD = 30  # s: a never-hangs guard; nothing is expected to come near it
LONG = {"chunks": 100_000, "interval": 0.01}  # a turn that streams until it is stopped


def body(say: str = "hi", **sim: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": say}], "stream": True, "sim": sim}


@dataclass
class Rig:
    server: ChannelServer
    sim: Simulator
    runner: Runner
    job: str
    conn: Conn

    @property
    def turns(self) -> Turns:
        turns = self.runner.sessions[self.job].turns
        assert turns is not None
        return turns

    def sent(self, n: int) -> list[bytes]:
        """What the backend sent for its ``n``-th stream (1-based), [DONE] left out."""
        return [p for p in self.sim.streams[n - 1].payloads if p != b"[DONE]"]


@asynccontextmanager
async def rig(
    tmp_path: Path,
    hello: Callable[[ChannelServer, int, str], dict[str, Any] | None] | None = None,
    **overrides: Any,
) -> AsyncIterator[Rig]:
    async with (
        open_hub(Hub(admin_token=ADMIN)) as (hub, url),
        channel_server(hello) as server,
        open_sim(require_key=BACKEND_KEY) as sim,
    ):
        config = runner_config(url, sim.url, tmp_path, **overrides)
        async with running(config) as runner:
            definition = {**CHAT_DEFINITION, "channelUrl": server.url}
            job = await hub.board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], definition)
            with trio.fail_after(GUARD):
                conn = await server.conn(1)
            yield Rig(server, sim, runner, job.id, conn)


async def test_a_dropped_channel_resumes_byte_for_byte(tmp_path: Path) -> None:
    """The Server resets the channel mid-answer; the frames the runner wrote after that are
    lost. On the redial it names the count it got; the runner sends the rest, and the turn goes
    on live. Every payload the backend sent reaches the Server once, in order, byte for byte,
    from one backend request that was never interrupted."""
    async with rig(tmp_path) as r:
        await r.server.request(r.conn, r.job, "t1", body(chunks=400, interval=0.002))
        with trio.fail_after(GUARD):
            await r.server.until_chunks("t1", 40)
            r.conn.drop()
            got_before = r.server.chunk_count("t1")
            last = await r.server.until_finished("t1")
        assert last["type"] == protocol.COMPLETION_DONE
        assert r.server.chunks("t1") == r.sent(1)  # no chunk lost, none twice, verbatim
        assert [f["type"] for f in r.server.of("t1")].count(protocol.COMPLETION_DONE) == 1
        assert len(r.sim.streams) == 1 and r.sim.streams[0].completed  # one generation, whole
        on_second = [f for n, f, _ in r.server.frames["t1"] if n == 2]
        assert on_second and len(r.server.chunks("t1")) - got_before == len(on_second) - 1
        assert r.runner.counters.get("turns_resumed") == 1
        assert r.runner.counters.get("turns_done") == 1
        assert r.runner.counters.get("reconnects") == 1


@pytest.mark.parametrize("fault", ["frozen", "cut"])
async def test_a_broken_path_resumes_what_it_swallowed(
    fault: str, autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """The path between runner and Server breaks mid-answer (``tests/support/pathproxy.py``). Frozen:
    what the runner writes into it is lost, unknown to either end, until its ping goes
    unanswered. Cut: both ends are reset at once. The redial (through the proxy, on a new path)
    names what arrived; the runner sends the rest."""
    async with (
        open_hub(Hub(admin_token=ADMIN)) as (hub, url),
        channel_server() as server,
        open_sim(require_key=BACKEND_KEY) as sim,
        path_proxy(server.port) as proxy,
    ):
        config = runner_config(url, sim.url, tmp_path, ping_interval=1.0, ping_timeout=1.0)
        async with running(config) as runner:
            channel = f"ws://127.0.0.1:{proxy.port}/api/lives/chat/channel/ws"
            job = await hub.board.enqueue(
                OWNER, PROJECT, ["chat-llm:v1"], {**CHAT_DEFINITION, "channelUrl": channel}
            )
            with trio.fail_after(GUARD):
                conn = await server.conn(1)
                await server.request(conn, job.id, "t", body(chunks=3000, interval=0.005))
                await server.until_chunks("t", 20)
                if fault == "frozen":
                    proxy.freeze()
                    await runner.counters.wait("channels_dead", 1)
                    relayed_by_then = len(sim.streams[0].payloads)
                    got_frozen = server.chunk_count("t")
                else:
                    assert proxy.cut_all() == 1
                last = await server.until_finished("t")
        sent = [p for p in sim.streams[0].payloads if p != b"[DONE]"]
        assert last["type"] == protocol.COMPLETION_DONE
        assert server.chunks("t") == sent
        if fault == "frozen":
            assert got_frozen + 100 < relayed_by_then  # written into the frozen path, lost there
        assert runner.counters.get("turns_resumed") == 1 and len(sim.streams) == 1
        assert runner.counters.get("reconnects") == 1


def _naming(*turns: str, ghost: int | None = None) -> Callable[..., dict[str, Any] | None]:
    """A hello that names only ``turns`` (with their counts) on a redial, and a turn the
    runner never had (``ghost``: its count)."""

    def hello(server: ChannelServer, number: int, job_id: str) -> dict[str, Any]:
        frame: dict[str, Any] = {
            "type": protocol.HELLO,
            "jobId": job_id,
            "extensions": ["resume", "continue", "some-future-extension"],
        }
        if number > 1:
            frame["resume"] = {t: server.chunk_count(t) for t in turns}
            if ghost is not None:
                frame["resume"]["ghost"] = ghost
        return frame

    return hello


async def test_turns_not_named_are_cancelled_and_unknown_ones_unavailable(tmp_path: Path) -> None:
    async with rig(tmp_path, _naming("a", ghost=0)) as r:
        await r.server.request(r.conn, r.job, "a", body("turn a", **LONG))
        await r.server.request(r.conn, r.job, "b", body("turn b", **LONG))
        with trio.fail_after(GUARD):
            await r.server.until_chunks("a", 3)
            await r.server.until_chunks("b", 3)
            a_stream, b_stream = (
                next(s for s in r.sim.streams if f"turn {t}".encode() in s.body) for t in "ab"
            )
            r.conn.drop()
            conn2 = await r.server.conn(2)
            ghost = await r.server.until_finished("ghost")
            await b_stream.finished.wait()  # b: cancelled at once, its backend request closed
            # a: goes on, live, on the new connection; then the Server cancels it
            count = r.server.chunk_count("a")
            await r.server.until_chunks("a", count + 5)
            await conn2.send({"type": protocol.COMPLETION_CANCEL, "jobId": r.job, "requestId": "a"})
            last_a = await r.server.until_finished("a")
        assert ghost == {
            "type": protocol.COMPLETION_ERROR,
            "jobId": r.job,
            "requestId": "ghost",
            "error": protocol.RESUME_UNAVAILABLE,
        }
        assert b_stream.client_closed and not b_stream.completed
        assert all(n == 1 for n, _, _ in r.server.frames["b"])  # nothing for b after the drop
        assert last_a["error"] == protocol.CANCELLED
        a_chunks = r.server.chunks("a")
        assert a_chunks == [p for p in a_stream.payloads if p != b"[DONE]"][: len(a_chunks)]
        assert r.runner.counters.get("turns_resumed") == 1


async def test_a_turn_kept_for_a_resume_keeps_its_frames_not_its_answers_decoder(
    tmp_path: Path,
) -> None:
    """A streamed turn that ends while its channel is up is kept a while (``linger``: the time a
    dead path takes to be found) in case the Server did not get all of it: its frames, by
    reference, and nothing of its backend answer's decoding (under load a runner keeps
    thousands such turns, and every full collection walked their decoders and parsers)."""
    async with rig(tmp_path) as r:
        for n in range(3):
            await r.server.request(r.conn, r.job, f"t{n}", body(chunks=5))
        with trio.fail_after(GUARD):
            await r.runner.counters.wait("turns_done", 3)  # each kept as its task ends
        assert {"t0", "t1", "t2"} <= set(r.turns._kept())  # ended, kept
        got = sorted(r.server.chunks(f"t{n}") for n in range(3))  # (the backend's order)
        assert got == sorted(r.sent(n) for n in (1, 2, 3))
        gc.collect()
        kept = [o for o in gc.get_objects() if isinstance(o, (EventStream, ResponseParser))]
        assert kept == []


async def test_frames_no_longer_kept_get_resume_unavailable(tmp_path: Path) -> None:
    """A small resume_buffer: by the drop the turn's first frames were trimmed; the redial asks
    for them (count 0): resume_unavailable, and the turn is cancelled (its backend closed)."""

    def from_zero(server: ChannelServer, number: int, job_id: str) -> dict[str, Any]:
        frame: dict[str, Any] = {"type": protocol.HELLO, "jobId": job_id, "extensions": ["resume"]}
        if number > 1:
            frame["resume"] = {"t": 0}
        return frame

    async with rig(tmp_path, from_zero, resume_buffer=4096) as r:
        await r.server.request(r.conn, r.job, "t", body(**LONG))
        with trio.fail_after(GUARD):
            await r.server.until_chunks("t", 60)  # ~12 KB of frames: more than the buffer
            r.conn.drop()
            await r.server.conn(2)
            last = await r.server.until_finished("t")
            await r.sim.streams[0].finished.wait()
        assert last["error"] == protocol.RESUME_UNAVAILABLE
        assert r.sim.streams[0].client_closed
        assert r.turns.buffer is not None and r.turns.buffer.bytes == 0


async def test_a_turn_outgrowing_the_buffer_while_down_is_cancelled_memory_stays_bounded(
    tmp_path: Path,
) -> None:
    """While the channel is down the turn goes on and its frames are kept: never more than
    resume_buffer bytes for the channel. Past it the turn is cancelled and its backend request
    closed; the redial then gets resume_unavailable for it."""
    limit = 16 * 1024
    async with rig(tmp_path, resume_buffer=limit) as r:
        await r.server.request(r.conn, r.job, "t", body(chunks=100_000, interval=0.001))
        with trio.fail_after(GUARD):
            await r.server.until_chunks("t", 10)
            r.server.refuse = True  # the redials are refused (503) until told otherwise
            r.conn.drop()
            stream = r.sim.streams[0]
            kept: list[int] = []
            while not stream.finished.is_set():
                assert r.turns.buffer is not None
                kept.append(r.turns.buffer.bytes)
                await stream.wait_sent(len(stream.payloads) + 5)
            r.server.refuse = False
            last = await r.server.until_finished("t")
        assert max(kept) <= limit and max(kept) > limit // 2
        assert stream.client_closed and len(stream.payloads) > 40  # ~16 KB of ~230-byte frames
        assert last["error"] == protocol.RESUME_UNAVAILABLE
        assert r.runner.counters.get("turns_cancelled") == 1


async def test_no_redial_within_the_resume_window_cancels_the_kept_turns(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with rig(tmp_path, resume_window=3.0, reconnect_window=30.0) as r:
        await r.server.request(r.conn, r.job, "t", body(**LONG))
        with trio.fail_after(GUARD):
            await r.server.until_chunks("t", 3)
            r.server.refuse = True
            r.conn.drop()
            dropped = trio.current_time()
            await r.sim.streams[0].finished.wait()
            cancelled = trio.current_time() - dropped
        assert r.sim.streams[0].client_closed
        assert cancelled == pytest.approx(3.0, abs=0.3)  # the window, from the drop
        assert r.runner.counters.get("turns_cancelled") == 1


def _hello_first_only(server: ChannelServer, number: int, job_id: str) -> dict[str, Any] | None:
    if number == 1:
        return {"type": protocol.HELLO, "jobId": job_id, "extensions": ["resume"]}
    return None


async def test_a_redial_without_hello_cancels_the_kept_turns_after_the_wait(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with rig(tmp_path, _hello_first_only) as r:
        await r.server.request(r.conn, r.job, "t", body(**LONG))
        with trio.fail_after(GUARD):
            await r.server.until_chunks("t", 3)
            r.conn.drop()
            await r.server.conn(2)
            redialled = trio.current_time()
            await r.sim.streams[0].finished.wait()
            waited = trio.current_time() - redialled
        assert waited == pytest.approx(HELLO_WAIT, abs=0.3)
        assert r.sim.streams[0].client_closed
        assert all(n == 1 for n, _, _ in r.server.frames["t"])


async def test_a_redial_whose_first_frame_is_a_request_cancels_kept_turns_at_once(
    tmp_path: Path,
) -> None:
    async with rig(tmp_path, _hello_first_only) as r:
        await r.server.request(r.conn, r.job, "t", body(**LONG))
        with trio.fail_after(GUARD):
            await r.server.until_chunks("t", 3)
            r.conn.drop()
            conn2 = await r.server.conn(2)
            await r.server.request(conn2, r.job, "next", body(chunks=3))
            await r.sim.streams[0].finished.wait()
            last = await r.server.until_finished("next")
        assert last["type"] == protocol.COMPLETION_DONE
        assert r.sim.streams[0].client_closed
        assert all(n == 1 for n, _, _ in r.server.frames["t"])


async def test_a_server_that_never_says_hello_sees_todays_behaviour(tmp_path: Path) -> None:
    """No hello: the drop cancels the turn at once (its backend request closed), nothing of it
    is kept, and the redialled channel serves new turns as ever."""
    async with rig(tmp_path, no_hello) as r:
        await r.server.request(r.conn, r.job, "t", body(**LONG))
        with trio.fail_after(GUARD):
            await r.server.until_chunks("t", 3)
            r.conn.drop()
            await r.sim.streams[0].finished.wait()
            conn2 = await r.server.conn(2)
            await r.server.request(conn2, r.job, "next", body(chunks=3))
            last = await r.server.until_finished("next")
        assert r.sim.streams[0].client_closed
        assert last["type"] == protocol.COMPLETION_DONE
        assert all(n == 1 for n, _, _ in r.server.frames["t"])
        assert r.turns.buffer is not None and r.turns.buffer.bytes == 0
        assert r.runner.counters.get("turns_resumed") == 0


# -- the buffer's bounds, in memory ---------------------------------------------------------


def _turn(name: str) -> Turn:
    return Turn(name, protocol.TurnFrames("job", name), 0.0)


def _frame(turn: Turn, i: int, size: int = 100) -> bytes:
    return turn.frames.chunk(b'{"i":%d,"pad":"%b"}' % (i, b"x" * size))


def _add(buffer: ResumeBuffer, turn: Turn, frames: list[bytes]) -> None:
    """Add frames as a turn's pump does: one a read, none once the turn is stopped."""
    for frame in frames:
        if turn.stopped is not None:
            return
        buffer.add(turn, frame)
        turn.chunks += 1


def test_the_buffer_trims_the_oldest_frames_of_the_channel_first() -> None:
    lost: list[int] = []
    buffer = ResumeBuffer(4000, lambda out: lost.append(1))
    a, b = _turn("a"), _turn("b")
    a_frames = [_frame(a, i) for i in range(20)]
    b_frames = [_frame(b, i) for i in range(20)]
    for i in range(20):  # interleaved, as two turns stream
        _add(buffer, a, a_frames[i : i + 1])
        _add(buffer, b, b_frames[i : i + 1])
        assert buffer.bytes <= 4000
    assert a.kept_from > 0 and b.kept_from > 0 and abs(a.kept_from - b.kept_from) <= 1
    assert buffer.frames_from(a, a.kept_from) == a_frames[a.kept_from :]
    assert buffer.frames_from(a, a.kept_from - 1) is None  # trimmed
    assert buffer.frames_from(b, 20) == []
    assert buffer.frames_from(b, 21) is None  # more than it sent


def test_while_down_sent_frames_go_first_then_the_turn_that_needs_more_is_stopped() -> None:
    buffer = ResumeBuffer(4000, lambda out: None)
    a = _turn("a")
    _add(buffer, a, [_frame(a, i) for i in range(10)])  # ~1.5 KB, sent
    buffer.down()
    _add(buffer, a, [_frame(a, i) for i in range(10, 25)])  # not sent: must stay
    assert a.stopped is None and a.kept_from > 0  # sent frames trimmed to make room
    _add(buffer, a, [_frame(a, i) for i in range(25, 40)])
    assert a.stopped is not None and a.stopped.ending is Ending.UNRESUMED
    assert buffer.bytes == 0 and a.released


def test_a_batch_is_one_entry_and_resumes_from_its_middle() -> None:
    buffer = ResumeBuffer(1 << 20, lambda out: None)
    a = _turn("a")
    frames = [_frame(a, i) for i in range(6)]
    batch = frames[:4]
    buffer.add_batch(a, batch)
    a.chunks += 4
    _add(buffer, a, frames[4:])
    assert len(buffer.entries) == 3 and buffer.entries[0][2] is batch  # kept, not copied
    assert buffer.frames_from(a, 2) == frames[2:]
    buffer.release(a)
    assert buffer.bytes == 0 and buffer.frames_from(a, 0) is None


def test_frames_let_go_are_dropped_before_they_hold_an_eighth_of_the_bound() -> None:
    """Released turns' entries are skipped, and purged once they hold an eighth of the bound:
    the memory referenced stays within resume_buffer and an eighth of it."""
    buffer = ResumeBuffer(16_000, lambda out: None)
    live = _turn("live")
    for n in range(200):  # short turns end one after another beside a long one
        short = _turn(f"short{n}")
        _add(buffer, short, [_frame(short, i) for i in range(3)])
        _add(buffer, live, [_frame(live, n)])
        buffer.release(short)
        held = sum(e[3] for e in buffer.entries)
        assert buffer.bytes <= 16_000 and held <= 16_000 + 16_000 // 8
    assert buffer.frames_from(live, live.kept_from) is not None
