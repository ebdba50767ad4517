"""Traces: spans' parents, ids, GenAI attributes and the exporter's manners, via a real receiver."""

from __future__ import annotations

import logging
import socket

import pytest
import trio
from helpers import LogCapture
from otlp_receiver import open_receiver

from gateway import tracing
from gateway.otel import Tracing

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
    assert (tracing.valid_traceparent(value) is not None) is valid


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
    assert turn.traceparent == f"00-{first.trace_id}-{first.span_id}-01"
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
