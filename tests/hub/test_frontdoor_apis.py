"""The front door's other APIs with their own SDKs, end to end: anthropic → /v1/messages and
openai → /v1/responses, through the hub, a runner and the simulator; /healthz; the 404s."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import httpx
import openai
import trio
from helpers import BACKEND_KEY, OWNER, PROJECT, runner_config, running

from gateway.hub import Hub, open_hub
from gateway.sim import SimOptions, open_sim

T = TypeVar("T")
TOOL_SCHEMA = {"type": "object", "properties": {"seq": {"type": "string"}}}


@asynccontextmanager
async def whole_path(
    tmp_path: Path, options: SimOptions | None = None, **hub_settings: Any
) -> AsyncIterator[tuple[Hub, str, str]]:
    """A hub, a runner and a simulator (``options``): (hub, its URL, an API key)."""
    async with open_sim(require_key=BACKEND_KEY, options=options) as sim:
        async with open_hub(Hub(runner_wait_timeout=10, **hub_settings)) as (hub, url):
            config = runner_config(url, sim.url, tmp_path, user_token=hub.admin_token)
            async with running(config):
                yield hub, url, await hub.keys.create("apis", f"{OWNER}/{PROJECT}")


async def in_thread(fn: Callable[[], T]) -> T:
    """A blocking SDK call, off the event loop that serves it."""
    with trio.fail_after(30):
        return await trio.to_thread.run_sync(fn)


def claude(url: str, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=20)


def oai(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=20)


# -- Anthropic Messages ------------------------------------------------------------------------


async def test_messages_create_and_stream(tmp_path: Path) -> None:
    async with whole_path(tmp_path, SimOptions(chunks=5)) as (_, url, key):
        client = claude(url, key)
        ask = {"max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
        message = await in_thread(lambda: client.messages.create(model="sim-model", **ask))  # type: ignore[call-overload]
        text = "".join(b.text for b in message.content if b.type == "text")
        assert text == "tok0 tok1 tok2 tok3 tok4 " and message.stop_reason == "end_turn"
        assert message.model == "sim-model" and message.usage.output_tokens > 0

        def stream() -> tuple[list[str], Any]:
            with client.messages.stream(model="sim-model", **ask) as s:  # type: ignore[arg-type]
                pieces = list(s.text_stream)
                return pieces, s.get_final_message()

        pieces, final = await in_thread(stream)
        assert "".join(pieces) == text and len(pieces) == 5  # one text delta per chunk
        assert final.stop_reason == "end_turn"


async def test_messages_tool_use_streamed_and_whole(tmp_path: Path) -> None:
    async with whole_path(tmp_path, SimOptions(chunks=4, tool_calls=True)) as (_, url, key):
        client = claude(url, key)
        ask: dict[str, Any] = {
            "model": "sim-model",
            "max_tokens": 50,
            "tools": [{"name": "lookup", "description": "d", "input_schema": TOOL_SCHEMA}],
            "messages": [{"role": "user", "content": "look it up"}],
        }

        def stream() -> Any:
            with client.messages.stream(**ask) as s:
                return s.get_final_message()

        for message in (
            await in_thread(lambda: client.messages.create(**ask)),
            await in_thread(stream),
        ):
            (use,) = [b for b in message.content if b.type == "tool_use"]
            assert use.name == "lookup" and use.input == {"seq": "tok0 tok1 tok2 tok3 "}
            assert message.stop_reason == "tool_use"
        # the round trip: the tool's result goes back, translated to a tool message
        follow = dict(ask)
        follow["messages"] = [
            *ask["messages"],
            {"role": "assistant", "content": [use.model_dump()]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}],
            },
        ]
        again = await in_thread(lambda: client.messages.create(**follow))
        assert again.stop_reason == "tool_use"  # this simulator always calls its tool


async def test_messages_errors_in_anthropics_shape(tmp_path: Path) -> None:
    async with whole_path(tmp_path) as (_, url, key):
        bad = claude(url, "sk-not-a-key")
        ask = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        try:
            await in_thread(lambda: bad.messages.create(model="sim-model", **ask))  # type: ignore[call-overload]
        except anthropic.AuthenticationError as exc:
            assert exc.status_code == 401 and exc.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        else:
            raise AssertionError("a wrong key was accepted")
        client = claude(url, key)
        try:
            await in_thread(lambda: client.messages.create(model="nope", **ask))  # type: ignore[call-overload]
        except anthropic.NotFoundError as exc:
            assert exc.body["error"]["type"] == "not_found_error"  # type: ignore[index]
            assert "sim-model" in exc.body["error"]["message"]  # type: ignore[index]
        else:
            raise AssertionError("an unknown model was served")
        counted = await in_thread(
            lambda: client.messages.count_tokens(
                model="sim-model", messages=[{"role": "user", "content": "a" * 400}]
            )
        )
        assert counted.input_tokens >= 100


async def test_a_fixed_model_name_is_served_by_the_default_model(tmp_path: Path) -> None:
    """Claude Code asks for claude-* names: the hub's default_model serves them."""
    async with whole_path(tmp_path, default_model="sim-model") as (_, url, key):
        client = claude(url, key)
        message = await in_thread(
            lambda: client.messages.create(
                model="claude-sonnet-4-5",
                max_tokens=20,
                messages=[{"role": "user", "content": "hi"}],
            )
        )
        assert message.model == "claude-sonnet-4-5" and message.content


# -- the Responses API -------------------------------------------------------------------------


async def test_responses_create_and_stream(tmp_path: Path) -> None:
    async with whole_path(tmp_path, SimOptions(chunks=3)) as (_, url, key):
        client = oai(url, key)
        reply = await in_thread(
            lambda: client.responses.create(model="sim-model", input="hi", instructions="be brief")
        )
        assert reply.output_text == "tok0 tok1 tok2 " and reply.status == "completed"

        def stream() -> tuple[list[str], Any]:
            deltas: list[str] = []
            with client.responses.stream(model="sim-model", input="hi") as s:
                for event in s:
                    if event.type == "response.output_text.delta":
                        deltas.append(event.delta)
                return deltas, s.get_final_response()

        deltas, final = await in_thread(stream)
        assert deltas == ["tok0 ", "tok1 ", "tok2 "] and final.output_text == "tok0 tok1 tok2 "
        assert final.usage is not None and final.usage.output_tokens > 0


async def test_responses_function_call_round_trip(tmp_path: Path) -> None:
    async with whole_path(tmp_path, SimOptions(chunks=2, tool_calls=True)) as (_, url, key):
        client = oai(url, key)
        tools: Any = [{"type": "function", "name": "lookup", "parameters": TOOL_SCHEMA}]
        first = await in_thread(
            lambda: client.responses.create(model="sim-model", input="look", tools=tools)
        )
        (call,) = [item for item in first.output if item.type == "function_call"]
        assert call.name == "lookup" and json.loads(call.arguments) == {"seq": "tok0 tok1 "}
        follow: Any = [
            {"role": "user", "content": "look"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": "lookup",
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "42"},
        ]

        def stream() -> Any:
            with client.responses.stream(model="sim-model", input=follow, tools=tools) as s:
                return s.get_final_response()

        final = await in_thread(stream)
        assert final.status == "completed" and final.output


# -- health and what is not served -----------------------------------------------------------------


async def test_healthz_and_the_endpoints_not_served(tmp_path: Path) -> None:
    async with open_hub(Hub()) as (hub, url):
        async with httpx.AsyncClient(base_url=url) as http:
            down = await http.get("/healthz")
            assert down.status_code == 503 and down.json()["reason"] == "no runner is connected"
            ready = await http.get("/readyz")  # the readiness probe: not ready without a runner
            assert ready.status_code == 503 and ready.json() == down.json()
            live = await http.get("/livez")  # the liveness probe: the hub serves, runners or not
            assert live.status_code == 200 and live.json() == {"status": "ok"}
            key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
            for path in ("/v1/completions",):
                r = await http.post(path, json={}, headers={"authorization": f"Bearer {key}"})
                assert r.status_code == 404 and "/v1/messages" in r.json()["error"]["message"]
    async with whole_path(tmp_path) as (_, url, _key):
        async with httpx.AsyncClient(base_url=url) as http:
            up = await http.get("/healthz")
            assert up.status_code == 200 and up.json()["runners"] == 1
            assert (await http.get("/readyz")).json() == up.json()
            assert (await http.get("/livez")).status_code == 200
