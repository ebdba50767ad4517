"""Backend faults hit only their own turn: stall (per-read idle timeout), death mid-stream, refusal, garbage."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import trio
from helpers import BACKEND_KEY, Turns, open_chat, request_frame, runner_config, running, send

from gateway.hub import Hub
from gateway.sim import Simulator


async def test_faults_end_their_own_turn_only(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    async with running(runner_config(hub[1], sim.url, tmp_path, idle_timeout=0.5)):
        job_a, ch_a = await open_chat(hub[0])
        job_b, ch_b = await open_chat(hub[0])
        # session B streams steadily the whole time; session A meets every fault at once
        await send(ch_b, request_frame(job_b.id, "steady", sim={"chunks": 30, "interval": 0.05}))
        await send(ch_a, request_frame(job_a.id, "stall", sim={"fault": "stall", "fault_after": 2}))
        await send(
            ch_a, request_frame(job_a.id, "dies", sim={"fault": "disconnect", "fault_after": 3})
        )
        await send(
            ch_a, request_frame(job_a.id, "garbage", sim={"fault": "malformed", "fault_after": 1})
        )
        await send(ch_a, request_frame(job_a.id, "fine", sim={"chunks": 4, "interval": 0.05}))
        a, b = Turns(ch_a), Turns(ch_b)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: a.until(
                    "stall", "dies", "garbage", "fine", errors={"stall", "dies", "garbage"}
                )
            )
            nursery.start_soon(b.until, "steady")
        assert "idle timeout" in a.last("stall")["error"]
        assert "broke" in a.last("dies")["error"]
        assert "malformed" in a.last("garbage")["error"]
        assert a.last("fine")["type"] == "chat.completion.done"
        assert b.last("steady")["type"] == "chat.completion.done"
        steady = next(s for s in sim.streams if b'"chunks":30' in s.body)
        assert len(b.chunks("steady")) == len(steady.payloads) - 1
        # the stalled backend request was closed, not left hanging
        stalled = next(s for s in sim.streams if b'"stall"' in s.body)
        with trio.fail_after(5):
            await stalled.finished.wait()
        assert stalled.client_closed
        # and the session lives on
        await send(ch_a, request_frame(job_a.id, "after", sim={"chunks": 1}))
        await a.until("after")
        assert a.last("after")["type"] == "chat.completion.done"


async def test_a_long_silent_generation_is_not_cut_by_an_overall_deadline(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    # each read comes within the idle timeout, the whole turn takes far longer than it
    async with running(runner_config(hub[1], sim.url, tmp_path, idle_timeout=0.3)):
        job, ch = await open_chat(hub[0])
        await send(
            ch, request_frame(job.id, "slow", sim={"chunks": 12, "interval": 0.15, "ttft": 0.2})
        )
        turns = Turns(ch)
        await turns.until("slow")
        assert turns.last("slow")["type"] == "chat.completion.done"


async def _echoing_backend(stream: trio.SocketStream) -> None:
    """A model server that lists one model and answers every completion 500 with the request's
    head in the body (as some proxies and debug servers do): the backend key included."""
    head = b""
    while b"\r\n\r\n" not in head:
        data = await stream.receive_some(65536)
        if not data:
            return
        head += data
    if head.startswith(b"GET "):
        status, body = b"200 OK", b'{"object": "list", "data": [{"id": "sim-model"}]}'
    else:
        request_head = head.split(b"\r\n\r\n", 1)[0].decode()
        status = b"500 Internal Server Error"
        body = json.dumps({"error": {"message": "failed", "request": request_head}}).encode()
    await stream.send_all(
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    await stream.aclose()


async def test_a_backend_error_body_never_relays_the_backend_key(
    hub: tuple[Hub, str], tmp_path: Path
) -> None:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, _echoing_backend, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        backend = f"http://127.0.0.1:{port}/v1"
        async with running(runner_config(hub[1], backend, tmp_path)):
            job, ch = await open_chat(hub[0])
            await send(ch, request_frame(job.id, "r1"))
            turns = Turns(ch)
            await turns.until("r1", errors={"r1"})
        nursery.cancel_scope.cancel()
    error = turns.last("r1")["error"]
    assert error.startswith("backend returned 500: ") and "failed" in error, error
    assert BACKEND_KEY not in error, error
    assert "[redacted]" in error and "POST /v1/chat/completions" in error, error
