"""Connections of a hub under a fleet (issue 39, point 4): runners and clients have budgets of
their own, so runners at theirs never lock clients out; past either one the caller gets a 503 in
its API's shape at once; a hub out of file descriptors answers a new connection 503 at once
instead of leaving it to time out; the hub raises its file limit at start and says what it holds.
A real hub on loopback (the last test: in a process of its own, its file limit lowered)."""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from helpers import ADMIN, register_runner

from gateway.hub import Hub, open_hub

OWNER, PROJECT = "acme", "chat"
BASE = f"/api/owners/{OWNER}/projects/{PROJECT}"
GUARD = 5000.0  # s of virtual time: a hang guard


def _hub(**settings: Any) -> Hub:
    return Hub(
        admin_token=ADMIN,
        max_runner_connections=3,
        max_client_connections=3,
        runner_wait_timeout=1e6,
        keepalive_interval=1e6,
        offline_after=1e6,
        ping_interval=0.0,
        **settings,
    )


async def _waiting_turns(hub: Hub, n: int) -> None:
    """Until ``n`` front-door turns wait in the dispatcher (their requests are in progress)."""
    while sum(len(p.waiting) for p in hub.dispatcher._projects.values()) < n:
        await trio.testing.wait_all_tasks_blocked()


async def test_runners_at_their_budget_do_not_lock_clients_out(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_hub(_hub()) as (hub, url), AsyncExitStack() as stack:
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        token = (await register_runner(hub, OWNER, PROJECT, "box", ["chat-llm:v1"]))["token"]
        runner = {"Authorization": f"Bearer {token}"}
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=GUARD))
        with trio.fail_after(GUARD):
            for _ in range(3):  # the runners' budget: three push streams in progress
                events = await stack.enter_async_context(
                    http.stream("GET", f"{BASE}/runners/events", headers=runner)
                )
                assert events.status_code == 200
            refused = await http.post(
                f"{BASE}/runners/jobs", json={"capabilities": ["chat-llm:v1"]}, headers=runner
            )
            models = await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "too_many_connections"
    assert refused.headers["retry-after"] == "1"
    assert models.status_code == 200  # the clients' budget is their own
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "budget" in r.message]
    assert len(warned) == 1 and "runners'" in warned[0].message


async def test_clients_past_their_budget_get_503_in_their_apis_shape_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(_hub()) as (hub, url), trio.open_nursery() as nursery:
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        token = (await register_runner(hub, OWNER, PROJECT, "box", ["chat-llm:v1"]))["token"]
        auth = {"Authorization": f"Bearer {key}"}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:

            async def hold(headers: dict[str, str]) -> None:
                try:
                    await http.post("/v1/chat/completions", json=body, headers=headers)
                except httpx.HTTPError:  # cut at the test's end
                    pass

            with trio.fail_after(GUARD):
                for n in range(3):  # three turns waiting for a runner: the clients' budget
                    nursery.start_soon(hold, {**auth, "X-Chat-Session": f"s{n}"})
                await _waiting_turns(hub, 3)
                start = trio.current_time()
                chat = await http.post("/v1/chat/completions", json=body, headers=auth)
                messages = await http.post(
                    "/v1/messages", json={**body, "max_tokens": 5}, headers=auth
                )
                took = trio.current_time() - start
                poll = await http.post(
                    f"{BASE}/runners/jobs",
                    json={"capabilities": []},
                    headers={"Authorization": f"Bearer {token}"},
                )
            nursery.cancel_scope.cancel()
    assert chat.status_code == 503, (chat.status_code, chat.headers, chat.text)
    assert chat.json()["error"]["code"] == "too_many_connections"  # OpenAI's shape
    assert messages.status_code == 503
    assert messages.json()["type"] == "error"  # Anthropic's shape
    assert took == 0  # at once: no wait on the virtual clock
    assert poll.status_code == 204  # the runners' budget is their own


HUB_SCRIPT = """
import json, os, resource, sys, trio
from gateway.hub import Hub, serve_hub
resource.setrlimit(resource.RLIMIT_NOFILE, (FDS, FDS))
async def main():
    hub = Hub(admin_token="alpa_budget_test_admin", head_timeout=600.0)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_hub, hub)
        eaten = []
        while True:  # the descriptors used up (by the store, logs, anything): accept fails
            try:
                eaten.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        print(json.dumps({"url": url}), flush=True)
trio.run(main)
"""


def test_a_hub_out_of_file_descriptors_answers_503_at_once(tmp_path: Path) -> None:
    """A hub whose descriptors are all used (its file limit at 120): every new connection gets a
    503 at once, never left to time out in the backlog, said in one warning line."""
    limit = 120
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    log_file = (tmp_path / "hub.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-c", HUB_SCRIPT.replace("FDS", str(limit))],
        stdout=subprocess.PIPE,
        stderr=log_file,
        text=True,
        env=env,
    )
    held: list[socket.socket] = []
    answers: list[bytes] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, (tmp_path / "hub.log").read_text()
        url = json.loads(line)["url"]
        host, port = url.removeprefix("http://").split(":")
        for _ in range(3):
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
            answers.append(sock.recv(4096))  # the timeout: a guard, the answer comes at once
            sock.close()
    finally:
        for sock in held:
            sock.close()
        proc.kill()
        proc.wait()
        log_file.close()
    log = (tmp_path / "hub.log").read_text()
    assert all(a.startswith(b"HTTP/1.1 503") for a in answers), answers
    assert all(b"too_many_connections" in a for a in answers)
    assert log.count("cannot accept connections") == 1, log


async def test_the_hub_raises_its_file_limit_and_says_what_it_holds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    caplog.set_level(logging.INFO, logger="gateway.hub")
    async with open_hub(Hub(admin_token=ADMIN)):
        pass
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    said = [r.message for r in caplog.records if r.message.startswith("file limit")]
    assert said == [
        f"file limit {hard}: up to {min(16384, hard - 64)} connections "
        "(runners' budget 12288, clients' 4096)"
    ], (said, soft)
