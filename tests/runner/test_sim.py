"""Test the backend simulator over real loopback sockets with httpx and raw streams."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gateway.sim import SimOptions, Simulator, StreamRecord, open_sim, token_text
from gateway.sim.cli import main

ROOT = Path(__file__).resolve().parents[2]
MODEL = "sim-model"
DISCONNECT_ERRORS = (httpx.ReadError, httpx.RemoteProtocolError)


@pytest.fixture
async def sim() -> AsyncIterator[Simulator]:
    async with open_sim() as simulator:
        yield simulator


@pytest.fixture
async def client(sim: Simulator) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sim.url, trust_env=False, timeout=5) as c:
        yield c


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], **extra}


def split_events(raw: bytes) -> list[bytes]:
    """The data payloads of an SSE body, checking every event is exactly ``data: X\\n\\n``."""
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events)
    return [e[6:] for e in events]


async def stream_raw(
    client: httpx.AsyncClient, payload: dict[str, Any]
) -> tuple[httpx.Response, bytes]:
    async with client.stream("POST", "/chat/completions", json=payload) as response:
        raw = b"".join([part async for part in response.aiter_raw()])
    return response, raw


def chunks_of(payloads: list[bytes]) -> list[dict[str, Any]]:
    assert payloads[-1] == b"[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def content_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> None:
    assert response.status_code == status
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    if code is not None:
        assert error["code"] == code


async def test_models_list(sim: Simulator, client: httpx.AsyncClient) -> None:
    response = await client.get("/models")
    assert response.status_code == 200
    listing = response.json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["sim-model"]
    assert all(
        m["object"] == "model" and m["owned_by"] == "sim" and isinstance(m["created"], int)
        for m in listing["data"]
    )
    sim.models.append("other")
    response = await client.get("/models")
    assert [m["id"] for m in response.json()["data"]] == ["sim-model", "other"]
    assert sim.requests[0].method == "GET" and sim.requests[0].path == "/v1/models"


async def test_stream_shape_sequence_and_done(sim: Simulator, client: httpx.AsyncClient) -> None:
    response, raw = await stream_raw(client, body(stream=True))
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["transfer-encoding"] == "chunked"
    payloads = split_events(raw)
    rec = sim.streams[0]
    assert payloads == rec.payloads
    assert len(rec.sent_at) == len(payloads) and rec.sent_at == sorted(rec.sent_at)
    assert rec.finished.is_set() and rec.completed and not rec.client_closed
    assert rec.stream and rec.status == 200 and rec.model == MODEL
    assert json.loads(rec.body) == body(stream=True)

    chunks = chunks_of(payloads)
    assert len(chunks) == 1 + 8 + 1
    assert {c["id"] for c in chunks} == {rec.id} and rec.id.startswith("chatcmpl-sim-")
    for c in chunks:
        assert c["object"] == "chat.completion.chunk"
        assert c["model"] == MODEL and isinstance(c["created"], int)
        assert len(c["choices"]) == 1 and c["choices"][0]["index"] == 0
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    tokens = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert tokens == [f"tok{i} " for i in range(8)]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 9 + ["stop"]
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert not any("usage" in c for c in chunks)


async def test_non_stream_reply(sim: Simulator, client: httpx.AsyncClient) -> None:
    response = await client.post("/chat/completions", json=body())
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    reply = response.json()
    assert reply["object"] == "chat.completion" and reply["model"] == MODEL
    assert reply["id"].startswith("chatcmpl-sim-")
    choice = reply["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": "".join(token_text(i) for i in range(8)),
    }
    assert choice["finish_reason"] == "stop"
    assert reply["usage"] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}
    rec = sim.streams[0]
    assert not rec.stream and rec.completed and rec.payloads == [response.content]


async def test_tool_calls_stream(client: httpx.AsyncClient) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    payload = body(stream=True, tools=tools, sim={"tool_calls": True, "chunks": 4})
    _, raw = await stream_raw(client, payload)
    chunks = chunks_of(split_events(raw))
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant"
    call = first["tool_calls"][0]
    assert call["index"] == 0 and call["id"] and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    fragments = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks[1:-1]]
    assert len(fragments) == 4 and all(f["index"] == 0 for f in fragments)
    arguments = call["function"]["arguments"] + "".join(
        f["function"]["arguments"] for f in fragments
    )
    assert json.loads(arguments) == {"seq": "tok0 tok1 tok2 tok3 "}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_tool_calls_non_stream(client: httpx.AsyncClient) -> None:
    response = await client.post("/chat/completions", json=body(sim={"tool_calls": True}))
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "sim_tool"
    json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])


@pytest.mark.parametrize("how", ["option", "stream_options"])
async def test_usage_chunk(how: str) -> None:
    options = SimOptions(usage=how == "option", chunks=3)
    extra = {"stream_options": {"include_usage": True}} if how == "stream_options" else {}
    async with open_sim(options=options) as sim:
        async with httpx.AsyncClient(base_url=sim.url, trust_env=False) as client:
            _, raw = await stream_raw(client, body(stream=True, **extra))
    chunks = chunks_of(split_events(raw))
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


async def test_per_request_override_is_per_request(
    sim: Simulator, client: httpx.AsyncClient
) -> None:
    _, raw = await stream_raw(client, body(stream=True, sim={"chunks": 3, "chunk_size": 40}))
    chunks = chunks_of(split_events(raw))
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]] == [
        token_text(i, 40) for i in range(3)
    ]
    assert all(len(token_text(i, 40)) == 40 for i in range(3))
    assert sim.streams[0].options == SimOptions(chunks=3, chunk_size=40)
    _, raw = await stream_raw(client, body(stream=True))
    assert content_of(chunks_of(split_events(raw))) == "".join(token_text(i) for i in range(8))
    assert sim.options == SimOptions()

    response = await client.post("/chat/completions", json=body(sim={"chunkz": 1}))
    assert_error(response, 400)
    response = await client.post("/chat/completions", json=body(sim={"fault": "nope"}))
    assert_error(response, 400)


@pytest.mark.parametrize("stream", [True, False])
async def test_fault_500(sim: Simulator, client: httpx.AsyncClient, stream: bool) -> None:
    response = await client.post(
        "/chat/completions", json=body(stream=stream, sim={"fault": "500"})
    )
    assert_error(response, 500)
    assert response.json()["error"]["type"] == "server_error"
    assert sim.streams[0].status == 500 and sim.streams[0].finished.is_set()


async def test_fault_stall_then_client_cancel(sim: Simulator, client: httpx.AsyncClient) -> None:
    payload = body(stream=True, sim={"fault": "stall", "fault_after": 2})
    received = b""
    with trio.CancelScope() as scope:
        async with client.stream("POST", "/chat/completions", json=payload) as response:
            assert response.status_code == 200
            async for part in response.aiter_raw():
                received += part
                if received.count(b"\n\n") == 2:
                    scope.cancel()
    assert scope.cancelled_caught
    rec = sim.streams[0]
    with trio.fail_after(10):
        await rec.finished.wait()
    assert rec.client_closed and not rec.completed
    assert len(rec.payloads) == 2 and split_events(received) == rec.payloads


async def test_client_gone_during_ttft_is_noticed_promptly(
    sim: Simulator, client: httpx.AsyncClient
) -> None:
    payload = body(stream=True, sim={"ttft": 30})
    async with client.stream("POST", "/chat/completions", json=payload) as response:
        assert response.status_code == 200  # headers come before the ttft wait
        rec = await sim.wait_for_streams(1)
        assert not rec.finished.is_set()
    with trio.fail_after(10):  # a hang guard: unnoticed, the reply would wait out its 30 s ttft
        await rec.finished.wait()
    assert rec.client_closed and not rec.completed and rec.payloads == []


async def test_wait_for_streams_and_wait_sent(sim: Simulator, client: httpx.AsyncClient) -> None:
    async def consume() -> None:
        with trio.move_on_after(5):
            await stream_raw(client, body(stream=True, sim={"fault": "stall", "fault_after": 3}))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        rec: StreamRecord = await sim.wait_for_streams(1)
        assert await rec.wait_sent(3)
        assert len(rec.payloads) == 3 and not rec.finished.is_set()
        nursery.cancel_scope.cancel()
    with trio.fail_after(10):
        await rec.finished.wait()
    assert rec.client_closed
    assert not await rec.wait_sent(4)  # a finished stream does not block


@pytest.mark.parametrize("fault_after", [2, 100])
async def test_fault_disconnect(
    sim: Simulator, client: httpx.AsyncClient, fault_after: int
) -> None:
    payload = body(
        stream=True, sim={"fault": "disconnect", "fault_after": fault_after, "chunks": 3}
    )
    with pytest.raises(DISCONNECT_ERRORS):
        await stream_raw(client, payload)
    rec = sim.streams[0]
    assert rec.finished.is_set() and not rec.completed and not rec.client_closed
    assert len(rec.payloads) == min(fault_after, 5)  # at the latest, before [DONE]
    assert b"[DONE]" not in rec.payloads
    # the simulator keeps serving
    assert (await client.get("/models")).status_code == 200


async def test_fault_disconnect_non_stream(client: httpx.AsyncClient) -> None:
    with pytest.raises(DISCONNECT_ERRORS):
        await client.post("/chat/completions", json=body(sim={"fault": "disconnect"}))


async def test_fault_malformed(sim: Simulator, client: httpx.AsyncClient) -> None:
    _, raw = await stream_raw(client, body(stream=True, sim={"fault": "malformed", "chunks": 4}))
    assert b"data: {not json\n\n" in raw
    payloads = split_events(raw)
    assert payloads[2] == b"{not json"
    good = payloads[:2] + payloads[3:]
    assert content_of(chunks_of(good)) == "".join(token_text(i) for i in range(4))
    assert sim.streams[0].payloads == payloads and sim.streams[0].completed


async def test_require_key() -> None:
    async with open_sim(require_key="sekrit") as sim:
        async with httpx.AsyncClient(base_url=sim.url, trust_env=False) as client:
            assert_error(await client.get("/models"), 401, "invalid_api_key")
            response = await client.post("/chat/completions", json=body())
            assert_error(response, 401, "invalid_api_key")
            bad = {"Authorization": "Bearer wrong"}
            assert_error(await client.post("/chat/completions", json=body(), headers=bad), 401)
            good = {"Authorization": "Bearer sekrit"}
            assert (await client.get("/models", headers=good)).status_code == 200
            response = await client.post("/chat/completions", json=body(), headers=good)
            assert response.status_code == 200
            assert sim.requests[-1].headers["authorization"] == "Bearer sekrit"
            assert [r.status for r in sim.streams] == [401, 401, 200]


async def test_request_errors(sim: Simulator, client: httpx.AsyncClient) -> None:
    response = await client.post("/chat/completions", json=body(model="nope", stream=True))
    assert_error(response, 404, "model_not_found")
    assert response.json()["error"]["type"] == "invalid_request_error"
    response = await client.post(
        "/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert_error(response, 400)
    response = await client.post("/chat/completions", json=[1, 2])
    assert_error(response, 400)
    response = await client.post("/chat/completions", json={"messages": []})
    assert_error(response, 400)
    assert_error(await client.get("/nowhere"), 404)
    assert_error(await client.get("/chat/completions"), 405)
    assert sim.connections == 1  # errors keep the connection alive too


async def test_pacing_interval_and_ttft(sim: Simulator, client: httpx.AsyncClient) -> None:
    started = time.perf_counter()
    _, raw = await stream_raw(
        client, body(stream=True, sim={"chunks": 3, "interval": 0.05, "ttft": 0.05})
    )
    rec = sim.streams[0]
    assert split_events(raw) == rec.payloads and len(rec.sent_at) == 6
    assert rec.sent_at[0] - started >= 0.045
    gaps = [b - a for a, b in zip(rec.sent_at, rec.sent_at[1:], strict=False)]
    assert all(gap >= 0.045 for gap in gaps), gaps


async def test_keep_alive_many_requests_one_connection(
    sim: Simulator, client: httpx.AsyncClient
) -> None:
    for _ in range(3):
        _, raw = await stream_raw(client, body(stream=True, sim={"chunks": 2}))
        assert split_events(raw)[-1] == b"[DONE]"
        assert (await client.post("/chat/completions", json=body())).status_code == 200
        assert (await client.get("/models")).status_code == 200
    assert sim.connections == 1
    assert len(sim.requests) == 9 and len(sim.streams) == 6
    assert all(r.completed for r in sim.streams)
    assert len({r.id for r in sim.streams}) == 6


async def read_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    data = b""
    with trio.fail_after(10):
        while marker not in data:
            part = await stream.receive_some()
            assert part, data
            data += part
    return data


async def test_raw_http11_one_chunk_per_event(sim: Simulator) -> None:
    request = json.dumps(body(stream=True, sim={"chunks": 2})).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", sim.port)
    async with stream:
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(request), request)
        )
        data = await read_until(stream, b"\r\n0\r\n\r\n")
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"transfer-encoding: chunked" in head.lower()
    expected = b"".join(
        b"%x\r\ndata: %b\n\n\r\n" % (len(p) + 8, p) for p in sim.streams[0].payloads
    )
    assert rest == expected + b"0\r\n\r\n"


async def test_raw_http10_close_delimited(sim: Simulator) -> None:
    request = json.dumps(body(stream=True, sim={"chunks": 2})).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", sim.port)
    async with stream:
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.0\r\ncontent-length: %d\r\n\r\n%b"
            % (len(request), request)
        )
        data = b""
        with trio.fail_after(10):
            while part := await stream.receive_some():
                data += part
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert split_events(rest) == sim.streams[0].payloads
    assert sim.streams[0].completed


def test_cli_busy_port_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["--listen", f"127.0.0.1:{port}"]) == 1
    assert "cannot listen" in capsys.readouterr().err


async def test_cli_serves_until_interrupted() -> None:
    process = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "gateway.sim",
            "--listen",
            "127.0.0.1:0",
            "--chunks",
            "2",
            "--models",
            "a,b",
        ],
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(10):
            while not line.endswith(b"\n"):
                part = await process.stdout.receive_some()
                assert part, line
                line += part
        text = line.decode().strip()
        assert text.startswith("sim listening on http://127.0.0.1:") and text.endswith("/v1")
        url = text.removeprefix("sim listening on ")
        async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
            models = (await client.get("/models")).json()
            assert [m["id"] for m in models["data"]] == ["a", "b"]
            _, raw = await stream_raw(client, {"model": "b", "stream": True})
            assert content_of(chunks_of(split_events(raw))) == "tok0 tok1 "
        process.send_signal(signal.SIGINT)
        with trio.fail_after(5):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


# -- a realistic backend: n choices, max_tokens, its own port ----------------------------------


async def test_n_choices_in_every_chunk(client: httpx.AsyncClient) -> None:
    _, raw = await stream_raw(client, body(stream=True, n=3, sim={"chunks": 2}))
    chunks = chunks_of(split_events(raw))
    assert len(chunks) == 4  # role, two tokens, finish
    for chunk in chunks:
        assert [c["index"] for c in chunk["choices"]] == [0, 1, 2]
    for i in range(3):
        text = "".join(c["choices"][i]["delta"].get("content") or "" for c in chunks)
        assert text == "tok0 tok1 "
    assert [c["finish_reason"] for c in chunks[-1]["choices"]] == ["stop"] * 3
    whole = (await client.post("/chat/completions", json=body(n=2, sim={"chunks": 2}))).json()
    assert [(c["index"], c["message"]["content"]) for c in whole["choices"]] == [
        (0, "tok0 tok1 "),
        (1, "tok0 tok1 "),
    ]
    assert whole["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_max_tokens_cuts_the_reply_with_finish_reason_length(
    client: httpx.AsyncClient, field: str
) -> None:
    _, raw = await stream_raw(client, body(stream=True, sim={"chunks": 8}, **{field: 3}))
    chunks = chunks_of(split_events(raw))
    assert content_of(chunks) == "tok0 tok1 tok2 "
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = await client.post("/chat/completions", json=body(sim={"chunks": 8}, **{field: 3}))
    choice = whole.json()["choices"][0]
    assert choice["message"]["content"] == "tok0 tok1 tok2 " and choice["finish_reason"] == "length"
    assert whole.json()["usage"]["completion_tokens"] == 3
    # enough room: the whole reply, "stop"
    _, raw = await stream_raw(client, body(stream=True, sim={"chunks": 2}, **{field: 5}))
    assert chunks_of(split_events(raw))[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("dialect", ["ollama", "vllm", "llamacpp", "litellm"])
async def test_max_tokens_in_every_dialect(client: httpx.AsyncClient, dialect: str) -> None:
    payload = body(stream=True, max_tokens=2, sim={"chunks": 5, "dialect": dialect})
    _, raw = await stream_raw(client, payload)
    chunks = chunks_of(split_events(raw))
    assert content_of(chunks) == "tok0 tok1 "
    reasons = [c["finish_reason"] for ch in chunks for c in ch["choices"] if c.get("finish_reason")]
    assert reasons == ["length"]


@pytest.mark.parametrize("bad", [{"n": 0}, {"n": "2"}, {"max_tokens": 0}, {"max_tokens": True}])
async def test_bad_n_or_max_tokens_is_a_400(client: httpx.AsyncClient, bad: dict[str, Any]) -> None:
    response = await client.post("/chat/completions", json=body(**bad))
    assert_error(response, 400)
    assert response.json()["error"]["param"] == next(iter(bad))


def test_cli_help_shows_the_defaults_and_its_own_port(capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.runner.discovery import LOCAL_SERVERS
    from gateway.sim.cli import DEFAULT_LISTEN

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in (
        f"HOST:PORT to bind (default {DEFAULT_LISTEN})",
        "content chunks per reply (default 8)",
        "seconds between chunks (default 0.0)",
        "chunks before the fault (default 2)",
        "(default openai)",
        "(default sim-model)",
    ):
        assert shown in text, shown
    port = DEFAULT_LISTEN.rsplit(":", 1)[1]
    assert port == "8789"
    others = [kind for kind, url in LOCAL_SERVERS if f":{port}/" in url]
    assert others == ["alp-gateway sim"]  # doctor names it as what it is, not as vLLM


# -- the deterministic continuation mode ----------------------------------------------------


async def _answer(client: httpx.AsyncClient, messages: list[Any], stream: bool, **sim: Any) -> str:
    payload = {"model": MODEL, "messages": messages, "stream": stream, "sim": sim}
    if not stream:
        whole = await client.post("/chat/completions", json=payload)
        return str(whole.json()["choices"][0]["message"]["content"])
    _, raw = await stream_raw(client, payload)
    chunks = chunks_of(split_events(raw))
    roles = [c for ch in chunks for c in ch["choices"] if "role" in c["delta"]]
    assert len(roles) == 1  # a continuation is an answer of its own: one role delta
    return content_of(chunks)


@pytest.mark.parametrize("words", ["tok", "conversation"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_answer_so_far_plus_continuation_is_the_undisturbed_answer(
    client: httpx.AsyncClient, words: str, stream: bool
) -> None:
    """A request ending with the start of its answer as an assistant message gets exactly the
    rest, wherever the cut (mid-token included), so the two parts make the undisturbed answer."""
    conversation = [{"role": "user", "content": "hello there"}]
    whole = await _answer(client, conversation, stream, chunks=7, words=words)
    assert whole == await _answer(client, conversation, stream, chunks=7, words=words)
    for cut in range(len(whole) + 1):
        so_far = [*conversation, {"role": "assistant", "content": whole[:cut]}]
        rest = await _answer(client, so_far, stream, chunks=7, words=words)
        assert whole[:cut] + rest == whole, cut


async def test_conversation_words_are_the_conversations_own(client: httpx.AsyncClient) -> None:
    one = [{"role": "user", "content": "hello there"}]
    two = [{"role": "user", "content": "something else"}]
    a = await _answer(client, one, True, chunks=12, words="conversation")
    b = await _answer(client, two, True, chunks=12, words="conversation")
    assert a != b and len(a.split()) == len(b.split()) == 12
    assert a == await _answer(client, one, False, chunks=12, words="conversation")


async def test_a_prefill_that_is_not_the_answer_is_followed_by_the_whole_answer(
    client: httpx.AsyncClient,
) -> None:
    other = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: "}]
    assert await _answer(client, other, True, chunks=3) == "tok0 tok1 tok2 "


async def test_max_tokens_cuts_a_continuation_too(client: httpx.AsyncClient) -> None:
    so_far = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "tok0 to"}]
    payload = {"model": MODEL, "messages": so_far, "max_tokens": 2, "sim": {"chunks": 6}}
    choice = (await client.post("/chat/completions", json=payload)).json()["choices"][0]
    assert choice["message"]["content"] == "k1 tok2 " and choice["finish_reason"] == "length"


async def test_max_tokens_whole_reply_waits_only_for_its_own_tokens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue 31 point 12: ``max_tokens: 2`` non-streamed waits for 2 tokens, not all 50."""
    async with open_sim() as sim, httpx.AsyncClient(base_url=sim.url, trust_env=False) as client:
        started = trio.current_time()
        payload = body(max_tokens=2, sim={"chunks": 50, "interval": 1.0})
        reply = await client.post("/chat/completions", json=payload)
        took = trio.current_time() - started
    assert reply.json()["choices"][0]["message"]["content"] == "tok0 tok1 "
    assert took == pytest.approx(2.0, abs=0.5)  # 2 tokens of 1 s each; all 50 would be 50 s


def test_bad_words_option_is_refused() -> None:
    with pytest.raises(ValueError, match="words"):
        SimOptions(words="lorem")
