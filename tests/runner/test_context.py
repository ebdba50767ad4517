"""A prompt too long for its backend is an error, not a truncation (issue 37, point 3): a real
hub, a real runner and the simulator saying its model's context length the way each imitated
server says it (vLLM's ``max_model_len`` in ``/v1/models``, llama.cpp's ``/props``, Ollama's
``/api/show``), all on loopback. The runner reports the contexts with its model list, the hub
answers a turn whose prompt estimate is over it with a 400 in the caller's shape (chat
completions, Responses, Anthropic Messages) naming the model, its context and how to raise it;
a prompt under it is served. ``doctor`` prints each model's context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers import ADMIN, BACKEND_KEY, OWNER, PROJECT, runner_config, running

from gateway.hub import Hub, open_hub
from gateway.ops.doctor import diagnose
from gateway.sim import SimOptions, open_sim
from gateway.wire import protocol

CONTEXT = 64  # tokens: the backend's context in these tests
SHORT = "hi"
LONG = "word " * 100  # 500 characters: about 125 tokens, as the hub estimates (chars / 4)
GUARD = 30.0  # s: a hang guard, never a timing


async def turn(http: httpx.AsyncClient, key: str, api: str, text: str) -> httpx.Response:
    """One non-streamed turn in ``api``'s shape."""
    if api == "chat":
        body: dict[str, Any] = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": text}],
        }
        return await http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
    if api == "responses":
        body = {"model": "sim-model", "input": text}
        return await http.post(
            "/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"}
        )
    body = {
        "model": "sim-model",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": text}],
    }
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    return await http.post("/v1/messages", json=body, headers=headers)


@pytest.mark.parametrize("dialect", ["vllm", "llamacpp", "ollama"])
async def test_a_prompt_over_the_backends_context_is_refused_in_the_callers_shape(
    dialect: str, tmp_path: Path
) -> None:
    options = SimOptions(dialect=dialect)
    async with (
        open_sim(require_key=BACKEND_KEY, options=options, context=CONTEXT) as sim,
        open_hub(Hub(admin_token=ADMIN)) as (hub, url),
        running(runner_config(url, sim.url, tmp_path / "state")),
        httpx.AsyncClient(base_url=url, timeout=GUARD) as http,
    ):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        with trio.fail_after(GUARD):
            listed = await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert [m["id"] for m in listed.json()["data"]] == ["sim-model"]
            assert hub.catalog.context_of(OWNER, PROJECT, "sim-model") == CONTEXT
            replies = {
                (api, size): await turn(http, key, api, text)
                for api in ("chat", "responses", "messages")
                for size, text in (("short", SHORT), ("long", LONG))
            }
        served = len(sim.streams)
    for api in ("chat", "responses", "messages"):
        short, long = replies[(api, "short")], replies[(api, "long")]
        assert short.status_code == 200, (api, short.text)
        assert long.status_code == 400, (api, long.text)
        body = long.json()
        if api == "messages":
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            message = body["error"]["message"]
        else:
            assert body["error"]["code"] == "context_length_exceeded"
            message = body["error"]["message"]
        assert "'sim-model'" in message and f"{CONTEXT} tokens" in message
        assert "num_ctx" in message and "--ctx-size" in message and "--max-model-len" in message
    assert served == 3  # the long prompts never reached the backend
    print(f"OBSERVED ({dialect}) {replies[('chat', 'long')].status_code} {message}")


async def test_the_runner_reports_contexts_only_when_its_backend_says_them(
    tmp_path: Path,
) -> None:
    """A backend that says no context: the models frame is the one a Server without the
    extension knows (no ``contexts`` field), and a long prompt is served as before."""
    async with (
        open_sim(require_key=BACKEND_KEY) as sim,
        open_hub(Hub(admin_token=ADMIN)) as (hub, url),
        running(runner_config(url, sim.url, tmp_path / "state")) as runner,
        httpx.AsyncClient(base_url=url, timeout=GUARD) as http,
    ):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        with trio.fail_after(GUARD):
            await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            long = await turn(http, key, "chat", LONG)
        models = runner.pool.servable()
        frame = protocol.models_frame("j", "r", models, runner.pool.contexts(models))
    assert long.status_code == 200, long.text
    assert hub.catalog.context_of(OWNER, PROJECT, "sim-model") is None
    assert (
        frame
        == '{"type":"chat.models.response","jobId":"j","requestId":"r","models":["sim-model"]}'
    )


@pytest.mark.parametrize("dialect", ["vllm", "llamacpp", "ollama"])
async def test_doctor_prints_each_models_context(dialect: str, tmp_path: Path) -> None:
    async with open_sim(
        require_key=BACKEND_KEY, options=SimOptions(dialect=dialect), context=8192
    ) as sim:
        config = runner_config("http://127.0.0.1:9", sim.url, tmp_path / "state")
        with trio.fail_after(GUARD):
            checks = {c.name.strip(): c for c in await diagnose(config)}
    assert "sim-model (context 8192 tokens)" in checks["backend default"].detail
    assert "servable now: sim-model (context 8192 tokens)" in checks["models"].detail


def test_ollamas_context_is_num_ctx_else_its_default_not_the_trained_length() -> None:
    from gateway.runner.contexts import OLLAMA_DEFAULT_CONTEXT, ollama_context

    trained = b'{"model_info": {"qwen2.context_length": 32768}, "parameters": "stop \\"x\\""}'
    assert ollama_context(trained) == OLLAMA_DEFAULT_CONTEXT == 4096
    assert ollama_context(b'{"parameters": "num_ctx    16384\\nstop x"}') == 16384
    assert ollama_context(b'{"model_info": {}}') is None
