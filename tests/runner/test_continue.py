"""An answer continued: asked for by the Server (``continuation: true``, issue 27 point 2), and
by the runner itself when a backend dies mid-answer and another serves the model (point 3).

Real parts over loopback: the hub for the runner's REST calls, simulators as backends (their
deterministic continuation mode: a request ending with the start of its answer gets exactly the
rest), our own Server end for the channel (``tests/support/channelserver.py``). A backend that dies is a
simulator that resets the connection after N events (``fault: disconnect``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from channelserver import ChannelServer, Conn, channel_server, no_hello
from helpers import ADMIN, BACKEND_KEY, CHAT_DEFINITION, OWNER, PROJECT, runner_config, running

from gateway.config import BackendSpec
from gateway.hub import Hub, open_hub
from gateway.runner.supervisor import Runner
from gateway.sim import SimOptions, Simulator, open_sim
from gateway.wire import protocol

GUARD = 30  # s: a never-hangs guard
WHOLE = "".join(f"tok{i} " for i in range(10))


@dataclass
class Rig:
    server: ChannelServer
    sims: list[Simulator]
    runner: Runner
    job: str
    conn: Conn

    async def turn(self, request_id: str, body: dict[str, Any], **extra: Any) -> dict[str, Any]:
        """Send one turn; its last frame, once it came."""
        await self.server.request(self.conn, self.job, request_id, body, **extra)
        with trio.fail_after(GUARD):
            return await self.server.until_finished(request_id)

    def chunks(self, request_id: str) -> list[dict[str, Any]]:
        return [json.loads(c) for c in self.server.chunks(request_id)]


@asynccontextmanager
async def rig(tmp_path: Path, *options: SimOptions) -> AsyncIterator[Rig]:
    """A runner whose backends are simulators with ``options`` (in that order), all serving
    sim-model; its channel on our Server end, which says no hello (it needs none here)."""
    async with (
        open_hub(Hub(admin_token=ADMIN)) as (hub, url),
        channel_server(no_hello) as server,
        trio.open_nursery() as nursery,
    ):
        sims = [await nursery.start(_serve_sim, o) for o in options]
        specs = tuple(
            BackendSpec(f"b{n}", s.url, BACKEND_KEY, ("sim-model",)) for n, s in enumerate(sims)
        )
        config = runner_config(url, None, tmp_path, backends=specs)
        async with running(config) as runner:
            definition = {**CHAT_DEFINITION, "channelUrl": server.url}
            job = await hub.board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], definition)
            with trio.fail_after(GUARD):
                conn = await server.conn(1)
            yield Rig(server, sims, runner, job.id, conn)
        nursery.cancel_scope.cancel()


async def _serve_sim(options: SimOptions, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    async with open_sim(require_key=BACKEND_KEY, options=options) as sim:
        task_status.started(sim)
        await trio.sleep_forever()


def body(*so_far: str, **extra: Any) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    messages += [{"role": "assistant", "content": text} for text in so_far]
    return {"messages": messages, "stream": True, **extra}


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["delta"].get("content") or "" for ch in chunks for c in ch["choices"])


def sent_body(sim: Simulator, n: int = 1) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(sim.streams[n - 1].body)
    return body


# -- continuation: true (point 2) -----------------------------------------------------------


async def test_a_continuation_asks_vllm_to_continue_its_final_message(tmp_path: Path) -> None:
    async with rig(tmp_path, SimOptions(chunks=10, dialect="vllm")) as r:
        assert r.runner.pool.backends[0].kind == "vllm"  # from its model list's owned_by
        last = await r.turn("c", body("tok0 tok1 to"), continuation=True)
        assert last["type"] == protocol.COMPLETION_DONE
        sent = sent_body(r.sims[0])
        assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
        assert sent["messages"][-1] == {"role": "assistant", "content": "tok0 tok1 to"}
        assert "tok0 tok1 to" + text_of(r.chunks("c")) == WHOLE  # only the new text relayed


async def test_a_continuation_goes_as_it_is_to_a_server_that_continues_a_prefill(
    tmp_path: Path,
) -> None:
    async with rig(tmp_path, SimOptions(chunks=10, dialect="llamacpp")) as r:
        assert r.runner.pool.backends[0].kind == "llama.cpp"
        request = body("tok0 tok1 ")
        last = await r.turn("c", request, continuation=True)
        assert last["type"] == protocol.COMPLETION_DONE
        assert sent_body(r.sims[0]) == {**request, "model": "sim-model"}
        assert "tok0 tok1 " + text_of(r.chunks("c")) == WHOLE


async def test_a_backend_known_not_to_continue_gets_continuation_unsupported(
    tmp_path: Path,
) -> None:
    async with rig(tmp_path, SimOptions(chunks=10)) as r:
        r.runner.pool.backends[0].kind = "openai"  # as for api.openai.com, which is not here
        last = await r.turn("c", body("tok0 "), continuation=True)
        plain = await r.turn("p", body())  # a turn that is no continuation is served
        assert last["error"] == protocol.CONTINUATION_UNSUPPORTED
        assert plain["type"] == protocol.COMPLETION_DONE
        assert len(r.sims[0].streams) == 1  # the continuation never reached the backend


# -- a backend that dies mid-answer (point 3) ------------------------------------------------

DIES = SimOptions(chunks=10, fault="disconnect", fault_after=4)  # role + 3 tokens, then a reset
LIVES = SimOptions(chunks=10, dialect="vllm")  # its own ids, and asked in vLLM's way


async def test_a_backend_dying_mid_answer_is_continued_on_another_as_one_answer(
    tmp_path: Path,
) -> None:
    async with rig(tmp_path, DIES, LIVES) as r:
        last = await r.turn("t", body(stream_options={"include_usage": True}))
        chunks = r.chunks("t")
        assert last["type"] == protocol.COMPLETION_DONE
        assert text_of(chunks) == WHOLE  # the undisturbed answer
        assert {c["id"] for c in chunks} == {r.sims[0].streams[0].id}  # the first part's id
        choices = [c for ch in chunks for c in ch["choices"]]
        assert sum("role" in c["delta"] for c in choices) == 1  # one role delta
        assert [c["finish_reason"] for c in choices if c.get("finish_reason")] == ["stop"]
        usage = [ch["usage"] for ch in chunks if ch.get("usage")]
        continuation_usage = json.loads(r.sims[1].streams[0].payloads[-2])["usage"]
        assert usage == [continuation_usage]  # the continuation's own, as its backend counted
        assert continuation_usage["completion_tokens"] == 7  # the tokens after the fault
        assert not r.sims[0].streams[0].completed
        continued = sent_body(r.sims[1])
        assert continued["messages"][-1] == {"role": "assistant", "content": "tok0 tok1 tok2 "}
        assert continued["continue_final_message"] is True
        assert r.sims[1].streams[0].id != r.sims[0].streams[0].id
        assert r.runner.counters.get("turns_continued") == 1


async def test_a_backend_dying_before_its_first_chunk_is_replaced_whole(tmp_path: Path) -> None:
    dies_at_once = SimOptions(chunks=10, fault="disconnect", fault_after=0)
    async with rig(tmp_path, dies_at_once, LIVES) as r:
        last = await r.turn("t", body())
        assert last["type"] == protocol.COMPLETION_DONE
        assert text_of(r.chunks("t")) == WHOLE
        assert sent_body(r.sims[1])["messages"] == body()["messages"]  # the turn, not a rest


async def test_without_another_backend_the_fault_is_the_turns_error(tmp_path: Path) -> None:
    async with rig(tmp_path, DIES) as r:
        last = await r.turn("t", body())
        assert last["type"] == protocol.COMPLETION_ERROR
        assert "stream broke" in last["error"]
        assert text_of(r.chunks("t")) == "tok0 tok1 tok2 "


async def test_an_answer_that_began_a_tool_call_is_not_continued(tmp_path: Path) -> None:
    tool_dies = SimOptions(chunks=10, tool_calls=True, fault="disconnect", fault_after=4)
    async with rig(tmp_path, tool_dies, LIVES) as r:
        last = await r.turn("t", body())
        assert last["type"] == protocol.COMPLETION_ERROR and "stream broke" in last["error"]
        assert r.sims[1].streams == []  # nobody asked to continue a tool call
