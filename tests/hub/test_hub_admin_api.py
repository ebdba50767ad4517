"""The hub's admin JSON API behind the status page (runners, sessions, turns, usage, keys) and
its Prometheus ``/metrics``: a real runner and the simulator, the official openai client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import trio
from helpers import ADMIN, OWNER
from helpers import PROJECT as PROJECT_NAME
from prometheus_client.parser import text_string_to_metric_families

from gateway.hub import Hub
from gateway.hub.accounting import LimitExceeded
from gateway.hub.dispatcher import WaitStats
from gateway.runner.supervisor import Runner
from gateway.sim import Simulator

LIMIT = 15  # s: no step may take longer
PROJECT = f"{OWNER}/{PROJECT_NAME}"
MESSAGES = [{"role": "user", "content": "hello there"}]


@dataclass
class Env:
    hub: Hub
    base: str
    runner: Runner
    sim: Simulator

    def admin(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=LIMIT
        )

    def client(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=LIMIT
        )


@pytest.fixture
async def env(hub: tuple[Hub, str], sim: Simulator, runner: Runner) -> AsyncIterator[Env]:
    yield Env(hub[0], hub[1], runner, sim)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics text by (name, sorted labels)."""
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


async def test_every_data_route_needs_the_admin_credential(env: Env) -> None:
    routes = [
        ("GET", "/api/hub/runners"),
        ("GET", "/api/hub/turns"),
        ("GET", "/api/hub/usage"),
        ("GET", "/api/hub/keys"),
        ("POST", "/api/hub/keys"),
        ("POST", "/api/hub/keys/revoke"),
        ("DELETE", "/api/hub/keys/tester"),
        ("GET", "/metrics"),
        ("POST", "/metrics"),  # no 405 either without the credential
    ]
    key = await env.hub.keys.create("tester", PROJECT)
    async with httpx.AsyncClient(base_url=env.base, timeout=LIMIT) as client:
        for method, path in routes:
            r = await client.request(method, path)
            assert r.status_code == 401, (method, path)
            r = await client.request(method, path, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 403, (method, path)
    assert [k["revoked"] for k in await env.hub.keys.listing()] == [False]


async def test_runners_sessions_turns_and_keys(env: Env) -> None:
    key = await env.hub.keys.create("tester", PROJECT)
    client = env.client(key)
    with trio.fail_after(LIMIT):
        await client.models.list()  # the runner lists its models
    async with env.admin() as admin:
        with trio.fail_after(LIMIT):
            # a slow streamed turn: seen in flight, with its pace, then counted for its key
            stream = await client.chat.completions.create(
                model="sim-model",
                messages=MESSAGES,  # type: ignore[arg-type]
                stream=True,
                extra_body={"sim": {"chunks": 6, "interval": 0.05}},
            )
            chunks = 0
            async for _chunk in stream:
                chunks += 1
                if chunks == 2:
                    turns = (await admin.get("/api/hub/turns")).json()["turns"]
                    [turn] = turns
                    assert turn["key"] == "tester" and turn["model"] == "sim-model"
                    assert turn["runnerId"] in env.hub.board.runners
                    assert turn["chunks"] >= 1 and turn["stream"] is True
                    assert turn["tokensPerSecond"] is None or turn["tokensPerSecond"] >= 0
                    sessions = (await admin.get("/api/hub/sessions")).json()["sessions"]
                    [session] = sessions
                    assert session["key"] == "tester" and session["session"] == "default"
                    assert session["runnerId"] == turn["runnerId"] and session["turns"] == 1
                    [runner] = (await admin.get("/api/hub/runners")).json()["runners"]
                    assert runner["id"] == turn["runnerId"]
                    assert runner["name"] == "test-runner" and runner["up"] is True
                    assert runner["models"] == env.sim.models
                    assert runner["sessions"] == 1 and runner["turnsInFlight"] == 1
                    assert runner["project"] == "chat" and runner["owner"] == "acme"
            assert (await admin.get("/api/hub/turns")).json() == {"turns": []}
            keys = (await admin.get("/api/hub/keys")).json()
            [entry] = keys["keys"]
            assert entry["name"] == "tester" and entry["revoked"] is False
            assert "key" not in entry and keys["limitsSupported"] is True
            # the simulator's usage: a token per word of the prompt, one per chunk
            assert entry["used"] == {
                "turns": 1,
                "promptTokens": 2,
                "completionTokens": 6,
                "refused": 0,
            }
            usage = (await admin.get("/api/hub/usage", params={"since": "0"})).json()
            assert usage["since"] == 0 and isinstance(usage["usage"], list)
            assert (await admin.get("/api/hub/usage", params={"since": "x"})).status_code == 400


async def test_create_and_revoke_keys(env: Env) -> None:
    async with env.admin() as admin:
        with trio.fail_after(LIMIT):
            r = await admin.post("/api/hub/keys", json={"name": "alice", "project": "acme/chat"})
            assert r.status_code == 201 and r.headers["cache-control"] == "no-store"
            made = r.json()
            assert made["name"] == "alice" and made["project"] == "acme/chat"
            client = env.client(made["key"])
            reply = await client.chat.completions.create(model="sim-model", messages=MESSAGES)  # type: ignore[arg-type]
            assert reply.choices[0].message.content
            r = await admin.post("/api/hub/keys", json={"name": "alice"})
            assert r.status_code == 409
            for bad in ({}, {"name": ""}, {"name": "b", "rpm": 0}, {"name": "b", "rpm": "1"}):
                assert (await admin.post("/api/hub/keys", json=bad)).status_code == 400, bad
            assert (await admin.post("/api/hub/keys", content=b"[")).status_code == 400
            r = await admin.post("/api/hub/keys", json={"name": "bob"})
            assert r.status_code == 201
            # revoked: by POST .../revoke or DELETE; its requests are refused at once
            r = await admin.post("/api/hub/keys/revoke", json={"name": "alice"})
            assert r.status_code == 200 and r.json() == {"name": "alice", "revoked": True}
            with pytest.raises(openai.AuthenticationError):
                await client.chat.completions.create(model="sim-model", messages=MESSAGES)  # type: ignore[arg-type]
            assert (await admin.delete("/api/hub/keys/bob")).status_code == 200
            assert (await admin.delete("/api/hub/keys/bob")).status_code == 404
            assert (await admin.post("/api/hub/keys/revoke", json={"name": "x"})).status_code == 404
            keys = {k["name"]: k for k in (await admin.get("/api/hub/keys")).json()["keys"]}
            assert keys["alice"]["revoked"] and keys["bob"]["revoked"]
            assert keys["alice"]["used"]["turns"] == 1


async def test_metrics(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    key = await env.hub.keys.create("tester", PROJECT)
    client = env.client(key)
    with trio.fail_after(LIMIT):
        stream = await client.chat.completions.create(
            model="sim-model",
            messages=MESSAGES,  # type: ignore[arg-type]
            stream=True,
            extra_body={"sim": {"chunks": 3}},
        )
        async for _chunk in stream:
            pass

        # a limit refusal as the accounting answers one: 429 before the turn is served
        async def refuse(turn: Any) -> None:
            raise LimitExceeded("rpm", "rpm limit of the key passed", 1)

        monkeypatch.setattr(env.hub.accounting, "admit", refuse)
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="sim-model", messages=MESSAGES)  # type: ignore[arg-type]
        monkeypatch.undo()

        # the queues, as the dispatcher keeps them
        waits = WaitStats()
        for seconds in (0.25, 0.25, 0.5, 1.5, 0.0):
            waits.add(seconds)
        monkeypatch.setattr(env.hub.dispatcher, "waits", waits)
        monkeypatch.setattr(env.hub.dispatcher, "depth", lambda: {"acme/chat": 3})
        async with env.admin() as admin:
            r = await admin.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    found = samples(r.text)
    model = (("model", "sim-model"),)
    ok = (("key", "tester"), ("model", "sim-model"), ("outcome", "ok"))
    refused = (("key", "tester"), ("model", "sim-model"), ("outcome", "refused"))
    assert found[("alp_hub_turns_total", ok)] == 1
    assert found[("alp_hub_turns_total", refused)] == 1
    assert found[("alp_hub_limit_refusals_total", (("key", "tester"),))] == 1
    prompt = (("key", "tester"), ("kind", "prompt"), ("model", "sim-model"))
    completion = (("key", "tester"), ("kind", "completion"), ("model", "sim-model"))
    assert found[("alp_hub_tokens_total", prompt)] == 2
    assert found[("alp_hub_tokens_total", completion)] == 3
    assert found[("alp_hub_ttft_seconds_count", model)] == 1
    assert found[("alp_hub_turn_duration_seconds_count", model)] == 1
    assert found[("alp_hub_ttft_seconds_bucket", (("le", "+Inf"), *model))] == 1
    assert found[("alp_hub_runners_up", ())] == 1
    assert found[("alp_hub_runners_connected", ())] == 1
    assert found[("alp_hub_sessions", ())] == 1
    assert found[("alp_hub_turns_in_flight", ())] == 0
    assert ("alp_hub_failovers_total", ()) in found
    assert found[("alp_hub_pings_sent_total", ())] == env.hub.counters.pings_sent
    assert found[("alp_hub_queue_depth", (("project", "acme/chat"),))] == 3
    assert found[("alp_hub_queue_waits_total", ())] == 5
    assert found[("alp_hub_queue_wait_seconds_total", ())] == 2.5
    assert found[("alp_hub_queue_longest_wait", ())] == 1.5
    # a hub serving alone is no team's replica: no replica info, no replica label
    assert not [name for name, labels in found if name.startswith("alp_hub_replica")]
    assert not [name for name, labels in found if "replica" in dict(labels)]
