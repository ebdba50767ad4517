"""What a new user trips on, answered (issue 31, points 2 and 8), against a real hub on loopback:
a stream whose client hangs up right after ``data: [DONE]`` is counted ``ok``; a credential used
where another belongs is told which one belongs there."""

from __future__ import annotations

import json
import socket

import httpx
import trio
from fake_runner import FakeRunner
from test_causes import ADMIN, OWNER, PROJECT, hub_of

from gateway.hub import open_hub
from gateway.hub.turn import Turn


async def test_a_client_that_hangs_up_right_after_done_is_counted_ok() -> None:
    """curl and the OpenAI SDK close the connection as soon as they read ``data: [DONE]``: that
    turn was whole (5 of 5 such streams were counted ``client_gone``)."""
    async with open_hub(hub_of()) as (hub, url), trio.open_nursery() as nursery:
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        fake = FakeRunner(url, ADMIN, owner=OWNER, project=PROJECT)
        await nursery.start(fake.run)
        ended: list[Turn] = []
        got = trio.Event()

        def observe(turn: Turn) -> None:
            ended.append(turn)
            if len(ended) == 5:
                got.set()

        hub.accounting.observers.append(observe)
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps(
            {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        ).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        with trio.fail_after(30):
            for _ in range(5):
                sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                await sock.connect((host, int(port)))
                await sock.send(head + body)
                seen = b""
                while b"data: [DONE]\n\n" not in seen:
                    seen += await sock.recv(65536)
                sock.close()  # at once, as curl does
            await got.wait()
        nursery.cancel_scope.cancel()
    assert [t.outcome for t in ended] == ["ok"] * 5


async def test_a_credential_used_where_another_belongs_is_told_which() -> None:
    async with open_hub(hub_of()) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        async with httpx.AsyncClient(base_url=url) as http:
            # the admin credential used as an API key
            chat = await http.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": []},
                headers={"Authorization": f"Bearer {ADMIN}"},
            )
            # an API key used to register a runner
            register = await http.post(
                f"/api/owners/{OWNER}/projects/{PROJECT}/runners",
                json={"name": "box"},
                headers={"Authorization": f"Bearer {key}"},
            )
    assert chat.status_code == 401
    assert "admin credential, not an API key" in chat.json()["error"]["message"]
    assert "hub keys create" in chat.json()["error"]["message"]
    assert register.status_code == 403
    message = register.json()["error"]["message"]
    assert "API key" in message and "enrollment token (alpe_" in message  # issue 34
