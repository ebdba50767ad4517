"""Traces: spans' parents, ids, GenAI attributes and the exporter's manners, via a real receiver."""

from __future__ import annotations

import json
import logging
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import trio
from helpers import (
    OWNER,
    PROJECT,
    LogCapture,
    Turns,
    clean_env,
    open_chat,
    request_frame,
    runner_config,
    running,
    send,
)
from otlp_receiver import ReceivedSpan, open_receiver

from gateway.hub import Hub
from gateway.runner import tracing
from gateway.runner.otel import Tracing
from gateway.runner.supervisor import Runner
from gateway.sim import Simulator
from gateway.wire.traceparent import valid_traceparent

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
USAGE_CHUNK = (
    b'{"id":"chatcmpl-9","object":"chat.completion.chunk","model":"sim-model-v2",'
    b'"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":42,"total_tokens":53}}'
)


def test_endpoint_from_env() -> None:
    assert tracing.endpoint_from_env({}) is None
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318"}
    assert tracing.endpoint_from_env(base) == "http://otel:4318/v1/traces"
    full = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://otel:4318/custom"}
    assert tracing.endpoint_from_env(full) == "http://otel:4318/custom"
    assert tracing.endpoint_from_env({}, "http://tempo:4318/") == "http://tempo:4318/v1/traces"
    assert tracing.endpoint_from_env({**base, "OTEL_SDK_DISABLED": "true"}) is None
    assert tracing.endpoint_from_env({**base, "OTEL_TRACES_EXPORTER": "none"}) is None


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        (PARENT, True),
        (PARENT.upper(), True),
        ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", False),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01", False),
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),
        ("garbage", False),
        (42, False),
    ],
)
def test_valid_traceparent(value: object, valid: bool) -> None:
    assert (valid_traceparent(value) is not None) is valid


def test_usage_attributes() -> None:
    assert tracing.usage_attributes(USAGE_CHUNK) == {
        "gen_ai.response.model": "sim-model-v2",
        "gen_ai.response.id": "chatcmpl-9",
        "gen_ai.usage.input_tokens": 11,
        "gen_ai.usage.output_tokens": 42,
    }
    assert tracing.usage_attributes(b"not json") == {}
    assert tracing.usage_attributes(None) == {}


async def test_session_and_turn_spans_reach_the_collector() -> None:
    async with open_receiver() as receiver:
        tracer = Tracing.start(receiver.url + "/v1/traces", service_version="9.9")
        session = tracer.session("job-1", "run-1", PARENT, runner_name="gpu-box")
        turn = session.turn("req-1", "sim-model", "http://127.0.0.1:11434/v1")
        turn.first_token()
        turn.end("done", None, 3, USAGE_CHUNK)
        other = session.turn("req-2", "sim-model", "https://api.example:8443/v1", CLIENT)
        other.end("error", "backend returned 500: boom", 0, None)
        session.end("success", "ended by the Server")
        await trio.to_thread.run_sync(tracer.shutdown)
        spans = {s.name + ":" + s.attributes.get("alp.request.id", ""): s for s in receiver.spans}

    root = spans["chat_llm session:"]
    assert root.trace_id == PARENT.split("-")[1]
    assert root.parent_span_id == PARENT.split("-")[2]
    assert root.attributes["alp.job.id"] == "job-1"
    assert root.attributes["alp.run.id"] == "run-1"
    assert root.resource["service.name"] == "alp-gateway"
    assert root.resource["service.version"] == "9.9"

    first = spans["chat sim-model:req-1"]
    assert first.trace_id == root.trace_id
    assert first.parent_span_id == root.span_id
    assert turn.traceparent.split("-")[:3] == ["00", first.trace_id, first.span_id]
    assert first.attributes["gen_ai.operation.name"] == "chat"
    assert first.attributes["gen_ai.request.model"] == "sim-model"
    assert first.attributes["server.address"] == "127.0.0.1"
    assert first.attributes["server.port"] == 11434
    assert first.attributes["gen_ai.usage.input_tokens"] == 11
    assert first.attributes["gen_ai.usage.output_tokens"] == 42
    assert first.attributes["alp.turn.chunks"] == 3
    assert first.events == ["gen_ai.first_token"]
    assert first.status_code == 0  # unset: not an error

    second = spans["chat sim-model:req-2"]  # the client's own trace, linked to the session
    assert second.trace_id == CLIENT.split("-")[1]
    assert second.parent_span_id == CLIENT.split("-")[2]
    assert second.links == [(root.trace_id, root.span_id)]
    assert second.attributes["server.port"] == 8443
    assert second.attributes["error.type"] == "error"
    assert second.status_code == 2  # ERROR


async def test_unreachable_collector_costs_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.2")
    with socket.socket() as probe:  # a port with nothing behind it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    handler = LogCapture()
    handler.setLevel(logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        tracer = Tracing.start(f"http://127.0.0.1:{port}/v1/traces")
        session = tracer.session("job-1", "run-1", None)
        for n in range(3):
            session.turn(f"req-{n}", "m", "http://127.0.0.1:1/v1").end("done", None, 1, None)
            await trio.to_thread.run_sync(tracer.flush)
        session.end("success", "done")
        await trio.to_thread.run_sync(tracer.shutdown)
    finally:
        root.removeHandler(handler)
    warnings = [line for line in handler.lines if "traces" in line or "opentelemetry" in line]
    assert warnings == [
        f"traces: the collector at http://127.0.0.1:{port}/v1/traces does not take spans;"
        " they are dropped until it does"
    ]


# -- end to end: client -> hub -> runner -> simulator, spans at a real receiver ------------------


async def _front_door_turn(
    base: str, key: str, traceparent: str | None, session: str = "traced"
) -> dict[str, Any]:
    """One streamed front-door turn asking for usage; the usage the client got."""
    headers = {"Authorization": f"Bearer {key}", "X-Chat-Session": session}
    if traceparent is not None:
        headers["traceparent"] = traceparent
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "sim": {"chunks": 4},
    }
    usage: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
    assert usage, "the stream had no usage chunk"
    return usage


async def test_a_trace_runs_from_the_client_through_hub_and_runner_to_the_backend(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    """The first front-door request's traceparent becomes the job's; the session span is its
    child; the first turn span is the session's child, the second (its own traceparent, in its
    frame) the client's child linked to the session; the backend saw each turn span's id."""
    hub_, base = hub
    key = await hub_.keys.create("tracer", f"{OWNER}/{PROJECT}")
    async with open_receiver() as receiver:
        runner = Runner(
            runner_config(base, sim.url, tmp_path, otlp_endpoint=receiver.url, grace=1.0)
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner.run)
            with trio.fail_after(30):
                await runner.first_poll.wait()  # up (before it the hub answers "no runner")
                first_usage = await _front_door_turn(base, key, PARENT)
                second_usage = await _front_door_turn(base, key, CLIENT)
            runner.begin_shutdown()  # the session ends (its span too), the exporter is flushed
        with trio.fail_after(30):
            spans = await receiver.wait_for(3)
        print_trace(spans)  # the note's example (pytest -s shows it)

    (job,) = await hub_.board.all_jobs.values()
    assert job.agent_definition["traceparent"] == PARENT
    by_request = {s.attributes.get("alp.request.id"): s for s in spans}
    session = by_request.pop(None)
    assert session.name == "chat_llm session"
    assert session.trace_id == PARENT.split("-")[1]
    assert session.parent_span_id == PARENT.split("-")[2]
    assert session.attributes["alp.job.id"] == job.id
    assert session.attributes["alp.run.id"] == job.run_id
    assert session.attributes["alp.session.outcome"] == "success"
    assert session.resource["service.name"] == "alp-gateway"

    requests = sim.requests  # in order: the first turn's, then the second's
    completions = [r for r in requests if r.path.endswith("/chat/completions")]
    assert len(completions) == 2
    first, second = sorted(by_request.values(), key=lambda s: s.start_ns)
    assert first.parent_span_id == session.span_id and first.trace_id == session.trace_id
    assert second.trace_id == CLIENT.split("-")[1]
    assert second.parent_span_id == CLIENT.split("-")[2]
    assert second.links == [(session.trace_id, session.span_id)]
    for span, request, usage in (
        (first, completions[0], first_usage),
        (second, completions[1], second_usage),
    ):
        sent = request.headers["traceparent"].split("-")
        assert sent[:3] == ["00", span.trace_id, span.span_id]
        assert int(sent[3], 16) & 1  # sampled
        assert span.name == "chat sim-model"
        assert span.attributes["gen_ai.operation.name"] == "chat"
        assert span.attributes["gen_ai.request.model"] == "sim-model"
        assert span.attributes["server.address"] == "127.0.0.1"
        assert span.attributes["server.port"] == urlsplit(sim.url).port
        assert span.attributes["alp.turn.outcome"] == "done"
        assert span.attributes["alp.turn.chunks"] >= 5  # four tokens, the finish, the usage
        assert span.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert span.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
        assert span.events == ["gen_ai.first_token"]
        assert span.status_code == 0


async def test_a_failed_turn_is_an_error_span(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    async with open_receiver() as receiver:
        config = runner_config(hub[1], sim.url, tmp_path, otlp_endpoint=receiver.url)
        async with running(config) as runner:
            job, ch = await open_chat(hub[0])
            await send(ch, request_frame(job.id, "e500", sim={"fault": "500"}))
            await Turns(ch).until("e500", errors={"e500"})
            assert runner.tracing is not None
            await trio.to_thread.run_sync(runner.tracing.flush)
            with trio.fail_after(30):
                (span,) = await receiver.wait_for(1, "chat")
    assert span.attributes["alp.turn.outcome"] == "failed"
    assert span.attributes["error.type"] == "failed"
    assert span.status_code == 2
    assert span.attributes["alp.turn.chunks"] == 0


_TRACING_OFF = """
import sys
sys.path.insert(0, {tests!r})
import trio
from helpers import ADMIN, BACKEND_KEY, Turns, open_chat, request_frame, runner_config, running, send
from gateway.hub import Hub, open_hub
from gateway.sim import open_sim
from pathlib import Path

async def main():
    async with open_sim(require_key=BACKEND_KEY) as sim, open_hub(Hub(admin_token=ADMIN)) as hub:
        async with running(runner_config(hub[1], sim.url, Path({state!r}))) as runner:
            assert runner.tracing is None
            job, ch = await open_chat(hub[0])
            await send(ch, request_frame(job.id, "t", sim={{"chunks": 3}}))
            await Turns(ch).until("t")
            assert runner.counters.get("turns_done") == 1
            assert "traceparent" not in sim.requests[-1].headers
    loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
    print("opentelemetry modules:", loaded)

trio.run(main)
"""


@pytest.mark.parametrize("env", [{}, {"OTEL_SDK_DISABLED": "true"}])
async def test_tracing_off_imports_no_opentelemetry_and_exports_nothing(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A real turn in a fresh interpreter: with no endpoint, or one switched off, no OpenTelemetry
    module is loaded, the backend gets no traceparent and the receiver hears nothing."""
    async with open_receiver() as receiver:
        extra = dict(env)
        if env:  # an endpoint is set, and switched off again
            extra["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.url
        script = _TRACING_OFF.format(
            tests=str(Path(__file__).parents[1] / "support"), state=str(tmp_path)
        )
        environ = {
            k: v for k, v in clean_env(**extra).items() if k in extra or not k.startswith("OTEL_")
        }
        with trio.fail_after(60):
            result = await trio.run_process(
                [sys.executable, "-c", script],
                env=environ,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
        assert result.returncode == 0, result.stderr.decode()
        assert result.stdout.decode().strip() == "opentelemetry modules: []"
        assert receiver.exports == 0 and receiver.spans == []


def print_trace(spans: list[ReceivedSpan]) -> None:
    """The span tree, ids and attributes (the lead's note shows one)."""
    by_parent: dict[str, list[ReceivedSpan]] = {}
    ids = {s.span_id for s in spans}
    for span in sorted(spans, key=lambda s: s.start_ns):
        parent = span.parent_span_id if span.parent_span_id in ids else ""
        by_parent.setdefault(parent, []).append(span)

    def show(span: ReceivedSpan, depth: int) -> None:
        pad = "  " * depth
        print(
            f"{pad}{span.name}  trace={span.trace_id} span={span.span_id} "
            f"parent={span.parent_span_id or '-'} links={span.links} events={span.events}"
        )
        for key, value in sorted(span.attributes.items()):
            print(f"{pad}    {key} = {value!r}")
        for child in by_parent.get(span.span_id, []):
            show(child, depth + 1)

    for root in by_parent.get("", []):
        show(root, 0)
