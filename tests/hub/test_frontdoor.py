"""The hub's OpenAI-compatible front door, driven by the official openai client over real loopback sockets."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import openai
import pytest
import trio
from fake_runner import SLOW, TOOL_ARGUMENTS, FakeRunner, Script, stream_chunks

from gateway.apis import shapes
from gateway.hub import Hub, open_hub
from gateway.hub.store import StoredSession

MESSAGES = [{"role": "user", "content": "hello"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
LIMIT = 10  # s: no single step of a test may take longer


@dataclass
class Env:
    hub: Hub
    base: str
    key: str
    runner: FakeRunner

    def client(self, session: str | None = None, key: str | None = None) -> openai.AsyncOpenAI:
        headers = {"X-Chat-Session": session} if session else None
        return openai.AsyncOpenAI(
            base_url=self.base + "/v1",
            api_key=key or self.key,
            max_retries=0,
            timeout=LIMIT,
            default_headers=headers,
        )

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base, headers={"Authorization": f"Bearer {self.key}"}, timeout=LIMIT
        )


# what the runner lists (the hub asks every runner): every model the tests script
LISTED = [
    "fake-model",
    "fake-tools",
    "fake-error",
    "fake-error-late",
    "fake-slow",
    "fake-streams-anyway",
    "fake-tools-anyway",
    "fake-gated",
]


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    hub = Hub(runner_wait_timeout=5.0, keepalive_interval=5.0, resume_within=0.5)
    async with open_hub(hub) as (hub, base):
        key = await hub.keys.create("tester")
        runner = FakeRunner(
            base,
            hub.admin_token,
            scripts={
                "fake-tools": Script(tool_calls=True),
                "fake-error": Script(error_before="backend returned 500: boom"),
                "fake-error-late": Script(error_after="backend returned 500: late boom"),
                "fake-slow": SLOW,
                "fake-streams-anyway": Script(chunks=4, stream_anyway=True),
                "fake-tools-anyway": Script(tool_calls=True, stream_anyway=True),
            },
            models=LISTED,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            yield Env(hub, base, key, runner)
            nursery.cancel_scope.cancel()


def _text(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


async def _stream(client: openai.AsyncOpenAI, model: str = "fake-model", **kw: Any) -> list[Any]:
    stream = await client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **kw)
    return [chunk async for chunk in stream]


# -- streaming and non-streaming ------------------------------------------------------


async def test_streaming_turn(env: Env) -> None:
    async with env.client() as client:
        with trio.fail_after(LIMIT):
            chunks = await _stream(client)
    assert _text(chunks) == "tok0tok1tok2"
    assert chunks[-1].choices[0].finish_reason == "stop"
    (turn,) = env.runner.turns.values()
    assert turn.body["messages"] == MESSAGES and turn.body["stream"] is True


async def test_non_streaming_turn(env: Env) -> None:
    async with env.client() as client:
        with trio.fail_after(LIMIT):
            done = await client.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert done.object == "chat.completion"
    assert done.choices[0].message.content == "tok0tok1tok2"
    assert done.usage is not None and done.usage.total_tokens == 8


async def test_non_streaming_aggregates_streamed_chunks(env: Env) -> None:
    async with env.client() as client:
        with trio.fail_after(LIMIT):
            text = await client.chat.completions.create(
                model="fake-streams-anyway", messages=MESSAGES
            )
            tools = await client.chat.completions.create(
                model="fake-tools-anyway", messages=MESSAGES, tools=[WEATHER_TOOL]
            )
    assert text.object == "chat.completion"
    assert text.choices[0].message.content == "tok0tok1tok2tok3"
    assert text.choices[0].finish_reason == "stop"
    call = tools.choices[0].message.tool_calls[0]
    assert (call.id, call.type, call.function.name) == ("call_fake1", "function", "get_weather")
    assert call.function.arguments == "".join(TOOL_ARGUMENTS)
    assert tools.choices[0].finish_reason == "tool_calls"


async def test_tool_calls_stream_intact(env: Env) -> None:
    async with env.client() as client:
        with trio.fail_after(LIMIT):
            chunks = await _stream(client, "fake-tools", tools=[WEATHER_TOOL])
    deltas = [
        c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls
    ]
    first = deltas[0][0]
    assert (first.index, first.id, first.type, first.function.name) == (
        0,
        "call_fake1",
        "function",
        "get_weather",
    )
    arguments = "".join(d[0].function.arguments or "" for d in deltas)
    assert json.loads(arguments) == {"city": "Paris", "unit": "c"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    (turn,) = env.runner.turns.values()
    assert turn.body["tools"] == [WEATHER_TOOL]


async def test_usage_chunk_arrives(env: Env) -> None:
    async with env.client() as client:
        with trio.fail_after(LIMIT):
            chunks = await _stream(client, stream_options={"include_usage": True})
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None and last.usage.total_tokens == 8
    assert _text(chunks) == "tok0tok1tok2"


async def test_chunks_relayed_verbatim_with_keepalive_first(env: Env) -> None:
    env.hub.settings.keepalive_interval = 0.05
    gate = trio.Event()
    env.runner.scripts["fake-gated"] = Script(gate=gate)
    body = {"model": "fake-gated", "messages": MESSAGES, "stream": True}
    received = b""
    async with env.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        with trio.fail_after(LIMIT):
            async for data in reply.aiter_raw():
                received += data
                if b": keepalive\n\n" in received and not gate.is_set():
                    gate.set()
        assert received.startswith(b": keepalive\n\n")
    assert received.endswith(b"data: [DONE]\n\n")
    payloads = [line[6:] for line in received.split(b"\n") if line.startswith(b"data: ")]
    # the runner's own bytes (json.dumps spacing), never re-encoded by the hub
    expected = [json.dumps(c).encode() for c in stream_chunks(body, Script())]
    assert payloads == [*expected, b"[DONE]"]


# -- errors from the runner -----------------------------------------------------------


async def test_runner_error_before_first_chunk_is_502(env: Env) -> None:
    async with env.client() as client:
        with trio.fail_after(LIMIT):
            with pytest.raises(openai.InternalServerError) as streamed:
                await _stream(client, "fake-error")
            with pytest.raises(openai.InternalServerError) as whole:
                await client.chat.completions.create(model="fake-error", messages=MESSAGES)
    for caught in (streamed.value, whole.value):
        assert caught.status_code == 502
        assert caught.body["type"] == "upstream_error"
        assert caught.body["message"] == "backend returned 500: boom"


async def test_runner_error_after_first_chunk_is_an_error_event(env: Env) -> None:
    received: list[Any] = []
    async with env.client() as client:
        with trio.fail_after(LIMIT):
            stream = await client.chat.completions.create(
                model="fake-error-late", messages=MESSAGES, stream=True
            )
            with pytest.raises(openai.APIError) as caught:
                async for chunk in stream:
                    received.append(chunk)
    assert _text(received) == "tok0"
    assert caught.value.message == "backend returned 500: late boom"
    assert caught.value.body["type"] == "upstream_error"


async def test_channel_lost_mid_stream_with_a_runner_that_cannot_resume_is_continued(
    env: Env,
) -> None:
    """The fake runner redials but knows no resume: after ``resume_within`` the answer so far
    is continued (on a new job: the old one is cancelled) and the client sees one answer."""
    received: list[Any] = []
    env.runner.scripts["fake-slow"] = Script(chunks=3, pace=0.3)  # short, paced
    async with env.client() as client:
        with trio.fail_after(LIMIT):
            stream = await client.chat.completions.create(
                model="fake-slow", messages=MESSAGES, stream=True
            )
            async for chunk in stream:
                received.append(chunk)
                if len(received) == 1:
                    (job_id,) = env.runner.claimed
                    await env.hub.channels.get(job_id).close(1011)
            chunks = await _stream(client)  # the session goes on, on the continuation's job
    assert _text(received) == "tok0tok1tok2" and received[-1].choices[0].finish_reason == "stop"
    assert len({c.id for c in received}) == 1
    assert env.hub.counters.turns_continued == 1 and env.hub.counters.turns_resumed == 0
    assert env.runner.dials[job_id] == 2 and len(env.runner.claimed) == 2
    so_far = list(env.runner.turns.values())[-2].body["messages"][-1]  # what the client had
    assert so_far["role"] == "assistant" and "tok0tok1tok2".startswith(so_far["content"])
    assert so_far["content"].startswith("tok0")
    assert _text(chunks) == "tok0tok1tok2"


async def test_channel_lost_before_a_whole_answer_is_served_after_the_redial(env: Env) -> None:
    """Nothing had reached the client: the turn goes again on the redialled channel, no error."""
    gate = trio.Event()
    env.runner.scripts["fake-gated"] = Script(gate=gate)
    async with env.client() as client:
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:

                async def drop_when_started() -> None:
                    await env.runner.wait_until(lambda: bool(env.runner.turns))
                    (job_id,) = env.runner.claimed
                    await env.hub.channels.get(job_id).close(1011)
                    await env.runner.wait_until(lambda: len(env.runner.turns) == 2)
                    gate.set()

                nursery.start_soon(drop_when_started)
                done = await client.chat.completions.create(model="fake-gated", messages=MESSAGES)
    assert done.choices[0].message.content == "tok0tok1tok2"
    (job_id,) = env.runner.claimed
    assert env.runner.dials[job_id] == 2
    first, second = env.runner.turns.values()
    assert first.body == second.body
    assert env.hub.counters.failovers == 0  # the same job served it: no new job


def test_pretty_printed_chunk_becomes_multi_line_event() -> None:
    event = shapes.sse_data(msgspec.Raw(b'{\n  "a": 1\r\n}'))
    assert event == b'data: {\ndata:   "a": 1\ndata: }\n\n'
    assert shapes.sse_data(msgspec.Raw(b'{"a":1}')) == b'data: {"a":1}\n\n'


def test_aggregate_chunks_folds_deltas() -> None:
    body = {"model": "m", "stream_options": {"include_usage": True}}
    chunks = [json.dumps(c).encode() for c in stream_chunks(body, Script(tool_calls=True))]
    done = shapes.aggregate_chunks(chunks)
    assert done["object"] == "chat.completion" and done["model"] == "m"
    (choice,) = done["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"] == [
        {
            "id": "call_fake1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": "".join(TOOL_ARGUMENTS)},
        }
    ]
    assert done["usage"]["total_tokens"] == 8


# -- sessions -------------------------------------------------------------------------


async def test_two_sessions_interleaved(env: Env) -> None:
    gate = trio.Event()
    env.runner.scripts["fake-gated"] = Script(gate=gate)
    results: dict[str, str] = {}
    async with env.client("a") as a, env.client("b") as b:

        async def held_turn() -> None:
            results["a1"] = _text(await _stream(a, "fake-gated"))

        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(held_turn)
                await env.runner.wait_until(lambda: len(env.runner.turns) == 1)
                results["b1"] = _text(await _stream(b))  # while a's first turn is still running
                results["b2"] = _text(await _stream(b))
                gate.set()
            results["a2"] = _text(await _stream(a))
    assert results == {k: "tok0tok1tok2" for k in ("a1", "b1", "b2", "a2")}
    jobs = env.hub.sessions.listing()
    job_a, job_b = jobs[("tester", "a")], jobs[("tester", "b")]
    assert job_a != job_b and sorted(env.runner.claimed) == sorted([job_a, job_b])
    assert len(env.runner.turns_of(job_a)) == 2 and len(env.runner.turns_of(job_b)) == 2


async def test_concurrent_first_requests_open_one_job(env: Env) -> None:
    results: list[str] = []
    async with env.client("same") as client:

        async def turn() -> None:
            results.append(_text(await _stream(client)))

        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(turn)
    assert results == ["tok0tok1tok2"] * 3
    assert len(env.runner.claimed) == 1
    assert len([j for j in await env.hub.board.all_jobs.values() if j.owner == "local"]) == 1


async def test_idle_session_gets_chat_end(env: Env) -> None:
    env.hub.settings.session_idle_timeout = 0.2
    async with env.client() as client:
        with trio.fail_after(LIMIT):
            await _stream(client)
            (job_id,) = env.runner.claimed
            await env.runner.wait_until(lambda: bool(env.runner.ends))
            assert env.runner.ends == [(job_id, "idle")]
            assert env.hub.sessions.listing() == {}
            await _stream(client)  # the next request opens a new job
    assert len(env.runner.claimed) == 2


async def test_session_ended_by_runner_is_forgotten(env: Env) -> None:
    async with env.client() as client:
        with trio.fail_after(LIMIT):
            await _stream(client)
            (job_id,) = env.runner.claimed
            await env.runner.end_session(job_id)
            await (await env.hub.board.all_jobs.get(job_id)).completed.wait()
            chunks = await _stream(client)
    assert _text(chunks) == "tok0tok1tok2"
    assert len(env.runner.claimed) == 2 and env.runner.claimed[0] == job_id


async def test_client_disconnect_cancels_the_turn(env: Env) -> None:
    async with env.client() as client:
        with trio.fail_after(LIMIT):
            stream = await client.chat.completions.create(
                model="fake-slow", messages=MESSAGES, stream=True
            )
            async for _chunk in stream:
                break
            await stream.close()
            await env.runner.wait_until(lambda: bool(env.runner.cancels))
            (turn,) = env.runner.turns.values()
            await turn.finished.wait()
    assert env.runner.cancels == [turn.request_id]
    assert turn.cancelled.is_set() and turn.sent_chunks < SLOW.chunks


async def test_a_non_streamed_turns_client_leaving_cancels_the_turn(env: Env) -> None:
    # a non-streamed turn's task is parked (``gateway.wire.park``) while the runner answers:
    # its client's socket is still watched, and its leaving ends the turn and cancels it
    async with env.client() as client:

        async def ask() -> None:
            await client.chat.completions.create(model="fake-slow", messages=MESSAGES)

        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                await env.runner.wait_until(lambda: bool(env.runner.turns))
                nursery.cancel_scope.cancel()  # the client closes its connection
            await env.runner.wait_until(lambda: bool(env.runner.cancels))
            (turn,) = env.runner.turns.values()
            await turn.finished.wait()
    assert env.runner.cancels == [turn.request_id]
    assert turn.cancelled.is_set() and turn.sent_chunks < SLOW.chunks


async def test_no_runner_is_503(env: Env) -> None:
    # no runner of the key's project at all: answered at once (tests/hub/test_causes.py has the rest)
    env.hub.settings.runner_wait_timeout = 30
    lonely = await env.hub.keys.create("lonely", "nobody/here")
    async with env.client(key=lonely) as client:
        with trio.fail_after(LIMIT):
            started = trio.current_time()
            with pytest.raises(openai.APIStatusError) as caught:
                await _stream(client)
            elapsed = trio.current_time() - started
    assert caught.value.status_code == 503 and caught.value.body["code"] == "no_runner"
    assert caught.value.body["message"] == (  # the hint names this hub as the runner's Server
        "no runner is connected for project nobody/here: start one with "
        f"`alp-gateway run --server {env.base} --project nobody/here`"
    )
    assert elapsed < 3
    # concurrent first requests of one session share one wait and one answer
    statuses: list[int] = []
    async with env.client(key=lonely) as client:

        async def turn() -> None:
            with pytest.raises(openai.APIStatusError) as caught:
                await _stream(client)
            statuses.append(caught.value.status_code)

        with trio.fail_after(LIMIT):
            started = trio.current_time()
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(turn)
            elapsed = trio.current_time() - started
    assert statuses == [503] * 3 and elapsed < 3
    assert not [
        j for j in await env.hub.board.all_jobs.values() if j.owner == "nobody"
    ]  # the job was withdrawn


# -- /v1/models -----------------------------------------------------------------------


async def test_models_lists_open_channels_deduplicated(env: Env) -> None:
    async with env.client("a") as a, env.client("b") as b:
        with trio.fail_after(LIMIT):
            await _stream(a)
            await _stream(b)
            listed = await a.models.list()
            one = await a.models.retrieve("fake-tools")
            with pytest.raises(openai.NotFoundError):
                await a.models.retrieve("no-such-model")
    assert [m.id for m in listed.data] == LISTED
    assert {(m.object, m.owned_by) for m in listed.data} == {("model", "alp-runner")}
    assert env.runner.models_requests == 2  # each channel asked once, as it opened
    assert one.id == "fake-tools"


async def test_models_without_a_session_open_a_listing_session(env: Env) -> None:
    # a fresh hub, a runner polling, no chat session: the first call lists through a short
    # Chat Job (chat.models.request, then chat.end); the next ones answer from the store
    async with env.client() as client:
        with trio.fail_after(LIMIT):
            listed = await client.models.list()
            one = await client.models.retrieve("fake-tools")
            with pytest.raises(openai.NotFoundError) as missing:
                await client.models.retrieve("no-such-model")
            again = await client.models.list()
            (job_id,) = env.runner.claimed
            await env.runner.wait_until(lambda: bool(env.runner.ends))
    assert [m.id for m in listed.data] == LISTED
    assert [m.id for m in again.data] == LISTED and one.id == "fake-tools"
    assert missing.value.body["code"] == "model_not_found"
    assert env.runner.models_requests == 1  # one listing session; the rest came from the store
    assert env.runner.ends == [(job_id, "models listed")]
    assert (await env.hub.board.all_jobs.get(job_id)).cancelled and env.hub.sessions.listing() == {}
    (stored,) = await env.hub.store.load_models("local", "chat")
    assert stored.runner_id == env.runner.runner_id
    assert stored.models == tuple(LISTED)


async def test_models_forget_runners_not_seen_recently(env: Env) -> None:
    from gateway.hub.store import ModelList

    # the last answer of a runner this hub has not seen (gone, or before a restart) is not used
    await env.hub.store.save_models(ModelList("gone-runner", "local", "chat", ("old-model",), 1.0))
    async with env.client() as client:
        with trio.fail_after(LIMIT):
            listed = await client.models.list()
    assert [m.id for m in listed.data] == LISTED
    assert env.runner.models_requests == 1


async def test_models_with_no_runner_is_an_error_naming_the_cause(env: Env) -> None:
    env.hub.settings.models_wait = 30
    lonely = await env.hub.keys.create("lonely", "nobody/here")
    async with env.client(key=lonely) as client:
        with trio.fail_after(LIMIT), pytest.raises(openai.APIStatusError) as caught:
            await client.models.list()
    assert caught.value.status_code == 503
    assert caught.value.body == {
        "message": "no runner is connected for project nobody/here to list models: start one "
        f"with `alp-gateway run --server {env.base} --project nobody/here`",
        "type": "service_unavailable",
        "param": None,
        "code": "no_runner",
    }
    assert not [
        j for j in await env.hub.board.all_jobs.values() if j.owner == "nobody"
    ]  # withdrawn


# -- request errors -------------------------------------------------------------------


async def test_bad_requests_are_400(env: Env) -> None:
    bodies = [
        b'{"messages": [',
        b"[1, 2]",
        b'{"messages": "hi"}',
        b'{"model": "x"}',
        b"",
        b'{"messages": [], "stream": 1}',
    ]
    async with env.http() as http:
        for body in bodies:
            reply = await http.post("/v1/chat/completions", content=body)
            assert reply.status_code == 400, body
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"], body
    assert env.runner.claimed == []


async def test_oversized_body_is_413(env: Env) -> None:
    env.hub.settings.max_body = 1000
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "x" * 2000}]}
    async with env.http() as http:
        reply = await http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "request_too_large"


async def test_missing_or_invalid_key_is_401(env: Env) -> None:
    async with httpx.AsyncClient(base_url=env.base, timeout=LIMIT) as http:
        reply = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert reply.status_code == 401
    assert reply.json()["error"]["code"] == "invalid_api_key"
    async with env.client(key="alpk_not-a-key") as client:
        with pytest.raises(openai.AuthenticationError) as caught:
            await client.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"


async def test_unknown_path_404_wrong_method_405(env: Env) -> None:
    async with env.http() as http:
        missing = await http.post("/v1/audio/speech", json={})
        wrong = await http.get("/v1/chat/completions")
        wrong_models = await http.post("/v1/models", json={})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong_models.status_code == 405 and wrong_models.headers["allow"] == "GET"


async def test_unexpected_error_is_a_short_500(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*_args: Any) -> list[str]:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(env.hub.catalog, "listing", broken)
    async with env.http() as http:
        reply = await http.get("/v1/models")
    assert reply.status_code == 500
    error = reply.json()["error"]
    assert (
        error["type"] == "server_error"
        and "secret" not in reply.text
        and "Traceback" not in reply.text
    )


# -- sessions across a hub restart ----------------------------------------------------------------


async def test_sessions_restored_after_a_restart(tmp_path: Any) -> None:
    data = tmp_path / "hub"
    first = Hub(data)
    caps = ["chat-llm:v1"]

    async def claimed(origin: str) -> Any:
        job = await first.board.enqueue("local", "chat", caps, origin=origin)
        job.claimed_by, job.run_id = "runner-1", "run-1"
        await first.board.save(job)
        return job

    live, orphan, done, api_job = [
        await claimed(o) for o in ("frontdoor", "frontdoor", "frontdoor", "api")
    ]
    unclaimed = await first.board.enqueue("local", "chat", caps, origin="frontdoor")
    done.status, done.conclusion = "completed", "success"
    await first.board.save(done)
    await first.store.save_session(StoredSession("tester", "s", "local", "chat", live.id))
    await first.store.save_session(StoredSession("tester", "old", "local", "chat", done.id))
    await first.store.close()

    second = Hub(data)
    async with open_hub(second):
        assert second.sessions.listing() == {("tester", "s"): live.id}
        # the claimed jobs' runners are expected to redial: their sessions wait for that first
        assert second.channels.restored_at is not None
        assert second.channels.awaited == {live.id, api_job.id}
        assert [(s.session_id, s.job_id) for s in await second.store.load_sessions()] == [
            ("s", live.id)
        ]
        # a front-door job no session points at lost its client: withdrawn, its redial refused
        assert (
            await second.board.all_jobs.get(orphan.id)
        ).cancelled and unclaimed.id not in await second.board.all_jobs.ids()
        assert (
            not (await second.board.all_jobs.get(live.id)).cancelled
            and not (await second.board.all_jobs.get(api_job.id)).cancelled
        )
    await second.store.close()
    third = Hub(data)
    assert (
        await third.board.all_jobs.get(orphan.id)
    ).cancelled and unclaimed.id not in await third.board.all_jobs.ids()
    await third.store.close()


async def test_session_mapping_is_stored_and_follows_the_job(env: Env) -> None:
    async def stored() -> list[tuple[str, str, str]]:
        return [(s.key_name, s.session_id, s.job_id) for s in await env.hub.store.load_sessions()]

    async with env.client("persisted") as client:
        with trio.fail_after(LIMIT):
            await _stream(client)
            (first,) = env.runner.claimed
            assert await stored() == [("tester", "persisted", first)]
            await env.runner.end_session(first)  # the runner ends it: the next turn opens a job
            await (await env.hub.board.all_jobs.get(first)).completed.wait()
            await _stream(client)
    second = env.runner.claimed[1]
    assert second != first and await stored() == [("tester", "persisted", second)]
