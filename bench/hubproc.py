"""The hub (control plane, Chat Channel and front door) in a process of its own, driven over stdin.

Commands: ``apikey`` (a front-door key), ``enqueue`` (Kind B jobs, optionally carrying their own
channel URL so the runner dials the bench's lean sink instead of the hub), ``hubsink`` (streams
through a channel that ends in this hub, read by the hub's own receive path: how fast can the
hub take frames?), ``jobs`` (how many jobs are in each state). With a directory as its argument
the hub keeps its store there (a file, as a deployed hub does: each turn's usage row is a write
to it), else in memory.

``BENCH_HUB_WITHOUT`` (``ledger``, ``metrics`` or both, comma-separated) serves turns without
that part of the hub's per-turn bookkeeping, to measure what it costs (``python -m
bench.turnprofile --hub-without``): ``ledger`` is the usage journal's two lines and the row
queued for the store, ``metrics`` the turn's counters and histograms. Never a way to run a hub.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any

import msgspec
import trio

from bench.common import reply_line, serve_commands
from gateway.heap import HUB_YOUNG, settle
from gateway.hub import Hub, serve_hub
from gateway.hub.store import DEFAULT_KEY_PROJECT
from gateway.wire import protocol

ADMIN = "alpa_bench_admin_credential"
OWNER, PROJECT = DEFAULT_KEY_PROJECT.split("/")
DEFINITION = {"jobType": "chat_llm", "needs": [protocol.CAPABILITY]}


WITHOUT = ("ledger", "metrics")


def without(hub: Hub, parts: str) -> None:
    """``hub`` (started: its journal taken on) without the bookkeeping ``parts`` names."""
    for part in filter(None, (p.strip() for p in parts.split(","))):
        if part == "ledger":
            hub.store.journal = None  # no start and end lines (the batch writer seals none)
            hub.accounting.write_row = lambda turn, wall: None  # type: ignore[method-assign]
        elif part == "metrics":
            hub.accounting.observers.remove(hub.metrics.observe)
        else:
            raise SystemExit(f"BENCH_HUB_WITHOUT: {part!r} is none of {', '.join(WITHOUT)}")


class _Count:
    """Chunk frames taken by the hub's own receive path, and when the last one came."""

    def __init__(self) -> None:
        self.events = 0
        self.last = 0.0


class _Turn:
    """A sink (``gateway.hub.channel.Sink``) that only counts a turn's chunks."""

    def __init__(self, count: _Count, ended: trio.Event) -> None:
        self.count, self.ended = count, ended

    def chunk(self, chunk: Any, frame: bytes) -> None:
        self.count.events += 1
        self.count.last = time.perf_counter()

    def flush(self) -> None:
        pass

    def reply(self, frame: Any) -> None:
        self.ended.set()

    def lost(self) -> bool:
        self.ended.set()
        return False

    def resume_count(self) -> int:
        return 0

    def resumed(self) -> None:
        pass


async def main() -> None:
    # ``python -m bench.hubproc [DATA_DIR]``: the store in DATA_DIR (SQLite in WAL mode, as
    # ``alp-gateway hub`` keeps it), else in memory
    data_dir = sys.argv[1] if len(sys.argv) > 1 else None
    hub = Hub(data_dir, admin_token=ADMIN, offline_after=3600.0)
    sink_job: list[str] = []

    async def hubsink(streams: int, body: dict[str, Any]) -> dict[str, Any]:
        if not sink_job:
            sink_job.append(
                (
                    await hub.board.enqueue(OWNER, PROJECT, [protocol.CAPABILITY], dict(DEFINITION))
                ).id
            )
        job_id = sink_job[0]
        ch = await hub.channels.wait(job_id, 30)
        assert ch is not None, "no runner took the hub-sink job"
        count = _Count()
        raw = msgspec.json.encode(body)

        async def one(rid: str) -> None:
            ended = trio.Event()
            ch.open(rid, _Turn(count, ended))
            frame = protocol.RequestFrame(job_id, rid, msgspec.Raw(raw))
            await ch.send(protocol.encode_frame(frame))
            await ended.wait()
            ch.close_request(rid)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(one, uuid.uuid4().hex)
        return {"events": count.events, "elapsed": count.last - start}

    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_hub, hub)
        without(hub, os.environ.get("BENCH_HUB_WITHOUT", ""))
        reply_line({"url": url, "admin": ADMIN, "project": DEFAULT_KEY_PROJECT})

        async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
            if cmd["cmd"] == "apikey":
                return {"key": await hub.keys.create(f"bench-{uuid.uuid4().hex[:8]}")}
            if cmd["cmd"] == "enqueue":
                definition = dict(DEFINITION)
                if cmd.get("channel_url"):
                    definition["channelUrl"] = cmd["channel_url"]
                ids = [
                    (
                        await hub.board.enqueue(
                            OWNER, PROJECT, [protocol.CAPABILITY], dict(definition)
                        )
                    ).id
                    for _ in range(cmd["n"])
                ]
                return {"ids": ids}
            if cmd["cmd"] == "hubsink":
                return await hubsink(cmd["streams"], cmd["body"])
            if cmd["cmd"] == "seen":
                return {"runners": len(hub.board.last_seen)}
            if cmd["cmd"] == "jobs":
                states: dict[str, int] = {}
                for job in await hub.board.all_jobs.values():
                    states[job.status] = states.get(job.status, 0) + 1
                return {"states": states}
            raise ValueError(f"unknown command {cmd['cmd']!r}")

        await serve_commands(handle)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    # as ``alp-gateway hub`` does before it serves (gateway/hub/cli.py): the start-up heap
    # frozen, the young generation sized for a server (gateway/heap.py)
    settle(HUB_YOUNG)
    trio.run(main)
