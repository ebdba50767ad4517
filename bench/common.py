"""What every part of the bench shares: process CPU and memory counters, child processes
driven by one JSON line per command, percentiles, and the machine's description."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


# -- /proc counters ---------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces: split after its closing parenthesis
    return raw[raw.rindex(b")") + 2 :].decode().split()


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (a proxy may run workers of its own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def _schedstat_ns(pid: int) -> int | None:
    """CPU time (user + system) of every live thread of ``pid`` in ns (/proc/PID/task/*/schedstat)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


def cpu_seconds(pid: int, tree: bool = False) -> float:
    """User + system CPU time of ``pid`` (and its descendants).

    From the kernel's per-thread run time (schedstat, ns resolution) where it is kept, else from
    /proc/PID/stat utime + stime (10 ms ticks: too coarse for a one-second run).
    """
    total = 0.0
    for p in descendants(pid) if tree else [pid]:
        ns = _schedstat_ns(p) if _SCHEDSTAT else None
        if ns is not None:
            total += ns / 1e9
            continue
        fields = _stat_fields(p)
        if fields is not None:
            total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)
    return total


_SCHEDSTAT = os.path.exists("/proc/self/schedstat")


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (VmRSS)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * _PAGE


# -- statistics ---------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile (nearest rank on the sorted values); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[rank]


# -- the machine ------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "kernel": platform.release(),
    }


# -- child processes ----------------------------------------------------------------------


class Child:
    """A bench child process: JSON commands on its stdin, one JSON line back per command."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self.env = env
        self.cwd = cwd  # where it runs (``python -m`` imports from there first)
        self.proc: trio.Process | None = None
        self._buf = b""
        self._lock = trio.Lock()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self, rpc: bool = True, within: float = 60) -> dict[str, Any] | None:
        """Start it; with ``rpc`` wait for its first line (its address, as JSON)."""
        log = self._open_log()
        self.proc = await trio.lowlevel.open_process(
            self.argv,
            stdin=subprocess.PIPE if rpc else subprocess.DEVNULL,
            stdout=subprocess.PIPE if rpc else log,
            stderr=log,
            env=self.env,
            cwd=self.cwd,
        )
        if not rpc:
            return None
        with trio.fail_after(within):
            return await self._line()

    def _open_log(self) -> Any:
        return open(self.log_path, "wb")  # kept open for the child's life

    async def _line(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        while b"\n" not in self._buf:
            data = await self.proc.stdout.receive_some(65536)
            if not data:
                raise RuntimeError(f"{self.name} exited; see {self.log_path}")
            self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    async def rpc(self, cmd: str, within: float = 120, **args: Any) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        async with self._lock:
            await self.proc.stdin.send_all(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
            with trio.fail_after(within):
                reply = await self._line()
        if "error" in reply:
            raise RuntimeError(f"{self.name} {cmd}: {reply['error']}")
        return reply

    def cpu(self, tree: bool = False) -> float:
        return cpu_seconds(self.pid, tree)

    def rss(self) -> int:
        return rss_bytes(self.pid)

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.terminate()
        with trio.move_on_after(5):
            await self.proc.wait()
            return
        self.proc.kill()
        await self.proc.wait()


async def serve_commands(handle: Any) -> None:
    """In a child: read JSON commands from stdin, answer each with ``await handle(cmd)`` on stdout.

    A closed stdin (the bench went away) ends the child.
    """
    stdin = trio.lowlevel.FdStream(os.dup(0))
    buf = b""
    while True:
        data = await stdin.receive_some(65536)
        if not data:
            return
        buf += data
        while b"\n" in buf:
            line, _, buf = buf.partition(b"\n")
            cmd = json.loads(line)
            try:
                reply = await handle(cmd)
            except Exception as exc:  # reported to the bench, which stops with it
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            reply_line(reply)


async def serve_commands_asyncio(handle: Any) -> None:
    """``serve_commands`` for a child on asyncio (the peer, the asyncio floor)."""
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    async for line in stdin:
        cmd = json.loads(line)
        try:
            reply = await handle(cmd)
        except Exception as exc:  # reported to the bench, which stops with it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        reply_line(reply)


def reply_line(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()
