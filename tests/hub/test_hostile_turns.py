"""The hub against a hostile key holder and a hostile runner (issue 30, rows 2, 4, 5, 6, 8, 9, 10),
over loopback sockets to an in-process hub: the key holder is a plain HTTP client, the runner the
fake runner of tests/support/fake_runner.py answering with frames the test scripts (``Script.play``).

- a client that reads part of an answer and leaves, or a runner that fails midway, is charged
  what the client got (a token a chunk, its prompt estimated, the row marked ``estimated``, and
  so is ``/api/hub/usage``), and its key's token limits bite on it;
- token limits hold what the turns in flight may use: six turns at once on ``tpm 20`` overshoot
  it by one turn's reservation at most;
- a non-streamed answer of many 1 MiB chunks is gathered up to ``max_body`` bytes, then the client
  gets a clean error in its API's shape at once;
- one 4 MiB chunk then ``done`` to a fast client: the whole answer, nothing after the body's end,
  no traceback;
- a model a client made up is a metrics label and a stored row only as ``unlisted``; one a runner
  listed with a terminal's escape sequences in its name is printed escaped by ``hub usage``;
- a session id over 200 characters is a 400 in the caller's shape, in every API and in Claude
  Code's header;
- a runner's usage numbers that are not token counts (negative, past any count) are not taken.

trio's autojump clock: time moves only when every task waits (a hang guard, never a timing).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from fake_runner import CONTENT_MODEL, FakeRunner, Script, Turn
from rawclient import RawConn, bearer, request
from test_causes import ADMIN, GUARD, MESSAGES, OWNER, PROJECT, error_of, hub_of
from test_key_limits import Ended

from gateway.hub import Hub, open_hub
from gateway.hub.catalog import MAX_LABEL, UNLISTED
from gateway.hub.cli import main as hub_main
from gateway.wire import protocol

MiB = 1 << 20
Send = Callable[[str], Awaitable[None]]


@asynccontextmanager
async def served(
    data: Path | None = None,
    scripts: dict[str, Script] | None = None,
    lists_models: bool = True,
    models: tuple[str, ...] | None = None,
    **settings: Any,
) -> AsyncIterator[tuple[Hub, str, FakeRunner, Ended]]:
    """A hub and one fake runner of its project (``scripts`` by model; else 3 chunks and the
    backend's usage)."""
    async with open_hub(hub_of(data, **settings)) as (hub, url):
        runner = FakeRunner(
            url,
            ADMIN,
            owner=OWNER,
            project=PROJECT,
            scripts=scripts,
            default=Script(usage=True),
            poll_interval=2.0,
            lists_models=lists_models,
            models=models,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            yield hub, url, runner, Ended(hub)
            nursery.cancel_scope.cancel()


class Records(logging.Handler):
    """Every log record at WARNING or above, and any with a traceback."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING or record.exc_info is not None:
            self.records.append(record)

    def bad(self) -> list[str]:
        return [
            f"{r.levelname} {r.name}: {r.getMessage()}"
            for r in self.records
            if r.levelno >= logging.ERROR or r.exc_info is not None
        ]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    root = logging.getLogger()
    saved = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(saved)


def chunk_json(turn: Turn, content: str) -> bytes:
    """One ``chat.completion.chunk`` of ``content``, as a backend sends it."""
    return json.dumps(
        {
            "id": "chatcmpl-hostile",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": turn.body.get("model") or CONTENT_MODEL,
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
        }
    ).encode()


def usage_json(turn: Turn, prompt: Any, completion: Any) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-hostile",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": turn.body.get("model") or CONTENT_MODEL,
            "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion},
        }
    ).encode()


def headers(key: str, session: str | None = None) -> dict[str, str]:
    out = {"Authorization": f"Bearer {key}"}
    if session is not None:
        out["X-Chat-Session"] = session
    return out


async def post(url: str, path: str, body: Any, head: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
        return await http.post(path, json=body, headers=head)


# -- row 2: every token delivered is charged ------------------------------------------------------


async def read_then_leave(url: str, key: str, model: str, events: int, session: str) -> int:
    """A streamed turn whose client reads ``events`` content events and closes its connection:
    how many it read."""
    body = {"model": model, "messages": MESSAGES, "stream": True}
    read = 0
    async with (
        httpx.AsyncClient(base_url=url, timeout=GUARD) as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers=headers(key, session)) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                read += 1
                if read == events:
                    break
    return read


async def test_a_client_that_reads_part_of_an_answer_and_leaves_is_charged_what_it_got(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """Before: usage was taken only from the backend's last chunk, so 3 x 150 of 300 tokens read
    were 0 recorded and ``tokens_per_day 100`` never bit. Now the turn is charged a token a chunk
    delivered and its prompt estimated, marked estimated; the key's next turn is refused."""
    long = Script(chunks=300, pace=0.01, usage=True)
    async with served(tmp_path / "hub", {"long": long}) as (hub, url, _runner, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}", tokens_per_day=100)
        with trio.fail_after(GUARD):
            read = await read_then_leave(url, key, "long", 150, "s1")
            await ended.count(1)
            refused = await post(
                url, "/v1/chat/completions", {"model": "long", "messages": MESSAGES}, headers(key)
            )
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                hourly = await http.get(
                    "/api/hub/usage", headers={"Authorization": f"Bearer {ADMIN}"}
                )
        rows = await hub.store.usage_rows()
    assert read == 150
    ((row),) = rows
    assert row["outcome"] == "client_gone" and row["estimated"]
    assert 150 <= row["completion_tokens"] < 300  # what reached the client's socket
    assert row["prompt_tokens"] >= 1  # estimated: the backend never said
    # the admin API marks it too: one turn of the hour's, its tokens the hub's estimate
    ((hour),) = hourly.json()["usage"]
    assert hour["turns"] == 1 and hour["estimated"] == 1
    assert hour["completionTokens"] == row["completion_tokens"]
    assert refused.status_code == 429
    assert error_of(refused)["message"].startswith(
        f"this API key is limited to 100 tokens per day (tokens_per_day, UTC) and has used "
        f"{row['prompt_tokens'] + row['completion_tokens']} today"
    )


async def test_a_client_that_leaves_is_charged_what_it_got_on_postgresql_too(
    tmp_path: Path, pg_url: str
) -> None:
    """The same on a hub whose store is PostgreSQL (a team of one: its admission and its
    reservation go through the store): the turn read half and left is charged, estimated, and
    the key's next turn is refused."""
    long = Script(chunks=300, pace=0.002, usage=True)
    async with served(tmp_path / "hub", {"long": long}, store=pg_url) as (hub, url, _r, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}", tokens_per_day=100)
        with trio.fail_after(GUARD):
            read = await read_then_leave(url, key, "long", 150, "s1")
            await ended.count(1)
            refused = await post(
                url, "/v1/chat/completions", {"model": "long", "messages": MESSAGES}, headers(key)
            )
        rows = await hub.store.usage_rows()
    assert read == 150
    ((row),) = rows
    assert row["outcome"] == "client_gone" and row["estimated"]
    assert 150 <= row["completion_tokens"] < 300
    assert row["prompt_tokens"] >= 1
    assert refused.status_code == 429


def chunks_then_error(count: int) -> Callable[[Send, Turn], Awaitable[None]]:
    """``count`` content chunks, then the runner's error: no usage, no done."""

    async def play(send: Send, turn: Turn) -> None:
        frames = protocol.TurnFrames(turn.job_id, turn.request_id)
        for i in range(count):
            await send(frames.chunk(chunk_json(turn, f"t{i} ")).decode())
            turn.sent_chunks += 1
        await send(protocol.error_frame(turn.job_id, turn.request_id, "the backend died"))

    return play


async def test_a_turn_its_runner_fails_midway_is_charged_what_the_client_got(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """A runner that sends 50 chunks then an error (no usage ever): the client reads the 50 and
    one error event; the turn is charged 50 completion tokens and its prompt estimated, marked
    estimated, and counts against ``tokens_per_day``."""
    scripts = {"dies": Script(play=chunks_then_error(50))}
    async with served(tmp_path / "hub", scripts) as (hub, url, _runner, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}", tokens_per_day=40)
        body = {"model": "dies", "messages": MESSAGES, "stream": True}
        with trio.fail_after(GUARD):
            async with (
                httpx.AsyncClient(base_url=url, timeout=GUARD) as http,
                http.stream("POST", "/v1/chat/completions", json=body, headers=headers(key)) as r,
            ):
                assert r.status_code == 200
                events = [line async for line in r.aiter_lines() if line.startswith("data: {")]
            await ended.count(1)
            refused = await post(url, "/v1/chat/completions", body, headers(key))
        rows = await hub.store.usage_rows()
    assert len(events) == 51 and '"error"' in events[-1]
    ((row),) = rows
    assert row["outcome"] == "error" and row["estimated"]
    assert row["completion_tokens"] == 50 and row["prompt_tokens"] >= 1
    assert refused.status_code == 429


# -- row 9: token limits reserve what turns in flight may use -----------------------------------


def gated_with_usage(gate: trio.Event) -> Callable[[Send, Turn], Awaitable[None]]:
    """Once ``gate`` is set: one chunk, then the backend's usage (its prompt a token per 4
    characters, as the hub estimates it; one completion token), then done."""

    async def play(send: Send, turn: Turn) -> None:
        await gate.wait()
        frames = protocol.TurnFrames(turn.job_id, turn.request_id)
        prompt = -(-sum(len(m["content"]) for m in turn.body["messages"]) // 4)
        await send(frames.chunk(chunk_json(turn, "ok")).decode())
        await send(frames.chunk(usage_json(turn, prompt, 1)).decode())
        await send(protocol.done_frame(turn.job_id, turn.request_id))

    return play


@pytest.mark.parametrize(
    ("tpm", "max_tokens", "prompt", "admitted"),
    [(20, 10, "hi", 2), (20, None, "hi", 1), (2000, 1, "x" * 4000, 2)],
    ids=["max_tokens", "token_reservation", "long-prompt"],
)
async def test_six_turns_at_once_overshoot_a_token_limit_by_one_reservation_at_most(
    autojump_clock: trio.testing.MockClock,
    tpm: int,
    max_tokens: int | None,
    prompt: str,
    admitted: int,
) -> None:
    """Before: all six admitted (token limits looked only at ended turns): 48 tokens on ``tpm
    20``. Now each turn holds its prompt's estimate and its ``max_tokens`` (or
    ``token_reservation``) while in flight: what is admitted passes the limit by one turn's
    reservation at most, a long prompt with ``max_tokens: 1`` included."""
    gate = trio.Event()
    scripts = {"gated": Script(play=gated_with_usage(gate))}
    async with served(scripts=scripts) as (hub, url, runner, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}", tpm=tpm)
        body: dict[str, Any] = {"model": "gated", "messages": [{"role": "user", "content": prompt}]}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        replies: list[httpx.Response] = []
        reserved: list[int] = []

        async def one(i: int) -> None:
            replies.append(await post(url, "/v1/chat/completions", body, headers(key, f"s{i}")))

        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                for i in range(6):
                    nursery.start_soon(one, i)
                await runner.wait_until(lambda: len(replies) + len(runner.turns) == 6)
                reserved = [t.reserved for t in hub.accounting.in_flight.values()]
                gate.set()
            await ended.count(6)
    ok = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 429]
    assert len(ok) + len(refused) == 6 and len(ok) == len(reserved) == admitted
    assert all("held by turns in flight" in error_of(r)["message"] for r in refused)
    totals = hub.metrics.keys["k"]
    used = totals.prompt_tokens + totals.completion_tokens
    # each admitted while what was held stayed under the limit
    assert sum(reserved[:-1]) < tpm and used <= tpm + max(reserved)


# -- row 4: a non-streamed answer is gathered up to max_body ----------------------------------------


def many_mib_chunks(count: int) -> Callable[[Send, Turn], Awaitable[None]]:
    async def play(send: Send, turn: Turn) -> None:
        frames = protocol.TurnFrames(turn.job_id, turn.request_id)
        piece = frames.chunk(chunk_json(turn, "x" * MiB)).decode()
        for _ in range(count):
            await send(piece)
            turn.sent_chunks += 1
        await send(protocol.done_frame(turn.job_id, turn.request_id))

    return play


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
async def test_a_non_streamed_answer_of_150_mib_is_a_clean_error_past_max_body(
    autojump_clock: trio.testing.MockClock, records: Records, api: str
) -> None:
    """Before: the whole answer was gathered without a cap (RSS +145 MB, nothing to the client in
    30 s). Now it is gathered up to ``max_body`` (4 MiB here) and the client gets a 502
    ``answer_too_large`` in its API's shape at once; the runner is told to stop."""
    scripts = {"huge": Script(play=many_mib_chunks(150))}
    async with served(scripts=scripts, max_body=4 * MiB) as (hub, url, runner, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        path, body, head = {
            "chat": ("/v1/chat/completions", {"model": "huge", "messages": MESSAGES}, headers(key)),
            "messages": (
                "/v1/messages",
                {"model": "huge", "max_tokens": 10, "messages": MESSAGES},
                {"x-api-key": key, "anthropic-version": "2023-06-01"},
            ),
            "responses": ("/v1/responses", {"model": "huge", "input": "hi"}, headers(key)),
        }[api]
        with trio.fail_after(GUARD):
            started = trio.current_time()
            reply = await post(url, path, body, head)
            took = trio.current_time() - started
            await ended.count(1)
            (turn,) = runner.turns.values()
            await runner.wait_until(lambda: turn.finished.is_set())
    assert reply.status_code == 502, reply.text
    message = "the runner's answer is over 4194304 bytes, the hub's bound"
    if api == "messages":
        assert reply.json() == {"type": "error", "error": {"type": "api_error", "message": message}}
    else:
        assert error_of(reply) == {
            "message": message,
            "type": "upstream_error",
            "param": None,
            "code": "answer_too_large",
        }
    assert took < 5.0  # virtual seconds: at once, not after the whole answer
    assert turn.request_id in runner.cancels and turn.sent_chunks < 150
    assert records.bad() == []


# -- row 8: a 4 MiB chunk then done to a fast client -------------------------------------------------


class FastClient:
    """A streamed turn's client that reads as fast as it can over a raw socket, asking the hub to
    close the connection after the response: every byte it sent, to the end."""

    def __init__(self) -> None:
        self.url = self.key = ""
        self.got = b""
        self.chunk_read = trio.Event()  # the big chunk's event reached the client whole

    async def run(self, size: int) -> None:
        body = {"model": "big", "messages": MESSAGES, "stream": True}
        head = [bearer(self.key), ("Connection", "close")]
        conn = await RawConn.open(self.url)
        try:
            await conn.send(request("POST", "/v1/chat/completions", head, body))
            while await conn._fill():
                if len(conn.buf) > size and conn.buf.endswith(b"\n\n\r\n"):
                    self.chunk_read.set()
            self.got = bytes(conn.buf)
        finally:
            await conn.aclose()


def one_big_chunk_then_done(
    size: int, client: FastClient, apart: bool
) -> Callable[[Send, Turn], Awaitable[None]]:
    """A 4 MiB chunk, then ``done``: at once (one read of the hub's, or two), or ``apart`` once
    the client has read the chunk (two reads, the chunk written to the client alone first)."""

    async def play(send: Send, turn: Turn) -> None:
        frames = protocol.TurnFrames(turn.job_id, turn.request_id)
        await send(frames.chunk(chunk_json(turn, "y" * size)).decode())
        if apart:
            await client.chunk_read.wait()
        await send(protocol.done_frame(turn.job_id, turn.request_id))

    return play


@pytest.mark.parametrize("apart", [False, True], ids=["at-once", "apart"])
async def test_a_4_mib_chunk_then_done_to_a_fast_client_is_the_whole_answer_then_nothing(
    autojump_clock: trio.testing.MockClock, records: Records, apart: bool
) -> None:
    """Before: after the chunked body's end the client got one more chunk (``client_too_slow``)
    and the hub logged a traceback (h11's ``LocalProtocolError``). Now a client that reads gets
    the chunk, ``[DONE]`` and the body's end, and nothing after it; the turn is ok."""
    size = 4 * MiB
    client = FastClient()
    scripts = {"big": Script(play=one_big_chunk_then_done(size, client, apart))}
    async with served(scripts=scripts) as (hub, url, _runner, ended):
        client.url, client.key = url, await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        with trio.fail_after(GUARD):
            await client.run(size)
            await ended.count(1)
    head, _, body = client.got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"transfer-encoding: chunked" in head.lower()
    events = []
    while body:  # the chunked framing, read strictly: nothing may follow its last chunk
        size_line, _, body = body.partition(b"\r\n")
        n = int(size_line, 16)
        if n == 0:
            assert body == b"\r\n", body[:200]
            break
        events.append(body[:n])
        assert body[n : n + 2] == b"\r\n"
        body = body[n + 2 :]
    text = b"".join(events)
    assert text.count(b"data: ") == 2, text[-300:]
    assert text.endswith(b"data: [DONE]\n\n"), text[-300:]
    assert b"y" * size in text and b"client_too_slow" not in text
    assert hub.metrics.turns[("k", "big", "ok")] == 1
    assert records.bad() == []


# -- a runner's usage numbers ----------------------------------------------------------------------


def usage_says(prompt: Any, completion: Any) -> Callable[[Send, Turn], Awaitable[None]]:
    async def play(send: Send, turn: Turn) -> None:
        frames = protocol.TurnFrames(turn.job_id, turn.request_id)
        await send(frames.chunk(chunk_json(turn, "a")).decode())
        await send(frames.chunk(chunk_json(turn, "b")).decode())
        await send(frames.chunk(usage_json(turn, prompt, completion)).decode())
        await send(protocol.done_frame(turn.job_id, turn.request_id))

    return play


@pytest.mark.parametrize(
    ("prompt", "completion"),
    [(1 << 63, 1), (5, -1_000_000), (10**30, 2)],
    ids=["past-sqlite", "negative", "past-any-int"],
)
async def test_usage_numbers_that_are_no_token_counts_are_not_taken(
    autojump_clock: trio.testing.MockClock,
    tmp_path: Path,
    records: Records,
    prompt: int,
    completion: int,
) -> None:
    """A runner's usage past any count of tokens (once: an OverflowError in the store's writer,
    the hub down) or below zero (a key's token window lowered): not taken; the turn is charged
    as one without usage (a token a chunk, its prompt estimated), and the hub serves on."""
    scripts = {"liar": Script(play=usage_says(prompt, completion))}
    async with served(tmp_path / "hub", scripts) as (hub, url, _runner, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}", tpm=1000)
        body = {"model": "liar", "messages": MESSAGES, "stream": True}
        with trio.fail_after(GUARD):
            first = await post(url, "/v1/chat/completions", body, headers(key))
            await ended.count(1)
            await hub.store.flush_usage()
            second = await post(url, "/v1/chat/completions", body, headers(key))
            await ended.count(2)
        rows = await hub.store.usage_rows()
    assert first.status_code == second.status_code == 200
    # a token a chunk: the two of text and the usage chunk (read, then kept from the client)
    assert [(r["completion_tokens"], r["estimated"]) for r in rows] == [(3, True)] * 2
    assert all(0 < r["prompt_tokens"] < 100 for r in rows)
    assert records.bad() == []


# -- row 5: a model a client made up is no label of its own ------------------------------------------


async def admin_get(url: str, path: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
        return await http.get(path, headers={"Authorization": f"Bearer {ADMIN}"})


def journal_text(data: Path) -> str:
    return "".join(p.read_text() for p in sorted(data.glob("usage-journal.*")))


async def test_made_up_model_names_are_unlisted_in_the_metrics_the_ledger_and_the_journal(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """Before: 40 requests naming made-up 2 KB models, before any runner listed its models, made
    663 new ``/metrics`` series (5 KiB -> 1.3 MiB) and permanent ``usage_hourly`` rows. Now a
    model is a label or a stored row only when a runner listed it: else ``unlisted``, in the
    metrics, the ledger's rows and totals, and the usage journal's record of a turn in flight."""
    data = tmp_path / "hub"
    gate = trio.Event()
    scripts = {"gated": Script(gate=gate, usage=True)}
    # a runner that never answers a models request: nothing is listed, every model goes to it
    async with served(data, scripts, lists_models=False) as (hub, url, runner, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        before = (await admin_get(url, "/metrics")).text
        made_up = [f"made-up-{i}-" + "x" * 2000 for i in range(40)]
        with trio.fail_after(GUARD):
            for i, model in enumerate(made_up):
                body = {"model": model, "messages": MESSAGES}
                reply = await post(url, "/v1/chat/completions", body, headers(key, f"s{i % 4}"))
                assert reply.status_code == 200, reply.text
            await ended.count(40)
            # a turn in flight: its start in the journal names no made-up model either
            async with trio.open_nursery() as nursery:
                body = {"model": "gated-" + "y" * 2000, "messages": MESSAGES}
                nursery.start_soon(post, url, "/v1/chat/completions", body, headers(key))
                await runner.wait_until(lambda: len(runner.turns) == 41)
                in_flight = journal_text(data)
                gate.set()
            await ended.count(41)
            after = (await admin_get(url, "/metrics")).text
        rows = await hub.store.usage_rows()
        hourly = await hub.store.hourly_usage(0)
    assert runner.models_requests >= 1 and hub.catalog.of_runner(runner.runner_id or "") is None
    assert "x" * 100 not in after and "y" * 100 not in after
    assert len(after) < len(before) + 10_000, (len(before), len(after))
    assert 'alp_hub_turns_total{key="k",model="unlisted",outcome="ok"} 41.0' in after
    assert {r["model"] for r in rows} == {UNLISTED} and len(rows) == 41
    assert [(h.model, h.turns) for h in hourly] == [(UNLISTED, 41)]
    assert "y" * 100 not in in_flight and f'"{UNLISTED}"' in in_flight


async def test_a_model_list_past_the_bound_is_refused_and_never_a_label(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """A runner that lists a model name past ``MAX_LABEL`` has its whole list refused (issue 34
    point 5; before, the name was kept, capped): nothing of it is stored or becomes a label, and
    its turns are served all the same, labelled as no list names them."""
    long = "listed-" + "z" * 2000
    async with served(tmp_path / "hub", models=("real-model", long)) as (hub, url, _r, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        with trio.fail_after(GUARD):
            for model in ("real-model", long):
                body = {"model": model, "messages": MESSAGES}
                reply = await post(url, "/v1/chat/completions", body, headers(key))
                assert reply.status_code == 200, reply.text
            await ended.count(2)
            metrics = (await admin_get(url, "/metrics")).text
        rows = await hub.store.usage_rows()
        stored = await hub.store.load_models(OWNER, PROJECT)
    assert stored == []
    assert [r["model"] for r in rows] == [UNLISTED, UNLISTED]
    assert "z" * MAX_LABEL not in metrics and "real-model" not in metrics


# -- row 6: what clients chose reaches the admin's terminal escaped ---------------------------------

EVIL_MODEL = "evil\x1b]0;pwned\x07\x1b[2J\u2028x\r\nFAKE-ROW  k  m  999  999  999  0  0"


async def test_a_model_name_with_terminal_escapes_is_printed_escaped_by_hub_usage(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A runner lists a model whose name holds a terminal's title and clear-screen sequences and
    a line break, a key holder chats with it over the front door; ``hub usage`` then prints it
    as the logs would (``gateway.logsafe``): no control character reaches the admin's terminal,
    no row is forged (before: printed raw)."""
    data = tmp_path / "hub"
    async with served(data, models=(EVIL_MODEL,)) as (hub, url, _r, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        with trio.fail_after(GUARD):
            body = {"model": EVIL_MODEL, "messages": MESSAGES}
            reply = await post(url, "/v1/chat/completions", body, headers(key))
            assert reply.status_code == 200, reply.text
            await ended.count(1)
    capsys.readouterr()
    # the command runs trio itself: in a thread of its own, once the hub has stopped
    assert await trio.to_thread.run_sync(hub_main, ["usage", "--data", str(data)]) == 0
    out = capsys.readouterr().out
    assert all(ch.isprintable() for ch in out.replace("\n", "")), repr(out)
    _title, header, *rows, _per_key, _per_model, _total = out.splitlines()  # (and the costs)
    assert header.split()[:2] == ["KEY", "MODEL"]
    (row,) = rows  # no forged row
    assert row.startswith("k  ") and "evil\\x1b]0;pwned\\x07\\x1b[2J\\u2028x\\r\\n" in row


# -- row 10: a session id is at most 200 characters -------------------------------------------------


@pytest.mark.parametrize(
    ("api", "name"),
    [
        ("chat", "X-Chat-Session"),
        ("responses", "X-Chat-Session"),
        ("messages", "X-Chat-Session"),
        ("messages", "X-Claude-Code-Session-Id"),
    ],
)
async def test_a_session_id_over_200_characters_is_a_400_in_the_callers_shape(
    autojump_clock: trio.testing.MockClock, api: str, name: str
) -> None:
    """Before: a 60 KB ``X-Chat-Session`` was accepted, listed and stored in every usage row for
    7 days. Now 200 characters is the most a session id may be, in Claude Code's header too."""
    async with served() as (hub, url, _runner, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        path, body, head = {
            "chat": ("/v1/chat/completions", {"messages": MESSAGES}, headers(key)),
            "responses": ("/v1/responses", {"input": "hi"}, headers(key)),
            "messages": (
                "/v1/messages",
                {"max_tokens": 10, "messages": MESSAGES},
                {"x-api-key": key, "anthropic-version": "2023-06-01"},
            ),
        }[api]
        body["model"] = CONTENT_MODEL
        with trio.fail_after(GUARD):
            longest = await post(url, path, body, {**head, name: "s" * 200})
            await ended.count(1)
            sessions = (await admin_get(url, "/api/hub/sessions")).json()["sessions"]
            refused = await post(url, path, body, {**head, name: "s" * 60_000})
    assert longest.status_code == 200, longest.text
    assert [s["session"] for s in sessions] == ["s" * 200]
    assert refused.status_code == 400
    message = f"the {name.lower()} header is over 200 characters"
    if api == "messages":
        assert refused.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": message},
        }
    else:
        assert error_of(refused) == {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_request",
        }
