"""Money (issue 35, points 1 and 2): model prices, each turn's cost fixed at the price in force
as it ended and its cost at a reference price, shown by ``hub usage`` and ``/api/hub/usage``;
budgets in money per API key, the turn's worst case reserved at admission and settled at its
end, refused with 429 ``budget_exceeded`` in the caller's API shape with when it resets; exact
across two replicas on PostgreSQL.

A real hub on loopback, the fake runner (tests/support/fake_runner.py) on trio's autojump clock, the
accounting's wall clock (the UTC day and month) set by hand; the replicas with the simulator."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from fake_runner import USAGE, Script
from helpers import hub_command, runner_config, running
from test_causes import ADMIN, GUARD, OWNER, PROJECT, chat, error_of
from test_key_limits import served
from test_replicas import replicas, until

from gateway.hub.money import Price, month_start, next_month
from gateway.hub.store import UsageRecord
from gateway.sim import Simulator

DAY = 86400
MIDNIGHT = 1_700_006_400  # a UTC midnight (2023-11-15)
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}


async def admin(url: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
        return await http.request(method, path, headers=ADMIN_HEADERS, **kwargs)


async def test_each_turn_costs_the_price_in_force_as_it_ended_with_its_reference_cost(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "hub"
    async with served(data, {"other": Script(usage=True)}) as (hub, url, _runner, ended):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        with trio.fail_after(GUARD):
            # 2 and 4 per million input tokens, 10 and 20 output; a reference of 100 / 300
            price = {"model": "fake-model", "input": 2, "output": 10, "reference": "hosted-x"}
            price |= {"referenceInput": 100, "referenceOutput": 300}
            assert (await admin(url, "POST", "/api/hub/prices", json=price)).status_code == 200
            assert (await chat(url, key, "a")).status_code == 200
            await ended.count(1)
            price |= {"input": 4, "output": 20}
            assert (await admin(url, "POST", "/api/hub/prices", json=price)).status_code == 200
            assert (await chat(url, key, "a")).status_code == 200
            assert (await chat(url, key, "b", model="other")).status_code == 200
            await ended.count(3)
            listed = (await admin(url, "GET", "/api/hub/prices")).json()
            usage = (await admin(url, "GET", "/api/hub/usage", params={"since": 0})).json()
            bad = await admin(url, "POST", "/api/hub/prices", json={"model": "m", "input": -1})
            rows = await hub.store.usage_rows()
    await hub.store.close()
    prompt, completion = USAGE["prompt_tokens"], USAGE["completion_tokens"]
    first = (prompt * 2 + completion * 10) / 1e6
    second = (prompt * 4 + completion * 20) / 1e6
    reference = (prompt * 100 + completion * 300) / 1e6
    assert [(r["model"], r["cost"], r["ref_cost"]) for r in rows] == [
        ("fake-model", pytest.approx(first), pytest.approx(reference)),
        ("fake-model", pytest.approx(second), pytest.approx(reference)),
        ("other", None, None),  # a model with no price: it costs 0, said so
    ]
    assert listed["currency"] == "USD"
    assert listed["prices"] == [Price("fake-model", 4, 20, "hosted-x", 100, 300).as_json()]
    assert usage["currency"] == "USD"
    assert usage["cost"]["total"] == pytest.approx(first + second)
    assert usage["cost"]["referenceTotal"] == pytest.approx(2 * reference)
    assert usage["cost"]["perKey"]["k"]["cost"] == pytest.approx(first + second)
    assert usage["cost"]["perModel"]["fake-model"]["cost"] == pytest.approx(first + second)
    assert sorted(row["unpriced"] for row in usage["usage"]) == [0, 1]
    assert bad.status_code == 400 and error_of(bad)["message"].startswith('"input" must be')
    # the command line: the same costs from the store, and the prices
    capsys.readouterr()
    assert await hub_command(autojump_clock, ["usage", "--since", "7d", "--data", str(data)]) == 0
    out = capsys.readouterr().out
    assert "COST (USD)" in out and "AT REFERENCE (USD)" in out and "no price" in out
    assert f"total cost {first + second:.4f} USD ({2 * reference:.4f} USD at reference)" in out
    assert "1 turn(s) of models with no price, counted 0" in out
    assert await hub_command(autojump_clock, ["prices", "list", "--data", str(data)]) == 0
    out = capsys.readouterr().out
    assert out == (
        "fake-model: 4 / 20 USD per million tokens (input / output); reference (hosted-x) "
        "100 / 300 USD\n"
    )


async def test_a_gpu_priced_model_costs_its_electricity_at_the_measured_throughput(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "hub"
    from gateway.hub.store import open_store

    store = open_store(data, create=True)
    # 100 prompt tokens in 0.5 s (200 a second), 60 completion tokens in 3 s more (20 a second)
    for _ in range(2):
        await store.add_usage(
            UsageRecord(
                "id", "k", "s", "chat", "gpu-model", True, "ok", None, None, 50, 30, 0.25, 1.75
            ),
            time.time(),
        )
    await store.close()
    argv = ["prices", "set", "gpu-model", "--watts", "360", "--kwh-price", "0.5"]
    assert await trio.to_thread.run_sync(_hub, [*argv, "--data", str(data)]) == 0
    out = capsys.readouterr().out
    # 360 W at 0.5 a kWh: 0.18 an hour, 0.00005 a second; over 200 tokens a second that is
    # 0.25 per million, over 20 2.5
    assert out.startswith(
        "price of 'gpu-model': 0.25 / 2.5 USD per million tokens (input / output), from 360 W "
        "at 0.5 USD/kWh"
    )
    assert (
        await trio.to_thread.run_sync(
            _hub, ["prices", "set", "x", "--watts", "3", "--data", str(data)]
        )
        == 2
    )
    assert "--watts and --kwh-price go together" in capsys.readouterr().err


def _hub(argv: list[str]) -> int:
    from gateway.hub.cli import main

    return main(argv)


async def test_a_daily_budget_reserves_each_turns_worst_case_and_refuses_in_every_shape(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = trio.Event()
    scripts = {"gated": Script(gate=gate, usage=True)}
    wall = [MIDNIGHT + 20 * 3600.0]
    async with served(scripts=scripts) as (hub, url, runner, ended):
        hub.accounting.clock = lambda: wall[0]
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        budget = {"budgetDaily": 25, "priority": "interactive"}
        set_budget = await admin(url, "POST", "/api/hub/keys/k/budget", json=budget)
        for model in ("gated", "fake-model"):  # 1 a token of output, input free
            price = {"model": model, "input": 0, "output": 1_000_000}
            assert (await admin(url, "POST", "/api/hub/prices", json=price)).status_code == 200
        with trio.fail_after(GUARD):
            # five at once, each holding its max_tokens (10) at the price: 0, 10 and 20 held
            # are under 25, so three are admitted; 30 is not, so two are refused
            replies: list[httpx.Response] = []
            two_refused = trio.Event()

            async def one(i: int) -> None:
                replies.append(await chat(url, key, f"s{i}", model="gated", max_tokens=10))
                if len(replies) == 2:
                    two_refused.set()

            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(one, i)
                await runner.wait_until(lambda: len(runner.turns) == 3)
                await two_refused.wait()  # the gated three cannot answer before the gate
                assert len(runner.turns) == 3
                gate.set()
            await ended.count(5)
            # settled at what they used: 3 tokens each, 9; then one at a time until refused
            served_after = 0
            while (reply := await chat(url, key, "a", max_tokens=10)).status_code == 200:
                served_after += 1
            headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
            body = {
                "model": "fake-model",
                "max_tokens": 10,
                "messages": [{"role": "user", "content": "hi"}],
            }
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                anthropic = await http.post("/v1/messages", headers=headers, json=body)
                responses = await http.post(
                    "/v1/responses",
                    headers={"Authorization": f"Bearer {key}"},
                    json={"model": "fake-model", "input": "hi", "max_output_tokens": 10},
                )
            listing = (await admin(url, "GET", "/api/hub/keys")).json()["keys"]
            wall[0] = MIDNIGHT + DAY + 1.0  # the next UTC day: the budget is fresh
            next_day = await chat(url, key, "a", max_tokens=10)
    assert set_budget.status_code == 200 and set_budget.json()["budgetDaily"] == 25
    assert sorted(r.status_code for r in replies) == [200, 200, 200, 429, 429]
    # 9 spent: 9, 12, 15, 18, 21, 24 are under 25 (6 served), 27 is not
    assert served_after == 6
    spent = 9 + 6 * USAGE["completion_tokens"]
    assert spent < 25 + 10  # past the budget by less than one turn's reservation
    wait = 4 * 3600
    message = (
        f"this API key's daily budget of 25 USD is spent ({spent} USD used): it resets at "
        f"2023-11-16T00:00:00Z, retry in {wait} s"
    )
    assert reply.status_code == 429 and reply.headers["retry-after"] == str(wait)
    assert error_of(reply) == {
        "message": message,
        "type": "rate_limit_error",
        "param": None,
        "code": "budget_exceeded",
    }
    assert anthropic.status_code == 429 and anthropic.headers["retry-after"] == str(wait)
    assert anthropic.json() == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": message},
    }
    assert responses.status_code == 429
    assert responses.json()["error"]["code"] == "budget_exceeded"
    assert responses.json()["error"]["message"] == message
    assert [(k["name"], k["budgetDaily"], k["priority"]) for k in listing] == [
        ("k", 25, "interactive")
    ]
    assert next_day.status_code == 200


async def test_a_monthly_budget_resets_with_the_utc_month_and_survives_a_restart(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    end_of_month = next_month(MIDNIGHT) - 3600.0  # 23:00 on the month's last day
    wall = [end_of_month]
    data = tmp_path / "hub"
    argv = ["--data", str(data)]
    async with served(data) as (hub, url, _runner, ended):
        hub.accounting.clock = lambda: wall[0]
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        with trio.fail_after(GUARD):
            # another process sets the budget and the price (applied within key_check_interval)
            update = ["keys", "update", "k", "--budget-monthly", "4", *argv]
            assert await hub_command(autojump_clock, update) == 0
            price = ["prices", "set", "fake-model", "--input", "0", "--output", "1000000"]
            assert await hub_command(autojump_clock, [*price, *argv]) == 0
            await trio.sleep(hub.settings.key_check_interval)
            first = await chat(url, key, "a", max_tokens=1)  # 3 spent
            await ended.count(1)
            second = await chat(url, key, "a", max_tokens=1)  # 3 + 1 held < 4: 6 spent
            await ended.count(2)
            refused = await chat(url, key, "a", max_tokens=1)
    await hub.store.close()
    async with served(data) as (hub, url, _runner, ended):  # restarted: the month is read back
        hub.accounting.clock = lambda: wall[0]
        with trio.fail_after(GUARD):
            after_restart = await chat(url, key, "a", max_tokens=1)
            wall[0] = end_of_month + 3600.0 + 1.0  # the next month
            next_month_reply = await chat(url, key, "a", max_tokens=1)
    await hub.store.close()
    out = capsys.readouterr().out
    assert "API key 'k' budget/month=4 USD priority=standard" in out
    assert [first.status_code, second.status_code] == [200, 200]
    for reply in (refused, after_restart):
        assert reply.status_code == 429 and reply.headers["retry-after"] == "3600"
        assert error_of(reply)["code"] == "budget_exceeded"
        assert (
            "monthly budget of 4 USD is spent (6 USD used): it resets at"
            in (error_of(reply)["message"])
        )
    assert next_month_reply.status_code == 200
    assert month_start(wall[0]) == end_of_month + 3600.0


async def test_budgets_are_exact_across_replicas(
    pg_url: str, sim: Simulator, tmp_path: Path
) -> None:
    async with replicas(pg_url, 2) as (a, b):
        key = await a.hub.keys.create("k", f"{OWNER}/{PROJECT}")
        async with httpx.AsyncClient(base_url=a.url, timeout=30, headers=ADMIN_HEADERS) as http:
            # 0.01 a token of output: a turn of max_tokens 400 holds 4; a budget of 10 admits
            # three at once (0, 4 and 8 held are under it), wherever they arrive
            price = {"model": "sim-model", "input": 0, "output": 10_000}
            assert (await http.post("/api/hub/prices", json=price)).status_code == 200
            budget = {"budgetDaily": 10}
            assert (await http.post("/api/hub/keys/k/budget", json=budget)).status_code == 200
        async with running(
            runner_config(b.url, sim.url, tmp_path / "state", max_sessions=16)
        ) as runner:
            assert runner.registration is not None
            runner_id = runner.registration.id
            await until(lambda: a.hub.board.alive(runner_id), a)
            split = [a.url, b.url, a.url, b.url, a.url]
            statuses = await _statuses(split, key)
            assert sorted(statuses) == [200, 200, 200, 429, 429], statuses
            # the three streamed whole: 4 each, 12 spent
        refusal = await _one(b.url, key, "late")
        late_a = await _one(a.url, key, "late")
    for reply in (refusal, late_a):
        assert reply.status_code == 429
        assert reply.json()["error"]["code"] == "budget_exceeded"
        assert "daily budget of 10 USD is spent" in reply.json()["error"]["message"]


def _body(**more: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "stream": True,
        "max_tokens": 400,
        "messages": [{"role": "user", "content": "hi"}],
        "sim": {"chunks": 400, "interval": 0.025},
        **more,
    }


async def _one(url: str, key: str, session: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(
            f"{url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}", "X-Chat-Session": session},
            json=_body(sim={"chunks": 2}),
        )


async def _statuses(urls: list[str], key: str) -> list[int]:
    """One long stream to each URL at once, each read to its end; their statuses."""
    statuses: list[int] = []

    async def one(n: int, url: str) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            headers = {"Authorization": f"Bearer {key}", "X-Chat-Session": f"s{n}"}
            async with client.stream(
                "POST", f"{url}/v1/chat/completions", headers=headers, json=_body()
            ) as response:
                statuses.append(response.status_code)
                await response.aread()

    async with trio.open_nursery() as nursery:
        for n, url in enumerate(urls):
            nursery.start_soon(one, n, url)
    return statuses
