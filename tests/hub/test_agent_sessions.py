"""Each coding agent's own sessions kept apart (issue 37, point 2): the session header each agent
sends by itself (Claude Code's ``X-Claude-Code-Session-Id``, Codex's ``session-id``, OpenCode's
``x-opencode-session``; docs/hub.md "Sessions") makes a session of its own on every chat route,
``X-Chat-Session`` first when both come; and a session that switches between two models its
runner serves keeps its one Chat Job. A real hub, a real runner and the simulator on loopback;
the agents themselves are in tests/e2e/test_agents.py (two concurrent Codex sessions)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from helpers import BACKEND_KEY, OWNER, PROJECT, runner_config, running

from gateway.hub import Hub, open_hub
from gateway.sim import open_sim

ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages": {"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"input": "hi"},
}
AGENT_HEADERS = ("X-Claude-Code-Session-Id", "session-id", "session_id", "x-opencode-session")


@asynccontextmanager
async def hub_path(tmp_path: Path) -> AsyncIterator[tuple[Hub, httpx.AsyncClient]]:
    """A hub, one runner, the simulator serving two models; a client with an API key."""
    async with open_sim(require_key=BACKEND_KEY, models=["m1", "m2"]) as sim:
        async with open_hub(Hub(runner_wait_timeout=10)) as (hub, url):
            config = runner_config(url, sim.url, tmp_path / "state", user_token=hub.admin_token)
            async with running(config):
                key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
                auth = {"Authorization": f"Bearer {key}"}
                async with httpx.AsyncClient(base_url=url, timeout=60, headers=auth) as http:
                    yield hub, http


async def turn(http: httpx.AsyncClient, route: str, model: str, **headers: str) -> Any:
    reply = await http.post(route, json={"model": model, **ROUTES[route]}, headers=headers)
    assert reply.status_code == 200, reply.text
    return reply


async def test_each_agents_session_header_makes_a_session_on_every_route(
    tmp_path: Path,
) -> None:
    async with hub_path(tmp_path) as (hub, http):
        named = []
        for route in ROUTES:
            for name in AGENT_HEADERS:
                sid = f"{name}@{route}"
                await turn(http, route, "m1", **{name: sid})
                named.append(sid)
        # X-Chat-Session first; no header at all: the key's one session
        await turn(http, "/v1/responses", "m1", **{"X-Chat-Session": "ours", "session-id": "x"})
        await turn(http, "/v1/chat/completions", "m1")
        sessions = hub.sessions.listing()
    mine = {sid: job for (key, sid), job in sessions.items() if key == "k"}
    assert set(mine) == {*named, "ours", "default"}
    assert len(set(mine.values())) == len(mine)  # a Chat Job each


async def test_a_session_switching_between_two_models_of_its_runner_keeps_its_job(
    tmp_path: Path,
) -> None:
    """Codex's session asking m1, m2, m1, m2 of a runner that serves both: one Chat Job, never
    ended (no ``chat.end … does not serve``)."""
    async with hub_path(tmp_path) as (hub, http):
        for n in range(4):
            route = ("/v1/responses", "/v1/chat/completions")[n % 2]
            await turn(http, route, ("m1", "m2")[n % 2], **{"session-id": "codex-1"})
        sessions = hub.sessions.listing()
        jobs = [(job.id, job.over) for job in hub.board.jobs.values()]
    (job_id, over), *others = jobs
    assert not others and not over, jobs
    assert sessions[("k", "codex-1")] == job_id
