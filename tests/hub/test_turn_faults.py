"""A turn survives a fault, in all three APIs (issue 27 points 1 and 2, the hub's side).

Real parts over loopback: the hub, the simulator (whose prefill continuation makes "the answer
so far + its continuation" the undisturbed answer), runners in process behind a proxy that cuts
or freezes their connections (``tests/support/pathproxy.py``), and ``alp-gateway run`` processes where
one is SIGKILLed. Each client reads the SSE stream by hand, so every event counts. Nothing
waits on a sleep: the faults fire on the client's n-th event, the rest waits on the stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers import ADMIN, BACKEND_KEY, OWNER, PROJECT, runner_config, running
from pathproxy import PathProxy, path_proxy
from test_failover import all_polling, runners

from gateway.hub import Hub, open_hub
from gateway.sim import SimOptions, Simulator, open_sim

GUARD = 60  # s: a hang guard, never a timing
PING = 0.3  # s: both ends' ping interval where a frozen path must be found
CHUNKS = 40
APIS = ("chat", "messages", "responses")
SIM = SimOptions(chunks=CHUNKS, interval=0.02)


@dataclass
class Answer:
    """One streamed turn as its client saw it: every SSE event (``event:`` name, data)."""

    api: str
    status: int = 0
    events: list[tuple[str, str]] = field(default_factory=list)
    body: str = ""

    @property
    def data(self) -> list[dict[str, Any]]:
        return [json.loads(d) for _, d in self.events if d != "[DONE]"]

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [
            d for d in self.data if "error" in d or d.get("type") in ("error", "response.failed")
        ]

    @property
    def text(self) -> str:
        out = []
        for d in self.data:
            if self.api == "chat":
                for choice in d.get("choices") or []:
                    out.append((choice.get("delta") or {}).get("content") or "")
            elif self.api == "messages" and d.get("type") == "content_block_delta":
                out.append(d["delta"].get("text", ""))
            elif self.api == "responses" and d.get("type") == "response.output_text.delta":
                out.append(d["delta"])
        return "".join(out)

    def one_answer(self) -> None:
        """One id, one start, one end, in the API's shape (a continuation stitched in)."""
        data = self.data
        if self.api == "chat":
            ids = {d["id"] for d in data}
            roles = [
                c for d in data for c in d.get("choices") or [] if "role" in (c.get("delta") or {})
            ]
            finishes = [
                c
                for d in data
                for c in d.get("choices") or []
                if c.get("finish_reason") is not None
            ]
            assert len(ids) == 1 and len(roles) == 1 and len(finishes) == 1, self.events
            assert self.events[-1][1] == "[DONE]"
        elif self.api == "messages":
            kinds = [d["type"] for d in data]
            assert kinds.count("message_start") == 1 and kinds.count("message_stop") == 1, kinds
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
            starts = [d["index"] for d in data if d["type"] == "content_block_start"]
            assert starts == list(range(len(starts))), starts  # block indices in order, once
        else:
            kinds = [d["type"] for d in data]
            assert kinds.count("response.created") == 1, kinds
            assert kinds.count("response.completed") == 1 and kinds[-1] == "response.completed"
            added = [d["output_index"] for d in data if d["type"] == "response.output_item.added"]
            assert added == list(range(len(added))), added
            ids = {d["item_id"] for d in data if d["type"] == "response.output_text.delta"}
            assert len(ids) == 1, ids


def request(api: str, say: str) -> tuple[str, dict[str, Any]]:
    messages = [{"role": "user", "content": say}]
    if api == "chat":
        return "/v1/chat/completions", {"model": "sim-model", "messages": messages, "stream": True}
    if api == "messages":
        return "/v1/messages", {
            "model": "sim-model",
            "max_tokens": 1000,
            "messages": messages,
            "stream": True,
        }
    return "/v1/responses", {"model": "sim-model", "input": say, "stream": True}


async def turn(
    url: str,
    key: str,
    api: str,
    session: str,
    say: str = "hi",
    on_event: Callable[[Answer], None] | None = None,
) -> Answer:
    path, body = request(api, say)
    answer = Answer(api)
    headers = {"Authorization": f"Bearer {key}", "X-Chat-Session": session}
    async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
        async with http.stream("POST", path, json=body, headers=headers) as r:
            answer.status = r.status_code
            buffer = ""
            async for text in r.aiter_text():
                answer.body += text
                buffer += text
                while "\n\n" in buffer:
                    event, buffer = buffer.split("\n\n", 1)
                    name = ""
                    data = []
                    for line in event.split("\n"):
                        if line.startswith("event: "):
                            name = line[7:]
                        elif line.startswith("data: "):
                            data.append(line[6:])
                    if not data:
                        continue  # a keepalive
                    answer.events.append((name, "\n".join(data)))
                    if on_event is not None:
                        on_event(answer)
    return answer


def at_event(n: int, fault: Callable[[], None]) -> Callable[[Answer], None]:
    """A fault fired once, as the client reads its ``n``-th event."""
    fired: list[bool] = []

    def on_event(answer: Answer) -> None:
        if len(answer.events) == n and not fired:
            fired.append(True)
            fault()

    return on_event


def serving_runner(hub: Hub, session: str) -> str:
    """The name of the runner serving ``session``'s turn now."""
    (now,) = [t for t in hub.snapshot().turns if t.session == session]
    assert now.runner_id is not None
    name = hub.board.runners[now.runner_id].name
    assert name is not None
    return name


@asynccontextmanager
async def proxied_runner(
    tmp_path: Path, ping: float = 0.0, **hub_settings: Any
) -> AsyncIterator[tuple[Hub, str, str, PathProxy, Simulator]]:
    """A hub, one runner in process dialling it through a path proxy, the simulator."""
    async with open_sim(require_key=BACKEND_KEY, options=SIM) as sim:
        settings: dict[str, Any] = {"admin_token": ADMIN, "resume_within": 10.0}
        settings.update(hub_settings)
        async with open_hub(Hub(**settings)) as (hub, url):
            port = int(url.rsplit(":", 1)[1])
            async with path_proxy(port) as proxy:
                config = runner_config(proxy.url, sim.url, tmp_path, ping_interval=ping)
                async with running(config):
                    key = await hub.keys.create("faults", f"{OWNER}/{PROJECT}")
                    yield hub, url, key, proxy, sim


@pytest.mark.parametrize("api", APIS)
async def test_a_channel_cut_mid_answer_resumes_byte_for_byte(api: str, tmp_path: Path) -> None:
    async with proxied_runner(tmp_path) as (hub, url, key, proxy, sim):
        with trio.fail_after(GUARD):
            whole = await turn(url, key, api, "calm")
            cut = await turn(url, key, api, "cut", on_event=at_event(6, proxy.cut_all))
    assert proxy.cut >= 1 and hub.counters.turns_resumed == 1
    assert hub.counters.turns_continued == 0
    assert cut.status == 200 and not cut.errors and cut.text == whole.text
    cut.one_answer()
    assert len(sim.streams) == 2  # the backend was asked once for it: nothing generated again
    if api == "chat":  # relayed verbatim: every chunk the backend sent, once, in order
        sent = [p.decode() for p in sim.streams[1].payloads if p != b"[DONE]"]
        got = [d for _, d in cut.events if d != "[DONE]"]
        assert [json.loads(g) for g in got] == [
            json.loads(s) for s in sent if json.loads(s).get("choices")
        ]


async def test_a_frozen_channel_found_by_the_pings_resumes(tmp_path: Path) -> None:
    async with proxied_runner(tmp_path, ping=PING, ping_interval=PING) as (
        hub,
        url,
        key,
        proxy,
        sim,
    ):
        with trio.fail_after(GUARD):
            whole = await turn(url, key, "chat", "calm")
            frozen = await turn(url, key, "chat", "frozen", on_event=at_event(6, proxy.freeze))
    assert proxy.frozen >= 1 and hub.counters.turns_resumed == 1
    assert not frozen.errors and frozen.text == whole.text
    frozen.one_answer()
    assert len(sim.streams) == 2


@pytest.mark.parametrize("api", APIS)
async def test_a_runner_killed_mid_answer_is_continued_on_another_as_one_answer(
    api: str, tmp_path: Path
) -> None:
    async with open_sim(require_key=BACKEND_KEY, options=SIM) as sim:
        async with open_hub(Hub(admin_token=ADMIN, ping_interval=PING)) as (hub, url):
            key = await hub.keys.create("faults", f"{OWNER}/{PROJECT}")
            async with runners(url, sim, tmp_path, "a", "b") as procs:
                await all_polling(hub, 2)

                def kill_serving() -> None:
                    procs[serving_runner(hub, "killed")].kill()

                with trio.fail_after(GUARD):
                    whole = await turn(url, key, api, "calm")
                    cut = await turn(url, key, api, "killed", on_event=at_event(6, kill_serving))
                    rows = await hub.accounting.store.usage_rows()  # type: ignore[union-attr]
    assert hub.counters.turns_continued == 1
    assert cut.status == 200 and not cut.errors and cut.text == whole.text
    cut.one_answer()
    last = sim.streams[-1].body  # the continuation: the answer so far as a final message
    assert json.loads(last)["messages"][-1]["role"] == "assistant"
    (row,) = [r for r in rows if r["session"] == "killed"]
    assert row["continued"] and row["outcome"] == "ok" and row["estimated"]
    assert row["completion_tokens"] >= CHUNKS and row["prompt_tokens"] > 0


async def test_an_answer_that_began_a_tool_call_ends_with_one_channel_lost(
    tmp_path: Path,
) -> None:
    tools = SimOptions(chunks=CHUNKS, interval=0.02, tool_calls=True)
    async with open_sim(require_key=BACKEND_KEY, options=tools) as sim:
        async with open_hub(Hub(admin_token=ADMIN, ping_interval=PING)) as (hub, url):
            key = await hub.keys.create("faults", f"{OWNER}/{PROJECT}")
            async with runners(url, sim, tmp_path, "a", "b") as procs:
                await all_polling(hub, 2)

                def kill_serving() -> None:
                    procs[serving_runner(hub, "tool")].kill()

                with trio.fail_after(GUARD):
                    cut = await turn(url, key, "chat", "tool", on_event=at_event(6, kill_serving))
    assert hub.counters.turns_continued == 0
    (error,) = cut.errors  # one error event, the last: the tool call cannot be continued
    assert error["error"]["code"] == "channel_lost" and cut.data[-1] == error
    assert "[DONE]" not in [d for _, d in cut.events]
