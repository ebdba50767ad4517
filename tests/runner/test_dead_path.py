"""A dead path on every connection a runner holds is found in seconds (issue 27 point 4).

Real parts over loopback, all in this process on trio's autojump clock (time is virtual: the
bound is asserted exactly, and nothing depends on how loaded the machine is): the hub, the
simulator, and ``tests/support/pathproxy.py`` in front of the hub for everything the runner sends (its
REST requests, its push-events stream, its channels). The proxy freezes every connection the
runner holds at that moment: its channel, its events stream, the kept-alive connections of its
HTTP pool. A client then asks for a new session's turn at the hub's front door. The runner must
find its dead paths, redial, and serve that turn within 2 x the ping interval + 1 s.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import trio
import trio.testing
from helpers import ADMIN, OWNER, PROJECT, runner_config, running
from pathproxy import path_proxy

from gateway.hub import Hub, open_hub
from gateway.runner.alp import Deadlines
from gateway.sim import SimOptions, open_sim


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


async def chat(client: httpx.AsyncClient, key: str, session: str) -> str:
    """One streamed front-door turn in ``session``: its text."""
    body = {"model": "sim-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"authorization": f"Bearer {key}", "x-chat-session": session}
    text = ""
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    return text


def test_deadlines_follow_the_ping_settings() -> None:
    assert Deadlines.of(20.0, None) == Deadlines(request=20.0, register=30.0, events=40.0)
    assert Deadlines.of(1.0, 3.0) == Deadlines(request=3.0, register=30.0, events=4.0)
    assert Deadlines.of(0.0, None) == Deadlines()  # pings off: the defaults


@pytest.mark.parametrize("ping", [1.0, 20.0], ids=["ping-1s", "ping-20s-default"])
async def test_a_runner_whose_every_connection_froze_serves_a_new_session_in_time(
    ping: float, autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """``ping``: the runner's ping interval and timeout; the hub sends its keepalive comments
    on the events stream every ``ping / 2`` (what the runner asks of a Server), and waits for
    a runner as long as the bound."""
    hub = Hub(admin_token=ADMIN, keepalive_interval=ping / 2, runner_wait_timeout=2 * ping + 10)
    async with (
        open_hub(hub) as (server, url),
        open_sim(options=SimOptions(chunks=5)) as sim,
        path_proxy(port_of(url)) as proxy,
    ):
        config = runner_config(proxy.url, sim.url, tmp_path, ping_interval=ping, ping_timeout=ping)
        key = await server.keys.create("deadpath", f"{OWNER}/{PROJECT}")
        async with (
            running(config) as runner,
            httpx.AsyncClient(base_url=url, timeout=120) as client,
        ):
            whole = "tok0 tok1 tok2 tok3 tok4 "
            assert await chat(client, key, "first") == whole
            await trio.sleep(0.3 * ping)  # polls and the events' keepalives go on as usual
            frozen_at = trio.current_time()
            assert proxy.freeze() >= 2  # at least the channel and the events stream
            with trio.fail_after(120):
                assert await chat(client, key, "second") == whole
            served = trio.current_time() - frozen_at
            with trio.fail_after(120):
                await runner.counters.wait("reconnects", 1)  # the first session's channel too
            redialled = trio.current_time() - frozen_at
        print(f"\nnew session served {served:.2f} s after the freeze; redial {redialled:.2f} s")
        assert served <= 2 * ping + 1
        assert redialled <= 2 * ping + 1
        assert runner.alp is not None and runner.alp.pools_dropped >= 1
