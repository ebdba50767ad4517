"""The backend simulator in a process of its own, driven by the bench over stdin.

Commands: ``opts`` (the options every following stream gets, and ``pace``: ``spread`` or
``lockstep``, see ``_Pacing``), ``record`` (keep each stream's
send times from now on, or stop), ``dump`` (the recorded streams: sim id, the bench tag found
in the request body, ``sent_at`` per payload, then forget them).
"""

from __future__ import annotations

import math
import re
from typing import Any

import trio

from bench.common import reply_line, serve_commands
from gateway.sim import SimOptions, Simulator
from gateway.sim import server as sim_server
from gateway.sim.server import serve_sim

TAG = re.compile(rb"bench-tag-([A-Za-z0-9_.-]+)")


class _Pacing:
    """The simulator's ``trio``, but for ``sleep``, which paces the streams one of two ways.

    ``spread``: each stream's events follow a fixed-rate schedule of its own (event k at
    start + ttft + k * interval) instead of a sleep after each write.

    With a sleep after each write, every delay pushes a stream's later events back, and streams
    whose sleeps end in the same scheduler pass stay together from then on: in a second or two,
    64 evenly spread streams have merged into bursts, and the latency measured grows with the
    length of the run. A model server generating at a steady rate per sequence does not drift.

    ``lockstep``: every stream's events fall on one shared grid (the multiples of the interval
    on the clock): each sleep ends at the next grid point, so the events of all running
    streams are released in the same scheduler pass, one write each, as a batched model
    server's decode step releases one token for every running sequence at once. A stream's
    first event (the role chunk, ``ttft`` 0) goes out at once; its tokens then join the grid.
    """

    def __init__(self) -> None:
        self._due: dict[int, float] = {}  # id(task) -> when its last event was due
        self.lockstep = False

    def __getattr__(self, name: str) -> Any:
        return getattr(trio, name)

    async def sleep(self, delay: float) -> None:
        now = trio.current_time()
        if self.lockstep:
            await trio.sleep_until((math.floor(now / delay) + 1) * delay)
            return
        task = id(trio.lowlevel.current_task())
        due = self._due.get(task)
        # a new stream on this connection (or one far behind): its schedule starts now
        due = due + delay if due is not None and now - delay < due + delay else now + delay
        self._due[task] = due
        try:
            await trio.sleep_until(due)
        except BaseException:
            self._due.pop(task, None)
            raise


async def main() -> None:
    pacing = _Pacing()
    sim_server.trio = pacing  # type: ignore[assignment]
    async with trio.open_nursery() as nursery:
        sim: Simulator = await nursery.start(
            lambda task_status: serve_sim(
                record=False, models=["sim-model"], task_status=task_status
            )
        )
        reply_line({"url": sim.url, "port": sim.port})

        async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
            if cmd["cmd"] == "opts":
                opts = dict(cmd["opts"])
                pace = opts.pop("pace", "spread")
                if pace not in ("spread", "lockstep"):
                    raise ValueError(f"unknown pace {pace!r}")
                pacing.lockstep = pace == "lockstep"
                sim.options = SimOptions(**opts)
                return {"ok": True}
            if cmd["cmd"] == "record":
                sim.clear()
                sim.record = bool(cmd["on"])
                return {"ok": True}
            if cmd["cmd"] == "dump":
                streams = []
                for rec in sim.streams:
                    found = TAG.search(rec.body)
                    streams.append(
                        {
                            "id": rec.id,
                            "tag": found.group(1).decode() if found else None,
                            "sent_at": rec.sent_at,
                        }
                    )
                sim.clear()
                return {"streams": streams}
            raise ValueError(f"unknown command {cmd['cmd']!r}")

        await serve_commands(handle)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main)
