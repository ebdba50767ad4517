"""``python -m bench.fleet``: one hub on SQLite under a fleet (issue 39): many protocol-speaking
runners in this one process, their sessions open, front-door clients streaming; the hub's costs
as the fleet grows, as one table.

Each fake runner registers, keeps the push stream (``GET .../runners/events``) open, polls every
``--poll`` s (its phase spread) and at each ``job_available``, claims what a poll offers, and
holds one Chat Channel per session it took (the hub's pings answered by trio_websocket's pongs),
with a progress heartbeat every ``--heartbeat`` s and a model list when asked. A turn is
answered with a few chunk frames. The hub runs in its own process (``bench/fleethub.py``, from
``--hub-path``'s checkout: ``before`` and ``after`` side by side), measured from ``/proc``.

Figures per point (runners/sessions): the hub's RSS; idle CPU (% of a core, nothing asked);
a poll's and a ping's marginal CPU (µs: ``--polls`` polls of one more runner, as many pings on one
channel, each answered before the next, the idle rate taken out); a new
session's TTFT p50 and hub CPU (``--new`` sessions one after another: enough that the full
garbage collections they cause weigh in at their rate, not by luck); short turns a second with
``--clients`` clients on open sessions, and the hub's CPU a turn. ``--profile`` samples the hub
(py-spy) in the idle, new-session (for ``--idle`` s, at least ``--new``) and turns phases;
``--perf`` records the idle window with ``perf`` (the kernel's part too).

An idle event is read against a baseline measured in the same point, right after the idle
window: what a bare trio loop spends to answer pings as far apart as the idle events were
(``bench/wakefloor.py``; a bare epoll loop's is kept in the JSON). On a virtual machine an event
that finds a process asleep costs several times what the same work costs back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.parse
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio
import trio_websocket

from bench.common import cpu_seconds, percentile, rss_bytes
from bench.lighthttp import LightHttp
from gateway.wire import protocol

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OWNER, PROJECT = "local", "chat"
MODEL = "fleet-model"
SIZES = "10/100,100/1000,100/5000,1000/5000,1000/10000"
PING_EVERY = 20.0  # s: a runner's ping on a quiet channel (``ping_interval``, both ends' default)
CHUNK = json.dumps(
    {
        "id": "chatcmpl-fleet",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}],
    }
).encode()
LAST = json.dumps(
    {
        "id": "chatcmpl-fleet",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
    }
).encode()


@dataclass
class Fleet:
    """The fake runners' shared state and counts."""

    base: str
    admin: str
    http: httpx.AsyncClient
    poll_every: float
    heartbeat: float
    polls: int = 0
    pushes: int = 0
    claims: int = 0
    lost_claims: int = 0
    sessions: int = 0
    errors: int = 0
    heartbeats: int = 0
    pings: int = 0
    keepalives: int = 0  # the push streams' keepalive comments
    liveness: bool = False  # the hub's hello named it: the channel stands for the heartbeats
    channels: list[trio_websocket.WebSocketConnection] = field(default_factory=list)
    taken: set[str] = field(default_factory=set)


class FakeRunner:
    """One runner of the fleet (see the module's docstring)."""

    def __init__(self, fleet: Fleet, n: int) -> None:
        self.fleet = fleet
        self.name = f"fleet-{n}"
        self.token = ""
        self.auth: dict[str, str] = {}
        self.wake = trio.Event()
        netloc = urllib.parse.urlsplit(fleet.base)
        self.light = LightHttp(netloc.hostname or "127.0.0.1", netloc.port or 80)

    async def register(self) -> None:
        f = self.fleet
        reply = await f.http.post(
            f"{f.base}/api/owners/{OWNER}/projects/{PROJECT}/runners",
            json={"name": self.name, "labels": []},
            headers={"Authorization": f"Bearer {f.admin}"},
        )
        reply.raise_for_status()
        self.token = reply.json()["token"]
        self.auth = {"Authorization": f"Bearer {self.token}"}

    def url(self, tail: str) -> str:
        return f"{self.fleet.base}/api/owners/{OWNER}/projects/{PROJECT}/{tail}"

    @staticmethod
    def path(tail: str) -> str:
        return f"/api/owners/{OWNER}/projects/{PROJECT}/{tail}"

    async def run(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._events)
        await trio.sleep(random.uniform(0, self.fleet.poll_every))  # the timers spread
        while True:
            try:
                await self.poll(nursery)
            except (OSError, EOFError, ValueError):  # counted, and polled again as a runner does
                self.fleet.errors += 1
            with trio.move_on_after(self.fleet.poll_every):
                await self.wake.wait()
            self.wake = trio.Event()

    async def poll(self, nursery: trio.Nursery | None) -> None:
        f = self.fleet
        f.polls += 1
        light, token = self.light, self.token
        reply = await light.request(
            "POST", self.path("runners/jobs"), token, {"capabilities": [protocol.CAPABILITY]}
        )
        if reply.status != 200 or nursery is None:
            return
        for job in reply.json().get("jobs") or []:
            if job["id"] in f.taken:
                continue
            claim = await light.request(
                "POST",
                self.path("runners/generate-jitconfig"),
                token,
                {"jobId": job["id"], "name": self.name},
            )
            f.claims += 1
            if claim.status != 200:
                f.lost_claims += 1
                continue
            f.taken.add(job["id"])
            nursery.start_soon(self._session, job["id"], claim.json()["runId"])

    async def _events(self) -> None:
        f = self.fleet
        while True:
            try:
                stream = await self.light.events(self.path("runners/events"), self.token)
                async with stream:
                    rest = b""
                    while data := await stream.receive_some(65536):
                        *events, rest = (rest + data).split(b"\n\n")  # whole events only
                        for event in events:
                            if b"event: job_available" in event:
                                f.pushes += 1
                                self.wake.set()
                            elif b": keepalive" in event:
                                f.keepalives += 1
            except OSError:
                pass
            f.errors += 1  # the stream ended
            await trio.sleep(1.0)

    async def _session(self, job_id: str, run_id: str) -> None:
        try:
            await self._serve_session(job_id, run_id)
        except (OSError, EOFError, ValueError, trio_websocket.ConnectionClosed):
            self.fleet.errors += 1  # counted: the fleet goes on

    async def _serve_session(self, job_id: str, run_id: str) -> None:
        f = self.fleet
        report = self.path(f"runs/{run_id}/jobs/{job_id}")
        await self.light.request("PATCH", report, self.token, {"status": "in_progress"})
        f.sessions += 1
        authority = urllib.parse.urlsplit(f.base).netloc
        query = urllib.parse.urlencode({"jobId": job_id, "token": self.token})
        async with trio.open_nursery() as nursery:
            try:
                async with trio_websocket.open_websocket_url(
                    f"ws://{authority}/api/lives/chat/channel/ws?{query}",
                    max_message_size=1 << 24,
                ) as ws:
                    hello = json.loads(await ws.get_message())
                    extensions = hello.get("extensions") or []
                    if protocol.LIVENESS in extensions:
                        f.liveness = True
                    else:  # a hub without it wants a heartbeat every --heartbeat s
                        nursery.start_soon(self._heartbeats, report + "/progress")
                    nursery.start_soon(self._pings, ws)
                    f.channels.append(ws)
                    try:
                        await self._serve(ws, job_id)
                    finally:
                        f.channels.remove(ws)
            except (trio_websocket.ConnectionClosed, trio_websocket.HandshakeError, OSError):
                f.errors += 1
            nursery.cancel_scope.cancel()
        f.sessions -= 1
        body = {"status": "completed", "conclusion": "success", "logs": "", "completionReason": ""}
        await self.light.request("PATCH", report, self.token, body)

    async def _heartbeats(self, url: str) -> None:
        every = self.fleet.heartbeat
        await trio.sleep(random.uniform(0, every))
        while True:
            await self.light.request("POST", url, self.token, {"stage": "serving", "message": None})
            self.fleet.heartbeats += 1
            await trio.sleep(every)

    async def _pings(self, ws: trio_websocket.WebSocketConnection) -> None:
        """A ping every ``PING_EVERY`` s, as our runner's keepalive sends one on a quiet channel
        (these channels are quiet between turns)."""
        await trio.sleep(random.uniform(0, PING_EVERY))
        while True:
            try:
                await ws.ping()
            except trio_websocket.ConnectionClosed:
                return  # the session's reader sees it end
            self.fleet.pings += 1
            await trio.sleep(PING_EVERY)

    async def _serve(self, ws: trio_websocket.WebSocketConnection, job_id: str) -> None:
        while True:
            frame = json.loads(await ws.get_message())
            kind = frame.get("type")
            if kind == protocol.COMPLETION_REQUEST:
                frames = protocol.TurnFrames(job_id, frame["requestId"])
                for payload in (CHUNK, CHUNK, LAST):
                    await ws.send_message(frames.chunk(payload).decode())
                await ws.send_message(frames.done.decode())
            elif kind == protocol.MODELS_REQUEST:
                await ws.send_message(protocol.models_frame(job_id, frame["requestId"], [MODEL]))
            elif kind == protocol.END:
                return


async def turn(http: httpx.AsyncClient, base: str, key: str, session: str) -> float:
    """One short streamed turn on ``session``: seconds to its first content chunk."""
    body = {
        "model": MODEL,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    headers = {"Authorization": f"Bearer {key}", "X-Chat-Session": session}
    start = time.perf_counter()
    first: float | None = None
    async with http.stream(
        "POST", f"{base}/v1/chat/completions", json=body, headers=headers
    ) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"turn: {resp.status_code} {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    assert first is not None, "no chunk"
    return first


async def _profile(pid: int, seconds: float, name: str) -> None:
    """``py-spy record`` on the hub for a phase: the collapsed stacks and the functions with the
    most samples (inclusive, the epoll wait left out) in ``bench/profiles/fleet-<name>.*``."""
    out = HERE / "profiles"
    out.mkdir(exist_ok=True)
    raw = out / f"fleet-{name}.collapsed"
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
    argv = [spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "250", "-f", "raw"]
    await trio.run_process([*argv, "-o", str(raw), "--nonblocking"], capture_stdout=True)
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if "get_events" in frames[-1]:
            continue
        total += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    lines = [f"{total} samples on CPU (epoll's wait left out)"]
    lines += [f"{100 * n / max(total, 1):5.1f}%  {f}" for f, n in inclusive.most_common(60)]
    (out / f"fleet-{name}.txt").write_text("\n".join(lines) + "\n")


def _user_system(pid: int) -> tuple[int, int]:
    """The hub's user and system CPU so far, in clock ticks (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return int(fields[11]), int(fields[12])


async def _perf(pid: int, seconds: float, name: str) -> None:
    """``perf record -g`` on the hub for a phase (the kernel's part too): the functions with the
    most samples, self and with their callees, in ``bench/profiles/fleet-<name>.perf.txt``."""
    out = HERE / "profiles"
    out.mkdir(exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix="fleet-perf-")) / "perf.data"  # large: not kept
    argv = ["perf", "record", "-g", "-F", "499", "-p", str(pid), "-o", str(data)]
    await trio.run_process(
        [*argv, "--", "sleep", str(int(seconds))], capture_stdout=True, capture_stderr=True
    )
    report = [
        "perf",
        "report",
        "-i",
        str(data),
        "--stdio",
        "--no-children",
        "--percent-limit",
        "0.5",
        "-g",
        "none",
        "--sort",
        "sym",
    ]
    done = await trio.run_process(report, capture_stdout=True, capture_stderr=True)
    (out / f"fleet-{name}.perf.txt").write_bytes(done.stdout)
    shutil.rmtree(data.parent, ignore_errors=True)


def _hub_log() -> Any:
    """Where the hub's stderr goes: ``FLEET_HUB_LOG``'s file, else nowhere."""
    where = os.environ.get("FLEET_HUB_LOG")
    return open(where, "a") if where else subprocess.DEVNULL  # noqa: SIM115 (the hub's, for its life)


def _hub(hub_path: Path, data_dir: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(hub_path))
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "fleethub.py"), data_dir],
        stdout=subprocess.PIPE,
        # FLEET_HUB_LOG=FILE: the hub's log there (FLEET_HUB_GC=1: its full collections too)
        stderr=_hub_log(),
        text=True,
        env=env,
        cwd=str(hub_path),
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


async def point(args: argparse.Namespace, runners: int, sessions: int) -> dict[str, Any]:
    data_dir = tempfile.mkdtemp(prefix="fleet-")
    proc, hello = _hub(Path(args.hub_path), data_dir)
    pid, base, key = proc.pid, hello["url"], hello["key"]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    out: dict[str, Any] = {"runners": runners, "sessions": sessions}
    windows: dict[str, list[float]] = {}  # each phase's start and end (the monotonic clock)
    try:
        async with (
            httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as http,
            trio.open_nursery() as nursery,
        ):
            fleet = Fleet(base, hello["admin"], http, args.poll, args.heartbeat)
            fleet_runners = [FakeRunner(fleet, n) for n in range(runners)]
            with trio.fail_after(args.setup_timeout):
                async with trio.open_nursery() as reg:
                    for r in fleet_runners:
                        reg.start_soon(r.register)
                for r in fleet_runners:
                    nursery.start_soon(r.run, nursery)
                # the sessions, opened a few at a time
                names = [f"s{n}-{uuid.uuid4().hex[:8]}" for n in range(sessions)]
                limiter = trio.CapacityLimiter(args.open_parallel)

                opened = 0

                async def open_one(name: str) -> None:
                    nonlocal opened
                    async with limiter:
                        await turn(http, base, key, name)
                    opened += 1

                async def progress() -> None:
                    while True:
                        await trio.sleep(10)
                        print(
                            f"  {runners}/{sessions}: {opened} sessions open, "
                            f"{fleet.sessions} held, claims {fleet.claims} "
                            f"(lost {fleet.lost_claims}), polls {fleet.polls}",
                            file=sys.stderr,
                            flush=True,
                        )

                started = time.perf_counter()
                async with trio.open_nursery() as opening:
                    opening.start_soon(progress)
                    async with trio.open_nursery() as each:
                        for name in names:
                            each.start_soon(open_one, name)
                    opening.cancel_scope.cancel()
                out["setup_s"] = round(time.perf_counter() - started, 1)
            # idle once every channel's runner has pinged since its session's first turn: the
            # hub at rest, not the tail of the setting up (the last turns' channels and requests)
            await trio.sleep(PING_EVERY + 2.0)
            out["rss_mb"] = round(rss_bytes(pid) / 1e6)
            # idle
            seen0 = fleet.polls + fleet.heartbeats + fleet.pings + fleet.keepalives
            fds0 = len(os.listdir(f"/proc/{pid}/fd"))
            c0, t0, ticks0 = cpu_seconds(pid), time.perf_counter(), _user_system(pid)
            windows["idle"] = [time.monotonic()]
            if args.profile:
                await _profile(pid, args.idle, f"idle-{runners}-{sessions}")
            elif args.perf:
                await _perf(pid, args.idle, f"idle-{runners}-{sessions}")
            else:
                await trio.sleep(args.idle)
            idle_rate = (cpu_seconds(pid) - c0) / (time.perf_counter() - t0)
            windows["idle"].append(time.monotonic())
            out["idle_pct"] = round(100 * idle_rate, 1)
            user, system = (b - a for a, b in zip(ticks0, _user_system(pid), strict=True))
            out["idle_fds"] = [fds0, len(os.listdir(f"/proc/{pid}/fd"))]
            out["idle_system_share"] = round(system / max(user + system, 1), 2)
            # the idle events a second, as counted by the fleet: polls, push keepalives,
            # heartbeats, the runners' pings; and the hub's own pings, which the fleet's
            # WebSockets answer unseen: one a channel every 20 s from a hub that pings on a
            # schedule (one without the liveness extension), none from one that pings a quiet
            # channel only (ours are pinged by their runners)
            seen = fleet.polls + fleet.heartbeats + fleet.pings + fleet.keepalives - seen0
            events = seen / args.idle + (0.0 if fleet.liveness else sessions / PING_EVERY)
            out["idle_events_s"] = round(events)
            out["idle_event_us"] = round(1e6 * idle_rate / events)
            # the least an idle event costs a server on this machine now: a bare loop's answer to
            # pings as far apart as the idle events were (bench/wakefloor.py)
            floor = await trio.run_process(
                [
                    *(sys.executable, "-m", "bench.wakefloor", "--gap", f"{1 / events:.5f}"),
                    *("--events", str(max(50, min(2000, round(5 * events))))),  # ~5 s a loop
                ],
                capture_stdout=True,
                cwd=str(ROOT),
            )
            wake = json.loads(floor.stdout)
            out["floor_trio_us"], out["floor_epoll_us"] = wake["trio_us"], wake["epoll_us"]
            # a poll's marginal cost: one more runner, polling in a loop
            probe = FakeRunner(fleet, runners)
            await probe.register()
            await probe.poll(None)
            c0, t0 = cpu_seconds(pid), time.perf_counter()
            for _ in range(args.polls):
                await probe.poll(None)
            cpu, took = cpu_seconds(pid) - c0, time.perf_counter() - t0
            out["poll_us"] = round(1e6 * max(0.0, cpu - idle_rate * took) / args.polls)
            # a ping's marginal cost: one channel's runner pinging in a loop (each pong awaited)
            ws = fleet.channels[0]
            c0, t0 = cpu_seconds(pid), time.perf_counter()
            for _ in range(args.polls):
                await ws.ping()
            cpu, took = cpu_seconds(pid) - c0, time.perf_counter() - t0
            out["ping_us"] = round(1e6 * max(0.0, cpu - idle_rate * took) / args.polls)
            # new sessions, one after another
            ttfts = []
            lost0 = fleet.lost_claims
            profiled = trio.Event()

            async def profile_new() -> None:
                await _profile(pid, args.idle, f"new-{runners}-{sessions}")
                profiled.set()

            if args.profile:
                # the profile's phase: new sessions for as long as it records (at least --new)
                nursery.start_soon(profile_new)
            else:
                profiled.set()
            c0, t0 = cpu_seconds(pid), time.perf_counter()
            windows["new"] = [time.monotonic()]
            while len(ttfts) < args.new or not profiled.is_set():
                name = f"new{len(ttfts)}-{uuid.uuid4().hex[:8]}"
                ttfts.append(await turn(http, base, key, name))
            cpu, took = cpu_seconds(pid) - c0, time.perf_counter() - t0
            windows["new"].append(time.monotonic())
            out["new_sessions"] = len(ttfts)
            out["new_ttft_ms"] = round(1e3 * (percentile(ttfts, 50) or 0.0), 1)
            out["new_cpu_ms"] = round(1e3 * max(0.0, cpu - idle_rate * took) / len(ttfts), 1)
            out["new_lost_claims"] = fleet.lost_claims - lost0
            # short turns on open sessions
            count = 0
            stop = time.perf_counter() + args.turns_for

            async def client(name: str) -> None:
                nonlocal count
                while time.perf_counter() < stop:
                    await turn(http, base, key, name)
                    count += 1

            c0, t0, b0 = cpu_seconds(pid), time.perf_counter(), time.process_time()
            windows["turns"] = [time.monotonic()]
            async with trio.open_nursery() as clients:
                for name in names[: args.clients]:
                    clients.start_soon(client, name)
                if args.profile:
                    clients.start_soon(_profile, pid, args.turns_for, f"turns-{runners}-{sessions}")
            cpu, took = cpu_seconds(pid) - c0, time.perf_counter() - t0
            windows["turns"].append(time.monotonic())
            out["turns_s"] = round(count / took)
            out["turn_cpu_ms"] = round(1e3 * max(0.0, cpu - idle_rate * took) / max(count, 1), 2)
            out["turns_bench_pct"] = round(100 * (time.process_time() - b0) / took)
            # the same turns at one fixed rate at every point (open loop): what a turn costs the
            # hub as the fleet grows, its rate (and so what a wake of the hub serves) held equal
            if args.turn_rate > 0:
                out.update(await _paced_turns(args, http, base, key, names, pid, idle_rate))
            out["lost_claims"] = fleet.lost_claims
            out["errors"] = fleet.errors
            nursery.cancel_scope.cancel()
    finally:
        proc.kill()
        proc.wait()
    collections = _full_collections(windows)
    if collections:
        out["full_gc_ms"] = collections
    return out


async def _paced_turns(
    args: argparse.Namespace,
    http: httpx.AsyncClient,
    base: str,
    key: str,
    names: list[str],
    pid: int,
    idle_rate: float,
) -> dict[str, Any]:
    """``--turn-rate`` short turns a second for ``--turns-for`` s on the first ``--clients``
    sessions in turn, each started on its tick (one a session at a time; a tick whose session
    is still busy is missed and counted): the hub's CPU a turn, the idle rate taken out."""
    gap = 1.0 / args.turn_rate
    sessions = names[: args.clients]
    busy: set[str] = set()
    done = missed = 0

    async def one(name: str) -> None:
        nonlocal done
        try:
            await turn(http, base, key, name)
            done += 1
        finally:
            busy.discard(name)

    c0, t0, b0 = cpu_seconds(pid), time.perf_counter(), time.process_time()
    async with trio.open_nursery() as nursery:
        for n in range(round(args.turns_for * args.turn_rate)):
            await trio.sleep_until(
                trio.current_time() + max(0.0, t0 + n * gap - time.perf_counter())
            )
            name = sessions[n % len(sessions)]
            if name in busy:
                missed += 1
                continue
            busy.add(name)
            nursery.start_soon(one, name)
    cpu, took = cpu_seconds(pid) - c0, time.perf_counter() - t0
    return {
        "paced_rate": args.turn_rate,
        "paced_turns": done,
        "paced_missed": missed,
        "paced_turn_cpu_ms": round(1e3 * max(0.0, cpu - idle_rate * took) / max(done, 1), 2),
        "paced_bench_pct": round(100 * (time.process_time() - b0) / took),
    }


def _full_collections(windows: dict[str, list[float]]) -> dict[str, float]:
    """With ``FLEET_HUB_GC`` and ``FLEET_HUB_LOG`` set: the hub's CPU ms in full garbage
    collections in each phase (from the ``gc full`` lines of ``bench/fleethub.py``)."""
    where = os.environ.get("FLEET_HUB_LOG")
    if not (os.environ.get("FLEET_HUB_GC") and where):
        return {}
    out = dict.fromkeys(windows, 0.0)
    for line in Path(where).read_text().splitlines():
        if not line.startswith("gc full "):
            continue
        ended, cpu = (float(x) for x in line.split()[2:4])
        for phase, (start, end) in ((k, w) for k, w in windows.items() if len(w) == 2):
            if start <= ended <= end:
                out[phase] += cpu
    return {k: round(v, 1) for k, v in out.items()}


HEAD = (
    "| runners | open sessions | hub RSS | idle CPU (% of a core) | a poll / a ping (µs, marginal) "
    "| a new session: TTFT p50 / hub CPU | short turns/s ({c} clients) "
    "| hub CPU a turn (closed loop; paced) | idle: events/s, µs an event (a bare trio loop's) |"
)


def row(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {r['runners']:,} | {r['sessions']:,} | {r['error']} | | | | | | |"
    ping = f" / {r['ping_us']}" if "ping_us" in r else ""
    events = f"{r['idle_events_s']:,}, {r['idle_event_us']}" if "idle_events_s" in r else ""
    paced = ""
    if "paced_turn_cpu_ms" in r:
        paced = f"; {r['paced_turn_cpu_ms']} ms at {r['paced_rate']:g}/s"
    if "floor_trio_us" in r:
        events += f" ({r['floor_trio_us']:g})"
    return (
        f"| {r['runners']:,} | {r['sessions']:,} | {r['rss_mb']} MB | {r['idle_pct']} "
        f"| {r['poll_us']}{ping} | {r['new_ttft_ms']} ms / {r['new_cpu_ms']} ms "
        f"| {r['turns_s']:,} | {r['turn_cpu_ms']} ms{paced} | {events} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__)
    p.add_argument("--sizes", default=SIZES, help=f"runners/sessions,... (default {SIZES})")
    p.add_argument("--hub-path", default=str(ROOT), help="the checkout whose hub runs")
    p.add_argument("--poll", type=float, default=10.0, help="s between a runner's polls")
    p.add_argument("--heartbeat", type=float, default=20.0, help="s between heartbeats")
    p.add_argument("--idle", type=float, default=20.0, help="s of idle measured")
    p.add_argument("--polls", type=int, default=300, help="polls of the probe runner")
    p.add_argument("--new", type=int, default=100, help="new sessions opened one by one")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--turns-for", type=float, default=10.0, help="s of short turns")
    p.add_argument(
        "--turn-rate",
        type=float,
        default=100.0,
        help="short turns a second in the paced phase, the same at every point (0: none)",
    )
    p.add_argument("--open-parallel", type=int, default=16, help="sessions opened at once")
    p.add_argument("--setup-timeout", type=float, default=900.0, help="s for a point's setup")
    p.add_argument("--timeout", type=float, default=60.0, help="s an HTTP request may take")
    p.add_argument("--json", help="append each point's figures to this file")
    p.add_argument(
        "--profile",
        action="store_true",
        help="py-spy the hub through the idle window, the new sessions and the short turns: "
        "bench/profiles/fleet-{idle,new,turns}-R-S.txt",
    )
    p.add_argument(
        "--perf",
        action="store_true",
        help="perf record the hub through the idle window (the kernel's part too): "
        "bench/profiles/fleet-idle-R-S.perf.txt",
    )
    args = p.parse_args(argv)
    print(HEAD.format(c=args.clients))
    print("|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        runners, sessions = (int(x) for x in size.split("/"))
        try:
            result = trio.run(point, args, runners, sessions)
        except Exception as exc:  # a point that fails is said in its row; the next one runs
            traceback.print_exc()  # whole, on stderr
            result = {"runners": runners, "sessions": sessions, "error": repr(exc)[:120]}
        print(row(result), flush=True)
        if "full_gc_ms" in result:
            print(f"  of which full collections (hub CPU ms): {result['full_gc_ms']}", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"hub": args.hub_path, **result}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
