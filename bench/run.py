"""``python -m bench``: every path side by side in one run, then the scale test; a table and JSON.

Processes (each measured by its own CPU counters): the simulator; the floor; the runner
(``python -m gateway run``); the hub (control plane, hub channel and front door); the LiteLLM
proxy. The bench process holds the lean sinks and clients.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import resource
import shutil
import signal
import socket
import ssl
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path as FsPath
from typing import Any

import trio

from bench import report, reqload, reqreport
from bench.common import Child, machine, percentile
from bench.paths import (
    ChannelPath,
    FloorPath,
    HttpPath,
    Outcome,
    Path,
    chat_body,
    messages_body,
    responses_body,
)
from bench.sinks import MESSAGES, RESPONSES, FloorSink, SSEClient, Stream, WsSink, clock
from bench.tail import brief, tail_breakdown

SIZES: dict[str, dict[str, int]] = {
    # chunks per stream at full speed (1 stream, 64 streams), spread chunks, TTFT turns, scale sessions
    "full": {
        "single": 10000,
        "c64": 300,
        "spread": 100,
        "ttft": 100,
        "scale": 1000,
        "scale_chunks": 20,
    },
    "quick": {
        "single": 3000,
        "c64": 100,
        "spread": 30,
        "ttft": 40,
        "scale": 200,
        "scale_chunks": 10,
    },
}
TTFT_GAP = 0.002  # s of idle between two TTFT turns
REPEAT = 3  # every measurement is run this many times, the paths alternating; the median is kept
LITELLM_SHARE = 10  # LiteLLM relays 1/10 of the chunks at full speed (it is that much slower)
PACE = 0.020  # s per token in the spread runs
# path -> what it is; "floor" on the command line means the four floors
PATHS = (
    "floor-trio-poller",
    "floor-trio",
    "floor-trio-streams",
    "floor-asyncio",
    "direct",
    "peer",
    "runner",
    "e2e",
    "e2e-messages",
    "e2e-responses",
    "e2e-base",
    "plain-e2e",
    "litellm",
    "portkey",
    "peer-wss",
    "runner-wss",
)
FLOORS = {
    "floor-trio-poller": "bench.floor_poller",
    "floor-trio": "bench.floor",
    "floor-trio-streams": "bench.floor_streams",
    "floor-asyncio": "bench.floor_asyncio",
}
SCENARIO_NAMES = (
    "single",
    "c64",
    "c64s8",
    "spread",
    "spread8",
    "lockstep",
    "ttft",
    "req-idle",
    "req-load",
)
REQUEST_SCENARIOS = ("req-idle", "req-load")  # the request path: bench/reqload.py
# the paths that serve short turns over HTTP (the request path); direct is the floor
REQUEST_PATHS = ("direct", "plain-e2e", "e2e", "e2e-base", "litellm", "portkey")
PORTKEY_DIR = FsPath(__file__).parent / "portkey"  # npm install --prefix bench/portkey


@dataclass(frozen=True)
class Scenario:
    """One measurement: ``streams`` over ``sessions``, ``chunks`` tokens each, paced or not."""

    name: str
    streams: int
    sessions: int
    chunks: int
    interval: float = 0.0
    pace: str = "spread"  # or "lockstep": see bench/simproc.py
    share: bool = True  # LiteLLM relays 1/LITELLM_SHARE of the chunks (full-speed runs)

    @property
    def stagger(self) -> float:
        """Spread streams start over one interval, as turns arrive in life; lockstep ones at once."""
        return self.interval / self.streams if self.pace == "spread" and self.interval else 0.0


def scenarios(args: argparse.Namespace) -> dict[str, Scenario]:
    sizes = SIZES["quick" if args.quick else "full"]
    tokens = args.tokens if args.tokens is not None else (50 if args.quick else 200)
    return {
        "single": Scenario("single", 1, 1, sizes["single"]),
        "c64": Scenario("c64", args.streams, 1, sizes["c64"]),
        "c64s8": Scenario("c64s8", args.streams, args.sessions, sizes["c64"]),
        "spread": Scenario("spread", args.streams, 1, sizes["spread"], PACE, share=False),
        "spread8": Scenario(
            "spread8", args.streams, args.sessions, sizes["spread"], PACE, share=False
        ),
        "lockstep": Scenario(
            "lockstep", args.streams, args.sessions, tokens, args.step, "lockstep", share=False
        ),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _until_healthy(host: str, port: int, within: float) -> None:
    """Wait until the hub's ``GET /healthz`` answers 200 (a runner can serve a chat turn)."""
    with trio.fail_after(within):
        while True:
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                await stream.send_all(
                    b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
                )
                head = await stream.receive_some(65536)
            if head.startswith(b"HTTP/1.1 200"):
                return
            await trio.sleep(0.05)


def runner_argv(
    module: str,
    hub_url: str,
    hub_info: dict[str, Any],
    sim_url: str,
    name: str,
    tmp: FsPath,
    max_sessions: int,
    extra: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """``python -m <module> run`` against the bench's hub and simulator, as runner ``name``
    (its own state directory under ``tmp``), quiet but for warnings."""
    return _py(
        "-m",
        module,
        "run",
        "--server",
        hub_url,
        "--project",
        hub_info["project"],
        "--backend",
        sim_url,
        "--model",
        "sim-model",
        "--user-token",
        hub_info["admin"],
        "--name",
        name,
        "--state-dir",
        str(tmp / f"state-{name}"),
        "--max-sessions",
        str(max_sessions),
        "--log-level",
        "WARNING",
        *extra,
    )


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AGENTICS_", "ALP_", "CHAT_LLM_", "OPENAI_"))
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.sizes = SIZES["quick" if args.quick else "full"]
        self.scenarios = scenarios(args)
        self.repeat = args.repeat if args.repeat is not None else (1 if args.quick else REPEAT)
        self.tmp = FsPath(tempfile.mkdtemp(prefix="alp-bench-"))
        self.children: list[Child] = []
        self.results: dict[str, Any] = {"paths": {}, "notes": []}
        self.run_no = 0

    def note(self, text: str) -> None:
        print(f"  · {text}", flush=True)
        self.results["notes"].append(text)

    async def child(
        self,
        name: str,
        argv: list[str],
        rpc: bool = True,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> tuple[Child, dict[str, Any] | None]:
        c = Child(name, argv, self.tmp, env or _env(), cwd)
        self.children.append(c)
        hello = await c.start(rpc)
        return c, hello

    def runner_argv(
        self, hub_url: str, sim_url: str, name: str, max_sessions: int, ca_file: str | None = None
    ) -> list[str]:
        module = "bench.whatif_pool" if self.args.whatif_pool else "gateway"
        if self.args.probe or self.args.runner_gc:
            module = "bench.tailprobe"
        extra = ["--poll-interval", "5", *(["--ca-file", ca_file] if ca_file else [])]
        return runner_argv(
            module, hub_url, self.hub_info, sim_url, name, self.tmp, max_sessions, extra
        )

    def wanted(self, *names: str) -> bool:
        return any(n in self.args.paths for n in names)

    # -- setup ---------------------------------------------------------------------------

    def _tls(self) -> tuple[ssl.SSLContext, str]:
        """A throwaway CA and a certificate for 127.0.0.1: the wss sink's context, the CA file."""
        import trustme  # the bench extra (and the test extra) has it

        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1", "localhost")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(ctx)
        ca_file = self.tmp / "bench-ca.pem"
        ca.cert_pem.write_to_path(str(ca_file))
        return ctx, str(ca_file)

    async def setup(self, nursery: trio.Nursery) -> None:
        sessions = self.args.sessions
        self.sim, hello = await self.child("sim", _py("-m", "bench.simproc"))
        assert hello is not None
        self.sim_url, self.sim_port = hello["url"], hello["port"]
        self.hub, hub_hello = await self.child("hub", self._hubproc("hub-data"))
        assert hub_hello is not None
        self.hub_info = hub_hello
        self.hub_port = int(hub_hello["url"].rsplit(":", 1)[1])
        self.api_key = (await self.hub.rpc("apikey"))["key"]
        self.litellm: Child | None = None
        self.litellm_ready = trio.Event()  # started, or known to be missing
        if "litellm" in self.args.paths:
            nursery.start_soon(self._start_litellm)
        else:
            self.litellm_ready.set()
        self.portkey_ready = trio.Event()
        if "portkey" in self.args.paths:
            nursery.start_soon(self._start_portkey)
        else:
            self.portkey_ready.set()
        tls_ctx, ca_file = self._tls()
        self.ws_sink = WsSink()
        await nursery.start(self.ws_sink.serve)
        self.wss_sink = WsSink(tls_ctx)
        await nursery.start(self.wss_sink.serve)
        self.paths: dict[str, Path] = {
            "direct": HttpPath("direct", SSEClient("127.0.0.1", self.sim_port), {}, sessions=False),
        }
        for name, module in FLOORS.items():
            if not self.wanted(name):
                continue
            sink = FloorSink()
            await nursery.start(sink.serve)
            floor, _ = await self.child(name, _py("-m", module, "127.0.0.1", str(self.sim_port)))
            await floor.rpc("dial", host="127.0.0.1", port=sink.port, n=sessions)
            await sink.wait_sessions(sessions)
            self.paths[name] = FloorPath(name, floor, sink.sessions)
        if self.wanted("peer", "peer-wss", "plain-e2e"):
            self.peer, _ = await self.child("peer", _py("-m", "bench.peer", self.sim_url, ca_file))
            for name, sink in (("peer", self.ws_sink), ("peer-wss", self.wss_sink)):
                if not self.wanted(name):
                    continue
                ids = [f"{name}-{uuid.uuid4().hex[:8]}" for _ in range(sessions)]
                urls = [f"{sink.url}?jobId={i}&token=peer-token" for i in ids]
                await self.peer.rpc("dial", urls=urls)
                channels = await sink.wait_channels(ids, 60)
                self.paths[name] = ChannelPath(name, "peer", self.peer, channels)
            if self.wanted("plain-e2e"):
                await self._plain_e2e(sessions)
        runner_env = _env()
        if self.args.probe:
            runner_env["BENCH_TAILPROBE"] = str(self.tmp / "tailprobe.json")
        if self.args.runner_gc:
            runner_env["BENCH_GC"] = self.args.runner_gc
        self.runner, _ = await self.child(
            "runner",
            self.runner_argv(
                hub_hello["url"], self.sim_url, "bench-runner", max(64, 4 * sessions), ca_file
            ),
            rpc=False,
            env=runner_env,
        )
        for name, sink in (("runner", self.ws_sink), ("runner-wss", self.wss_sink)):
            if not self.wanted(name):
                continue
            ids = (await self.hub.rpc("enqueue", n=sessions, channel_url=sink.url))["ids"]
            channels = await sink.wait_channels(ids, 60)
            self.paths[name] = ChannelPath(name, "runner", self.runner, channels)
        front = {"runner": (self.runner, False), "hub": (self.hub, False)}
        bearer = {"authorization": f"Bearer {self.api_key}"}
        self.paths["e2e"] = HttpPath(
            "e2e", SSEClient("127.0.0.1", self.hub_port, headers=bearer), front, sessions=True
        )
        # the same front door, sessions and streams over the two translated APIs (Anthropic's
        # clients send their key as x-api-key)
        self.paths["e2e-messages"] = HttpPath(
            "e2e-messages",
            SSEClient(
                "127.0.0.1", self.hub_port, headers={"x-api-key": self.api_key}, dialect=MESSAGES
            ),
            front,
            sessions=True,
            body=messages_body,
        )
        self.paths["e2e-responses"] = HttpPath(
            "e2e-responses",
            SSEClient("127.0.0.1", self.hub_port, headers=bearer, dialect=RESPONSES),
            front,
            sessions=True,
            body=responses_body,
        )
        if self.wanted("e2e-base"):
            await self._e2e_base(sessions, ca_file)
        front_paths = [n for n in ("e2e", "e2e-messages", "e2e-responses") if self.wanted(n)]
        if front_paths:
            await _until_healthy("127.0.0.1", self.hub_port, 60)  # the runner has polled
            # open the front door's sessions (one Chat Job each) before anything is measured;
            # every API then serves one turn on each of them (the same X-Chat-Session names:
            # the same sessions, whatever the API)
            await self.sim.rpc("opts", opts={"chunks": 1})
            for name in dict.fromkeys(["e2e", *front_paths]):
                out = await self.paths[name].run(sessions, sessions, False, f"warm-{name}")
                if out.errors:
                    raise RuntimeError(f"front door warm-up ({name}) failed: {out.errors[:3]}")

    def _hubproc(self, data: str) -> list[str]:
        """``python -m bench.hubproc``, its store in a file under the bench's scratch directory
        (as a deployed hub keeps it) unless ``--hub-store memory``."""
        if self.args.hub_store == "memory":
            return _py("-m", "bench.hubproc")
        return _py("-m", "bench.hubproc", str(self.tmp / data))

    async def _e2e_base(self, sessions: int, ca_file: str) -> None:
        """``e2e`` over a hub and a runner of another checkout (``--base-tree``: run from there,
        its ``gateway`` and ``bench.hubproc``), the same simulator, client and sessions: an A/B
        whose two sides alternate within one run."""
        tree = self.args.base_tree
        if not tree:
            raise SystemExit("the path e2e-base needs --base-tree DIR (a checkout to compare)")
        env = {**_env(), "PYTHONPATH": tree}
        hub, hello = await self.child("hub-base", self._hubproc("hub-base-data"), env=env, cwd=tree)
        assert hello is not None
        port = int(hello["url"].rsplit(":", 1)[1])
        key = (await hub.rpc("apikey"))["key"]
        argv = runner_argv(
            "gateway",
            hello["url"],
            hello,
            self.sim_url,
            "bench-runner-base",
            self.tmp,
            max(64, 4 * sessions),
            ["--poll-interval", "5", "--ca-file", ca_file],
        )
        runner, _ = await self.child("runner-base", argv, rpc=False, env=env, cwd=tree)
        self.paths["e2e-base"] = HttpPath(
            "e2e-base",
            SSEClient("127.0.0.1", port, headers={"authorization": f"Bearer {key}"}),
            {"runner": (runner, False), "hub": (hub, False)},
            sessions=True,
        )
        await _until_healthy("127.0.0.1", port, 60)
        await self.sim.rpc("opts", opts={"chunks": 1})
        out = await self.paths["e2e-base"].run(sessions, sessions, False, "warm-e2e-base")
        if out.errors:
            raise RuntimeError(f"front door warm-up (e2e-base) failed: {out.errors[:3]}")

    async def _plain_e2e(self, sessions: int) -> None:
        """The plain pair: client → ``bench/plainhub.py`` (aiohttp Server) → the plain peer →
        simulator; the peer dials one channel per session before anything is measured."""
        plain, hello = await self.child("plainhub", _py("-m", "bench.plainhub"))
        assert hello is not None
        urls = [f"{hello['channel_url']}?jobId=plain-{i}" for i in range(sessions)]
        await self.peer.rpc("dial", urls=urls)
        with trio.fail_after(60):
            while (await plain.rpc("channels"))["n"] < sessions:  # noqa: ASYNC110 (another process)
                await trio.sleep(0.05)
        self.paths["plain-e2e"] = HttpPath(
            "plain-e2e",
            SSEClient(
                "127.0.0.1", hello["port"], headers={"authorization": f"Bearer {hello['key']}"}
            ),
            {"peer": (self.peer, False), "plainhub": (plain, False)},
            sessions=True,
        )
        # the same warm-up as the front door's: every session has served a turn
        await self.sim.rpc("opts", opts={"chunks": 1})
        out = await self.paths["plain-e2e"].run(sessions, sessions, False, "warm-plain")
        if out.errors:
            raise RuntimeError(f"plain Server warm-up failed: {out.errors[:3]}")

    async def _start_litellm(self) -> None:
        try:
            await self._open_litellm()
        finally:
            self.litellm_ready.set()

    async def _open_litellm(self) -> None:
        exe = shutil.which("litellm", path=str(FsPath(sys.executable).parent))
        if exe is None:
            self.note("LiteLLM is not installed (pip install 'litellm[proxy]'): its row is skipped")
            return
        port = _free_port()
        config = self.tmp / "litellm.yaml"
        config.write_text(
            "model_list:\n"
            "  - model_name: sim-model\n"
            "    litellm_params:\n"
            "      model: openai/sim-model\n"
            f"      api_base: {self.sim_url}\n"
            "      api_key: sk-bench\n"
            "litellm_settings:\n"
            "  telemetry: false\n"
        )
        env = _env()
        env.update(
            {
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of the cost map
                "LITELLM_TELEMETRY": "False",
                "LITELLM_LOG": "ERROR",
                "LITELLM_DONT_SHOW_FEEDBACK_BOX": "True",
                "HTTP_PROXY": "http://127.0.0.1:9",
                "HTTPS_PROXY": "http://127.0.0.1:9",  # no network
                "NO_PROXY": "127.0.0.1,localhost",
            }
        )
        child, _ = await self.child(
            "litellm",
            [
                exe,
                "--config",
                str(config),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num_workers",
                "1",
            ],
            rpc=False,
            env=env,
        )
        with trio.fail_after(90):
            while True:
                try:
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                    await stream.aclose()
                    break
                except OSError:
                    await trio.sleep(0.2)
        self.litellm = child
        client = SSEClient("127.0.0.1", port, headers={"authorization": "Bearer sk-bench"})
        self.paths["litellm"] = HttpPath(
            "litellm", client, {"litellm": (child, True)}, sessions=False
        )

    async def _start_portkey(self) -> None:
        try:
            await self._open_portkey()
        finally:
            self.portkey_ready.set()

    async def _open_portkey(self) -> None:
        """Portkey's open-source gateway (``@portkey-ai/gateway``, Node), one hop: the simulator
        as an OpenAI provider at a custom host (``x-portkey-provider``, ``x-portkey-custom-host``
        on each request). Installed by npm into ``bench/portkey/node_modules`` (gitignored) on
        first use: ``npm install --prefix bench/portkey``."""
        server = PORTKEY_DIR / "node_modules/@portkey-ai/gateway/build/start-server.js"
        node, npm = shutil.which("node"), shutil.which("npm")
        if not server.exists() and npm is not None:
            self.note("installing Portkey's gateway: npm install --prefix bench/portkey")
            proc = await trio.run_process(
                [npm, "install", "--no-audit", "--no-fund", "--prefix", str(PORTKEY_DIR)],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            if proc.returncode != 0:
                self.note(f"npm install failed: {proc.stderr.decode()[-300:]}")
        if node is None or not server.exists():
            self.note(
                "Portkey's gateway is not installed (node and npm needed): its row is skipped"
            )
            return
        port = _free_port()
        env = {**_env(), "NODE_ENV": "production"}
        child, _ = await self.child(
            "portkey", [node, str(server), f"--port={port}", "--headless"], rpc=False, env=env
        )
        with trio.fail_after(60):
            while True:
                try:
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                    await stream.aclose()
                    break
                except OSError:
                    await trio.sleep(0.2)
        headers = {
            "authorization": "Bearer sk-bench",
            "x-portkey-provider": "openai",
            "x-portkey-custom-host": self.sim_url,
        }
        client = SSEClient("127.0.0.1", port, headers=headers)
        self.paths["portkey"] = HttpPath(
            "portkey", client, {"portkey": (child, True)}, sessions=False
        )

    # -- measuring -----------------------------------------------------------------------

    async def measure(self, path: Path, sc: Scenario) -> dict[str, Any]:
        self.run_no += 1
        latency = sc.interval > 0
        chunks = sc.chunks // LITELLM_SHARE if path.name == "litellm" and sc.share else sc.chunks
        await self.sim.rpc(
            "opts", opts={"chunks": chunks, "interval": sc.interval, "pace": sc.pace}
        )
        if latency:
            await self.sim.rpc("record", on=True)
        procs = {**path.procs, "sim": (self.sim, False)}
        probing = self.args.probe and path.name == "runner" and latency
        if probing:
            await self._probe_dump()  # the stamps so far (start-up, the last run) are dropped
        cpu0 = {k: c.cpu(tree) for k, (c, tree) in procs.items()}
        own0 = time.process_time()
        sessions = sc.sessions if path.sessions else 1
        out = await path.run(sc.streams, sessions, latency, f"r{self.run_no}", sc.stagger)
        own1 = time.process_time()
        cpu1 = {k: c.cpu(tree) for k, (c, tree) in procs.items()}
        elapsed = max(out.end - out.start, 1e-9)
        result: dict[str, Any] = {
            "streams": sc.streams,
            "sessions": sessions,
            "chunks": out.events,
            "seconds": round(elapsed, 4),
            "chunks_per_s": round(out.events / elapsed),
            "cpu_us_per_chunk": {
                k: round((cpu1[k] - cpu0[k]) / max(out.events, 1) * 1e6, 2) for k in procs
            },
            "cpu_busy": {k: round((cpu1[k] - cpu0[k]) / elapsed, 3) for k in procs},
            "bench_busy": round((own1 - own0) / elapsed, 3),
        }
        if out.firsts:
            result["ttft_ms"] = {
                "p50": _ms(percentile(out.firsts, 50)),
                "p99": _ms(percentile(out.firsts, 99)),
            }
        if out.errors:
            result["errors"] = out.errors[:5]
            self.note(f"{path.name}: {len(out.errors)} stream error(s), e.g. {out.errors[0]}")
        if latency:
            dump = (await self.sim.rpc("dump"))["streams"]
            await self.sim.rpc("record", on=False)
            result.update(self._latency(out, dump))
            if probing:
                result["probe"] = tail_breakdown(out, dump, await self._probe_dump())
        return result

    async def _probe_dump(self) -> dict[str, Any]:
        """The runner's stamps (``bench/tailprobe.py``) since the last dump; ``tail_breakdown``
        joins them per chunk with the simulator's ``sent_at`` and the sink's receive stamps."""
        path = self.tmp / "tailprobe.json"
        path.unlink(missing_ok=True)
        os.kill(self.runner.pid, signal.SIGUSR1)
        with trio.fail_after(10):
            while not path.exists():  # noqa: ASYNC110 (another process writes it)
                await trio.sleep(0.02)
        probe: dict[str, Any] = json.loads(path.read_text())
        return probe

    def _latency(self, out: Outcome, dump: list[dict[str, Any]]) -> dict[str, Any]:
        by_key: dict[tuple[str, str], list[float]] = {}
        for rec in dump:
            by_key[("id", rec["id"])] = rec["sent_at"]
            if rec["tag"]:
                by_key[("tag", rec["tag"])] = rec["sent_at"]
        # steady state: once every stream is streaming (their openings are what TTFT measures)
        steady_from = max((rec["sent_at"][0] for rec in dump if rec["sent_at"]), default=0.0)
        delays, steady = [], []
        for key, tok, at in out.tokens:
            sent = by_key.get(key)
            if sent is not None and tok + 1 < len(sent):
                delay = at - sent[tok + 1]  # payload 0 is the role chunk, 1 + i is token i
                delays.append(delay)
                if sent[tok + 1] > steady_from:
                    steady.append(delay)
        return {
            "latency_samples": len(steady),
            "latency_ms": {
                "p50": _ms(percentile(steady, 50)),
                "p99": _ms(percentile(steady, 99)),
                "max": _ms(max(steady) if steady else None),
            },
            "latency_all_ms": {
                "samples": len(delays),
                "p50": _ms(percentile(delays, 50)),
                "p99": _ms(percentile(delays, 99)),
            },
        }

    async def ttft(self, names: list[str], turns: int) -> dict[str, dict[str, Any]]:
        """Time to first token of one-chunk turns, one at a time on an idle path.

        The paths alternate turn by turn (a burst of another process's work lands on every
        path alike), with ``TTFT_GAP`` of idle between turns."""
        await self.sim.rpc("opts", opts={"chunks": 1, "interval": 0.0})
        values: dict[str, list[float]] = {name: [] for name in names}
        errors: dict[str, list[str]] = {name: [] for name in names}
        for i in range(turns):
            for name in names:
                self.run_no += 1
                got = await self._ttft_turn(self.paths[name], f"t{self.run_no}-{i}")
                if isinstance(got, str):
                    errors[name].append(got)
                else:
                    values[name].append(got)
                await trio.sleep(TTFT_GAP)
        out: dict[str, dict[str, Any]] = {}
        for name in names:
            row: dict[str, Any] = {
                "turns": turns,
                "ttft_ms": {
                    "p50": _ms(percentile(values[name], 50)),
                    "p99": _ms(percentile(values[name], 99)),
                },
            }
            if errors[name]:
                row["errors"] = errors[name][:5]
                self.note(f"{name}: {len(errors[name])} TTFT turn error(s), e.g. {errors[name][0]}")
            out[name] = row
        return out

    async def _ttft_turn(self, path: Path, tag: str) -> float | str:
        """One one-chunk turn: request sent -> first chunk received (s), or what went wrong.

        Everything the bench does for the turn is ready before the request is stamped, the stamp
        is taken right before its send, and after the send the bench only waits. On this kind of
        machine every process of the chain runs on one CPU, one after the other (a loopback
        wake-up puts the woken process on the waker's CPU), so any work the bench did between
        the send and the first chunk (a nursery, tasks, a lock hand-off) would be counted in
        that path's TTFT: ``Path.run`` does such work for some paths and not others."""
        body = path.body(tag) if isinstance(path, HttpPath) else chat_body(tag)
        with trio.move_on_after(60):
            if isinstance(path, FloorPath):
                session = path.socks[0]
                session.reset(False)
                data = json.dumps(body).encode()
                sent = clock()
                await session.request(data)
                await session.wait_dones(1)
                if session.first_at is None:
                    return "no event before [DONE]"
                return session.first_at - sent
            stream = Stream(tag)
            if isinstance(path, ChannelPath):
                await path.channels[0].turn(body, stream)
            elif isinstance(path, HttpPath):
                session_id = "bench-0" if path.sessions else None
                await path.client.stream(json.dumps(body).encode(), stream, session_id)
            else:
                raise TypeError(f"no TTFT turn for {type(path).__name__}")
            if stream.error:
                return stream.error
            if stream.first_at is None:
                return "no event"
            return stream.first_at - stream.sent
        return "no answer within 60 s"

    async def measure_requests(self, key: str, names: list[str], rnd: int) -> None:
        """One round of the request path (``bench/reqload.py``): ``req-idle``, short turns one at
        a time, or ``req-load``, the load sweep of both kinds; each round kept in
        ``results["requests"]`` (``bench/reqreport.py`` folds them)."""
        wanted = [n for n in REQUEST_PATHS if n in self.paths and (n in names or n == "direct")]
        if not hasattr(self, "short_turns"):
            await self.sim.rpc("opts", opts={"chunks": reqload.TOKENS, "interval": 0.0})
            self.short_turns = {n: reqload.Turns(self.paths[n]) for n in wanted}  # type: ignore[arg-type]
            for path_turns in self.short_turns.values():
                await path_turns.check()
        await self.sim.rpc("opts", opts={"chunks": reqload.TOKENS, "interval": 0.0})
        turns = self.short_turns
        if rnd % 2:  # the order reversed every other round (direct stays the floor of each rung)
            turns = dict(reversed(list(turns.items())))
        book = self.results.setdefault("requests", {"idle": [], "whole": [], "stream": []})
        tag = f"[{rnd + 1}/{self.repeat}]"
        if key == "req-idle":
            got = await reqload.idle(turns, self.sizes["ttft"])
            book["idle"].append(got)
            for name, row in got.items():
                print(f"  {tag} req-idle {name:10} {reqreport.idle_brief(row)}", flush=True)
            return
        start, factor, seconds = reqload.LADDER["quick" if self.args.quick else "full"]
        if self.args.req_seconds:
            seconds = self.args.req_seconds
        rates = (
            [float(r) for r in self.args.req_rates.split(",")]
            if self.args.req_rates
            else reqload.ladder(self.args.req_from or start, factor)
        )
        procs = {n: {**self.paths[n].procs, "sim": (self.sim, False)} for n in turns}
        for kind in reqload.KINDS:
            print(f"  {tag} req-load {kind}: {reqload.CLIENTS} clients", flush=True)
            got = await reqload.sweep(
                turns,
                kind,
                rates,
                seconds,
                procs,
                lambda line: print(line, flush=True),
                rnd % 2 == 1,
            )
            book[kind].append(got)

    async def measure_all(self, names: list[str]) -> None:
        """Every scenario on every path, ``repeat`` rounds, the paths alternating within each
        scenario, in the reverse order every other round (the machine is shared: a burst of
        another process's work then lands on every path alike, and a drift favours none); the
        median of the rounds is kept."""
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {n: {} for n in names}
        wanted = [s for s in self.args.scenarios if s in SCENARIO_NAMES]
        for rnd in range(self.repeat):
            for key in wanted:
                if key in REQUEST_SCENARIOS:
                    await self.measure_requests(key, names, rnd)
                    continue
                if key == "ttft":  # the paths alternate turn by turn within the round
                    turns = await self.ttft(names, self.sizes["ttft"])
                    for name in names:
                        runs[name].setdefault(key, []).append(turns[name])
                        print(
                            f"  [{rnd + 1}/{self.repeat}] {key:8} {name:18} {_brief(turns[name])}",
                            flush=True,
                        )
                    continue
                for name in names if rnd % 2 == 0 else names[::-1]:
                    path = self.paths[name]
                    if key == "c64" and not path.sessions:
                        continue  # without sessions "64 over one session" is c64s8 again
                    got = await self.measure(path, self.scenarios[key])
                    runs[name].setdefault(key, []).append(got)
                    print(
                        f"  [{rnd + 1}/{self.repeat}] {key:8} {name:18} {_brief(got)}", flush=True
                    )
                    if "probe" in got:
                        print(brief(got["probe"]), flush=True)
        for name in names:
            self.results["paths"][name] = {k: _median(v) for k, v in runs[name].items()}

    async def sink_check(self) -> None:
        """Is the hub's WebSocket receive path a bottleneck? The same streams, read by the hub."""
        print("\n== sink check: runner → hub channel (the hub's own receive path)", flush=True)
        out: dict[str, Any] = {}
        for label, n, chunks in (
            ("single", 1, self.sizes["single"]),
            ("c64", 64, self.sizes["c64"]),
        ):
            await self.sim.rpc("opts", opts={"chunks": chunks, "interval": 0.0})
            cpu0 = self.hub.cpu()
            reply = await self.hub.rpc(
                "hubsink",
                streams=n,
                body={
                    "model": "sim-model",
                    "messages": [{"role": "user", "content": "hubsink"}],
                    "stream": True,
                },
            )
            cpu1 = self.hub.cpu()
            rate = reply["events"] / max(reply["elapsed"], 1e-9)
            lean_run = self.results["paths"].get("runner", {}).get(label, {})
            lean = lean_run.get("chunks_per_s")
            out[label] = {
                "chunks": reply["events"],
                "chunks_per_s": round(rate),
                "hub_busy": round((cpu1 - cpu0) / max(reply["elapsed"], 1e-9), 3),
                "hub_cpu_us_per_chunk": round((cpu1 - cpu0) / max(reply["events"], 1) * 1e6, 2),
                "lean_sink_chunks_per_s": lean,
                "lean_sink_busy": lean_run.get("bench_busy"),  # the bench process, sink included
            }
            print(
                f"  {label}: hub as sink {round(rate)} chunks/s (hub busy {out[label]['hub_busy']:.0%}); "
                f"lean sink {lean}",
                flush=True,
            )
        self.results["sink_check"] = out

    # -- scale -----------------------------------------------------------------------------

    async def scale(self) -> None:
        total = self.sizes["scale"]
        half = total // 2
        print(
            f"\n== scale: {total} idle sessions on one fresh runner, then {total} concurrent turns",
            flush=True,
        )
        seen = (await self.hub.rpc("seen"))["runners"]
        runner, _ = await self.child(
            "runner-scale",
            self.runner_argv(self.hub_info["url"], self.sim_url, "bench-scale", total + 16),
            rpc=False,
        )
        with trio.fail_after(60):  # registered and polled: a runner serving nothing yet
            while (await self.hub.rpc("seen"))["runners"] < seen + 1:  # noqa: ASYNC110 (another process)
                await trio.sleep(0.1)
        await trio.sleep(1.0)
        rss = {"0": runner.rss()}
        opened = time.perf_counter()
        ids = (await self.hub.rpc("enqueue", n=half, channel_url=self.ws_sink.url))["ids"]
        await self.ws_sink.wait_channels(ids, 120)
        half_s = time.perf_counter() - opened
        await trio.sleep(1.0)
        rss[str(half)] = runner.rss()
        ids += (await self.hub.rpc("enqueue", n=total - half, channel_url=self.ws_sink.url))["ids"]
        channels = await self.ws_sink.wait_channels(ids, 180)
        all_s = time.perf_counter() - opened
        await trio.sleep(1.0)
        rss[str(total)] = runner.rss()
        print(
            f"  RSS MB: {', '.join(f'{k} sessions {v / 1e6:.1f}' for k, v in rss.items())}; "
            f"opened {total} sessions in {all_s:.1f} s",
            flush=True,
        )
        # 1,000 concurrent turns, one per session
        chunks = self.sizes["scale_chunks"]
        await self.sim.rpc("opts", opts={"chunks": chunks, "interval": 0.0})
        streams = [Stream(f"scale-{i}") for i in range(total)]
        peak = 0
        cpu0 = runner.cpu()
        start = clock()

        async def sample_rss(scope: trio.CancelScope) -> None:
            nonlocal peak
            while True:
                peak = max(peak, runner.rss())
                await trio.sleep(0.05)

        async with trio.open_nursery() as outer:
            outer.start_soon(sample_rss, outer.cancel_scope)
            async with trio.open_nursery() as nursery:
                for ch, s in zip(channels, streams, strict=True):
                    nursery.start_soon(
                        ch.turn,
                        {
                            "model": "sim-model",
                            "messages": [{"role": "user", "content": "scale"}],
                            "stream": True,
                        },
                        s,
                    )
            outer.cancel_scope.cancel()
        cpu1 = runner.cpu()
        end = max(s.last_at for s in streams)
        events = sum(s.events for s in streams)
        errors = [s.error for s in streams if s.error]
        firsts = [s.first_at - s.sent for s in streams if s.first_at is not None]
        after = runner.rss()
        self.results["scale"] = {
            "sessions": total,
            "rss_bytes": rss,
            "open_seconds": {str(half): round(half_s, 2), str(total): round(all_s, 2)},
            "marginal_bytes_per_session": {
                f"0-{half}": round((rss[str(half)] - rss["0"]) / half),
                f"{half}-{total}": round((rss[str(total)] - rss[str(half)]) / (total - half)),
            },
            "turns": {
                "turns": total,
                "chunks_each": chunks + 2,
                "chunks": events,
                "errors": len(errors),
                "seconds": round(end - start, 3),
                "chunks_per_s": round(events / max(end - start, 1e-9)),
                "ttft_ms": {"p50": _ms(percentile(firsts, 50)), "p99": _ms(percentile(firsts, 99))},
                "cpu_us_per_chunk": round((cpu1 - cpu0) / max(events, 1) * 1e6, 2),
                "rss_peak_bytes": peak,
                "rss_after_bytes": after,
            },
        }
        if errors:
            self.note(f"scale turns: {len(errors)} errors, e.g. {errors[0]}")
        print(f"  {total} turns: {self.results['scale']['turns']}", flush=True)

    # -- the whole run -----------------------------------------------------------------

    async def main(self) -> dict[str, Any]:
        began = time.perf_counter()
        self.results["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        self.results["machine"] = machine()
        self.results["mode"] = "quick" if self.args.quick else "full"
        self.results["label"] = self.args.label
        self.results["whatif_pool"] = bool(self.args.whatif_pool)
        self.results["sizes"] = self.sizes
        self.results["repeat"] = self.repeat
        self.results["scenarios"] = {k: dataclasses.asdict(v) for k, v in self.scenarios.items()}
        try:
            async with trio.open_nursery() as nursery:
                await self.setup(nursery)
                with trio.fail_after(120):
                    await self.litellm_ready.wait()
                    await self.portkey_ready.wait()
                names = [n for n in PATHS if n in self.args.paths and n in self.paths]
                await self.measure_all(names)
                if "runner" in self.args.paths:
                    await self.sink_check()
                # the scale test gets the machine to itself: stop what it does not need
                for c in list(self.children):
                    if c.name not in ("sim", "hub"):
                        await c.stop()
                if not self.args.no_scale:
                    await self.scale()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                for c in reversed(self.children):
                    await c.stop()
        self.results["bench_seconds"] = round(time.perf_counter() - began, 1)
        return self.results


def _median(runs: list[Any]) -> Any:
    """Runs of one measurement folded into one: the median of every number, lists joined."""
    first = runs[0]
    if isinstance(first, dict):
        out = {k: _median([r[k] for r in runs if k in r]) for k in first}
        for r in runs[1:]:
            for k in r.keys() - first.keys():
                out[k] = r[k]
        return out
    if isinstance(first, bool) or not isinstance(first, int | float):
        if isinstance(first, list):
            return [x for r in runs for x in r]
        return first
    values = sorted(v for v in runs if v is not None)
    if not values:
        return None
    middle = (
        values[len(values) // 2]
        if len(values) % 2
        else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
    )
    return round(middle, 3) if isinstance(middle, float) else middle


def _brief(got: dict[str, Any]) -> str:
    """One line of a run, as it goes."""
    parts = []
    if "chunks_per_s" in got:
        parts.append(f"{got['chunks_per_s']} chunks/s")
    cpu = {k: v for k, v in got.get("cpu_us_per_chunk", {}).items() if k != "sim"}
    if cpu:
        parts.append("CPU µs/chunk " + " ".join(f"{k} {v}" for k, v in cpu.items()))
    if "latency_ms" in got:
        parts.append(f"latency p50 {got['latency_ms']['p50']} p99 {got['latency_ms']['p99']} ms")
    if "ttft_ms" in got:
        parts.append(f"TTFT p50 {got['ttft_ms']['p50']} ms")
    if got.get("errors"):
        parts.append(f"ERRORS {got['errors'][:1]}")
    return ", ".join(parts)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="smaller runs, one round (a couple of minutes)"
    )
    parser.add_argument(
        "--paths",
        default=",".join(PATHS),
        help=f"comma-separated subset of {','.join(PATHS)} ('floor': the four floors)",
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIO_NAMES),
        help=f"comma-separated subset of {','.join(SCENARIO_NAMES)}",
    )
    parser.add_argument(
        "--streams", type=int, default=64, help="streams of the 64-stream scenarios (default 64)"
    )
    parser.add_argument(
        "--sessions", type=int, default=8, help="sessions they are spread over (default 8)"
    )
    parser.add_argument(
        "--step", type=float, default=0.020, help="lockstep: seconds per decode step (0.020)"
    )
    parser.add_argument(
        "--tokens", type=int, default=None, help="lockstep: tokens per stream (200; quick 50)"
    )
    parser.add_argument(
        "--repeat", type=int, default=None, help=f"rounds, median kept ({REPEAT}; quick 1)"
    )
    parser.add_argument("--no-scale", action="store_true", help="skip the 1,000-session test")
    parser.add_argument(
        "--whatif-pool",
        action="store_true",
        help="run the runner with httpcore's pool bookkeeping made linear "
        "(bench/whatif_pool.py): what that fix is worth",
    )
    parser.add_argument(
        "--base-tree",
        default="",
        help="another checkout (a directory) whose hub and runner the path e2e-base runs: "
        "an A/B of the hub, the two sides alternating within one run",
    )
    parser.add_argument(
        "--hub-store",
        choices=("file", "memory"),
        default="file",
        help="the bench's hubs keep their store in a file under the scratch directory (as a "
        "deployed hub does: default) or in memory",
    )
    parser.add_argument(
        "--req-rates",
        default="",
        help="req-load: the offered rates (turns/s, comma-separated) instead of the ladder",
    )
    parser.add_argument(
        "--req-from",
        type=float,
        default=0.0,
        help="req-load: the ladder's first rate (10 turns/s), each next one 1.3× (quick 1.5×)",
    )
    parser.add_argument(
        "--req-seconds", type=float, default=0.0, help="req-load: seconds per rung (2; quick 1)"
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="run the runner with bench/tailprobe.py's stamps and print where its slowest "
        "chunks' latency went (its own figures are then not the runner's)",
    )
    parser.add_argument(
        "--runner-gc",
        default="",
        help="a garbage-collection experiment on the runner (bench/tailprobe.py): off, "
        "freeze, t0=N, comma-joined",
    )
    parser.add_argument(
        "--label", default="", help="free text for the report's head (what is being measured)"
    )
    parser.add_argument(
        "--out", default=str(FsPath(__file__).parent / "results.json"), help="JSON output"
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    paths = []
    for p in (p.strip() for p in args.paths.split(",")):
        paths += list(FLOORS) if p == "floor" else [p] if p else []
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        parser.error(f"unknown path(s) {', '.join(unknown)}; known: {', '.join(PATHS)}")
    args.paths = paths
    if args.whatif_pool and (args.probe or args.runner_gc):
        parser.error("--whatif-pool runs another patched runner: not with --probe or --runner-gc")
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(args.scenarios) - set(SCENARIO_NAMES))
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    bench = Bench(args)
    results = trio.run(bench.main)
    results["id"] = uuid.uuid4().hex[:8]
    results["e2e"] = report.e2e_summary(results)
    results["translated"] = report.translated_summary(results)
    if results.get("requests"):
        results["request_summary"] = reqreport.summary(results)
    results["targets"] = {
        "issue18": [
            dict(zip(("target", "measured", "met"), t, strict=True))
            for t in report.targets_18(results)
        ],
        "issue19": [
            dict(zip(("target", "measured", "met"), t, strict=True))
            for t in report.targets_19(results)
        ],
        "issue10": [
            dict(zip(("target", "measured", "met"), t, strict=True))
            for t in report.targets(results)
        ],
    }
    FsPath(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print()
    print(report.render(results))
    if results.get("requests"):
        print()
        print(reqreport.render(results))
    print(f"\nwritten to {args.out}; logs in {bench.tmp}")
    return 0
