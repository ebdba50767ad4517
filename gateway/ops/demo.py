"""``alp-gateway demo``: hub, runner and backend in one process, one prompt through the whole path."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import httpx
import msgspec
import trio

from gateway import logsafe
from gateway.apis.chunks import chunk_decoder
from gateway.config import Config
from gateway.hub import Hub, serve_hub
from gateway.observe import setup_logging
from gateway.runner.discovery import discover_local
from gateway.runner.supervisor import Runner
from gateway.sim import SimOptions, Simulator, serve_sim
from gateway.wire.sse import SSESplitter

PROJECT = "demo/chat"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


async def _demo(args: argparse.Namespace) -> int:
    out = sys.stdout
    sim: Simulator | None = None
    backend_url: str | None = args.backend
    model: str | None = args.model
    label = backend_url or ""
    if backend_url is None and not args.sim:
        found = await discover_local()
        if found:
            kind, backend_url, models = found[0]
            model = model or models[0]
            label = f"{kind} at {backend_url}"
    async with trio.open_nursery() as nursery:
        if backend_url is None:
            options = SimOptions(chunks=24, interval=0.03, ttft=0.1)
            sim = await nursery.start(partial(serve_sim, options=options))
            backend_url = sim.url
            model = model or "sim-model"
            label = f"built-in simulator at {backend_url} (numbered tokens, 100 ms to the first, 30 ms apart)"
        hub = Hub(None)
        hub_url: str = await nursery.start(partial(serve_hub, hub))
        api_key = await hub.keys.create("demo", PROJECT)
        with tempfile.TemporaryDirectory(prefix="alp-gateway-demo-") as state:
            config = Config(
                server=hub_url,
                server_explicit=True,
                project=PROJECT,
                state_dir=Path(state),
                backend=(backend_url,),
                model=model,
                user_token=hub.admin_token,
                name="demo-runner",
                grace=5.0,
            )
            runner = Runner(config)
            stopped = trio.Event()

            async def run_runner() -> None:
                try:
                    await runner.run()
                finally:
                    stopped.set()

            nursery.start_soon(run_runner)
            with trio.fail_after(10):
                await runner.first_poll.wait()
            print(f"hub      {hub_url}  (OpenAI-compatible front door at {hub_url}/v1)", file=out)
            print(f"runner   {config.name}, dialled out to the hub", file=out)
            print(f"backend  {logsafe.escape(label)}", file=out)
            print(f"model    {logsafe.escape(str(model))}", file=out)
            print(f"\n> {args.prompt}\n", file=out, flush=True)
            code, times, started = await _ask(hub_url, api_key, model, args.prompt)
            runner.begin_shutdown()
            with trio.move_on_after(10):
                await stopped.wait()
            nursery.cancel_scope.cancel()
    if code != 0 or not times:
        return code or 1
    print("\n", file=out)
    ttft = times[0] - started
    span = times[-1] - times[0]
    rate = (len(times) - 1) / span if span > 0 else float("inf")
    print(f"time to first token  {_ms(ttft)}", file=out)
    print(f"tokens               {len(times)} at {rate:.1f} tokens/s", file=out)
    if sim is not None and sim.streams:
        stream = sim.streams[0]
        pairs = [
            (s, p) for s, p in zip(stream.sent_at, stream.payloads, strict=False) if p != b"[DONE]"
        ]
        sent = [s for s, p in pairs if b'"content":"tok' in p]
        if len(sent) == len(times):
            delays = sorted(r - s for r, s in zip(times, sent, strict=True))
            p99 = delays[min(len(delays) - 1, int(len(delays) * 0.99))]
            print(
                f"relay overhead       p50 {_ms(statistics.median(delays))}, p99 {_ms(p99)} "
                "(backend write → client read, through runner and hub)",
                file=out,
            )
    return 0


async def _ask(
    hub_url: str, api_key: str, model: str | None, prompt: str
) -> tuple[int, list[float], float]:
    """Stream one prompt through the front door, printing content as it arrives."""
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": prompt}]}
    times: list[float] = []
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=600.0)) as client:
        async with client.stream(
            "POST",
            f"{hub_url}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {api_key}", "x-chat-session": "demo"},
        ) as resp:
            if resp.status_code != 200:
                await resp.aread()
                print(
                    f"alp-gateway demo: the hub answered {resp.status_code}: "
                    f"{logsafe.escape(resp.text)}",
                    file=sys.stderr,
                )
                return 1, times, started
            splitter = SSESplitter()
            async for raw in resp.aiter_raw():
                for payload in splitter.feed(raw):
                    if payload == b"[DONE]":
                        return 0, times, started
                    try:
                        chunk = chunk_decoder.decode(payload)
                    except msgspec.DecodeError:
                        continue
                    for choice in chunk.choices or ():
                        text = choice.delta.content if choice.delta is not None else None
                        if text and isinstance(text, str):
                            times.append(time.perf_counter())
                            print(_shown(text), end="", flush=True)
    return 0, times, started


def _shown(text: str) -> str:
    """A model's text as the terminal gets it: its line breaks kept, every other control
    character escaped as in the logs (``gateway.logsafe``)."""
    return "\n".join(logsafe.escape(line) for line in text.split("\n"))


def main(args: argparse.Namespace) -> int:
    setup_logging("WARNING")
    try:
        return trio.run(_demo, args)
    except trio.TooSlowError:
        print("alp-gateway demo: the runner did not start in time", file=sys.stderr)
        return 1
