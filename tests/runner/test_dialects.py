"""Each backend dialect of the simulator passes through hub → runner → simulator byte for byte."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from helpers import Turns, open_chat, request_frame, send

from gateway.hub import Hub
from gateway.runner.supervisor import Runner
from gateway.sim import DIALECTS, SimOptions, Simulator, open_sim
from gateway.sim.cli import _build_parser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
]


async def relay(
    hub: Hub, sim: Simulator, dialect: str, **sim_opts: Any
) -> tuple[list[bytes], list[dict[str, Any]]]:
    """One streamed turn in ``dialect``; assert every payload arrived unchanged; the payloads and chunks."""
    job, ch = await open_chat(hub)
    frame = request_frame(
        job.id,
        "r",
        sim={"dialect": dialect, **sim_opts},
        stream_options={"include_usage": True},
        tools=TOOLS,
    )
    await send(ch, frame)
    turns = Turns(ch)
    await turns.until("r")
    stream = sim.streams[-1]
    assert stream.options is not None and stream.options.dialect == dialect
    payloads = [p for p in stream.payloads if p != b"[DONE]"]
    assert stream.payloads[-1] == b"[DONE]"
    frames = turns.frames["r"]
    assert [f["type"] for f, _, _ in frames] == ["chat.completion.chunk"] * len(payloads) + [
        "chat.completion.done"
    ]
    texts = [t for f, t, _ in frames if f["type"] == "chat.completion.chunk"]
    for text, payload in zip(texts, payloads, strict=True):
        assert text.encode().endswith(b'"chunk":' + payload + b"}"), (text, payload)
    return payloads, turns.chunks("r")


def content(chunks: list[dict[str, Any]]) -> str:
    return "".join(
        (c["choices"][0].get("delta") or {}).get("content") or ""
        for c in chunks
        if c.get("choices")
    )


def arguments(chunks: list[dict[str, Any]]) -> str:
    out = ""
    for c in chunks:
        for choice in c.get("choices") or []:
            for call in (choice.get("delta") or {}).get("tool_calls") or []:
                out += call.get("function", {}).get("arguments") or ""
    return out


def finish_reasons(chunks: list[dict[str, Any]]) -> list[str]:
    return [
        ch["finish_reason"]
        for c in chunks
        for ch in c.get("choices") or []
        if ch.get("finish_reason")
    ]


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
async def test_dialect_content_stream_is_relayed_verbatim(
    dialect: str, hub: tuple[Hub, str], sim: Simulator, runner: Runner
) -> None:
    payloads, chunks = await relay(hub[0], sim, dialect, chunks=4)
    assert content(chunks) == "tok0 tok1 tok2 tok3 "
    assert finish_reasons(chunks) == ["stop"]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 4
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    if dialect == "ollama":
        assert all(c["system_fingerprint"] == "fp_ollama" for c in chunks)
        assert all(ch["delta"]["role"] == "assistant" for c in chunks for ch in c["choices"])
        assert chunks[-1]["choices"] == [] and list(chunks[-1]["usage"]) == [
            "prompt_tokens",
            "completion_tokens",
            "total_tokens",
        ]
    elif dialect == "vllm":
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all("logprobs" in ch for c in chunks for ch in c["choices"])
        assert chunks[-2]["choices"][0]["stop_reason"] is None
        assert chunks[-1]["choices"] == [] and list(chunks[-1]["usage"]) == [
            "prompt_tokens",
            "total_tokens",
            "completion_tokens",
        ]
        assert "system_fingerprint" not in chunks[0]
    elif dialect == "llamacpp":
        assert payloads[0].startswith(
            b'{"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}]'
        )
        assert "timings" in chunks[-1] and all("timings" not in c for c in chunks[:-1])
        assert chunks[-1]["timings"]["predicted_n"] == 4
    elif dialect == "litellm":
        assert (
            payloads[0].startswith(b'{"id":"chatcmpl-')
            and b'"created":' in payloads[0].split(b'"model"')[0]
        )
        assert "finish_reason" not in chunks[0]["choices"][0]
        assert chunks[0]["choices"][0]["delta"] == {"content": "tok0 ", "role": "assistant"}
        assert chunks[-1]["choices"] == [{"index": 0, "delta": {}}]
        assert "completion_tokens_details" in chunks[-1]["usage"]
    else:
        assert chunks[-1]["choices"] == []


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
async def test_dialect_tool_calls_are_relayed_verbatim(
    dialect: str, hub: tuple[Hub, str], sim: Simulator, runner: Runner
) -> None:
    _, chunks = await relay(hub[0], sim, dialect, chunks=3, tool_calls=True)
    assert json.loads(arguments(chunks)) == {"seq": "tok0 tok1 tok2 "}
    assert finish_reasons(chunks) == ["tool_calls"]
    names = [
        call["function"]["name"]
        for c in chunks
        for ch in c.get("choices") or []
        for call in (ch.get("delta") or {}).get("tool_calls") or []
        if call.get("function", {}).get("name")
    ]
    assert names == ["get_weather"]
    if dialect == "ollama":  # Ollama sends a tool call whole, in one chunk
        assert (
            sum(
                bool((ch.get("delta") or {}).get("tool_calls"))
                for c in chunks
                for ch in c["choices"]
            )
            == 1
        )


async def test_dialect_chosen_at_start_and_refused_when_unknown() -> None:
    async with open_sim(options=SimOptions(dialect="ollama", chunks=2)) as sim:
        async with httpx.AsyncClient(base_url=sim.url, trust_env=False, timeout=5) as client:
            body = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": "x"}],
                "stream": True,
            }
            async with client.stream("POST", "/chat/completions", json=body) as response:
                raw = b"".join([part async for part in response.aiter_raw()])
            assert b'"system_fingerprint":"fp_ollama"' in raw
            bad = await client.post("/chat/completions", json={**body, "sim": {"dialect": "tgi"}})
            assert bad.status_code == 400 and "dialect" in bad.json()["error"]["message"]
            plain = await client.post(
                "/chat/completions", json={**body, "stream": False, "sim": {"dialect": "llamacpp"}}
            )
            assert plain.status_code == 200 and "timings" in plain.json()
    with pytest.raises(ValueError, match="dialect"):
        SimOptions(dialect="nope")
    assert _build_parser().parse_args(["--dialect", "vllm"]).dialect == "vllm"


async def test_usage_only_when_asked_in_ollama_dialect(sim: Simulator) -> None:
    headers = {"authorization": sim.require_key and f"Bearer {sim.require_key}" or ""}
    async with httpx.AsyncClient(
        base_url=sim.url, trust_env=False, timeout=5, headers=headers
    ) as client:
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "sim": {"dialect": "ollama", "chunks": 2},
        }
        async with client.stream("POST", "/chat/completions", json=body) as response:
            raw = b"".join([part async for part in response.aiter_raw()])
    assert b'"usage"' not in raw
    with trio.fail_after(5):
        await sim.wait_for_streams(1)
