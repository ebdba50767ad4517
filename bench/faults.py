"""``python -m bench.faults``: each fault that can hit a turn mid-answer, in each API, timed as a
client sees it (issue 27 point 6).

Real processes on loopback (``bench/faultrig.py``): ``python -m gateway sim`` (``--chunks`` 60
content chunks ``--interval`` 0.02 s apart: a 1.2 s answer; a request ending with the start of its
answer as an assistant message gets exactly the rest), ``python -m gateway hub`` (its own data
directory) and ``python -m gateway run`` runners, each dialling the hub through a path proxy of
its own (``tests/support/pathproxy.py``). Hub and runners ping every ``--ping`` s (0.5; ping timeout the
same; the hub's keepalives every half of it). The client (``bench/faultclient.py``) sends a
streamed turn on a fresh session and reads the SSE by hand; the fault fires as it reads its n-th
content delta, n drawn in [3, chunks - 10] (``--seed``). Faults (``--faults``):

- ``none``: no fault (the gap of an undisturbed answer, for reference).
- ``cut``: every connection of the serving runner (channel, events stream, kept-alive REST) reset
  at both ends by its proxy; a second runner idle.
- ``frozen``: every connection of the serving runner stops carrying bytes, both ends left open
  (found by the pings); a second runner idle.
- ``sigkill``: the serving runner SIGKILLed; a second runner idle (a new one replaces it after).
- ``backend``: one runner with two backends serving the model (two simulators); the one serving
  the turn SIGKILLed (started again on its port after).
- ``rest-frozen``: one runner, every connection it holds frozen, then a new session's turn at
  once (and while one fails, another new session's, until one is served). The freeze falls at a
  random time up to ``--spread`` s after the runner is ready: anywhere in a poll's cycle, whether
  the kept-alive connection the next poll takes is fresh or was closed. Figures: the freeze →
  the first content delta of a new session (issue 27 point 4: ≤ 2 × ping + 1 s), and what the
  first client waited (for its first delta, or for its error: counted as an error).
- ``hub-restart``: two runners; a session's turn 1 whole, turn 2 cut by a SIGKILL of the hub, the
  hub started again on its port and data directory, turn 3 sent as soon as it answers. Figures:
  the runners' return (every runner listed ready and as many channels open as before the kill,
  from the hub's first answer), turn 3's TTFT and whether the same runner served it, and the
  usage ledger at the end (each session: two turns ``ok``, one ``cut``). Turn 2's error is the
  expected one (a TCP connection cannot move to a new process).

Per fault × API: client-visible errors (an HTTP error, an error event, a stream that ends
without its API's last event, a deadline), answers whose text equals the undisturbed one, answers
that are one answer in the API's shape (``faultclient.Answer.shape``), the gap (the longest pause
between two content deltas) p50/p99, and how the hub saved it (its ``turnsResumed``,
``turnsContinued`` counters; the runner's ``turns_continued`` for ``backend``). Every wait is
bounded (``--within``); processes are stopped by PID; the scratch directory is removed unless
``--keep`` (or a run failed). Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.common import machine
from bench.faultclient import APIS, Answer, turn
from bench.faultreport import summarize, table
from bench.faultrig import Rig, RunnerProc, Sim

FAULTS = ("none", "cut", "frozen", "sigkill", "backend", "rest-frozen", "hub-restart")
Prepare = Callable[[str], Awaitable[Any]]  # session -> what the fault needs (found at delta 1)
Fire = Callable[[Any], Awaitable[None]]


class Bench:
    def __init__(self, args: argparse.Namespace, rig: Rig, rng: random.Random) -> None:
        self.args, self.rig, self.rng = args, rig, rng
        self.whole: dict[str, str] = {}  # api -> the undisturbed answer's text
        self.sessions = 0
        self.runs: list[dict[str, Any]] = []

    def session(self, fault: str) -> str:
        self.sessions += 1
        return f"{fault}-{self.sessions}"

    def order(self, run: int) -> list[str]:
        apis = list(self.args.apis)
        shift = run % len(apis)
        return apis[shift:] + apis[:shift]  # each API first in turn: the noise falls on all

    async def undisturbed(self) -> None:
        """One turn per API with no fault: the text every faulted answer must equal."""
        expected = "".join(f"tok{i} " for i in range(self.args.chunks))
        for api in self.args.apis:
            answer = await turn(
                self.rig.hub_port, self.rig.key, api, self.session("calm"), "hi", self.args.within
            )
            if answer.failed or answer.text != expected:
                raise RuntimeError(f"the undisturbed {api} turn: {answer.failed or answer.text!r}")
            self.whole[api] = answer.text

    async def faulted(
        self, api: str, session: str, prepare: Prepare | None, fire: Fire | None
    ) -> tuple[Answer, dict[str, Any]]:
        """One turn; ``prepare`` run at its first content delta (e.g. to find the serving runner,
        its answer kept as ``target``), and with ``fire`` the fault fired with it at a random
        content delta."""
        at = self.rng.randint(3, self.args.chunks - 10) if fire is not None else None
        first, reached = trio.Event(), trio.Event()
        seen = [0]
        info: dict[str, Any] = {"at": at, "fired_at": None}

        def on_delta(n: int) -> None:
            seen[0] = n
            if n == 1:
                first.set()
            if n == at:
                reached.set()

        async def fault() -> None:
            await first.wait()
            target = await prepare(session) if prepare is not None else None
            info["target"] = target
            if fire is None:
                return
            await reached.wait()
            info["fired_at"] = seen[0]
            await fire(target)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fault)
            answer = await turn(
                self.rig.hub_port, self.rig.key, api, session, "hi", self.args.within, on_delta
            )
            if info["fired_at"] is None:
                nursery.cancel_scope.cancel()  # it ended before the fault's delta (or no fault)
        return answer, info

    def record(
        self, fault: str, api: str, run: int, answer: Answer, **extra: Any
    ) -> dict[str, Any]:
        row = {
            "fault": fault,
            "api": api,
            "run": run,
            "status": answer.status,
            "failed": answer.failed,
            "equal": answer.text == self.whole.get(api),
            "shape": answer.shape() if not answer.failed else None,
            "gap_s": _r(answer.gap),
            "ttft_s": _r(answer.ttft),
            "deltas": len(answer.deltas),
            "keepalives": answer.keepalives,
            **extra,
        }
        self.runs.append(row)
        mark = "ok" if not row["failed"] and row["equal"] and not row["shape"] else "!!"
        said = ", ".join(f"{k}={v}" for k, v in extra.items() if k not in ("session",))
        print(
            f"  {mark} {fault:<11} {api:<9} run {run:>2}: "
            f"{'error: ' + row['failed'] if row['failed'] else 'whole'}"
            f"{'' if row['equal'] else ', text differs'}"
            f"{', shape: ' + row['shape'] if row['shape'] else ''}, "
            f"gap {_ms(row['gap_s'])}; {said}",
            flush=True,
        )
        return row

    async def how(self, before: dict[str, int]) -> dict[str, int]:
        after = await self.rig.counters()
        keys = ("turnsResumed", "turnsContinued", "failovers")
        return {k: after.get(k, 0) - before.get(k, 0) for k in keys}

    # -- the faults ------------------------------------------------------------------------

    async def two_runners(self) -> Sim:
        sim = await self.rig.start_sim()
        await self.rig.start_hub()
        await self.rig.start_runner([sim])
        await self.rig.start_runner([sim])
        await self.undisturbed()
        return sim

    async def serving(self, session: str) -> str:
        with trio.fail_after(self.args.within):
            while (name := await self.rig.serving(session)) is None:  # noqa: ASYNC110 (the hub's)
                await trio.sleep(0.01)
        return name

    async def on_path(self, fault: str) -> None:
        """``none``, ``cut``, ``frozen``, ``sigkill``: two runners, the serving one hit."""
        sim = await self.two_runners()
        rig = self.rig

        async def cut(name: str) -> None:
            rig.runners[name].proxy.cut_all()

        async def freeze(name: str) -> None:
            rig.runners[name].proxy.freeze()

        async def kill(name: str) -> None:
            await rig.kill_runner(name)

        fire: Fire | None = {"none": None, "cut": cut, "frozen": freeze, "sigkill": kill}[fault]
        for run in range(self.args.runs):
            for api in self.order(run):
                before = await rig.counters()
                session = self.session(fault)
                answer, info = await self.faulted(api, session, self.serving, fire)
                self.record(fault, api, run, answer, **info, **(await self.how(before)))
                if fault == "frozen":
                    await trio.sleep(2 * self.args.ping)  # both ends have given the paths up
                    for runner in rig.runners.values():
                        runner.proxy.reap()
                if fault == "sigkill" and len(rig.runners) < 2:
                    await rig.start_runner([sim])  # two runners again
                await rig.ready(list(rig.runners))

    async def backend(self) -> None:
        """One runner, two backends for the model; the one serving SIGKILLed mid-answer."""
        rig = self.rig
        sims = [await rig.start_sim(), await rig.start_sim()]
        await rig.start_hub()
        runner = await rig.start_runner(sims, metrics=True)
        await self.undisturbed()

        async def serving_backend(session: str) -> int:
            with trio.fail_after(self.args.within):
                while True:
                    metrics = _metrics(await rig.runner_metrics(runner))
                    for sim in sims:
                        if metrics.get(("alp_gateway_backend_in_flight", sim.url), 0) > 0:
                            return sim.port
                    await trio.sleep(0.01)

        async def kill(port: int) -> None:
            sim = next(s for s in sims if s.port == port)
            assert sim.child.proc is not None
            sim.child.proc.kill()

        for run in range(self.args.runs):
            for api in self.order(run):
                continued = _metrics(await rig.runner_metrics(runner)).get(
                    ("alp_gateway_turns_continued_total", ""), 0
                )
                answer, info = await self.faulted(
                    api, self.session("backend"), serving_backend, kill
                )
                after = _metrics(await rig.runner_metrics(runner))
                info["runner_continued"] = int(
                    after.get(("alp_gateway_turns_continued_total", ""), 0) - continued
                )
                self.record("backend", api, run, answer, **info)
                for i, sim in enumerate(sims):  # the killed one back on its port
                    if sim.child.proc is not None and sim.child.proc.returncode is None:
                        continue
                    if sim.child.proc is not None:
                        await sim.child.proc.wait()
                    sims[i] = await rig.start_sim(sim.port)
                await self.backends_up(runner, sims)

    async def backends_up(self, runner: RunnerProc, sims: list[Sim]) -> None:
        with trio.fail_after(self.args.within):
            while True:
                metrics = _metrics(await self.rig.runner_metrics(runner))
                if all(metrics.get(("alp_gateway_backend_up", s.url)) == 1 for s in sims):
                    return
                await trio.sleep(0.05)

    async def rest_frozen(self) -> None:
        """One runner, every connection it holds frozen; then a new session's turn at once, and
        while that one fails, another new session's, until one is served."""
        rig = self.rig
        sim = await rig.start_sim()
        await rig.start_hub()
        runner = await rig.start_runner([sim])
        await self.undisturbed()  # also: the runner holds channels, as a busy one does
        bound = 2 * self.args.ping + 1
        for run in range(self.args.runs):
            for api in self.order(run):
                await rig.ready([runner.name], within=2 * self.args.within)
                # polls and keepalives go on as usual; the freeze falls anywhere in a poll's cycle
                await trio.sleep(0.3 * self.args.ping + self.rng.uniform(0, self.args.spread))
                frozen_at = time.perf_counter()
                frozen = runner.proxy.freeze()
                first = answer = await turn(
                    rig.hub_port, rig.key, api, self.session("rest"), "hi", self.args.within
                )
                # what the first client waited: for its first delta, else for its error
                ends = [at for at, _, _ in first.events]
                waited = (first.deltas[0][0] if first.deltas else max(ends, default=0.0)) - (
                    first.sent or frozen_at
                )
                attempts = 1
                with trio.move_on_after(2 * self.args.within):
                    while not answer.deltas:  # a new session's turn until the runner serves one
                        attempts += 1
                        answer = await turn(
                            rig.hub_port, rig.key, api, self.session("rest"), "hi", self.args.within
                        )
                served = answer.deltas[0][0] - frozen_at if answer.deltas else None
                self.record(
                    "rest-frozen",
                    api,
                    run,
                    first,
                    frozen_paths=frozen,
                    wait_s=_r(served),
                    within_bound=served is not None and served <= bound,
                    client_wait_s=_r(waited if first.sent else None),
                    attempts=attempts,
                )
                await trio.sleep(2 * self.args.ping)
                runner.proxy.reap()

    async def hub_restart(self) -> None:
        """Turn 1 whole, turn 2 cut by the hub's SIGKILL, the hub again, turn 3 at once."""
        rig = self.rig
        sim = await rig.start_sim()
        await rig.start_hub()
        await rig.start_runner([sim])
        await rig.start_runner([sim])
        await self.undisturbed()

        async def kill(_: str) -> None:
            await rig.kill_hub()

        for run in range(self.args.runs):
            for api in self.order(run):
                await rig.ready(list(rig.runners))
                session = self.session("restart")
                one = await turn(rig.hub_port, rig.key, api, session, "hi", self.args.within)
                channels = await rig.hub_metric("alp_hub_channels_open")
                two, info = await self.faulted(api, session, self.serving, kill)
                assert rig.hub is not None and rig.hub.proc is not None
                if rig.hub.proc.returncode is None:  # the turn ended before its fault's delta
                    await rig.kill_hub()
                back = await rig.start_hub()
                returned: list[float] = []

                async def watch(
                    channels: float | None = channels,
                    back: float = back,
                    returned: list[float] = returned,
                ) -> None:
                    with trio.move_on_after(self.args.within):
                        while True:
                            try:
                                listed = (await rig.admin("/api/hub/runners"))["runners"]
                                open_now = await rig.hub_metric("alp_hub_channels_open") or 0
                            except httpx.HTTPError:
                                listed, open_now = [], 0
                            up = {r["name"] for r in listed if _ready_json(r)}
                            if set(rig.runners) <= up and open_now >= (channels or 0):
                                returned.append(time.perf_counter() - back)
                                return
                            await trio.sleep(0.05)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch)
                    three, next_info = await self.faulted(api, session, self.serving, None)
                self.record(
                    "hub-restart",
                    api,
                    run,
                    three,
                    session=session,
                    first_turn=one.failed or "whole",
                    cut_turn=two.failed or "whole",
                    cut_at=info["fired_at"],
                    served_cut=info.get("target"),
                    served_next=next_info.get("target"),
                    return_s=_r(returned[0]) if returned else None,
                )
        await self.ledger()

    async def ledger(self) -> None:
        """The hub stopped, its usage rows read: each session two turns ok and one cut."""
        from gateway.hub.store import open_store  # this checkout's store: the bench's own tree

        assert self.rig.hub is not None
        await self.rig.hub.stop()
        store = open_store(self.rig.data, create=False)
        try:
            rows = await store.usage_rows()
        finally:
            await store.close()
        outcomes: dict[str, list[str]] = {}
        for row in rows:
            outcomes.setdefault(row["session"], []).append(row["outcome"])
        for row in self.runs:
            if row["fault"] == "hub-restart":
                got = sorted(outcomes.get(row["session"], []))
                row["ledger"] = got
                row["ledger_ok"] = got == ["cut", "ok", "ok"]


def _ready_json(r: dict[str, Any]) -> bool:
    return bool(r.get("up")) and "chat-llm:v1" in (r.get("capabilities") or ())


def _metrics(text: str) -> dict[tuple[str, str], float]:
    """Prometheus text: (name, url label or "") -> value."""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        url = ""
        if "{" in name:
            name, _, labels = name.partition("{")
            for part in labels.rstrip("}").split(","):
                k, _, v = part.partition("=")
                if k == "url":
                    url = v.strip('"')
        try:
            out[(name, url)] = float(value)
        except ValueError:
            continue
    return out


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f} ms"


async def run_fault(
    args: argparse.Namespace, fault: str, rng: random.Random
) -> tuple[list[dict[str, Any]], str | None]:
    """The runs of one fault on a rig of its own; and what stopped it early, if anything."""
    tmp = Path(tempfile.mkdtemp(prefix=f"alp-faults-{fault}-"))
    print(f"{fault}: logs in {tmp}", flush=True)
    bench: Bench | None = None
    aborted: str | None = None
    try:
        async with trio.open_nursery() as nursery:
            rig = Rig(
                tmp,
                nursery,
                tree=Path(args.tree) if args.tree else None,
                chunks=args.chunks,
                interval=args.interval,
                ping=args.ping,
            )
            bench = Bench(args, rig, rng)
            try:
                if fault in ("none", "cut", "frozen", "sigkill"):
                    await bench.on_path(fault)
                elif fault == "backend":
                    await bench.backend()
                elif fault == "rest-frozen":
                    await bench.rest_frozen()
                else:
                    await bench.hub_restart()
            finally:
                await rig.stop()
                nursery.cancel_scope.cancel()
    except Exception as exc:  # reported, and the next fault runs
        aborted = f"{type(exc).__name__}: {exc!r}"
        print(f"{fault}: stopped early: {aborted}", flush=True)
    runs = bench.runs if bench is not None else []
    if args.keep or aborted or any(r["failed"] or not r["equal"] for r in runs):
        print(f"{fault}: kept {tmp}", flush=True)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return runs, aborted


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {
            k: getattr(args, k)
            for k in ("runs", "chunks", "interval", "ping", "within", "seed", "spread", "tree")
        },
        "faults": {},
    }
    for fault in args.faults:
        runs, aborted = await run_fault(args, fault, rng)
        results["faults"][fault] = {
            "runs": runs,
            "summary": summarize(fault, runs, args),
            "aborted": aborted,
        }
    results["seconds"] = round(time.perf_counter() - started, 1)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__)
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated (all)")
    parser.add_argument("--apis", default=",".join(APIS), help="comma-separated (all three)")
    parser.add_argument("--runs", type=int, default=20, help="runs per fault and API (20)")
    parser.add_argument("--chunks", type=int, default=60, help="content chunks an answer (60)")
    parser.add_argument("--interval", type=float, default=0.02, help="s between chunks (0.02)")
    parser.add_argument("--ping", type=float, default=0.5, help="hub's and runners' ping, s (0.5)")
    parser.add_argument("--within", type=float, default=30.0, help="bound on every wait, s (30)")
    parser.add_argument("--seed", type=int, default=1, help="where the faults fall (1)")
    parser.add_argument(
        "--spread",
        type=float,
        default=10.0,
        help="rest-frozen: the freeze falls up to this many s after the runner is ready (10: "
        "the runner's default poll interval, so that it falls anywhere in a poll's cycle)",
    )
    parser.add_argument("--tree", help="run the hub and runners of this checkout (default: this)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directories")
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results-faults.json"), help="JSON output"
    )
    args = parser.parse_args(argv)
    args.faults = [f for f in args.faults.split(",") if f]
    args.apis = [a for a in args.apis.split(",") if a]
    for fault in args.faults:
        if fault not in FAULTS:
            parser.error(f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")
    for api in args.apis:
        if api not in APIS:
            parser.error(f"unknown API {api!r}; one of {', '.join(APIS)}")
    if args.chunks < 14:
        parser.error("--chunks must be at least 14 (the fault falls in [3, chunks - 10])")
    # a SIGTERM (``timeout``, a CI runner) ends it as Ctrl-C does: every rig stops its processes
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    results = trio.run(main_async, args)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print()
    print(table(results))
    print(f"\n{results['seconds']:.0f} s; written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
