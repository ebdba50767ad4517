"""Usage counted once and kept (issue 20, point 1): every front-door turn's row and its key's
hourly totals in the hub's store, old rows pruned, ``hub usage``.

Real turns go through a real runner to the simulator on loopback (its usage is the truth), or
through the fake runner on trio's autojump clock; the book's wall clock is set by hand where
retention is tested. Tests wait on the book's observers (``Ended``), never on sleeps."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import trio
import trio.testing
from fake_runner import FakeRunner, Script
from helpers import ADMIN, OWNER, PROJECT, runner_config, running

from gateway.hub import Hub, open_hub
from gateway.hub.cli import main as hub_main
from gateway.hub.store import PRUNE_BATCH, HourlyUsage, KeyLimits, UsageRecord, open_store
from gateway.hub.turn import Turn
from gateway.sim import Simulator

LIMIT = 15.0  # s: no step of a real-time test may take longer
GUARD = 5000.0  # s of virtual time: a hang guard
PROMPT = [{"role": "user", "content": "one two three four"}]  # the simulator counts 4 tokens
DAY = 86400.0


class Ended:
    """The turns the usage book was told of, and a wait for a count of them."""

    def __init__(self, hub: Hub) -> None:
        self.records: list[Turn] = []
        self._change = trio.Event()
        hub.accounting.observers.append(self._ended)

    def _ended(self, record: Turn) -> None:
        self.records.append(record)
        self._change.set()
        self._change = trio.Event()

    async def count(self, n: int) -> list[Turn]:
        while len(self.records) < n:
            await self._change.wait()
        return self.records


def sim_usage(sim: Simulator, index: int) -> dict[str, int]:
    """The usage the simulator sent in its ``index``-th answer (streamed or whole)."""
    found: dict[str, int] | None = None
    for payload in sim.streams[index].payloads:
        if payload == b"[DONE]":
            continue
        usage = json.loads(payload).get("usage")
        if usage:
            found = usage
    assert found is not None, "the simulator sent no usage"
    return found


@pytest.fixture
async def served(
    sim: Simulator, tmp_path: Path
) -> AsyncIterator[tuple[Hub, str, str, Ended, Path]]:
    """A hub on a store in tmp_path, a real runner to the simulator, a key "alice"."""
    data = tmp_path / "hub"
    async with open_hub(Hub(data, admin_token=ADMIN, runner_wait_timeout=LIMIT)) as (hub, url):
        ended = Ended(hub)
        key = await hub.keys.create("alice", f"{OWNER}/{PROJECT}")
        async with running(runner_config(url, sim.url, tmp_path / "state")):
            yield hub, url, key, ended, data
    await hub.store.close()


async def test_turns_streamed_and_not_are_rows_and_hourly_totals_with_the_backends_tokens(
    served: tuple[Hub, str, str, Ended, Path], sim: Simulator
) -> None:
    hub, url, key, ended, _ = served
    oc = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=LIMIT)
    sim_opts = {"sim": {"chunks": 5}}
    with trio.fail_after(LIMIT):
        whole = await oc.chat.completions.create(
            model="sim-model", messages=PROMPT, extra_body=sim_opts
        )
        # a streaming client that did not ask for usage: the hub asked, and kept the chunk
        quiet = [
            c
            async for c in await oc.chat.completions.create(
                model="sim-model", messages=PROMPT, stream=True, extra_body=sim_opts
            )
        ]
        asked = [
            c
            async for c in await oc.chat.completions.create(
                model="sim-model",
                messages=PROMPT,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=sim_opts,
            )
        ]
        async with httpx.AsyncClient(base_url=url, timeout=LIMIT) as http:
            anthropic = await http.post(
                "/v1/messages",
                headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
                json={"model": "sim-model", "max_tokens": 50, "messages": PROMPT, **sim_opts},
            )
        records = await ended.count(4)
    assert anthropic.status_code == 200, anthropic.text
    told = [sim_usage(sim, i) for i in range(4)]  # every turn asked the simulator for it
    expected = {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
    assert told[:3] == [expected] * 3 and told[3]["prompt_tokens"] == 4  # (no sim options)
    assert whole.usage is not None and whole.usage.total_tokens == 9
    assert all(c.usage is None and c.choices for c in quiet)  # no usage chunk reached it
    assert asked[-1].choices == [] and asked[-1].usage is not None
    assert asked[-1].usage.total_tokens == 9
    assert anthropic.json()["usage"]["input_tokens"] == 4
    tokens = [(u["prompt_tokens"], u["completion_tokens"]) for u in told]
    assert [(r.prompt_tokens, r.completion_tokens) for r in records] == tokens

    async with httpx.AsyncClient(base_url=url, timeout=LIMIT) as http:
        listed = await http.get("/api/hub/runners", headers={"Authorization": f"Bearer {ADMIN}"})
    (runner,) = listed.json()["runners"]
    rows = await hub.store.usage_rows()
    assert [(r["api"], r["stream"]) for r in rows] == [
        ("chat", False),
        ("chat", True),
        ("chat", True),
        ("messages", False),
    ]
    api_key = await hub.store.check_api_key(key)
    assert api_key is not None
    assert [(r["prompt_tokens"], r["completion_tokens"]) for r in rows] == tokens
    for row in rows:
        assert row["key_name"] == "alice" and row["key_id"] == api_key.id
        assert row["model"] == "sim-model" and row["session"] == "default"
        assert row["runner_id"] == runner["id"] and row["job_id"]
        assert row["outcome"] == "ok"
        assert row["ttft"] is not None and 0 <= row["ttft"] <= row["duration"]
        assert abs(row["at"] - time.time()) < 3600
    hourly = await hub.accounting.hourly(time.time() - 3600, "alice")
    assert {(h.key_name, h.model) for h in hourly} == {("alice", "sim-model")}
    assert sum(h.turns for h in hourly) == 4 and sum(h.errors for h in hourly) == 0
    assert sum(h.prompt_tokens for h in hourly) == sum(p for p, _ in tokens)
    assert sum(h.completion_tokens for h in hourly) == sum(c for _, c in tokens)
    assert await hub.accounting.hourly(0, "bob") == []
    assert hub.accounting.in_flight == {}


async def test_a_failed_turn_is_an_error_in_the_totals(
    served: tuple[Hub, str, str, Ended, Path],
) -> None:
    hub, url, key, ended, data = served
    oc = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=LIMIT)
    with trio.fail_after(LIMIT):
        with pytest.raises(openai.APIStatusError):
            await oc.chat.completions.create(
                model="sim-model", messages=PROMPT, extra_body={"sim": {"fault": "500"}}
            )
        await oc.chat.completions.create(model="sim-model", messages=PROMPT)
        await ended.count(2)
    assert [r["outcome"] for r in await hub.store.usage_rows()] == ["error", "ok"]
    (total,) = (await hub.store.usage_totals(time.time() - 60))[0]
    assert (total.turns, total.errors, total.prompt_tokens) == (2, 1, 4)


async def test_retention_prunes_rows_and_keeps_the_hourly_totals(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    wall = [1_700_000_000.0]  # the book's wall clock, set by hand
    hub = Hub(tmp_path / "hub", admin_token=ADMIN, ping_interval=0.0, usage_retention=7 * DAY)
    hub.accounting.clock = lambda: wall[0]
    async with open_hub(hub) as (hub, url):
        ended = Ended(hub)
        key = await hub.keys.create("alice", f"{OWNER}/{PROJECT}")
        runner = FakeRunner(url, ADMIN, owner=OWNER, project=PROJECT, default=Script(usage=True))
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:

                async def turn() -> None:
                    reply = await http.post(
                        "/v1/chat/completions",
                        headers={"Authorization": f"Bearer {key}"},
                        json={"model": "fake-model", "messages": PROMPT},
                    )
                    assert reply.status_code == 200, reply.text

                with trio.fail_after(GUARD):
                    await turn()
                    await turn()
                    await ended.count(2)
                    first_rows = await hub.store.usage_rows()
                    wall[0] += 8 * DAY  # past the retention
                    await turn()
                    await ended.count(3)
            nursery.cancel_scope.cancel()
    rows = await hub.store.usage_rows()
    assert len(first_rows) == 2 and [r["at"] for r in rows] == [wall[0]]
    hourly = await hub.accounting.hourly(0)
    assert [(h.hour, h.turns, h.prompt_tokens, h.completion_tokens) for h in hourly] == [
        (1_699_999_200, 2, 10, 6),  # the hour of the first two turns, kept
        (1_699_999_200 + 8 * 24 * 3600, 1, 5, 3),
    ]
    assert all(isinstance(h, HourlyUsage) and h.key_name == "alice" for h in hourly)
    assert await hub.store.usage_turns_from() == wall[0] - 7 * DAY
    await hub.store.close()


def _record(name: str = "alice", model: str | None = "m", outcome: str = "ok") -> UsageRecord:
    return UsageRecord(
        f"id-{name}",
        name,
        "s",
        "chat",
        model or "",
        False,
        outcome,
        prompt_tokens=2,
        completion_tokens=3,
    )


async def test_pruning_is_bounded_work_and_totals_say_whether_they_are_exact(
    tmp_path: Path,
) -> None:
    store = open_store(tmp_path)
    now = time.time()
    for i in range(PRUNE_BATCH + 20):
        await store.add_usage(_record(), now - 10 * DAY + i)
    await store.add_usage(_record("bob", None, "lost"), now)
    before = now - 7 * DAY
    assert await store.prune_usage(before, PRUNE_BATCH) == PRUNE_BATCH  # at most a batch at a time
    assert await store.usage_turns_from() == now - 10 * DAY + PRUNE_BATCH - 1
    assert await store.prune_usage(before, PRUNE_BATCH) == 20
    assert (
        await store.usage_turns_from() == before
        and await store.prune_usage(before, PRUNE_BATCH) == 0
    )
    assert [r["key_name"] for r in await store.usage_rows()] == ["bob"]
    totals, exact = await store.usage_totals(now - 3600)
    assert exact and [(t.key_name, t.model, t.turns, t.errors) for t in totals] == [
        ("bob", "", 1, 1)
    ]
    totals, exact = await store.usage_totals(now - 30 * DAY)  # older than the rows kept
    assert not exact
    assert [(t.key_name, t.turns, t.prompt_tokens, t.completion_tokens) for t in totals] == [
        ("alice", PRUNE_BATCH + 20, 2 * (PRUNE_BATCH + 20), 3 * (PRUNE_BATCH + 20)),
        ("bob", 1, 2, 3),
    ]
    assert await store.tokens_since("id-alice", 0) == 5 * (PRUNE_BATCH + 20)
    await store.close()


class _Taken:
    """A response that keeps what the sink writes (the client's bytes)."""

    started = finished = gone = False
    backlog = 0

    def __init__(self) -> None:
        self.out = b""

    def head(self, status: int, headers: Any) -> bytes:
        self.started = True
        return b""

    def write_nowait(self, data: bytes, before: bytes = b"", end: bool = False) -> bool:
        self.out += data
        return True


HEAD = b'{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":'
SPACED = b'{"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": '
LLAMA = b'{"choices":'
TOKEN = b'[{"index":0,"delta":{"content":"a \\"choices\\":[] b"},"finish_reason":null}]'
USAGE = b'"usage":{"prompt_tokens":4,"completion_tokens":3,"total_tokens":7}'


@pytest.mark.parametrize(
    "chunks",
    [
        # the same head on every chunk (what backends write); a text holding "choices":[]
        [HEAD + TOKEN + b"}", HEAD + TOKEN + b"}", HEAD + b"[]," + USAGE + b"}"],
        # JSON with spaces; choices first (llama.cpp)
        [SPACED + TOKEN + b"}", SPACED + TOKEN + b"}", SPACED + b"[], " + USAGE + b"}"],
        [LLAMA + TOKEN + b"}", LLAMA + TOKEN + b"}", LLAMA + b'[],"id":"c1",' + USAGE + b"}"],
        # a head that grows, one that shrinks, a usage chunk laid out unlike the others
        [
            HEAD + TOKEN + b"}",
            b'{"id":"c12",' + HEAD[11:] + TOKEN + b"}",
            HEAD + b"[]," + USAGE + b"}",
        ],
        [
            HEAD + TOKEN + b"}",
            b'{"id":"",' + HEAD[11:] + TOKEN + b"}",
            b'{"choices":[],' + USAGE + b"}",
        ],
        # choices not opening on an object: searched each time
        [HEAD + b"[ {}]}", HEAD + b"[ {}]}", HEAD + b"[]," + USAGE + b"}"],
    ],
)
@pytest.mark.parametrize("framed", [True, False])
async def test_the_usage_chunk_is_kept_from_a_client_that_did_not_ask_whatever_the_layout(
    chunks: list[bytes], framed: bool
) -> None:
    """Only the usage-only chunk is kept from the client (the turn's choices found where its
    chunks open them, else searched), and its tokens are taken, the chunk frames handed over
    with their bytes or without."""
    from gateway.apis.dialects import CHAT
    from gateway.hub.turn import Turn
    from gateway.hub.turnstate import State
    from gateway.wire import protocol

    resp = _Taken()
    record = Turn(
        "id",
        "key-id",
        "alice",
        "s",
        b"{}",
        CHAT,
        resp,  # type: ignore[arg-type]
        model="m",
        stream=True,
        bound=1 << 20,
        max_answer=1 << 20,
        strip_usage=True,
        now=0.0,
    )
    record.sent("r", "runner", "job")
    frames = protocol.TurnFrames("job", "r")
    for chunk in chunks:
        frame = frames.chunk(chunk)
        raw = msgspec.json.decode(frame, type=protocol.ChunkFrame).chunk
        record.chunk(raw, frame) if framed else record.chunk(raw)
        record.flush()
    record.reply(protocol.DoneFrame("job", "r"))
    assert record.state is State.DONE
    sent = b"".join(b"data: " + c + b"\n\n" for c in chunks[:-1]) + b"data: [DONE]\n\n"
    assert resp.out == sent
    assert (record.prompt_tokens, record.completion_tokens, record.chunks) == (4, 3, 3)


def test_hub_usage_prints_per_key_and_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "hub"
    now = time.time()

    async def add() -> None:
        store = open_store(data)
        await store.create_api_key("alice")
        await store.create_api_key("dave")  # a key that chatted not at all
        await store.add_usage(_record("alice", "m1"), now - 10)
        await store.add_usage(_record("alice", "m1", "error"), now - 20)
        # a turn that ended before its backend said its usage: its tokens the hub's estimate
        await store.add_usage(
            msgspec.structs.replace(_record("alice", "m1"), estimated=True), now - 25
        )
        await store.add_usage(_record("alice", None), now - 30)
        await store.add_usage(_record("bob", "m2"), now - 2 * 3600)
        await store.add_usage(_record("carol", "m1"), now - 3 * DAY)
        await store.close()

    trio.run(add)

    assert hub_main(["usage", "--data", str(data)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("usage since ") and "hourly" not in out[0]
    assert out[1].split() == (
        "KEY MODEL TURNS PROMPT TOKENS COMPLETION TOKENS ERRORS ESTIMATED COST (USD) AT "
        "REFERENCE (USD)".split()
    )
    # no model has a price: each row's cost is "no price", its reference cost 0; then the
    # cost per key, per model and in total (issue 35)
    assert [line.split() for line in out[2:-3]] == [
        ["alice", "-", "1", "2", "3", "0", "0", "no", "price", "0.0000"],
        ["alice", "m1", "3", "6", "9", "1", "1", "no", "price", "0.0000"],
        ["bob", "m2", "1", "2", "3", "0", "0", "no", "price", "0.0000"],
    ]
    assert out[-1] == (
        "total cost 0.0000 USD (0.0000 USD at reference); 5 turn(s) of models with no price, "
        "counted 0"
    )
    assert hub_main(["usage", "--since", "30m", "--key", "alice", "--data", str(data)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "of API key 'alice'" in out[0]
    assert [line.split()[:3] for line in out[2:-3]] == [["alice", "-", "1"], ["alice", "m1", "3"]]
    assert hub_main(["usage", "--since", "7d", "--data", str(data)]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:-3]] == [
        "alice",
        "alice",
        "bob",
        "carol",
    ]
    assert hub_main(["usage", "--key", "nobody", "--data", str(data)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "no API key named 'nobody'" in err
    assert hub_main(["usage", "--key", "dave", "--data", str(data)]) == 0
    assert capsys.readouterr().out.startswith("no usage of API key 'dave' since ")

    # rows pruned after a day: a longer span is answered from the hourly totals, and says so
    async def prune() -> None:
        store = open_store(data)
        await store.prune_usage(now - DAY, PRUNE_BATCH)
        await store.close()

    trio.run(prune)
    assert hub_main(["usage", "--since", "7d", "--data", str(data)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "from the hourly totals" in out[0] and out[-4].split()[:3] == ["carol", "m1", "1"]

    assert hub_main(["usage", "--since", "soon", "--data", str(data)]) == 2
    assert hub_main(["usage", "--data", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "'soon' is not a duration" in err and "no hub in" in err


# Chosen by a key holder (a model name) or a key's admin (a key name): a terminal's title, a clear
# screen, a line separator and a line break that would forge a row of the table.
EVIL_MODEL = "evil\x1b]0;pwned\x07\x1b[2J\u2028x\r\nFAKE-ROW  bob  m  999  999  999  0"
EVIL_KEY = "mallory\x1b[31m\r\nFAKE-KEY  x/y"


def test_what_clients_chose_is_printed_escaped_as_in_the_logs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hub usage`` and ``hub keys list`` pass every name through ``gateway.logsafe`` (issue 30,
    row 6): no control character reaches the terminal and no row is forged."""
    data = tmp_path / "hub"

    async def add() -> None:
        store = open_store(data)
        await store.create_api_key("alice")
        await store.create_api_key(EVIL_KEY)
        await store.add_usage(_record("alice", EVIL_MODEL), time.time() - 10)
        await store.add_usage(_record(EVIL_KEY, "m1"), time.time() - 10)
        await store.close()

    trio.run(add)

    def printed(*args: str) -> list[str]:
        assert hub_main([*args, "--data", str(data)]) == 0
        out = capsys.readouterr().out
        assert all(ch.isprintable() for ch in out.replace("\n", "")), repr(out)
        return out.splitlines()

    title, header, *rows, _per_key, _per_model, _total = printed("usage")  # (and the costs)
    assert header.split()[:2] == ["KEY", "MODEL"] and len(rows) == 2  # no forged row
    assert rows[0].startswith("alice  ") and "\\x1b]0;pwned\\x07\\x1b[2J\\u2028x\\r\\n" in rows[0]
    assert rows[1].startswith("mallory\\x1b[31m\\r\\nFAKE-KEY  x/y  m1 ")
    header, *rows = printed("keys", "list")
    assert header.split()[0] == "NAME" and len(rows) == 2
    assert rows[1].startswith("mallory\\x1b[31m\\r\\nFAKE-KEY") and "active" in rows[1]
    # a name given on the command line comes back escaped in an error too
    assert hub_main(["usage", "--key", EVIL_KEY + "?", "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "\\x1b[31m" in err


async def test_an_old_store_gains_the_usage_tables_and_key_limits(tmp_path: Path) -> None:
    data = tmp_path / "hub"
    data.mkdir()
    db = sqlite3.connect(data / "hub.sqlite3")
    db.executescript(
        "CREATE TABLE api_keys (name TEXT PRIMARY KEY, owner TEXT NOT NULL, project TEXT NOT"
        " NULL, key_hash TEXT NOT NULL, created_at TEXT NOT NULL, revoked INTEGER NOT NULL"
        " DEFAULT 0);"
        "INSERT INTO api_keys VALUES ('old', 'acme', 'chat', 'abc', '2026-01-01T00:00:00Z', 0);"
    )
    db.commit()
    db.close()
    store = open_store(data)
    (old,) = await store.list_api_keys()
    assert old["name"] == "old" and old["limits"] == KeyLimits()
    assert await store.usage_rows() == [] and await store.hourly_usage(0) == []
    await store.add_usage(_record(), time.time())
    assert len(await store.usage_rows()) == 1
    await store.close()


def test_usage_retention_flag(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import gateway.hub.cli as cli

    seen: list[Any] = []
    monkeypatch.setattr(cli, "_serve", lambda *args: seen.append(args[-1]) or 0)
    data = ["--data", str(tmp_path), "--listen", "127.0.0.1:0"]  # 8787 may be taken here
    assert cli.main([*data, "--usage-retention", "36h"]) == 0
    assert cli.main(data) == 0
    assert [s.usage_retention for s in seen] == [36 * 3600.0, 7 * DAY]
    assert cli.main([*data, "--usage-retention", "-3d"]) == 2
    assert cli.main([*data, "--usage-retention", "0d"]) == 2
    assert "not a duration" in capsys.readouterr().err
