"""The runner against the hub and the simulator over loopback: sessions, turns, faults."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import trio
from faultproxy import fault_proxy
from helpers import (
    ADMIN,
    BACKEND_KEY,
    OWNER,
    PROJECT,
    Turns,
    open_chat,
    request_frame,
    runner_config,
    running,
    send,
)

from gateway.hub import Hub, open_hub
from gateway.runner.alp import AlpClient
from gateway.runner.backoff import backoff_delay
from gateway.runner.session import ChatJob, channel_url
from gateway.runner.supervisor import Runner
from gateway.sim import Simulator, serve_sim


async def test_one_turn_streams_verbatim_chunks(
    hub: tuple[Hub, str], sim: Simulator, runner: Runner
) -> None:
    job, ch = await open_chat(hub[0])
    assert job.claimed_by is not None
    await send(ch, request_frame(job.id, "r1", sim={"chunks": 5}))
    turns = Turns(ch)
    await turns.until("r1")
    frames = turns.of("r1")
    stream = sim.streams[0]
    payloads = [p for p in stream.payloads if p != b"[DONE]"]
    n = len(payloads)
    assert n >= 6 and stream.payloads[-1] == b"[DONE]"
    assert [f["type"] for f in frames] == ["chat.completion.chunk"] * n + ["chat.completion.done"]
    # byte-identical payloads: the frame text holds each backend payload unchanged
    texts = [t for f, t, _ in turns.frames["r1"] if f["type"] == "chat.completion.chunk"]
    for text, payload in zip(texts, payloads, strict=True):
        assert text.encode().endswith(b'"chunk":' + payload + b"}")
    assert all(f["jobId"] == job.id for f in frames)
    # the default model was filled in; the backend key was sent to the backend only
    body = json.loads(stream.body)
    assert body["model"] == "sim-model"
    assert stream.request is not None
    assert stream.request.headers["authorization"] == f"Bearer {BACKEND_KEY}"


async def test_two_turns_interleave(hub: tuple[Hub, str], sim: Simulator, runner: Runner) -> None:
    job, ch = await open_chat(hub[0])
    await send(ch, request_frame(job.id, "slow", sim={"chunks": 6, "interval": 0.15}))
    await send(ch, request_frame(job.id, "fast", sim={"chunks": 3}))
    turns = Turns(ch)
    await turns.until("fast")
    # the fast turn finished while the slow one was still streaming
    assert not turns.finished("slow")
    await turns.until("slow")
    order = [f["requestId"] for f in turns.of("slow") + turns.of("fast")]
    assert set(order) == {"slow", "fast"}
    assert turns.last("slow")["type"] == "chat.completion.done"


async def test_models_request_answered_during_a_generation(
    hub: tuple[Hub, str], sim: Simulator, runner: Runner
) -> None:
    job, ch = await open_chat(hub[0])
    await send(ch, request_frame(job.id, "long", sim={"chunks": 50, "interval": 0.1}))
    await send(ch, {"type": "chat.models.request", "jobId": job.id, "requestId": "m1"})
    turns = Turns(ch)
    await turns.until("m1")
    assert turns.last("m1")["models"] == ["sim-model"]
    assert not turns.finished("long")
    stream = await sim.wait_for_streams(1)  # the generation has reached the backend
    await send(ch, {"type": "chat.completion.cancel", "jobId": job.id, "requestId": "long"})
    await turns.until("long", errors={"long"})
    assert turns.last("long") == {
        "type": "chat.completion.error",
        "jobId": job.id,
        "requestId": "long",
        "error": "cancelled",
    }
    with trio.fail_after(5):
        await stream.finished.wait()
    assert stream.client_closed


async def test_chat_end_mid_generation_closes_backend_and_reports_success(
    hub: tuple[Hub, str], sim: Simulator, runner: Runner
) -> None:
    job, ch = await open_chat(hub[0])
    await send(ch, request_frame(job.id, "r", sim={"chunks": 100, "interval": 0.1}))
    stream = await sim.wait_for_streams(1)
    await stream.wait_sent(1)
    await send(ch, {"type": "chat.end", "reason": "user left"})
    with trio.fail_after(15):
        await stream.finished.wait()
    assert stream.client_closed and not stream.completed  # cut, not run to its end
    with trio.fail_after(5):
        await job.completed.wait()
    finals = [r for r in job.reports if r.get("status") == "completed"]
    assert len(finals) == 1 and finals[0]["conclusion"] == "success"
    assert job.reports[0] == {"status": "in_progress"}


async def test_chunks_are_not_bunched(hub: tuple[Hub, str], sim: Simulator, runner: Runner) -> None:
    job, ch = await open_chat(hub[0])
    await send(ch, request_frame(job.id, "p", sim={"chunks": 10, "interval": 0.05}))
    turns = Turns(ch)
    await turns.until("p")
    received = [at for f, _, at in turns.frames["p"] if f["type"] == "chat.completion.chunk"]
    sent = sim.streams[0].sent_at[: len(received)]  # the last send is [DONE]
    assert len(received) == len(sim.streams[0].payloads) - 1
    gaps = [b - a for a, b in zip(received[1:-1], received[2:], strict=False)]
    assert statistics.median(gaps) > 0.035, gaps  # ~50 ms apart, as sent
    delays = [r - s for r, s in zip(received, sent, strict=True)]
    assert statistics.median(delays) < 0.030, delays  # each chunk relayed as it came


async def test_frame_model_wins_and_non_stream_reply(
    hub: tuple[Hub, str], sim: Simulator, runner: Runner
) -> None:
    sim.models.append("other")
    job, ch = await open_chat(hub[0])
    frame = request_frame(job.id, "n", sim={"chunks": 3}, stream=False, model="sim-model")
    frame["model"] = "other"
    await send(ch, frame)
    turns = Turns(ch)
    await turns.until("n")
    chunks = turns.chunks("n")
    assert len(chunks) == 1 and chunks[0]["object"] == "chat.completion"
    assert chunks[0]["model"] == "other"
    assert json.loads(sim.streams[0].body)["model"] == "other"


async def test_backend_errors_become_error_frames(
    hub: tuple[Hub, str], sim: Simulator, runner: Runner
) -> None:
    job, ch = await open_chat(hub[0])
    await send(ch, request_frame(job.id, "e500", sim={"fault": "500"}))
    await send(ch, request_frame(job.id, "bad", sim={"fault": "malformed", "fault_after": 1}))
    await send(ch, request_frame(job.id, "cut", sim={"fault": "disconnect", "fault_after": 1}))
    await send(ch, request_frame(job.id, "ok", sim={"chunks": 2}))
    turns = Turns(ch)
    await turns.until("e500", "bad", "cut", "ok", errors={"e500", "bad", "cut"})
    assert turns.last("e500")["error"].startswith("backend returned 500: ")
    assert "malformed" in turns.last("bad")["error"]
    assert "broke" in turns.last("cut")["error"]
    assert turns.last("ok")["type"] == "chat.completion.done"
    for frame in turns.of("e500") + turns.of("bad") + turns.of("cut"):
        assert BACKEND_KEY not in json.dumps(frame)


async def test_unreachable_backend_names_url_not_key(hub: tuple[Hub, str], tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        backend_scope = trio.CancelScope()

        async def backend(
            task_status: trio.TaskStatus[Simulator] = trio.TASK_STATUS_IGNORED,
        ) -> None:
            with backend_scope:
                await serve_sim(require_key=BACKEND_KEY, task_status=task_status)

        doomed: Simulator = await nursery.start(backend)
        url = doomed.url
        async with running(runner_config(hub[1], url, tmp_path, health_interval=3600)):
            job, ch = await open_chat(hub[0])
            backend_scope.cancel()  # the backend dies after the session opened
            await send(ch, request_frame(job.id, "x"))
            turns = Turns(ch)
            await turns.until("x", errors={"x"})
            error = turns.last("x")["error"]
            assert url in error and BACKEND_KEY not in error


async def test_bad_frames_leave_the_channel_up(
    hub: tuple[Hub, str], sim: Simulator, runner: Runner, logs: object
) -> None:
    job, ch = await open_chat(hub[0])
    await send(ch, "this is not json")
    await send(ch, b"\x00\x01binary")
    await send(ch, {"type": "chat.unknown.type", "x": 1})
    await send(ch, {"type": "chat.completion.request", "requestId": "nobody"})
    await send(
        ch,
        {
            "type": "chat.completion.request",
            "jobId": "other-job",
            "requestId": "foreign",
            "body": {"messages": []},
        },
    )
    await send(ch, request_frame(job.id, "good", sim={"chunks": 2}))
    turns = Turns(ch)
    await turns.until("nobody", "foreign", "good", errors={"nobody", "foreign"})
    assert turns.last("nobody")["type"] == "chat.completion.error"
    assert turns.last("foreign")["type"] == "chat.completion.error"
    assert turns.last("good")["type"] == "chat.completion.done"
    assert not ch.closed.is_set()


async def test_dropped_channel_is_redialled_and_next_turn_served(
    hub: tuple[Hub, str], sim: Simulator, runner: Runner
) -> None:
    job, ch = await open_chat(hub[0])
    await send(ch, request_frame(job.id, "inflight", sim={"chunks": 100, "interval": 0.1}))
    stream = await sim.wait_for_streams(1)
    await stream.wait_sent(1)
    await ch.close(1011)
    with trio.fail_after(5):
        await stream.finished.wait()
    assert stream.client_closed  # the dropped turn's backend request was closed
    with trio.fail_after(5):
        await ch.closed.wait()
    ch2 = await hub[0].channels.wait(job.id, 10)
    assert ch2 is not None and ch2 is not ch
    await send(ch2, request_frame(job.id, "after", sim={"chunks": 2}))
    turns = Turns(ch2)
    await turns.until("after")
    assert turns.last("after")["type"] == "chat.completion.done"
    assert not job.completed.is_set()


async def test_reconnect_window_gives_up_with_failure(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    async with fault_proxy(hub[1]) as proxy:  # a Server that refuses every redial
        config = runner_config(proxy.url, sim.url, tmp_path, reconnect_window=1.0)
        async with running(config):
            job, ch = await open_chat(hub[0])
            proxy.faults["channel"] = [503] * 1000
            await ch.close(1011)
            with trio.fail_after(10):
                await job.completed.wait()
            finals = [r for r in job.reports if r.get("status") == "completed"]
            assert len(finals) == 1 and finals[0]["conclusion"] == "failure"
            assert "redial" in finals[0]["logs"]


async def test_foreign_job_never_claimed(
    hub: tuple[Hub, str], sim: Simulator, runner: Runner
) -> None:
    foreign = await hub[0].board.enqueue(OWNER, PROJECT, [], {"jobType": "dispatch_worker"})
    other = await hub[0].board.enqueue(OWNER, PROJECT, ["docker"], {})
    job, _ = await open_chat(hub[0])
    assert job.claimed_by is not None
    assert foreign.claimed_by is None and foreign.status == "queued"
    assert other.claimed_by is None


async def test_push_event_opens_a_session_without_waiting_for_a_poll(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    # polls an hour apart: only the runners/events push can open the session within the test
    async with running(runner_config(hub[1], sim.url, tmp_path, poll_interval=3600)) as r:
        polls = r.counters.get("polls")
        job, _ = await open_chat(hub[0], within=30)
        assert job.claimed_by is not None and r.counters.get("polls") > polls


async def test_short_polling_without_events(sim: Simulator, tmp_path: Path) -> None:
    async with open_hub(Hub(admin_token=ADMIN, events=False)) as (hub, url):
        async with running(runner_config(url, sim.url, tmp_path, poll_interval=0.2)):
            job, ch = await open_chat(hub)
            await send(ch, request_frame(job.id, "r", sim={"chunks": 1}))
            turns = Turns(ch)
            await turns.until("r")


async def test_max_sessions_stops_advertising(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    config = runner_config(hub[1], sim.url, tmp_path, max_sessions=1, poll_interval=0.2)
    async with running(config) as r:
        job1, ch1 = await open_chat(hub[0])
        assert r.capabilities() == []
        job2 = await hub[0].board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], {"jobType": "chat_llm"})
        with trio.fail_after(5):
            await r.counters.wait("polls", r.counters.get("polls") + 3)
        assert job2.claimed_by is None
        await send(ch1, {"type": "chat.end"})
        ch2 = await hub[0].channels.wait(job2.id, 5)
        assert ch2 is not None


async def test_heartbeat_progress(
    heartbeats_wanted: None, hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    async with running(runner_config(hub[1], sim.url, tmp_path, heartbeat_interval=0.1)) as r:
        job, _ = await open_chat(hub[0])
        with trio.fail_after(5):
            await r.counters.wait("heartbeats", 2)
        assert job.heartbeats >= 2
        assert job.last_progress == {"stage": "chat_llm_active", "message": None}


async def test_a_channel_whose_hello_names_liveness_is_the_jobs_heartbeat(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    """Issue 39: one liveness signal per session. Our hub's hello says a channel is its job's
    sign of life: while it is up the runner sends no heartbeat, and its session goes on
    (``heartbeats_wanted`` above: a Server whose hello does not say so gets every one)."""
    server = hub[0]
    config = runner_config(hub[1], sim.url, tmp_path, heartbeat_interval=0.1, poll_interval=3600)
    async with running(config) as r:
        job, ch = await open_chat(server)
        with trio.fail_after(5):
            await r.counters.wait("heartbeats_spared", 5)
        assert r.counters.get("heartbeats") == 0 and job.heartbeats == 0
        assert server.board.alive(job.claimed_by or "") and not ch.closed.is_set()
        assert list(r.sessions) == [job.id]


async def test_graceful_shutdown_lets_turns_finish(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    r = Runner(runner_config(hub[1], sim.url, tmp_path))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(r.run)
        job, ch = await open_chat(hub[0])
        await send(ch, request_frame(job.id, "t", sim={"chunks": 5, "interval": 0.05}))
        stream = await sim.wait_for_streams(1)
        await stream.wait_sent(1)
        r.begin_shutdown()
        turns = Turns(ch)
        with trio.fail_after(10):
            while not turns.other:
                await turns.next()
    assert turns.last("t")["type"] == "chat.completion.done"
    assert len(turns.chunks("t")) == len(stream.payloads) - 1
    assert turns.other == [{"type": "chat.end", "jobId": job.id, "reason": "runner shutting down"}]
    finals = [x for x in job.reports if x.get("status") == "completed"]
    assert len(finals) == 1 and finals[0]["conclusion"] == "success"


async def test_server_down_at_start_then_up(sim: Simulator, tmp_path: Path) -> None:
    with trio.socket.socket() as s:
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = runner_config(f"http://127.0.0.1:{port}", sim.url, tmp_path, poll_interval=0.2)
    r = Runner(config)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(r.run)  # keeps retrying registration while nobody listens
        with trio.fail_after(30):
            await r.counters.wait("registration_errors", 2)
        async with open_hub(Hub(admin_token=ADMIN), port=port) as (hub, _):
            job, ch = await open_chat(hub, within=15)
            await send(ch, request_frame(job.id, "r", sim={"chunks": 1}))
            turns = Turns(ch)
            await turns.until("r")
            nursery.cancel_scope.cancel()


def test_backoff_is_capped_and_jittered() -> None:
    values = [backoff_delay(n, 10.0, 60.0) for n in range(1, 12)]
    assert all(0 < v <= 60.0 for v in values)
    assert backoff_delay(1, 10.0, 60.0) <= 10.0
    assert max(backoff_delay(9, 10.0, 60.0) for _ in range(50)) > 30.0


def test_channel_url_scheme_follows_server() -> None:
    job = ChatJob("j1", "r1")
    assert channel_url("https://agentics.dk", job, "t") == (
        "wss://agentics.dk/api/lives/chat/channel/ws?jobId=j1&token=t"
    )
    assert channel_url("http://127.0.0.1:8787", job, "t").startswith(
        "ws://127.0.0.1:8787/api/lives/"
    )
    own = ChatJob("j1", "r1", "wss://relay.example/ws?x=1")
    assert (
        channel_url("https://agentics.dk", own, "t")
        == "wss://relay.example/ws?x=1&jobId=j1&token=t"
    )


async def test_backend_key_never_reaches_the_hub(
    hub: tuple[Hub, str], sim: Simulator, runner: Runner, logs: object
) -> None:
    job, ch = await open_chat(hub[0])
    await send(ch, request_frame(job.id, "a", sim={"chunks": 2}))
    await send(ch, request_frame(job.id, "b", sim={"fault": "500"}))
    await send(ch, {"type": "chat.models.request", "requestId": "m"})
    turns = Turns(ch)
    await turns.until("a", "b", "m", errors={"b"})
    seen = json.dumps([t for fr in turns.frames.values() for _, t, _ in fr])
    seen += json.dumps(job.reports) + json.dumps(job.last_progress)
    assert BACKEND_KEY not in seen
    assert all(BACKEND_KEY not in line for line in logs.lines)  # type: ignore[attr-defined]
    assert all(ADMIN not in line for line in logs.lines)  # type: ignore[attr-defined]


async def test_events_stream_is_closed_by_its_block_when_the_consumer_is_cancelled() -> None:
    closed = trio.Event()

    async def server(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)  # the request head
        event = b'event: job_available\ndata: {"jobId": "j1"}\n\n'
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(event), event)
        )
        try:
            while await stream.receive_some(65536):  # the stream stays open from this side
                pass
        except trio.BrokenResourceError:
            pass
        closed.set()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, server, 0)
        port = listeners[0].socket.getsockname()[1]
        client = AlpClient(f"http://127.0.0.1:{port}", OWNER, PROJECT)
        seen = []
        with trio.CancelScope() as consumer:
            async with client.events() as job_ids:
                async for job_id in job_ids:
                    seen.append(job_id)
                    consumer.cancel()  # the consumer goes away mid-stream
                    await trio.sleep_forever()
        assert seen == ["j1"]
        # `job_ids` is still referenced here: only the block can have closed the stream
        with trio.fail_after(10):
            await closed.wait()
        assert job_ids is not None
        await client.aclose()
        nursery.cancel_scope.cancel()
