"""A client that stops reading ends its own turn, never another turn of the same channel: its
backlog is bounded (``client_backlog``), past it the turn ends with an error event and the runner
is told to stop (``chat.completion.cancel``: the backend request is closed)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import openai
import trio
from helpers import BACKEND_KEY, OWNER, PROJECT, runner_config, running

from gateway.hub import Hub, open_hub
from gateway.sim import open_sim


def _request(port: int, key: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: hub\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + key.encode() + b"\r\nx-chat-session: shared\r\n"
        b"content-length: %d\r\n\r\n" % len(data)
    ) + data


async def test_a_client_that_stops_reading_ends_its_own_turn_only(tmp_path: Path) -> None:
    async with open_sim(require_key=BACKEND_KEY) as sim:
        hub = Hub(client_backlog=32 * 1024, runner_wait_timeout=10)
        async with open_hub(hub) as (hub_, url):
            config = runner_config(url, sim.url, tmp_path, user_token=hub_.admin_token)
            async with running(config) as runner:
                key = await hub_.keys.create("k", f"{OWNER}/{PROJECT}")
                port = int(url.rsplit(":", 1)[1])
                oc = openai.AsyncOpenAI(
                    base_url=url + "/v1",
                    api_key=key,
                    max_retries=0,
                    timeout=30,
                    default_headers={"X-Chat-Session": "shared"},
                )
                with trio.fail_after(60):
                    # the session's job and channel first, so both turns share that channel
                    await oc.chat.completions.create(
                        model="sim-model", messages=[{"role": "user", "content": "hi"}]
                    )
                    # the slow client: a small receive buffer, and it never reads
                    slow = trio.socket.socket()
                    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                    await slow.connect(("127.0.0.1", port))
                    big = {"chunks": 100000, "chunk_size": 1000, "interval": 0}  # 100 MB
                    await slow.send(
                        _request(
                            port,
                            key,
                            {
                                "model": "sim-model",
                                "stream": True,
                                "messages": [{"role": "user", "content": "slow"}],
                                "sim": big,
                            },
                        )
                    )
                    # meanwhile a reading client streams on the same session and channel
                    stream = await oc.chat.completions.create(
                        model="sim-model",
                        stream=True,
                        messages=[{"role": "user", "content": "steady"}],
                        extra_body={"sim": {"chunks": 200, "interval": 0}},
                    )
                    pieces = [c.choices[0].delta.content async for c in stream if c.choices]
                    assert "".join(p or "" for p in pieces).count("tok") == 200
                    # the runner was told (chat.completion.cancel) and stopped the turn
                    await runner.counters.wait("turns_cancelled", 1)
                    slow_stream = next(s for s in sim.streams if b'"slow"' in s.body)
                    await slow_stream.finished.wait()  # its backend request is over
                    # what the slow client finally reads: its backlog, then the error, then EOF
                    got = b""
                    while data := await slow.recv(65536):
                        got += data
                    slow.close()
    assert slow_stream.client_closed and not slow_stream.completed  # cut, not run to its end
    assert b"data: [DONE]" not in got
    assert len(got) < 100000 * 1000  # cut short, not the whole stream
    assert hub_.counters.turns_overrun == 1
