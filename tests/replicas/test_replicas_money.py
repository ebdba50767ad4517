"""Budgets and priority classes through two replicas on one PostgreSQL (issue 35, point 6): a
key's money budget is exact across both (concurrent turns arriving on both overshoot it by at most
one reservation, then every replica refuses with 429 ``budget_exceeded`` in the caller's API
shape), and an interactive key's turn is served before a background key's queued turns while the
runner is at capacity, the turns arriving on another replica than the runner's.

Two hubs in this process (``tests/test_replicas.py``'s ``replicas``), each on a port of its own,
a runner (the project's own) and the simulator on loopback. Nothing waits on a sleep: the
streams' own lines, the replicas' boards and the queue's depth say when to look again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio
from helpers import ADMIN, OWNER, PROJECT, runner_config, running
from test_replicas import replicas, until

from gateway.hub.money import KeyBudget
from gateway.sim import Simulator

GUARD = 60  # s: a hang guard, never a timing
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
BUDGET = 10.0  # USD a day
HOLD = 4.0  # USD a turn of max_tokens 400 holds at 0.01 a token of output (its reservation)


def _body(**more: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "stream": True,
        "max_tokens": 400,
        "messages": [{"role": "user", "content": "hi"}],
        "sim": {"chunks": 400, "interval": 0.005},  # 400 tokens: 4 USD used, its whole hold
        **more,
    }


async def test_a_money_budget_is_exact_across_two_replicas_then_429_in_each_shape(
    pg_url: str, sim: Simulator, tmp_path: Path
) -> None:
    """Eight long streams at once, four on each replica: the turns admitted hold 4 USD each
    against a budget of 10, so three are admitted wherever they arrive (0, 4 and 8 held are
    under it) and five are refused; 12 USD are spent, over the budget by less than one
    reservation. Then each replica refuses the key, in OpenAI's shape and in Anthropic's."""
    async with replicas(pg_url, 2) as (a, b):
        key = await a.hub.keys.create("k2", f"{OWNER}/{PROJECT}")
        async with httpx.AsyncClient(base_url=b.url, timeout=GUARD, headers=ADMIN_HEADERS) as http:
            price = {"model": "sim-model", "input": 0, "output": 10_000}  # 0.01 a token out
            assert (await http.post("/api/hub/prices", json=price)).status_code == 200
            budget = {"budgetDaily": BUDGET}
            assert (await http.post("/api/hub/keys/k2/budget", json=budget)).status_code == 200
        async with running(
            runner_config(a.url, sim.url, tmp_path / "state", max_sessions=16)
        ) as runner:
            assert runner.registration is not None
            runner_id = runner.registration.id
            await until(lambda: b.hub.board.alive(runner_id), b)
            statuses: dict[str, list[int]] = {"a": [], "b": []}
            with trio.fail_after(GUARD):
                async with trio.open_nursery() as nursery:
                    for n in range(8):
                        name, url = ("a", a.url) if n % 2 else ("b", b.url)
                        nursery.start_soon(_stream, url, key, f"s{n}", statuses[name])
                openai = await _post(b.url, "/v1/chat/completions", key, _body(stream=False))
                anthropic = await _post(a.url, "/v1/messages", key, _body(stream=False))
        rows = await a.hub.store.usage_rows(key_name="k2")
    spent = sum(row["cost"] or 0 for row in rows)
    print(
        f"8 streams at once (4 on each replica) on a budget of {BUDGET:g} USD, {HOLD:g} held a "
        f"turn: statuses a {sorted(statuses['a'])}, b {sorted(statuses['b'])}; {len(rows)} rows, "
        f"{spent:g} USD spent (over the budget by {spent - BUDGET:g}, a reservation {HOLD:g})"
    )
    assert sorted(statuses["a"] + statuses["b"]) == [200] * 3 + [429] * 5
    assert len(rows) == 3 and all(row["outcome"] == "ok" for row in rows)
    assert BUDGET <= spent <= BUDGET + HOLD
    message = f"this API key's daily budget of {BUDGET:g} USD is spent ({spent:g} USD used)"
    assert openai.status_code == 429 and "retry-after" in openai.headers
    error = openai.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "budget_exceeded")
    assert error["message"].startswith(message), error
    assert anthropic.status_code == 429 and "retry-after" in anthropic.headers
    assert anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "rate_limit_error"
    assert anthropic.json()["error"]["message"].startswith(message), anthropic.json()


async def _stream(url: str, key: str, session: str, into: list[int]) -> None:
    """One long stream, read to its end; its status noted."""
    headers = {"Authorization": f"Bearer {key}", "X-Chat-Session": session}
    async with (
        httpx.AsyncClient(timeout=GUARD) as client,
        client.stream("POST", f"{url}/v1/chat/completions", headers=headers, json=_body()) as r,
    ):
        await r.aread()
        into.append(r.status_code)


async def _post(url: str, path: str, key: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "x-api-key": key}
    headers["anthropic-version"] = "2023-06-01"
    async with httpx.AsyncClient(base_url=url, timeout=GUARD) as client:
        return await client.post(path, headers=headers, json=body)


async def test_an_interactive_turn_is_served_first_through_a_replica_while_the_runner_is_full(
    pg_url: str, sim: Simulator, tmp_path: Path
) -> None:
    """One runner of one slot, polling replica A. A background key's turn holds the slot (a
    stream), four more of its turns wait on replica B, then an interactive key's turn arrives on
    B; the stream is cut: the interactive turn is served next, before the four that waited
    longer (each turn a session of its own; a session's job ends ``session_idle_timeout``
    after its turn, freeing the slot)."""
    settings = {"session_idle_timeout": 0.2, "queue_wait": GUARD, "priority_promote_after": 1e6}
    async with replicas(pg_url, 2, **settings) as (a, b):
        keys = {}
        for name in ("background", "interactive"):
            keys[name] = await a.hub.keys.create(name, f"{OWNER}/{PROJECT}")
            assert await a.hub.keys.set_budget(name, KeyBudget(priority=name))
        async with running(
            runner_config(a.url, sim.url, tmp_path / "state", max_sessions=1)
        ) as runner:
            assert runner.registration is not None
            runner_id = runner.registration.id
            await until(lambda: b.hub.board.alive(runner_id), b)
            first_chunk: dict[str, float] = {}
            arrived: dict[str, float] = {}
            holding = trio.Event()
            with trio.fail_after(GUARD):
                async with trio.open_nursery() as clients:
                    hold = trio.CancelScope()

                    async def turn(name: str, text: str, chunks: int) -> None:
                        arrived[text] = trio.current_time()
                        headers = {"Authorization": f"Bearer {keys[name]}", "X-Chat-Session": text}
                        body = {**_body(max_tokens=chunks), "sim": {"chunks": chunks}}
                        async with (
                            httpx.AsyncClient(base_url=b.url, timeout=GUARD) as client,
                            client.stream(
                                "POST", "/v1/chat/completions", headers=headers, json=body
                            ) as r,
                        ):
                            assert r.status_code == 200, await r.aread()
                            async for line in r.aiter_lines():
                                if line.startswith("data: {") and text not in first_chunk:
                                    first_chunk[text] = trio.current_time()

                    async def held() -> None:
                        with hold:  # the slot's holder: a stream cut when everyone waits
                            body = _body(max_tokens=100_000)
                            body["sim"] = {"chunks": 100_000, "interval": 0.01}  # 1000 s
                            headers = {"Authorization": f"Bearer {keys['background']}"}
                            async with (
                                httpx.AsyncClient(base_url=b.url, timeout=GUARD) as client,
                                client.stream(
                                    "POST",
                                    "/v1/chat/completions",
                                    headers={**headers, "X-Chat-Session": "B0"},
                                    json=body,
                                ) as r,
                            ):
                                async for line in r.aiter_lines():
                                    if line.startswith("data: {"):
                                        holding.set()

                    clients.start_soon(held)
                    await holding.wait()
                    waiting = [("background", f"B{i}") for i in range(1, 5)]
                    for n, (name, text) in enumerate([*waiting, ("interactive", "I1")], 1):
                        clients.start_soon(turn, name, text, 8)
                        await until(lambda n=n: _depth(b) == n, b)  # queued in this order
                    hold.cancel()  # the holder's client leaves: its turn ends, then its session
    order = sorted(first_chunk, key=first_chunk.__getitem__)
    waits = {text: round(first_chunk[text] - arrived[text], 3) for text in order}
    print(f"served in the order {order}; waits (s) {waits}")
    assert order == ["I1", "B1", "B2", "B3", "B4"]


def _depth(replica: Any) -> int:
    return sum(replica.hub.snapshot().queue.depth.values())
