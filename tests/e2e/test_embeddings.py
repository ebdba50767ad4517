"""Embeddings through the channel (issue 37, point 6): ``POST /v1/embeddings`` on a real hub,
carried by a real runner to its backend as the ``embeddings`` extension of the hub's hello
(docs/protocol.md §6), bodies verbatim both ways, counted in usage with the backend's prompt
tokens; against the simulator, and against llama.cpp's own server (llama-cpp-python's) serving a
tiny random-weight GGUF model this test writes (``tests/support/tinygguf.py``). A Server without the
extension sees nothing new: no hello, no ``extensions`` in the models answer."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import trio
from channelserver import channel_server, no_hello, resume_hello
from helpers import ADMIN, BACKEND_KEY, CHAT_DEFINITION, OWNER, PROJECT, runner_config, running

from gateway.hub import Hub, open_hub
from gateway.sim import EMBEDDING_DIMENSIONS, embedding_of, open_sim
from gateway.wire import protocol

GUARD = 60.0  # s: a hang guard, never a timing
INPUTS = ["the quick brown fox", "jumps"]


async def test_embeddings_reach_the_backend_and_come_back_verbatim_and_counted(
    tmp_path: Path,
) -> None:
    async with (
        open_sim(require_key=BACKEND_KEY) as sim,
        open_hub(Hub(admin_token=ADMIN)) as (hub, url),
        running(runner_config(url, sim.url, tmp_path / "state")),
        httpx.AsyncClient(base_url=url, timeout=GUARD) as http,
    ):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        auth = {"Authorization": f"Bearer {key}"}
        body = json.dumps({"input": INPUTS, "model": "sim-model", "encoding_format": "float"})
        with trio.fail_after(GUARD):
            chat = await http.post(
                "/v1/chat/completions",
                json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]},
                headers=auth,
            )
            chat_job = hub.sessions.listing()[("k", "default")]
            raw = await http.post("/v1/embeddings", content=body, headers=auth)
            sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            one = await sdk.embeddings.create(model="sim-model", input="hello there")
            unknown = await http.post(
                "/v1/embeddings", json={"model": "no-such-model", "input": "x"}, headers=auth
            )
            bad = await http.post("/v1/embeddings", json={"model": "sim-model"}, headers=auth)
            again = await http.post(
                "/v1/chat/completions",
                json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]},
                headers=auth,
            )
        rows = await hub.store.usage_rows()
    assert chat.status_code == 200 and again.status_code == 200
    assert raw.status_code == 200, raw.text
    vectors = [embedding_of(text) for text in INPUTS]
    expected = {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)
        ],
        "model": "sim-model",
        "usage": {"prompt_tokens": 5, "total_tokens": 5},
    }
    assert raw.content == msgspec.json.encode(expected)  # the backend's bytes, verbatim
    (sent,) = [r for r in sim.requests if r.path == "/v1/embeddings" and b"quick" in r.body]
    assert sent.body == body.encode()  # the client's bytes, verbatim
    assert sent.headers["authorization"] == f"Bearer {BACKEND_KEY}"  # the runner's key
    assert len(one.data) == 1 and len(one.data[0].embedding) == EMBEDDING_DIMENSIONS
    assert one.data[0].embedding == embedding_of("hello there")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert bad.status_code == 400 and "'input'" in bad.json()["error"]["message"]
    # the chat session kept its job: embeddings have a session of their own
    assert hub.sessions.listing()[("k", "default")] == chat_job
    embedded = [r for r in rows if r["api"] == "embeddings"]
    assert [(r["prompt_tokens"], r["completion_tokens"], r["estimated"]) for r in embedded] == [
        (5, 0, False),
        (2, 0, False),
    ]
    assert all(r["session"] == "embeddings" and r["outcome"] == "ok" for r in embedded)


async def test_a_server_without_the_extension_sees_nothing_new(tmp_path: Path) -> None:
    """Without the hello (or with one that does not offer embeddings) the runner's models answer
    is the frame of §4, and a ``chat.embeddings.request`` is answered with an error, never sent
    to the backend; with it, the answer takes the extension up and the request is served."""
    answers: dict[str, dict[str, Any]] = {}
    async with (
        open_sim(require_key=BACKEND_KEY) as sim,
        open_hub(Hub(admin_token=ADMIN)) as (
            hub,
            url,
        ),
    ):
        for name, hello in (("none", no_hello), ("old", resume_hello), ("new", _embeddings_hello)):
            async with (
                channel_server(hello) as server,
                running(runner_config(url, sim.url, tmp_path / name)),
            ):
                definition = {**CHAT_DEFINITION, "channelUrl": server.url}
                job = await hub.board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], definition)
                with trio.fail_after(GUARD):
                    conn = await server.conn(1)
                    await conn.send(
                        {"type": "chat.models.request", "jobId": job.id, "requestId": "m"}
                    )
                    models = await server.until_finished("m")
                    request = {"model": "sim-model", "input": "a b"}
                    await conn.send(
                        {
                            "type": protocol.EMBEDDINGS_REQUEST,
                            "jobId": job.id,
                            "requestId": "e",
                            "body": request,
                        }
                    )
                    last = await server.until_finished("e")
                answers[name] = {"models": models, "last": last, "frames": server.of("e")}
        embedded = [r for r in sim.requests if r.path == "/v1/embeddings"]
    for name in ("none", "old"):
        assert answers[name]["models"] == {
            "type": "chat.models.response",
            "jobId": answers[name]["models"]["jobId"],
            "requestId": "m",
            "models": ["sim-model"],
        }
        assert answers[name]["last"]["type"] == protocol.COMPLETION_ERROR
        assert "embeddings extension" in answers[name]["last"]["error"]
    assert answers["new"]["models"]["extensions"] == ["embeddings"]
    kinds = [f["type"] for f in answers["new"]["frames"]]
    assert kinds == [protocol.COMPLETION_CHUNK, protocol.COMPLETION_DONE]
    assert answers["new"]["frames"][0]["chunk"]["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    assert len(embedded) == 1  # only the Server that offered it reached the backend


def _embeddings_hello(server: Any, number: int, job_id: str) -> dict[str, Any]:
    return {"type": protocol.HELLO, "jobId": job_id, "extensions": ["resume", "embeddings"]}


# -- llama.cpp's own server (llama-cpp-python), serving a tiny GGUF written here ---------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def llama_server(tmp_path: Path) -> Any:
    """llama-cpp-python's OpenAI-compatible server with ``--embedding`` on a tiny random-weight
    llama GGUF; skipped, saying why, where llama-cpp-python is not installed."""
    for module, why in (
        ("llama_cpp", "llama-cpp-python is not installed (the test extra has it)"),
        ("llama_cpp.server.app", "llama-cpp-python lacks its server extra ([server])"),
        ("gguf", "the gguf package is not installed (the test extra has it)"),
    ):
        try:
            __import__(module)
        except ImportError:
            if os.environ.get("CI", "").lower() in ("1", "true", "yes"):  # CI: required
                pytest.fail(why)
            pytest.skip(why)
    from tinygguf import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny.gguf")
    port = _free_port()
    log = (tmp_path / "llama.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--model_alias",
            "tiny",
            "--embedding",
            "true",
            "--n_ctx",
            "64",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=log,
        env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
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


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:]


async def _until_up(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"llama.cpp's server exited: {_tail(log)}")
            try:
                if (await http.get(f"{url}/models")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await trio.sleep(0.2)  # polling a starting process: no event to wait on


async def test_embeddings_through_the_real_llama_cpp_server(
    llama_server: Any, tmp_path: Path
) -> None:
    proc, backend, log = llama_server
    with trio.fail_after(GUARD * 3):
        await _until_up(backend, proc, log)
    async with (
        open_hub(Hub(admin_token=ADMIN)) as (hub, url),
        running(runner_config(url, backend, tmp_path / "state", model=None, backend_key=None)),
        httpx.AsyncClient(base_url=url, timeout=GUARD) as http,
        httpx.AsyncClient(base_url=backend, timeout=GUARD) as direct,
    ):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        body = {"model": "tiny", "input": ["hello world", "tiny model"]}
        with trio.fail_after(GUARD):
            through = await http.post(
                "/v1/embeddings", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            straight = await direct.post("/embeddings", json=body)
        rows = await hub.store.usage_rows()
    assert through.status_code == 200, through.text
    got, want = through.json(), straight.json()
    assert [len(d["embedding"]) for d in got["data"]] == [len(d["embedding"]) for d in want["data"]]
    assert [d["embedding"] for d in got["data"]] == [d["embedding"] for d in want["data"]]
    assert got["usage"] == want["usage"] and got["usage"]["prompt_tokens"] > 0
    (row,) = [r for r in rows if r["api"] == "embeddings"]
    assert (row["prompt_tokens"], row["completion_tokens"]) == (got["usage"]["prompt_tokens"], 0)
    print(
        f"OBSERVED llama.cpp embeddings through the hub: {len(got['data'])} vectors of "
        f"{len(got['data'][0]['embedding'])}, usage {got['usage']}"
    )
