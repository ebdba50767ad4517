"""A BASELINE, not part of the gateway: the plain asyncio + aiohttp runner a user would write.

No features, just the relay: the obvious minimal Kind B runner, written as the issue's
independent harness describes it, so that the bench can hold the runner against it. Per
channel: an aiohttp WebSocket; each ``chat.completion.request`` frame starts a task that POSTs
the body to the backend with an aiohttp client, reads ``async for line in resp.content``, and
sends one ``ws.send_str`` per ``data:`` line, the frame built by string concatenation around
the payload (no JSON re-encoding), then a done frame (an error frame for a non-200); a
non-streamed answer (JSON) goes up whole as one chunk frame, as the runner sends it.

The control plane (register, poll, claim, report) is left out: the bench hands it the
channel URLs of its jobs (``dial`` command), and it dials each one as the runner dials a
job's ``channelUrl``. Driven over stdin like the other bench children (one JSON line per
command, one back): ``dial {"urls": [...]}``, ``status``.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
from typing import Any

import aiohttp

from bench.common import reply_line, serve_commands_asyncio


class Peer:
    def __init__(self, backend: str, ca_file: str | None) -> None:
        self.url = backend.rstrip("/") + "/chat/completions"
        self.ssl = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self.session: aiohttp.ClientSession | None = None
        self.channels: list[asyncio.Task[None]] = []
        self.turns: set[asyncio.Task[None]] = set()
        self.chunks = 0

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0)  # as many backend connections as turns
        self.session = aiohttp.ClientSession(connector=connector)

    async def dial(self, url: str) -> None:
        assert self.session is not None
        ws = await self.session.ws_connect(url, ssl=self.ssl if url.startswith("wss:") else True)
        self.channels.append(asyncio.create_task(self.channel(ws)))

    async def channel(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        async for msg in ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            frame = json.loads(msg.data)
            if frame.get("type") == "chat.completion.request":
                task = asyncio.create_task(self.turn(ws, frame))
                self.turns.add(task)
                task.add_done_callback(self.turns.discard)

    async def turn(self, ws: aiohttp.ClientWebSocketResponse, frame: dict[str, Any]) -> None:
        assert self.session is not None
        job, rid = frame["jobId"], frame["requestId"]
        ids = '"jobId":"' + job + '","requestId":"' + rid + '"'
        head = '{"type":"chat.completion.chunk",' + ids + ',"chunk":'
        body = frame["body"]
        if frame.get("model"):
            body["model"] = frame["model"]
        try:
            async with self.session.post(
                self.url, json=body, headers={"accept": "text/event-stream"}
            ) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    error = json.dumps(f"backend returned {resp.status}: {text}")
                    await ws.send_str(
                        '{"type":"chat.completion.error",' + ids + ',"error":' + error + "}"
                    )
                    return
                if not resp.content_type.startswith("text/event-stream"):
                    # a non-streamed answer: the whole completion as one chunk
                    whole = await resp.read()
                    await ws.send_str(head + whole.decode() + "}")
                    self.chunks += 1
                    await ws.send_str('{"type":"chat.completion.done",' + ids + "}")
                    return
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    await ws.send_str(head + data.decode() + "}")
                    self.chunks += 1
            await ws.send_str('{"type":"chat.completion.done",' + ids + "}")
        except (aiohttp.ClientError, OSError) as exc:
            error = json.dumps(f"backend unreachable: {exc}")
            await ws.send_str('{"type":"chat.completion.error",' + ids + ',"error":' + error + "}")


async def main(backend: str, ca_file: str | None) -> None:
    peer = Peer(backend, ca_file)
    await peer.start()

    async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["cmd"] == "dial":
            for url in cmd["urls"]:
                await peer.dial(url)
            return {"ok": True}
        if cmd["cmd"] == "status":
            return {"turns": len(peer.turns), "chunks": peer.chunks}
        raise ValueError(f"unknown command {cmd['cmd']!r}")

    reply_line({"ok": True})
    await serve_commands_asyncio(handle)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
