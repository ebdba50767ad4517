"""Limits per API key (issue 20, point 2): requests and tokens a minute, tokens a UTC day, turns
in flight at once; refused with 429 and Retry-After in the caller's API shape, exact under
concurrency, changed by another process within key_check_interval.

A real hub on loopback, the fake runner of tests/support/fake_runner.py, trio's autojump clock (time
moves by ``jump``: never a sleep); the book's wall clock (the UTC day) is set by hand."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
import trio.testing
from fake_runner import USAGE, FakeRunner, Script
from helpers import hub_command
from test_causes import ADMIN, GUARD, MESSAGES, OWNER, PROJECT, chat, client, error_of, hub_of

from gateway.hub import Hub, open_hub
from gateway.hub.cli import main as hub_main
from gateway.hub.store import KeyLimits
from gateway.hub.turn import Turn

TOKENS = USAGE["total_tokens"]  # each of the fake runner's turns (it always sends usage here)


class Ended:
    """Counts the turns the usage book was told of; waits for a count."""

    def __init__(self, hub: Hub) -> None:
        self.n = 0
        self._change = trio.Event()
        hub.accounting.observers.append(self._ended)

    def _ended(self, _record: Turn) -> None:
        self.n += 1
        self._change.set()
        self._change = trio.Event()

    async def count(self, n: int) -> None:
        while self.n < n:
            await self._change.wait()


@asynccontextmanager
async def served(
    data: Path | None = None, scripts: dict[str, Script] | None = None, **settings: Any
) -> AsyncIterator[tuple[Hub, str, FakeRunner, Ended]]:
    async with open_hub(hub_of(data, **settings)) as (hub, url):
        runner = FakeRunner(
            url,
            ADMIN,
            owner=OWNER,
            project=PROJECT,
            scripts=scripts,
            default=Script(usage=True),
            poll_interval=2.0,  # within the hub's head_timeout: its kept-alive polls stay open
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            yield hub, url, runner, Ended(hub)
            nursery.cancel_scope.cancel()


async def let_pass(seconds: float) -> None:
    """Let ``seconds`` of virtual time pass (the autojump clock: the hub and the runner go on
    meanwhile, as they would; nothing waits on this to be synchronised)."""
    await trio.sleep(seconds)


async def concurrently(n: int, turn: Any) -> list[Any]:
    results: list[Any] = []

    async def one(i: int) -> None:
        results.append(await turn(i))

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return results


async def test_rpm_exactly_that_many_of_concurrent_requests_then_the_window_slides(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with served() as (hub, url, _runner, _ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}", rpm=3)
        with trio.fail_after(GUARD):
            replies = await concurrently(5, lambda i: chat(url, key, f"s{i}"))
            await let_pass(30.0)
            still = await chat(url, key, "s0")
            await let_pass(30.0)  # the first three are a minute old: out of the window
            later = await concurrently(4, lambda i: chat(url, key, f"s{i}"))
    codes = sorted(r.status_code for r in replies)
    assert codes == [200, 200, 200, 429, 429]
    refused = [r for r in replies if r.status_code == 429]
    for reply in refused:
        # the turns' times are virtual: the clock may jump (to a poll of the runner) while
        # a request is on the wire, so a wait is checked within bounds
        wait = int(reply.headers["retry-after"])
        assert 50 <= wait <= 60
        assert error_of(reply) == {
            "message": f"this API key is limited to 3 requests per minute (rpm): retry in {wait} s",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    assert still.status_code == 429 and 1 <= int(still.headers["retry-after"]) <= 30
    assert sorted(r.status_code for r in later) == [200, 200, 200, 429]


async def test_max_streams_exactly_two_of_six_concurrent_streams_and_slots_released(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = trio.Event()
    scripts = {
        "gated": Script(gate=gate, usage=True),
        "broken": Script(error_before="backend returned 500: boom"),
    }
    async with served(scripts=scripts) as (hub, url, runner, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}", max_streams=2)
        outcomes: list[str] = []
        four_refused = trio.Event()

        async def stream(i: int) -> None:
            async with client(url, key, f"s{i}") as oc:
                try:
                    chunks = await oc.chat.completions.create(
                        model="gated", messages=MESSAGES, stream=True
                    )
                    text = "".join([c.choices[0].delta.content or "" async for c in chunks])
                    outcomes.append(text)
                except openai.RateLimitError as exc:
                    outcomes.append(f"429 {exc.response.headers['retry-after']} {exc.message}")
                    if sum(o.startswith("429") for o in outcomes) == 4:
                        four_refused.set()

        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                for i in range(6):
                    nursery.start_soon(stream, i)
                await runner.wait_until(lambda: len(runner.turns) == 2)  # two at the gate
                await four_refused.wait()  # the other four, refused meanwhile
                assert len(runner.turns) == 2 and outcomes[4:] == []
                gate.set()
            await ended.count(2)
            # the slots are free again; a failed turn frees its slot too
            assert (await chat(url, key, "s0", model="broken")).status_code == 502
            assert (await chat(url, key, "s1", model="broken")).status_code == 502
            after = await concurrently(2, lambda i: chat(url, key, f"s{i}"))
    served_texts = [o for o in outcomes if not o.startswith("429")]
    assert served_texts == ["tok0tok1tok2"] * 2
    refused = [o for o in outcomes if o.startswith("429")]
    assert len(refused) == 4
    assert all(
        o.startswith("429 1 Error code: 429")
        and "this API key is limited to 2 turns in flight at once (max_streams) and has 2: "
        "retry when one ends"
        in o
        for o in refused
    )
    assert [r.status_code for r in after] == [200, 200]
    assert hub.accounting.in_flight == {}


async def test_tpm_counts_ended_turns_tokens_and_answers_anthropic_shape_on_messages(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with served() as (hub, url, _runner, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}", tpm=TOKENS + 2)
        headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
        body = {"model": "fake-model", "max_tokens": 10, "messages": MESSAGES}
        with trio.fail_after(GUARD):
            first = await chat(url, key)
            await ended.count(1)
            second = await chat(url, key)  # under the limit still: served whole
            await ended.count(2)
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                refused = await http.post("/v1/messages", headers=headers, json=body)
                await let_pass(60.0)
                again = await http.post("/v1/messages", headers=headers, json=body)
    assert [first.status_code, second.status_code] == [200, 200]
    assert refused.status_code == 429
    wait = int(refused.headers["retry-after"])
    assert 1 <= wait <= 60
    assert refused.json() == {
        "type": "error",
        "error": {
            "type": "rate_limit_error",
            "message": f"this API key is limited to {TOKENS + 2} tokens per minute (tpm) and "
            f"has used {2 * TOKENS} in the last minute: retry in {wait} s",
        },
    }
    assert again.status_code == 200, again.text


async def test_tokens_per_day_counts_the_utc_day_and_survives_a_restart(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    day = 1_700_006_400  # a UTC midnight
    wall = [day + 23 * 3600 + 0.5]

    def clocked(hub: Hub) -> None:
        hub.accounting.clock = lambda: wall[0]

    data = tmp_path / "hub"
    async with served(data) as (hub, url, _runner, ended):
        clocked(hub)
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}", tokens_per_day=TOKENS + 1)
        with trio.fail_after(GUARD):
            first = await chat(url, key)
            await ended.count(1)
            second = await chat(url, key)
            await ended.count(2)
            refused = await chat(url, key)
    await hub.store.close()
    async with served(data) as (hub, url, _runner, ended):  # a restarted hub, the same day
        clocked(hub)
        with trio.fail_after(GUARD):
            after_restart = await chat(url, key)
            wall[0] = day + 86400 + 1.0  # the next UTC day
            next_day = await chat(url, key)
    await hub.store.close()
    assert [first.status_code, second.status_code] == [200, 200]
    for reply in (refused, after_restart):
        assert reply.status_code == 429 and reply.headers["retry-after"] == "3600"
        assert error_of(reply) == {
            "message": f"this API key is limited to {TOKENS + 1} tokens per day "
            f"(tokens_per_day, UTC) and has used {2 * TOKENS} today: retry in 3600 s",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    assert next_day.status_code == 200


async def test_a_refused_turn_releases_its_slot(autojump_clock: trio.testing.MockClock) -> None:
    async with open_hub(hub_of()) as (hub, url):  # no runner: each turn is refused (503)
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}", max_streams=1)
        with trio.fail_after(GUARD):
            replies = [await chat(url, key) for _ in range(3)]
    assert [r.status_code for r in replies] == [503, 503, 503]
    assert [error_of(r)["code"] for r in replies] == ["no_runner"] * 3


async def test_limits_changed_by_another_process_apply_within_key_check_interval(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "hub"
    cli_data = ["--data", str(data)]
    async with served(data, key_check_interval=3.0) as (hub, url, _runner, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        with trio.fail_after(GUARD):
            before = await chat(url, key)
            # `alp-gateway hub keys update k --rpm 1` from another process on the same store
            argv = ["keys", "update", "k", "--rpm", "1", *cli_data]
            assert await hub_command(autojump_clock, argv) == 0
            await let_pass(3.0)
            limited = await chat(url, key)  # the minute already holds one request
            argv = ["keys", "update", "k", "--rpm", "0", *cli_data]
            assert await hub_command(autojump_clock, argv) == 0
            await let_pass(3.0)
            freed = await chat(url, key)
    await hub.store.close()
    assert before.status_code == 200 and freed.status_code == 200
    assert limited.status_code == 429 and error_of(limited)["message"].startswith(
        "this API key is limited to 1 requests per minute (rpm)"
    )
    out = capsys.readouterr().out
    assert "API key 'k' limits: rpm=1" in out and "API key 'k' limits: -" in out


async def test_limits_changed_in_the_hub_apply_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with served(key_check_interval=1000.0) as (hub, url, _runner, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        with trio.fail_after(GUARD):
            before = await chat(url, key)
            assert await hub.keys.update_limits("k", KeyLimits(rpm=1))
            limited = await chat(url, key)
            assert await hub.keys.limits("k") == KeyLimits(rpm=1)
            assert await hub.keys.update_limits("k", KeyLimits(rpm=0))  # 0: no limit
            freed = await chat(url, key)
    assert [before.status_code, limited.status_code, freed.status_code] == [200, 429, 200]
    assert await hub.keys.limits("k") == KeyLimits()
    assert not await hub.keys.update_limits("nobody", KeyLimits(rpm=1))
    assert await hub.keys.limits("nobody") is None
    with pytest.raises(ValueError, match="tpm"):
        await hub.keys.update_limits("k", KeyLimits(tpm=-1))
    with pytest.raises(ValueError, match="max_streams"):
        await hub.keys.create("j", f"{OWNER}/{PROJECT}", max_streams=-2)


def test_keys_create_update_list_with_limits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = ["--data", str(tmp_path / "hub")]
    assert (
        hub_main(["keys", "create", "a", "--rpm", "3", "--max-streams", "2", *data, "--create"])
        == 0
    )
    created = capsys.readouterr()
    assert created.out.startswith("alpk_") and "limits: rpm=3 streams=2" in created.err
    assert hub_main(["keys", "create", "b", "--project", "acme/chat", *data]) == 0
    assert hub_main(["keys", "update", "a", "--tpm", "1000", "--tokens-per-day", "9", *data]) == 0
    assert hub_main(["keys", "update", "a", "--rpm", "0", *data]) == 0
    capsys.readouterr()
    assert hub_main(["keys", "list", *data]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "PROJECT", "CREATED", "STATUS", "LIMITS", "BUDGET"]
    a, b = (line.split() for line in lines[1:])
    assert a[0] == "a"
    assert a[3:] == ["active", "tpm=1000", "tokens/day=9", "streams=2", "priority=standard"]
    assert b[0] == "b" and b[3:] == ["active", "-", "priority=standard"]
    hub = Hub(tmp_path / "hub")
    assert trio.run(hub.keys.limits, "a") == KeyLimits(tpm=1000, tokens_per_day=9, max_streams=2)
    trio.run(hub.store.close)
    assert hub_main(["keys", "update", "nobody", "--rpm", "1", *data]) == 2
    assert hub_main(["keys", "update", "a", *data]) == 2
    assert hub_main(["keys", "create", "c", "--rpm", "-1", *data]) == 2
    assert hub_main(["keys", "update", "a", "--tpm", "lots", *data]) == 2
    err = capsys.readouterr().err
    assert "no active API key named 'nobody'" in err and "needs at least one of" in err
    assert "'-1' is not a whole number" in err and "'lots' is not a whole number" in err
    assert "Traceback" not in err
