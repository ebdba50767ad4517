"""One hub against two replicas of it on one PostgreSQL, behind HAProxy, at saturation (issue 28
point 4): chunks per second through the front door, each replica's CPU per 1000 chunks, and
the database server's CPU per turn.

Each round starts a fresh database on a throwaway PostgreSQL (``tests/support/pgserver.py``), the
replicas as ``alp-gateway hub`` processes, HAProxy in front of them (round robin, the same
config with one backend or two), two runner processes and the simulator as a process; then
``--sessions`` clients turn one after another for ``--seconds`` (each turn ``--chunks`` chunks
as fast as the simulator sends them). Rounds alternate one replica and two (``--rounds`` each);
the medians and the ratio of two to one are printed. Every part shares this machine's cores,
so the ratio is bounded by what the clients, runners and simulator leave the hubs.

    python -m bench.replicas                     # one hub vs two, 3 rounds of each: about 2 min
    python -m bench.replicas --rounds 1 --seconds 5
    python -m bench.replicas --modes direct,forwarded               # a forwarded turn's cost
    python -m bench.replicas --modes direct,forwarded --chunks 1    # ... per turn
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.common import cpu_seconds
from gateway.hub.store import KeyLimits, open_store
from gateway.hub.store.credentials import write_admin_token

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
import pgserver  # noqa: E402  (the tests' throwaway PostgreSQL)

ADMIN = "alpa_bench_replicas_admin_credential"
PROJECT = "acme/chat"
PY = [sys.executable, "-m", "gateway"]


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ALP_", "OPENAI_"))}
    return {**env, "PYTHONUNBUFFERED": "1"}


HAPROXY = """global
    maxconn 4096
defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    timeout tunnel 1h
    option redispatch
    retries 2
frontend hub
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /healthz
    http-check expect rstatus ^(200|503)$
{servers}
"""


async def _until_up(url: str) -> None:
    with trio.fail_after(60):
        while True:
            try:
                async with httpx.AsyncClient(timeout=2) as client:
                    await client.get(f"{url}/healthz")  # 503 until a runner is there
                    return
            except httpx.HTTPError:
                pass
            await trio.sleep(0.1)


async def _runners_seen(url: str, count: int) -> None:
    with trio.fail_after(60):
        while True:
            async with httpx.AsyncClient(timeout=2) as client:
                found = (await client.get(f"{url}/healthz")).json()
            if found.get("capable") == count:
                return
            await trio.sleep(0.1)


async def _client(url: str, key: str, name: str, chunks: int, until: float, got: list[int]) -> None:
    body = {
        "model": "sim-model",
        "stream": True,
        "messages": [{"role": "user", "content": name}],
        "sim": {"chunks": chunks, "interval": 0},
    }
    headers = {"Authorization": f"Bearer {key}", "X-Chat-Session": name}
    async with httpx.AsyncClient(timeout=60) as client:
        while trio.current_time() < until:
            async with client.stream(
                "POST", f"{url}/v1/chat/completions", headers=headers, json=body
            ) as response:
                count = 0
                if response.status_code != 200:
                    got[2] += 1
                    got.append((await response.aread())[:300])  # type: ignore[arg-type]
                    continue
                async for data in response.aiter_bytes():
                    count += data.count(b"data: {")
            got[0] += count
            got[1] += 1


MODES = {  # name: (replicas, runners dial, clients reach)
    "one": (1, "lb", "lb"),
    "two": (2, "lb", "lb"),
    "direct": (2, "r1", "r1"),  # every channel on r1, every turn reaching r1
    "forwarded": (2, "r1", "r0"),  # every channel on r1, every turn reaching r0: forwarded
}


async def one_round(
    server: pgserver.PgServer, mode: str, args: argparse.Namespace, tmp: Path
) -> dict[str, float]:
    replicas, runners_at, clients_at = MODES[mode]
    url = server.database()
    store = open_store(url)
    key = await store.create_api_key("bench", PROJECT, KeyLimits())
    await store.close()
    procs: list[trio.Process] = []
    hubs: list[trio.Process] = []
    try:
        ports = [_port() for _ in range(replicas)]
        for n, port in enumerate(ports):
            data = tmp / f"hub-{mode}-{n}"
            write_admin_token(data, ADMIN)
            argv = [*PY, "hub", "--store", url, "--listen", f"127.0.0.1:{port}"]
            argv += ["--data", str(data), "--replica-id", f"r{n}", "--log-level", "WARNING"]
            hub = await trio.lowlevel.open_process(argv, env=_env(), stderr=subprocess.DEVNULL)
            procs.append(hub)
            hubs.append(hub)
        for port in ports:
            await _until_up(f"http://127.0.0.1:{port}")
        lb_port = _port()
        servers = "\n".join(
            f"    server r{n} 127.0.0.1:{p} check inter 1s" for n, p in enumerate(ports)
        )
        cfg = tmp / f"haproxy-{mode}.cfg"
        cfg.write_text(HAPROXY.format(port=lb_port, servers=servers))
        procs.append(await trio.lowlevel.open_process(["haproxy", "-f", str(cfg)]))
        lb = f"http://127.0.0.1:{lb_port}"
        await _until_up(lb)
        at = {"lb": lb, **{f"r{n}": f"http://127.0.0.1:{p}" for n, p in enumerate(ports)}}
        sim_port = _port()
        procs.append(
            await trio.lowlevel.open_process(
                [*PY, "sim", "--listen", f"127.0.0.1:{sim_port}", "--models", "sim-model"],
                env=_env(),
                stderr=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        )
        for n in range(args.runners):
            argv = [*PY, "run", "--server", at[runners_at], "--project", PROJECT]
            argv += ["--backend", f"http://127.0.0.1:{sim_port}/v1", "--model", "sim-model"]
            argv += ["--user-token", ADMIN, "--name", f"runner{n}", "--log-level", "WARNING"]
            argv += ["--state-dir", str(tmp / f"state-{mode}-{n}"), "--max-sessions", "64"]
            procs.append(
                await trio.lowlevel.open_process(argv, env=_env(), stderr=subprocess.DEVNULL)
            )
        for port in ports:
            await _runners_seen(f"http://127.0.0.1:{port}", args.runners)
        # warm up: every session's job claimed and its channel open
        got = [0, 0, 0]
        async with trio.open_nursery() as nursery:
            until = trio.current_time() + 1.0
            for s in range(args.sessions):
                nursery.start_soon(_client, at[clients_at], key, f"s{s}", args.chunks, until, got)
        cpu0 = [cpu_seconds(h.pid) for h in hubs]
        pg0 = _pg_cpu(server)
        got = [0, 0, 0]
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            until = start + args.seconds
            for s in range(args.sessions):
                nursery.start_soon(_client, at[clients_at], key, f"s{s}", args.chunks, until, got)
        wall = trio.current_time() - start
        if got[2]:
            print("refused:", got[3:5], file=sys.stderr)
        cpu = [cpu_seconds(h.pid) - c for h, c in zip(hubs, cpu0, strict=True)]
        pg = _pg_cpu(server) - pg0
        return {
            "chunks_per_s": got[0] / wall,
            "turns_per_s": got[1] / wall,
            "refused": got[2],
            "hub_cpu_ms_per_1000_chunks": 1e6 * sum(cpu) / max(got[0], 1),
            "hub_cpu_share": sum(cpu) / wall,
            "pg_cpu_ms_per_turn": 1e3 * pg / max(got[1], 1),
        }
    finally:
        for proc in reversed(procs):
            if proc.returncode is None:
                proc.terminate()
        with trio.move_on_after(10):
            for proc in procs:
                await proc.wait()
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
        server.drop(url)


def _pg_cpu(server: pgserver.PgServer) -> float:
    """The CPU time of the PostgreSQL server's processes (the postmaster and its children)."""
    pid = int((server.data / "postmaster.pid").read_text().split()[0])
    return cpu_seconds(pid, tree=True)


async def main(args: argparse.Namespace) -> None:
    if shutil.which("haproxy") is None:
        sys.exit("haproxy is not installed (apt-get install haproxy)")
    path = pgserver.bin_dir()
    if path is None:
        sys.exit("PostgreSQL is not installed (apt-get install postgresql)")
    server = pgserver.PgServer(path)
    server.start()
    modes = args.modes.split(",")
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    try:
        with tempfile.TemporaryDirectory(prefix="alp-bench-replicas-") as tmp:
            for r in range(args.rounds):
                for mode in modes if r % 2 == 0 else modes[::-1]:
                    found = await one_round(server, mode, args, Path(tmp))
                    results[mode].append(found)
                    print(f"round {r + 1}, {mode}: {_fmt(found)}", flush=True)
    finally:
        server.destroy()
    med = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for m, rs in results.items()}
    for mode in modes:
        print(f"median, {mode}: {_fmt(med[mode])}")
    base = med[modes[0]]
    for mode in modes[1:]:
        print(
            f"{mode} / {modes[0]}: {med[mode]['chunks_per_s'] / base['chunks_per_s']:.2f}x the "
            f"chunks per second, {med[mode]['turns_per_s'] / base['turns_per_s']:.2f}x the "
            f"turns per second ({args.rounds} rounds each, {args.chunks} chunks a turn)"
        )


def _fmt(found: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in found.items())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each (alternating)")
    parser.add_argument(
        "--modes",
        default="one,two",
        help="what to compare, the first the baseline: one (a hub), two (two replicas behind "
        "HAProxy), direct (two; channels and turns on one), forwarded (two; every turn forwarded)",
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="load per measurement")
    parser.add_argument(
        "--sessions",
        type=int,
        default=16,
        help="concurrent client sessions (the hub's per-key cap is 16)",
    )
    parser.add_argument("--chunks", type=int, default=200, help="chunks per turn")
    parser.add_argument("--runners", type=int, default=2, help="runner processes")
    return parser


if __name__ == "__main__":
    trio.run(main, _parser().parse_args())
