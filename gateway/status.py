"""``alp-gateway status``: a one-screen summary of a running runner, read from its /healthz and /metrics."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.config import parse_listen

DEFAULT_URL = "http://127.0.0.1:9464"
P = "alp_gateway_"


def default_url(env: Mapping[str, str]) -> str:
    """``ALP_GATEWAY_METRICS_URL``, else the address ``ALP_GATEWAY_METRICS_LISTEN`` binds, else 9464."""
    if env.get("ALP_GATEWAY_METRICS_URL"):
        return env["ALP_GATEWAY_METRICS_URL"].rstrip("/")
    if env.get("ALP_GATEWAY_METRICS_LISTEN"):
        try:
            host, port = parse_listen(env["ALP_GATEWAY_METRICS_LISTEN"])
        except ValueError:
            return DEFAULT_URL
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    return DEFAULT_URL


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

    def quantile(self, name: str, q: float) -> tuple[float, int] | None:
        """The upper bound of the bucket holding quantile ``q``, and the count; None when empty."""
        buckets = sorted(
            (float(labels["le"]), v) for labels, v in self.rows(name + "_bucket") if "le" in labels
        )
        count = int(self.get(name + "_count"))
        if not buckets or count == 0:
            return None
        for bound, cumulative in buckets:
            if cumulative >= q * count:
                return bound, count
        return buckets[-1][0], count


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


def _n(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.2f}"


def _seconds(value: float) -> str:
    return "more than the largest bucket" if value == float("inf") else f"≤ {value:g} s"


def summary(url: str, now: Reading, before: Reading | None = None) -> str:
    """The one-screen text for a reading (with a chunk rate when there is an earlier reading)."""
    s = now.samples
    version = next((labels.get("version", "?") for labels, _ in s.rows("info")), "?")
    lines = [f"alp-gateway {version} at {url}"]
    state = "healthy" if now.health_status == 200 else f"NOT HEALTHY ({now.health_status})"
    lines.append(f"health      {state}: {now.health_text}")
    lines.append(
        f"sessions    {_n(s.get('sessions_open'))} open (max {_n(s.get('max_sessions'))}), "
        f"{_n(s.get('sessions_started_total'))} started, {_n(s.get('sessions_ended_total'))} ended"
    )
    lines.append(
        "turns       "
        + ", ".join(
            f"{_n(s.get('turns_total', outcome=o))} {o}" for o in ("done", "error", "cancelled")
        )
    )
    chunks = s.get("chunks_total")
    rate = ""
    if before is not None and now.at > before.at:
        per_second = (chunks - before.samples.get("chunks_total")) / (now.at - before.at)
        rate = f"  ({per_second:.1f}/s over the last {now.at - before.at:.1f} s)"
    lines.append(f"chunks      {_n(chunks)}{rate}")
    age = s.get("last_poll_ok_age_seconds", -1.0)
    last = f"; last good {age:.1f} s ago" if age >= 0 else "; none good yet"
    lines.append(
        f"polls       {_n(s.get('polls_total'))}, {_n(s.get('poll_errors_total'))} failed{last}"
    )
    lines.append(
        f"channels    {_n(s.get('reconnects_total'))} redials, "
        f"{_n(s.get('heartbeats_total'))} heartbeats"
    )
    for name, title in (("ttft_seconds", "first token"), ("relay_seconds", "relay")):
        p50, p95 = s.quantile(name, 0.5), s.quantile(name, 0.95)
        if p50 is None or p95 is None:
            lines.append(f"{title:<12}no samples yet")
        else:
            lines.append(
                f"{title:<12}p50 {_seconds(p50[0])}, p95 {_seconds(p95[0])} ({p50[1]} samples)"
            )
    rows = s.rows("backend_up")
    if not rows:
        lines.append("backends    none")
    for i, (labels, up) in enumerate(rows):
        name = labels.get("backend", "?")
        in_flight = s.get("backend_in_flight", backend=name)
        waiting = s.get("backend_waiting", backend=name)
        head = "backends    " if i == 0 else " " * 12
        lines.append(
            f"{head}{name:<10} {'up' if up else 'DOWN':<5} "
            f"{_n(in_flight)} in flight, {_n(waiting)} waiting"
            f"  {labels.get('url', '')}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-url",
        default=None,
        metavar="URL",
        help=f"where the runner serves /metrics (default {DEFAULT_URL}, or from "
        "ALP_GATEWAY_METRICS_URL / ALP_GATEWAY_METRICS_LISTEN)",
    )
    parser.add_argument(
        "--rate", action="store_true", help="read twice, a second apart, for a chunk rate"
    )


def main(args: argparse.Namespace) -> int:
    """0 healthy, 1 running but not healthy, 2 not reachable (usable as a container health check)."""
    import httpx

    url = (args.metrics_url or default_url(os.environ)).rstrip("/")
    try:
        first = read(url)
        before: Reading | None = None
        now = first
        if args.rate:
            time.sleep(1.0)  # the sampling interval of the rate, not a synchronisation
            before, now = first, read(url)
    except httpx.HTTPError as exc:
        print(
            f"alp-gateway status: {url} is not answering ({type(exc).__name__}); is the runner "
            "started with --metrics-listen?",
            file=sys.stderr,
        )
        return 2
    print(summary(url, now, before))
    return 0 if now.health_status == 200 else 1
