"""A BASELINE, not part of the gateway: the plain aiohttp Server a user would write in an afternoon.

No features, just the pairing: the obvious minimal Server to put in front of the plain runner
(``bench/peer.py``), written as issue 18's independent harness describes it, so that the bench
can hold "hub + runner" against "plain Server + plain runner" end to end.

- ``GET /channel?jobId=...``: the WebSocket the plain runner dials (one per session). Every
  incoming text frame is ``json.loads``-ed and handed to the turn waiting for its ``requestId``.
- ``POST /v1/chat/completions``: a bearer check against one key; ``X-Chat-Session`` picks the
  channel (a new session takes the next channel, round-robin; no header: round-robin per
  request); the body goes down as ``chat.completion.request`` (``json.dumps``), and each
  ``chat.completion.chunk`` comes back as ``data: <json.dumps(chunk)>\\n\\n`` written with
  aiohttp's ``StreamResponse``; ``chat.completion.done`` → ``data: [DONE]``; an error frame →
  a ``data: {"error": ...}`` event, then ``[DONE]``. A non-streamed request (no ``"stream":
  true``) gets the runner's one chunk (the backend's whole completion) as a JSON answer.

No control plane (no jobs, no claims, no reconnects, no keys store): the bench tells the plain
runner this Server's channel URLs. Driven over stdin like the other bench children (one JSON
line per command, one back): the first line out is ``{"url", "channel_url"}``; commands
``channels`` (how many are open), ``status``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from typing import Any

from aiohttp import WSMsgType, web

from bench.common import reply_line, serve_commands_asyncio

KEY = "sk-plain-bench"


class PlainServer:
    def __init__(self, key: str) -> None:
        self.key = key
        self.channels: list[tuple[str, web.WebSocketResponse]] = []
        self.sessions: dict[str, tuple[str, web.WebSocketResponse]] = {}
        self.turns: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self.next = itertools.count()
        self.chunks = 0

    async def channel(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        entry = (request.query.get("jobId", uuid.uuid4().hex), ws)
        self.channels.append(entry)
        try:
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                frame = json.loads(msg.data)
                queue = self.turns.get(frame.get("requestId", ""))
                if queue is not None:
                    queue.put_nowait(frame)
        finally:
            self.channels.remove(entry)
            for sid in [s for s, e in self.sessions.items() if e is entry]:
                del self.sessions[sid]
        return ws

    def pick(self, session: str | None) -> tuple[str, web.WebSocketResponse]:
        if session is not None and session in self.sessions:
            return self.sessions[session]
        entry = self.channels[next(self.next) % len(self.channels)]
        if session is not None:
            self.sessions[session] = entry
        return entry

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": "bad key"}, status=401)
        if not self.channels:
            return web.json_response({"error": "no runner connected"}, status=503)
        body = await request.json()
        job_id, ws = self.pick(request.headers.get("X-Chat-Session"))
        rid = uuid.uuid4().hex
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.turns[rid] = queue
        try:
            frame = {
                "type": "chat.completion.request",
                "jobId": job_id,
                "requestId": rid,
                "body": body,
            }
            await ws.send_str(json.dumps(frame))
            if not body.get("stream"):
                return await self.whole(queue)
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await resp.prepare(request)
            while True:
                frame = await queue.get()
                kind = frame.get("type")
                if kind == "chat.completion.chunk":
                    chunk = json.dumps(frame["chunk"], separators=(",", ":"))
                    await resp.write(b"data: " + chunk.encode() + b"\n\n")
                    self.chunks += 1
                elif kind == "chat.completion.error":
                    error = json.dumps({"error": {"message": frame.get("error")}})
                    await resp.write(b"data: " + error.encode() + b"\n\n")
                    break
                elif kind == "chat.completion.done":
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            del self.turns[rid]

    async def whole(self, queue: asyncio.Queue[dict[str, Any]]) -> web.Response:
        """A non-streamed turn: the runner's one chunk (the backend's whole completion) as the
        answer, or its error."""
        answer: Any = None
        while True:
            frame = await queue.get()
            kind = frame.get("type")
            if kind == "chat.completion.chunk":
                answer = frame["chunk"]
            elif kind == "chat.completion.error":
                return web.json_response({"error": {"message": frame.get("error")}}, status=502)
            elif kind == "chat.completion.done":
                if answer is None:
                    return web.json_response({"error": {"message": "no answer"}}, status=502)
                return web.json_response(answer)


async def main() -> None:
    server = PlainServer(KEY)
    app = web.Application()
    app.router.add_get("/channel", server.channel)
    app.router.add_post("/v1/chat/completions", server.completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["cmd"] == "channels":
            return {"n": len(server.channels)}
        if cmd["cmd"] == "status":
            return {"turns": len(server.turns), "chunks": server.chunks}
        raise ValueError(f"unknown command {cmd['cmd']!r}")

    reply_line(
        {
            "url": f"http://127.0.0.1:{port}",
            "port": port,
            "channel_url": f"ws://127.0.0.1:{port}/channel",
            "key": KEY,
        }
    )
    try:
        await serve_commands_asyncio(handle)
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
