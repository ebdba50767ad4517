"""The fault bench's processes: simulators, the hub and runners as a user starts them, each runner
dialling the hub through a path proxy of its own (the tests' ``tests/support/pathproxy.py``, run in the
bench's process).

Every process is ``python -m gateway ...`` (``sim``, ``hub``, ``run``), of this checkout or of
another tree (``tree``: the hub and the runners run from there; the simulator always from here),
its output in a log file of the run's scratch directory, stopped by its PID. Only flags that
tree's ``--help`` lists are passed (an older tree lacks some). Every wait is bounded.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.common import Child
from tests.support.pathproxy import PathProxy, path_proxy  # the tests' proxy, the one copy

PROJECT = "local/chat"  # where `hub keys create` puts a key by default


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _flags(tree: Path, env: dict[str, str], command: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-m", "gateway", command, "--help"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return set(re.findall(r"--[a-z][a-z-]+", out))


@dataclass
class Sim:
    child: Child
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@dataclass
class RunnerProc:
    name: str
    child: Child
    proxy: PathProxy
    metrics_port: int | None


class Rig:
    """One hub, its simulators and runners, in one scratch directory; ``stop()`` ends them all."""

    def __init__(
        self,
        tmp: Path,
        nursery: trio.Nursery,
        *,
        tree: Path | None,
        chunks: int,
        interval: float,
        ping: float,
        hub_extra: tuple[str, ...] = (),
        runner_extra: tuple[str, ...] = (),
    ) -> None:
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.nursery = nursery
        here = Path(__file__).resolve().parent.parent
        self.tree = (tree or here).resolve()
        self.here_env = self._env(here)
        self.tree_env = self._env(self.tree)
        self.chunks, self.interval, self.ping = chunks, interval, ping
        self.hub_extra, self.runner_extra = hub_extra, runner_extra
        self.hub_flags = _flags(self.tree, self.tree_env, "hub")
        self.run_flags = _flags(self.tree, self.tree_env, "run")
        self.children: list[Child] = []
        self.sims: list[Sim] = []
        self.runners: dict[str, RunnerProc] = {}
        self.spawned = 0
        self.hub: Child | None = None
        self.hub_port = free_port()
        self.data = tmp / "hub-data"
        self.key = ""
        self.admin_token = ""
        self.http = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{self.hub_port}",
            trust_env=False,
            timeout=10,
            limits=httpx.Limits(max_keepalive_connections=0),  # a restarted hub: no stale ones
        )

    @staticmethod
    def _env(tree: Path) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("AGENTICS_", "ALP_", "CHAT_LLM_", "OPENAI_"))
        }
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = str(tree)
        return env

    def _only(self, known: set[str], *pairs: tuple[str, str]) -> list[str]:
        """The ``flag value`` pairs the tree's command knows."""
        return [word for flag, value in pairs if flag in known for word in (flag, value)]

    async def _start(self, name: str, argv: list[str], env: dict[str, str], cwd: Path) -> Child:
        child = Child(name, argv, self.tmp, env, cwd=str(cwd))
        self.children.append(child)
        await child.start(rpc=False)
        return child

    # -- simulators ------------------------------------------------------------------------

    async def start_sim(self, port: int | None = None) -> Sim:
        """A simulator (``python -m gateway sim``) on ``port`` (a free one unless given),
        answering ``chunks`` content chunks ``interval`` s apart; returns once it answers."""
        port = port or free_port()
        argv = [sys.executable, "-m", "gateway", "sim", "--listen", f"127.0.0.1:{port}"]
        argv += ["--chunks", str(self.chunks), "--interval", str(self.interval)]
        child = await self._start(
            f"sim-{port}-{len(self.children)}", argv, self.here_env, Path.cwd()
        )
        sim = Sim(child, port)
        await self._until_answers(f"{sim.url}/models", child)
        return sim

    async def _until_answers(self, url: str, child: Child, within: float = 30) -> float:
        """Poll ``url`` until it answers (any status); the time it first did."""
        async with httpx.AsyncClient(trust_env=False, timeout=2) as client:
            with trio.fail_after(within):
                while True:
                    if child.proc is not None and child.proc.returncode is not None:
                        raise RuntimeError(f"{child.name} exited; see {child.log_path}")
                    try:
                        await client.get(url)
                        return time.perf_counter()
                    except httpx.HTTPError:
                        await trio.sleep(0.02)

    # -- the hub ---------------------------------------------------------------------------

    async def start_hub(self) -> float:
        """Start the hub on its port and data directory (the first time: a store and an API
        key, made with ``hub keys create``); returns when it first answered."""
        if not self.key:
            with trio.fail_after(60):
                made = await trio.run_process(
                    [sys.executable, "-m", "gateway", "hub", "keys", "create", "bench"]
                    + ["--data", str(self.data), "--create"],
                    cwd=self.tree,
                    env=self.tree_env,
                    capture_stdout=True,
                    capture_stderr=True,
                )
            self.key = made.stdout.decode().split()[0]
        argv = [sys.executable, "-m", "gateway", "hub", "--data", str(self.data)]
        argv += ["--listen", f"127.0.0.1:{self.hub_port}"]
        argv += self._only(
            self.hub_flags,
            ("--log-level", "INFO"),
            ("--ping-interval", str(self.ping)),
            ("--keepalive-interval", str(self.ping / 2)),
        )
        argv += list(self.hub_extra)
        self.spawned += 1
        self.hub = await self._start(f"hub-{self.spawned}", argv, self.tree_env, self.tree)
        back = await self._until_answers(f"http://127.0.0.1:{self.hub_port}/healthz", self.hub)
        if not self.admin_token:
            self.admin_token = (self.data / "admin-token").read_text().strip()
        return back

    async def kill_hub(self) -> None:
        assert self.hub is not None and self.hub.proc is not None
        self.hub.proc.kill()  # SIGKILL: no goodbye to anyone
        with trio.fail_after(10):
            await self.hub.proc.wait()

    async def admin(self, path: str) -> Any:
        resp = await self.http.get(path, headers={"authorization": f"Bearer {self.admin_token}"})
        resp.raise_for_status()
        return resp.json()

    async def hub_metric(self, name: str) -> float | None:
        """One unlabelled gauge of the hub's ``/metrics`` (``alp_hub_channels_open``...)."""
        resp = await self.http.get(
            "/metrics", headers={"authorization": f"Bearer {self.admin_token}"}
        )
        for line in resp.text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    async def counters(self) -> dict[str, int]:
        found: dict[str, int] = await self.admin("/api/hub/counters")
        return found

    # -- runners ---------------------------------------------------------------------------

    async def start_runner(self, backends: list[Sim], metrics: bool = False) -> RunnerProc:
        """``python -m gateway run`` dialling the hub through a proxy of its own, its backends
        ``backends``; returns once the hub lists it ready (polling, serving sim-model)."""
        self.spawned += 1
        name = f"runner-{self.spawned}"
        proxy: PathProxy = await self.nursery.start(_proxy, self.hub_port)
        metrics_port = free_port() if metrics else None
        argv = [sys.executable, "-m", "gateway", "run", "--server", proxy.url]
        argv += ["--project", PROJECT, "--model", "sim-model", "--user-token", self.admin_token]
        argv += ["--name", name, "--state-dir", str(self.tmp / f"state-{name}")]
        for sim in backends:
            argv += ["--backend", sim.url]
        pairs = [("--log-level", "INFO"), ("--ping-interval", str(self.ping))]
        pairs.append(("--health-interval", str(self.ping)))
        if metrics_port is not None:
            pairs.append(("--metrics-listen", f"127.0.0.1:{metrics_port}"))
        argv += self._only(self.run_flags, *pairs)
        argv += list(self.runner_extra)
        child = await self._start(name, argv, self.tree_env, self.tree)
        runner = RunnerProc(name, child, proxy, metrics_port)
        self.runners[name] = runner
        await self.ready([name])
        return runner

    async def ready(self, names: list[str], within: float = 30) -> None:
        """Wait until the hub lists each runner up, advertising chat-llm:v1 and sim-model."""
        with trio.fail_after(within):
            while True:
                listed = {
                    r.get("name"): r for r in (await self.admin("/api/hub/runners"))["runners"]
                }
                if all(_ready(listed.get(n)) for n in names):
                    return
                for n in names:
                    proc = self.runners[n].child.proc
                    if proc is not None and proc.returncode is not None:
                        raise RuntimeError(f"{n} exited; see {self.runners[n].child.log_path}")
                await trio.sleep(0.05)

    async def serving(self, session: str) -> str | None:
        """The name of the runner serving ``session``'s turn now (None: none in flight)."""
        turns = (await self.admin("/api/hub/turns"))["turns"]
        ids = [t.get("runnerId") for t in turns if t.get("session") == session]
        if not ids or ids[0] is None:
            return None
        for r in (await self.admin("/api/hub/runners"))["runners"]:
            if r.get("id") == ids[0]:
                name: str | None = r.get("name")
                return name
        return None

    async def runner_metrics(self, runner: RunnerProc) -> str:
        assert runner.metrics_port is not None
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            return (await client.get(f"http://127.0.0.1:{runner.metrics_port}/metrics")).text

    async def kill_runner(self, name: str) -> None:
        runner = self.runners.pop(name)
        assert runner.child.proc is not None
        runner.child.proc.kill()  # SIGKILL
        with trio.fail_after(10):
            await runner.child.proc.wait()

    async def stop(self) -> None:
        """Every process this rig started, by its PID (SIGTERM, SIGKILL after 5 s)."""
        with trio.CancelScope(shield=True):
            for child in reversed(self.children):
                await child.stop()
            await self.http.aclose()


def _ready(runner: dict[str, Any] | None) -> bool:
    if runner is None or not runner.get("up"):
        return False
    if "chat-llm:v1" not in (runner.get("capabilities") or ()):
        return False
    models = runner.get("models")  # None until a channel of it told its list
    return models is None or "sim-model" in models


async def _proxy(port: int, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    async with path_proxy(port) as proxy:
        task_status.started(proxy)
        await trio.sleep_forever()
