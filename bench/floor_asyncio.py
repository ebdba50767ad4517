"""The asyncio floor: the least an asyncio relay does, in a process of its own.

The same job and wire as the trio floors (``bench/floor.py``): session sockets dialled to the
bench's floor sink, requests on them (``<length>\\n<body>``), each POSTed to the backend over a
kept-alive connection, the backend's response bytes written to the session socket unchanged
as they come. Asyncio streams: ``StreamReader.read`` for each backend read and
``transport.write`` (no lock: asyncio's write is synchronous and buffers what does not fit).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from bench.common import reply_line, serve_commands_asyncio

_END = b"\r\n0\r\n\r\n"
_RECV = 65536


class Floor:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
            "content-type: application/json\r\naccept: text/event-stream\r\ncontent-length: "
        ).encode()
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.active = 0
        self.forwarded = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def forward(self, body: bytes, out: asyncio.StreamWriter) -> None:
        self.active += 1
        try:
            if self.idle:
                reader, writer = self.idle.pop()
            else:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            writer.write(self.head + b"%d\r\n\r\n" % len(body) + body)
            read = reader.read
            write = out.write
            tail = b""
            while True:
                data = await read(_RECV)
                if not data:
                    writer.close()
                    return
                write(data)
                self.forwarded += len(data)
                tail = (tail + data[-7:])[-7:]
                if tail == _END:
                    self.idle.append((reader, writer))
                    return
        finally:
            self.active -= 1

    async def session(self, reader: asyncio.StreamReader, out: asyncio.StreamWriter) -> None:
        buf = b""
        while True:
            data = await reader.read(_RECV)
            if not data:
                return
            buf += data
            while True:
                head, sep, rest = buf.partition(b"\n")
                if not sep or len(rest) < int(head):
                    break
                size = int(head)
                task = asyncio.create_task(self.forward(rest[:size], out))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
                buf = rest[size:]


async def main(host: str, port: int) -> None:
    floor = Floor(host, port)
    sessions: list[asyncio.Task[None]] = []

    async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["cmd"] == "dial":
            for _ in range(cmd["n"]):
                reader, writer = await asyncio.open_connection(cmd["host"], cmd["port"])
                sessions.append(asyncio.create_task(floor.session(reader, writer)))
            return {"ok": True}
        if cmd["cmd"] == "status":
            return {"active": floor.active, "bytes": floor.forwarded}
        raise ValueError(f"unknown command {cmd['cmd']!r}")

    reply_line({"ok": True})
    await serve_commands_asyncio(handle)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
