"""Prompt estimates that count the chat template (issue 35, point 5): a turn whose backend said
no usage is charged its prompt estimated as its characters / 4 plus each message's template
tokens and the answer's opening, marked estimated. A real hub on loopback, the fake runner
(tests/support/fake_runner.py) answering without usage, trio's autojump clock. Then the estimate's error
measured against llama.cpp's own count (llama-cpp-python's server applying a tiny GGUF's ChatML
template, tests/support/tinygguf.py) and the simulator's, on the same fixed requests (docs/hub.md)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from fake_runner import Script
from test_causes import GUARD, OWNER, PROJECT
from test_embeddings import _free_port, _until_up
from test_key_limits import served

from gateway.apis.shapes import MESSAGE_TOKENS, REPLY_TOKENS, estimate_prompt_tokens
from gateway.sim import open_sim

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello"},
]


async def test_a_turn_without_usage_is_charged_its_template_too_marked_estimated(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scripts = {"silent": Script(usage=False)}
    async with served(scripts=scripts) as (hub, url, _runner, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        body = {"model": "silent", "messages": MESSAGES, "stream": True}
        with trio.fail_after(GUARD):
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                reply = await http.post(
                    "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                )
            await ended.count(1)
            (row,) = await hub.store.usage_rows()
    assert reply.status_code == 200
    chars = len("You are terse.") + len("Hello")
    # 5 for the text, 2 messages' roles and delimiters (10), the answer's opening (3): 18,
    # where characters / 4 alone said 5
    assert (MESSAGE_TOKENS, REPLY_TOKENS) == (5, 3)
    assert row["prompt_tokens"] == math.ceil(chars / 4) + 2 * MESSAGE_TOKENS + REPLY_TOKENS == 18
    assert row["estimated"] is True


# -- the estimate against llama.cpp's own count (llama-cpp-python's server) -----------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city's name."}},
                "required": ["city"],
            },
        },
    }
]


def measured_requests() -> list[dict[str, Any]]:
    """The fixed requests measured (``bench.estimate``'s six: short and long, with a system
    message, multi-turn; and one with a tool): each a chat body."""
    from bench.estimate import REQUESTS

    bodies: list[dict[str, Any]] = [{"messages": m} for m in REQUESTS]
    bodies.append(
        {
            "messages": [
                {"role": "system", "content": "You can look things up."},
                {"role": "user", "content": "What is the weather in Paris today?"},
            ],
            "tools": TOOLS,
        }
    )
    return bodies


@pytest.fixture
def llama_chat(tmp_path: Path) -> Any:
    """llama-cpp-python's server on a tiny GGUF with a ChatML template whose vocabulary has the
    measured requests' words whole (tests/tinygguf.py); skipped where it is not installed."""
    for module in ("llama_cpp", "llama_cpp.server.app", "gguf"):
        try:
            __import__(module)
        except ImportError as exc:
            if os.environ.get("CI", "").lower() in ("1", "true", "yes"):  # CI: required
                pytest.fail(str(exc))
            pytest.skip(str(exc))
    from tinygguf import write_tiny_llama

    text = json.dumps([measured_requests(), ["system", "user", "assistant", "Tools", "tools"]])
    words = sorted(set(re.findall(r"[A-Za-z0-9_]+", text)))
    model = write_tiny_llama(tmp_path / "chat.gguf", words=words)
    port = _free_port()
    log = (tmp_path / "llama.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(model)]
        + ["--model_alias", "tiny", "--n_ctx", "2048", "--host", "127.0.0.1"]
        + ["--port", str(port)],
        stdout=log,
        stderr=log,
    )
    try:
        yield proc, f"http://127.0.0.1:{port}/v1", tmp_path / "llama.log"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def mean_errors(pairs: list[tuple[int, int]]) -> tuple[float, float]:
    """(mean absolute error in tokens, and as a share of the real count)."""
    absolute = [abs(est - real) for est, real in pairs]
    share = [abs(est - real) / real for est, real in pairs]
    return sum(absolute) / len(pairs), sum(share) / len(pairs)


async def test_the_estimate_against_llama_cpp_and_the_simulator_on_the_same_requests(
    llama_chat: Any,
) -> None:
    """Each measured request sent non-streamed (``max_tokens`` 1) to llama.cpp's own server,
    which renders it with the model's ChatML template and counts it with its tokenizer
    (``usage.prompt_tokens``), and to the simulator (which counts words, no template); the
    hub's estimate of each against both, the errors printed and bounded as measured."""
    proc, backend, log = llama_chat
    with trio.fail_after(GUARD):
        await _until_up(backend, proc, log)
    bodies = measured_requests()
    estimates = [estimate_prompt_tokens(json.dumps(b).encode()) for b in bodies]
    llama: list[int] = []
    simulated: list[int] = []
    async with open_sim() as sim, httpx.AsyncClient(timeout=GUARD) as http:
        for body in bodies:
            for url, model, into in ((backend, "tiny", llama), (sim.url, "sim-model", simulated)):
                reply = await http.post(
                    f"{url}/chat/completions", json={**body, "model": model, "max_tokens": 1}
                )
                assert reply.status_code == 200, reply.text
                into.append(int(reply.json()["usage"]["prompt_tokens"]))
    template = [MESSAGE_TOKENS * len(b["messages"]) + REPLY_TOKENS for b in bodies]
    alone = [e - t for e, t in zip(estimates, template, strict=True)]  # characters / 4 alone
    on_llama = mean_errors(list(zip(estimates, llama, strict=True)))
    on_sim = mean_errors(list(zip(estimates, simulated, strict=True)))
    alone_llama = mean_errors(list(zip(alone, llama, strict=True)))
    alone_sim = mean_errors(list(zip(alone, simulated, strict=True)))
    print(f"estimates {estimates} (characters / 4 alone {alone})")
    print(f"llama.cpp {llama}\nsimulator {simulated}")
    for name, (tokens, share), (tokens_alone, share_alone) in (
        ("llama.cpp", on_llama, alone_llama),
        ("the simulator", on_sim, alone_sim),
    ):
        print(
            f"MEASURED against {name}: mean absolute error {tokens:.1f} tokens ({share:.0%}), "
            f"characters / 4 alone {tokens_alone:.1f} tokens ({share_alone:.0%})"
        )
    # as measured (llama-cpp-python 0.3.36, this vocabulary): 16.4 tokens (17 %), 24.6 (45 %) alone
    assert on_llama[0] <= 20 and on_llama[1] <= 0.20
    assert on_llama[0] < alone_llama[0] and on_llama[1] < alone_llama[1]
