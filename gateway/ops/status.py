"""``alp-gateway status``: a one-screen summary of a running runner, read from its /healthz and /metrics."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gateway import logsafe
from gateway.config import ConfigError, load_config, parse_listen
from gateway.runner.snapshot import BackendStatus, HistogramStatus, RunnerSnapshot

DEFAULT_URL = "http://127.0.0.1:9464"
P = "alp_gateway_"


def default_url(env: Mapping[str, str], config_file: Path | None = None) -> str:
    """``ALP_GATEWAY_METRICS_URL``, else the address the runner's ``metrics_listen`` setting
    binds (``ALP_GATEWAY_METRICS_LISTEN``, else ``metrics_listen`` in ``config_file``), else
    9464."""
    if env.get("ALP_GATEWAY_METRICS_URL"):
        return env["ALP_GATEWAY_METRICS_URL"].rstrip("/")
    listen: tuple[str, int] | None = None
    if env.get("ALP_GATEWAY_METRICS_LISTEN"):
        try:
            listen = parse_listen(env["ALP_GATEWAY_METRICS_LISTEN"])
        except ValueError:
            return DEFAULT_URL
    elif config_file is not None:
        listen = load_config({}, {}, config_file).metrics_listen  # ConfigError: said by main
    if listen is None:
        return DEFAULT_URL
    host, port = listen
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass
class Samples:
    """Parsed text-format samples: name -> [(labels, value)]."""

    by_name: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Samples:
        """Read the text format with ``prometheus_client``'s parser (imported only here)."""
        from prometheus_client.parser import text_string_to_metric_families

        samples = cls()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.by_name.setdefault(sample.name, []).append(
                    (dict(sample.labels), float(sample.value))
                )
        return samples

    def get(self, name: str, default: float = 0.0, **labels: str) -> float:
        for have, value in self.by_name.get(P + name, []):
            if all(have.get(k) == v for k, v in labels.items()):
                return value
        return default

    def rows(self, name: str) -> list[tuple[dict[str, str], float]]:
        return self.by_name.get(P + name, [])

    def snapshot(self) -> RunnerSnapshot:
        """The runner's ``RunnerSnapshot`` as /metrics shows it (what ``summary`` reads).

        Only what /metrics carries: ``poll_interval`` and ``last_poll_error`` are not in it."""
        counters: dict[str, int] = {}
        for name, rows in self.by_name.items():
            if name.startswith(P) and name.endswith("_total"):
                key = name[len(P) : -len("_total")]
                for labels, value in rows:
                    full = f"{key}_{labels['outcome']}" if "outcome" in labels else key
                    counters[full] = int(value)
        histograms = {}
        for name in self.by_name:
            if name.startswith(P) and name.endswith("_bucket"):
                key = name[len(P) : -len("_bucket")]
                bounds = sorted(
                    (float(labels["le"]), int(v)) for labels, v in self.rows(key + "_bucket")
                )
                finite = [(b, c) for b, c in bounds if b != float("inf")]
                histograms[key] = HistogramStatus(
                    tuple(b for b, _ in finite),
                    tuple(c for _, c in finite),
                    self.get(key + "_sum"),
                    int(self.get(key + "_count")),
                )
        backends = tuple(
            BackendStatus(
                name=labels.get("backend", "?"),
                url=labels.get("url", ""),
                up=bool(up),
                in_flight=int(self.get("backend_in_flight", backend=labels.get("backend", "?"))),
                waiting=int(self.get("backend_waiting", backend=labels.get("backend", "?"))),
            )
            for labels, up in self.rows("backend_up")
        )
        age = self.get("last_poll_ok_age_seconds", -1.0)
        return RunnerSnapshot(
            max_sessions=int(self.get("max_sessions")),
            poll_interval=0.0,
            ping_interval=self.get("ping_interval_seconds"),
            sessions_open=int(self.get("sessions_open")),
            last_poll_age=None if age < 0 else age,
            backends=backends,
            counters=counters,
            histograms=histograms,
            version=next((labels.get("version", "?") for labels, _ in self.rows("info")), "?"),
        )


@dataclass
class Reading:
    health_status: int
    health_text: str
    samples: Samples
    at: float


def read(url: str, timeout: float = 5.0) -> Reading:
    """One look at ``url``'s /healthz and /metrics (raises httpx.HTTPError when unreachable)."""
    import httpx  # here, so that building the command line parser stays cheap

    with httpx.Client(timeout=timeout, trust_env=False) as client:
        health = client.get(url + "/healthz")
        metrics = client.get(url + "/metrics")
        metrics.raise_for_status()
    return Reading(
        health.status_code, health.text.strip(), Samples.parse(metrics.text), time.monotonic()
    )


def _seconds(value: float) -> str:
    return "more than the largest bucket" if value == float("inf") else f"≤ {value:g} s"


def summary(url: str, now: Reading, before: Reading | None = None) -> str:
    """The one-screen text for a reading (with a chunk rate when there is an earlier reading)."""
    status = now.samples.snapshot()
    count = status.counters.get
    lines = [f"alp-gateway {status.version} at {url}"]
    state = "healthy" if now.health_status == 200 else f"NOT HEALTHY ({now.health_status})"
    lines.append(f"health      {state}: {now.health_text}")
    lines.append(
        f"sessions    {status.sessions_open} open (max {status.max_sessions}), "
        f"{count('sessions_started', 0)} started, {count('sessions_ended', 0)} ended"
    )
    outcomes = ("done", "error", "cancelled")
    lines.append("turns       " + ", ".join(f"{count('turns_' + o, 0)} {o}" for o in outcomes))
    chunks = count("chunks", 0)
    rate = ""
    if before is not None and now.at > before.at:
        earlier = before.samples.snapshot().counters.get("chunks", 0)
        per_second = (chunks - earlier) / (now.at - before.at)
        rate = f"  ({per_second:.1f}/s over the last {now.at - before.at:.1f} s)"
    lines.append(f"chunks      {chunks}{rate}")
    age = status.last_poll_age
    last = f"; last good {age:.1f} s ago" if age is not None else "; none good yet"
    lines.append(f"polls       {count('polls', 0)}, {count('poll_errors', 0)} failed{last}")
    lines.append(
        f"channels    {count('reconnects', 0)} redials, {count('heartbeats', 0)} heartbeats"
    )
    keepalive = (
        f"ping every {status.ping_interval:g} s" if status.ping_interval > 0 else "pings off"
    )
    lines.append(
        f"keepalive   {keepalive}: {count('pings_sent', 0)} pings sent, "
        f"{count('pong_timeouts', 0)} pong timeouts, {count('channels_dead', 0)} channels dead"
    )
    done = count("turns_done", 0)
    for name, title in (("ttft_seconds", "first token"), ("relay_seconds", "relay")):
        hist = status.histograms.get(name)
        p50, p95 = (hist.quantile(0.5), hist.quantile(0.95)) if hist else (None, None)
        if (hist is None or p50 is None or p95 is None) and done:
            # both are timed on streamed answers: the turns so far were answered whole
            lines.append(f"{title:<12}timed on streamed turns only: none yet ({done} done)")
        elif hist is None or p50 is None or p95 is None:
            lines.append(f"{title:<12}no samples yet")
        else:
            lines.append(
                f"{title:<12}p50 {_seconds(p50)}, p95 {_seconds(p95)} ({hist.count} samples)"
            )
    if not status.backends:
        lines.append("backends    none")
    for i, b in enumerate(status.backends):
        head = "backends    " if i == 0 else " " * 12
        lines.append(
            f"{head}{b.name:<10} {'up' if b.up else 'DOWN':<5} "
            f"{b.in_flight} in flight, {b.waiting} waiting  {b.url}"
        )
    # a line each: what the runner's endpoints said escaped as in the logs (a backend's name, its
    # URL, the health text), so that none can move the cursor or start a line of its own
    return "\n".join(logsafe.escape(line) for line in lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-url",
        default=None,
        metavar="URL",
        help=f"where the runner serves /metrics (default: ALP_GATEWAY_METRICS_URL, else the "
        f"runner's metrics_listen: ALP_GATEWAY_METRICS_LISTEN or --config's; else {DEFAULT_URL})",
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="the runner's TOML settings file, for its metrics_listen",
    )
    parser.add_argument(
        "--rate", action="store_true", help="read twice, a second apart, for a chunk rate"
    )


def main(args: argparse.Namespace) -> int:
    """0 healthy, 1 running but not healthy, 2 not reachable (usable as a container health check)."""
    import httpx

    try:
        url = (args.metrics_url or default_url(os.environ, args.config)).rstrip("/")
    except ConfigError as exc:
        print(f"alp-gateway status: {logsafe.escape(str(exc))}", file=sys.stderr)
        return 2
    try:
        first = read(url)
        before: Reading | None = None
        now = first
        if args.rate:
            time.sleep(1.0)  # the sampling interval of the rate, not a synchronisation
            before, now = first, read(url)
    except httpx.HTTPStatusError as exc:
        print(
            f"alp-gateway status: {exc.request.url} answered {exc.response.status_code}: "
            "something listens there, but it is not an alp-gateway runner's metrics port; "
            "give the address of the runner's --metrics-listen (--metrics-url or "
            "ALP_GATEWAY_METRICS_URL)",
            file=sys.stderr,
        )
        return 2
    except httpx.HTTPError as exc:
        from gateway.runner.alp import describe_error

        print(
            f"alp-gateway status: {url} is not answering ({describe_error(exc, url)}); is the "
            "runner started with --metrics-listen?",
            file=sys.stderr,
        )
        return 2
    print(summary(url, now, before))
    return 0 if now.health_status == 200 else 1
