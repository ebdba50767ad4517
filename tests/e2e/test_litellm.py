"""A real third-party backend: LiteLLM's proxy (its replies mocked by LiteLLM itself) behind hub → runner.

LiteLLM runs as a subprocess on a free loopback port with a master key, no telemetry, its model
cost map read locally, and HTTP(S)_PROXY pointed at a closed loopback port so any outbound call
fails at once. What its mock supports (litellm 1.82.6): a streamed ``mock_response`` (content
in 3-character pieces, ``finish_reason: stop``, ``usage`` when ``stream_options.include_usage``);
``mock_tool_calls`` only on non-streamed replies (a streamed mock ignores them). Streamed tool
calls are therefore tested with LiteLLM in front of the simulator, LiteLLM re-streaming them.
Between the runner and LiteLLM sits a tap that keeps the bytes LiteLLM sent, so the chunk
frames can be compared with them byte for byte.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import h11
import httpx
import pytest
import trio
from helpers import Turns, clean_env, open_chat, request_frame, runner_config, running, send

from gateway.config import BackendSpec
from gateway.hub import Hub
from gateway.ops.doctor import OK, diagnose
from gateway.sim import SimOptions, open_sim

LITELLM = Path(sys.executable).with_name("litellm")
MASTER_KEY = "sk-litellm-master-test-4242"
MOCK_TEXT = "Hello from the LiteLLM mock"
READY_WITHIN = 120.0  # seconds; LiteLLM imports a lot (about 5 s on two cores)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _missing() -> str | None:
    for module in ("litellm", "litellm.proxy", "fastapi", "uvicorn", "backoff", "yaml"):
        try:
            if importlib.util.find_spec(module) is None:
                return (
                    f"{module} is not importable: install the test extra "
                    "(`pip install -e '.[test]'`, litellm[proxy])"
                )
        except ImportError as exc:
            return f"{module} cannot be imported ({exc}): install litellm[proxy]"
    if not LITELLM.exists():
        return f"no litellm command at {LITELLM}"
    return None


def _unavailable(reason: str) -> NoReturn:
    """Skip where LiteLLM may be missing; under ``CI=true`` (GitHub Actions, ``.ci/run``) fail:
    CI must not go green without the LiteLLM path."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"LiteLLM proxy is required under CI=true: {reason}", pytrace=False)
    pytest.skip(f"LiteLLM proxy unavailable: {reason}")


def _log_tail(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:]


@dataclass
class Proxy:
    url: str
    upstream_port: int  # where the "via-sim" model expects the simulator


def _config(upstream_port: int) -> str:
    tool_call = {
        "id": "call_mock_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Aarhus"}'},
    }
    models = [
        {
            "model_name": "mock-chat",
            "litellm_params": {
                "model": "openai/mock-chat",
                "api_key": "sk-unused",
                "mock_response": MOCK_TEXT,
            },
        },
        {
            "model_name": "mock-tools",
            "litellm_params": {
                "model": "openai/mock-tools",
                "api_key": "sk-unused",
                "mock_response": "",
                "mock_tool_calls": [tool_call],
            },
        },
        {
            "model_name": "via-sim",
            "litellm_params": {
                "model": "openai/sim-model",
                "api_key": "sk-unused",
                "api_base": f"http://127.0.0.1:{upstream_port}/v1",
            },
        },
    ]
    config = {
        "model_list": models,
        "general_settings": {"master_key": MASTER_KEY},
        "litellm_settings": {"telemetry": False},
    }
    return json.dumps(config)  # JSON is YAML


@pytest.fixture(scope="module")
def litellm_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    reason = _missing()
    if reason:
        _unavailable(reason)
    work = tmp_path_factory.mktemp("litellm")
    upstream_port, port = _free_port(), _free_port()
    (work / "config.yaml").write_text(_config(upstream_port))
    env = clean_env(
        **{
            "LITELLM_TELEMETRY": "False",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of the cost map from the internet
            "LITELLM_DONT_SHOW_FEEDBACK_BOX": "True",
            "HTTP_PROXY": "http://127.0.0.1:9",
            "HTTPS_PROXY": "http://127.0.0.1:9",  # any outbound call fails
            "NO_PROXY": "127.0.0.1,localhost",
            "PYTHONUNBUFFERED": "1",
        }
    )
    log_path = work / "litellm.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                str(LITELLM),
                "--config",
                str(work / "config.yaml"),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=work,
        )
    try:
        # readiness, not synchronisation: poll its health route until it answers, bounded
        deadline = time.monotonic() + READY_WITHIN
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while True:
                if proc.poll() is not None:
                    _unavailable(
                        f"exited with {proc.returncode} at start; log:\n{_log_tail(log_path)}"
                    )
                try:
                    if client.get(f"http://127.0.0.1:{port}/health/liveliness").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    _unavailable(
                        f"not ready within {READY_WITHIN:.0f} s; log:\n{_log_tail(log_path)}"
                    )
                time.sleep(0.2)
        yield Proxy(f"http://127.0.0.1:{port}/v1", upstream_port)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Tap:
    """A loopback TCP forwarder to ``port`` that keeps what each side sent, per connection."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.port = 0
        self.sent: list[bytearray] = []  # client -> server, per connection
        self.received: list[bytearray] = []  # server -> client, per connection

    async def serve(self, task_status: trio.TaskStatus[Tap] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        up, down = bytearray(), bytearray()
        self.sent.append(up)
        self.received.append(down)
        async with client, await trio.open_tcp_stream("127.0.0.1", self.target) as server:
            async with trio.open_nursery() as nursery:

                async def pump(
                    src: trio.SocketStream, dst: trio.SocketStream, keep: bytearray
                ) -> None:
                    try:
                        while data := await src.receive_some(65536):
                            keep.extend(data)
                            await dst.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                    nursery.cancel_scope.cancel()

                nursery.start_soon(pump, client, server, up)
                nursery.start_soon(pump, server, client, down)

    def event_streams(self) -> list[bytes]:
        """The bodies of every ``text/event-stream`` response LiteLLM sent, de-chunked."""
        bodies = []
        for raw in self.received:
            conn = h11.Connection(h11.CLIENT)
            conn.receive_data(bytes(raw))
            while True:
                conn.send(h11.Request(method="GET", target="/", headers=[("host", "tap")]))
                conn.send(h11.EndOfMessage())
                kind, body = b"", bytearray()
                event = conn.next_event()
                while event is not h11.NEED_DATA and not isinstance(
                    event, h11.EndOfMessage | h11.ConnectionClosed
                ):
                    if isinstance(event, h11.Response):
                        kind = dict(event.headers).get(b"content-type", b"")
                    elif isinstance(event, h11.Data):
                        body += event.data
                    event = conn.next_event()
                if not isinstance(event, h11.EndOfMessage):
                    break
                if kind.startswith(b"text/event-stream"):
                    bodies.append(bytes(body))
                conn.start_next_cycle()
        return bodies


def sse_payloads(stream: bytes) -> list[bytes]:
    events = [e for e in stream.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]
    return [e[len(b"data: ") :] if e.startswith(b"data: ") else e[len(b"data:") :] for e in events]


def assert_verbatim(turns: Turns, request_id: str, stream: bytes) -> list[dict[str, Any]]:
    payloads = [p for p in sse_payloads(stream) if p != b"[DONE]"]
    frames = turns.frames[request_id]
    texts = [t for f, t, _ in frames if f["type"] == "chat.completion.chunk"]
    assert len(texts) == len(payloads) and payloads, (texts, payloads)
    for text, payload in zip(texts, payloads, strict=True):
        assert text.encode().endswith(b'"chunk":' + payload + b"}"), (text, payload)
    assert frames[-1][0]["type"] == "chat.completion.done"
    return turns.chunks(request_id)


def spec(tap: Tap) -> BackendSpec:
    return BackendSpec("litellm", f"http://127.0.0.1:{tap.port}/v1", key=MASTER_KEY)


async def test_streamed_mock_turn_with_usage(
    hub: tuple[Hub, str], litellm_proxy: Proxy, tmp_path: Path
) -> None:
    port = int(litellm_proxy.url.rsplit(":", 1)[1].split("/")[0])
    async with trio.open_nursery() as nursery:
        tap: Tap = await nursery.start(Tap(port).serve)
        config = runner_config(hub[1], None, tmp_path, backends=(spec(tap),), model="mock-chat")
        async with running(config) as runner:
            job, ch = await open_chat(hub[0])
            await send(ch, {"type": "chat.models.request", "jobId": job.id, "requestId": "m"})
            await send(ch, request_frame(job.id, "t", stream_options={"include_usage": True}))
            turns = Turns(ch)
            await turns.until("m", "t")
            assert sorted(turns.last("m")["models"]) == ["mock-chat", "mock-tools", "via-sim"]
            assert runner.pool.backends[0].models  # discovered from LiteLLM's /v1/models
        nursery.cancel_scope.cancel()
    [stream] = tap.event_streams()
    chunks = assert_verbatim(turns, "t", stream)
    text = "".join(
        (c["choices"][0].get("delta") or {}).get("content") or "" for c in chunks if c["choices"]
    )
    assert text == MOCK_TEXT
    assert [
        ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")
    ] == ["stop"]
    usage = chunks[-1]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    assert any(f"Bearer {MASTER_KEY}".encode() in bytes(sent) for sent in tap.sent)
    frames_text = json.dumps([t for fr in turns.frames.values() for _, t, _ in fr])
    assert MASTER_KEY not in frames_text


async def test_non_streamed_mock_tool_calls(
    hub: tuple[Hub, str], litellm_proxy: Proxy, tmp_path: Path
) -> None:
    port = int(litellm_proxy.url.rsplit(":", 1)[1].split("/")[0])
    async with trio.open_nursery() as nursery:
        tap: Tap = await nursery.start(Tap(port).serve)
        config = runner_config(hub[1], None, tmp_path, backends=(spec(tap),), model="mock-chat")
        async with running(config):
            job, ch = await open_chat(hub[0])
            await send(
                ch, request_frame(job.id, "t", model="mock-tools", stream=False, tools=TOOLS)
            )
            turns = Turns(ch)
            await turns.until("t")
        checks = await diagnose(config, deep=True)
        nursery.cancel_scope.cancel()
    [completion] = turns.chunks("t")
    assert completion["object"] == "chat.completion"
    [call] = completion["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"arguments": '{"city":"Aarhus"}', "name": "get_weather"}
    assert call["id"] == "call_mock_1" and completion["usage"]["total_tokens"] > 0
    assert turns.last("t")["type"] == "chat.completion.done"
    deep = {c.name.strip(): c for c in checks}
    assert deep["litellm completion"].mark == OK, deep["litellm completion"]
    assert deep["backend litellm"].mark == OK and "mock-chat" in deep["backend litellm"].detail


async def test_streamed_tool_calls_re_streamed_by_litellm(
    hub: tuple[Hub, str], litellm_proxy: Proxy, tmp_path: Path
) -> None:
    port = int(litellm_proxy.url.rsplit(":", 1)[1].split("/")[0])
    async with open_sim(
        port=litellm_proxy.upstream_port, options=SimOptions(tool_calls=True, chunks=4)
    ) as sim:
        async with trio.open_nursery() as nursery:
            tap: Tap = await nursery.start(Tap(port).serve)
            config = runner_config(hub[1], None, tmp_path, backends=(spec(tap),), model="via-sim")
            async with running(config):
                job, ch = await open_chat(hub[0])
                await send(
                    ch,
                    request_frame(job.id, "t", stream_options={"include_usage": True}, tools=TOOLS),
                )
                turns = Turns(ch)
                await turns.until("t")
            nursery.cancel_scope.cancel()
        assert len(sim.streams) == 1 and json.loads(sim.streams[0].body)["model"] == "sim-model"
    [stream] = tap.event_streams()
    chunks = assert_verbatim(turns, "t", stream)
    calls = [
        call
        for c in chunks
        for ch in c["choices"]
        for call in (ch.get("delta") or {}).get("tool_calls") or []
    ]
    assert calls[0]["function"]["name"] == "get_weather"
    args = "".join(call["function"].get("arguments") or "" for call in calls)
    assert json.loads(args) == {"seq": "tok0 tok1 tok2 tok3 "}
    assert [
        ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")
    ] == ["tool_calls"]
    assert chunks[-1]["usage"]["completion_tokens"] == 4
