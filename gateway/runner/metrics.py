"""The runner's local health and metrics HTTP server: ``/healthz``, ``/livez`` and ``/metrics``.

Off unless ``--metrics-listen`` is given; a bare port binds loopback only. The protocol needs no
listening socket (docs/protocol.md §5): this one is for the machine's own probes and Prometheus.

Everything served is read from one ``RunnerSnapshot`` snapshot (``gateway.runner.snapshot``), taken per
request through the callable the runner hands over; this module knows nothing of the runner.
``/metrics`` is rendered by ``prometheus_client`` (a private ``CollectorRegistry`` with one custom
collector over the snapshot: none of its global registry, default collectors or threads). It is
imported only when the server is opened, so a runner without ``--metrics-listen`` does not pay
its import time.

The server is the project's own HTTP core (``gateway.wire.server``) on listeners bound at the
start: GET/HEAD only, bounded head size and time and open connections, so a stuck client cannot
hold anything.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import trio

from gateway.runner.snapshot import RunnerSnapshot
from gateway.wire.http import Request
from gateway.wire.server import ConnectionLimits, Server

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

log = logging.getLogger("gateway.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "alp_gateway_"
MAX_REQUEST_HEAD = 8192
REQUEST_TIMEOUT = 10.0
MAX_CONNECTIONS = 64

# counter name in RunnerStatus.counters -> (metric family, help)
_COUNTERS: dict[str, tuple[str, str]] = {
    "chunks": ("chunks", "Chunk frames relayed from a backend to the Server."),
    "sessions_started": ("sessions_started", "Chat sessions (claimed Chat Jobs) started."),
    "sessions_ended": ("sessions_ended", "Chat sessions ended, whatever the outcome."),
    "reconnects": ("reconnects", "Chat Channels redialled after a drop."),
    "polls": ("polls", "Polls for jobs, successful or not."),
    "poll_errors": ("poll_errors", "Polls that failed (Server unreachable, timed out or 5xx)."),
    "heartbeats": ("heartbeats", "Progress heartbeats the Server accepted."),
    "heartbeats_spared": (
        "heartbeats_spared",
        "Progress heartbeats not sent: the Server's hello made the open channel the job's sign "
        "of life.",
    ),
    "pings_sent": ("pings_sent", "WebSocket pings sent on the Chat Channels (keepalive)."),
    "pong_timeouts": (
        "pong_timeouts",
        "Pings that got no pong, nor any other frame, within the ping timeout.",
    ),
    "channels_dead": (
        "channels_dead",
        "Chat Channels declared dead by the keepalive (dropped, then redialled).",
    ),
    "turns_resumed": (
        "turns_resumed",
        "Turns of a dropped Chat Channel resumed on its redial (the resume extension).",
    ),
    "turns_continued": (
        "turns_continued",
        "Answers continued on another backend after theirs died mid-answer.",
    ),
    "registration_errors": (
        "registration_errors",
        "Registration attempts that failed on an unreachable or failing Server (retried).",
    ),
}
_TURNS = {"turns_done": "done", "turns_error": "error", "turns_cancelled": "cancelled"}
_REPORTS = {"reports_success": "success", "reports_failure": "failure", "reports_lost": "lost"}
_HISTOGRAM_HELP = {
    "ttft_seconds": "Time from a streamed turn's request frame to its first chunk read from the "
    "backend (a turn answered whole is not timed).",
    "relay_seconds": "Time from a read of a streamed answer to its frames queued for the Server.",
}
_NOT_A_NAME = re.compile(r"[^a-zA-Z0-9_]")


def families(status: RunnerSnapshot) -> Iterator[Any]:
    """The snapshot as ``prometheus_client`` metric families (what the custom collector yields)."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    info = GaugeMetricFamily(
        PREFIX + "info", "The running alp-gateway version.", labels=["version"]
    )
    info.add_metric([status.version], 1)
    yield info
    healthy, _ = status.health()
    yield GaugeMetricFamily(
        PREFIX + "healthy", "1 when /healthz answers 200, else 0.", int(healthy)
    )
    yield GaugeMetricFamily(
        PREFIX + "sessions_open", "Chat sessions open now.", status.sessions_open
    )
    yield GaugeMetricFamily(
        PREFIX + "max_sessions", "Most chat sessions served at once.", status.max_sessions
    )
    yield GaugeMetricFamily(
        PREFIX + "ping_interval_seconds",
        "Seconds between keepalive pings on each Chat Channel (0: keepalive off).",
        status.ping_interval,
    )
    if status.last_poll_age is not None:
        yield GaugeMetricFamily(
            PREFIX + "last_poll_ok_age_seconds",
            "Seconds since the last successful poll.",
            round(status.last_poll_age, 3),
        )
    counts = dict(status.counters)
    turns = CounterMetricFamily(
        PREFIX + "turns", "Chat turns finished, by outcome.", labels=["outcome"]
    )
    for key, outcome in _TURNS.items():
        turns.add_metric([outcome], counts.pop(key, 0))
    yield turns
    reports = CounterMetricFamily(
        PREFIX + "final_reports",
        "Chat Jobs' final reports: recorded by the Server, by conclusion, or lost (given up).",
        labels=["outcome"],
    )
    for key, outcome in _REPORTS.items():
        reports.add_metric([outcome], counts.pop(key, 0))
    yield reports
    for key, (name, help_text) in _COUNTERS.items():
        yield CounterMetricFamily(PREFIX + name, help_text, counts.pop(key, 0))
    for key in sorted(counts):  # counters added elsewhere later show up without a change here
        yield CounterMetricFamily(
            PREFIX + _NOT_A_NAME.sub("_", key), f"Events counted as {key}.", counts[key]
        )
    for key, hist in status.histograms.items():
        buckets = [(repr(float(b)), c) for b, c in zip(hist.bounds, hist.cumulative, strict=True)]
        buckets.append(("+Inf", hist.count))
        yield HistogramMetricFamily(
            PREFIX + _NOT_A_NAME.sub("_", key),
            _HISTOGRAM_HELP.get(key, key),
            buckets=buckets,
            sum_value=float(hist.sum),
        )
    per_backend: tuple[tuple[str, str, Callable[[Any], int]], ...] = (
        ("backend_up", "1 when the backend answers, else 0.", lambda b: int(b.up)),
        ("backend_in_flight", "Turns being served by the backend now.", lambda b: b.in_flight),
        ("backend_waiting", "Turns waiting for a free slot on the backend.", lambda b: b.waiting),
    )
    for name, help_text, read in per_backend:
        family = GaugeMetricFamily(PREFIX + name, help_text, labels=["backend", "url"])
        for backend in status.backends:
            family.add_metric([backend.label, backend.url], read(backend))
        yield family
    per_backend_total: tuple[tuple[str, str, Callable[[Any], float]], ...] = (
        ("backend_turns", "Turns given a slot on the backend.", lambda b: b.turns),
        ("backend_waits", "Turns that queued for a slot on the backend.", lambda b: b.waits),
        (
            "backend_wait_seconds",
            "Seconds turns spent queued for a slot on the backend, summed.",
            lambda b: round(b.waited_seconds, 6),
        ),
        (
            "backend_busy",
            "Turns refused as busy: every slot of the backend taken and its queue full.",
            lambda b: b.busy,
        ),
    )
    for name, help_text, total in per_backend_total:
        counter = CounterMetricFamily(PREFIX + name, help_text, labels=["backend", "url"])
        for backend in status.backends:
            counter.add_metric([backend.label, backend.url], total(backend))
        yield counter


def registry(status: Callable[[], RunnerSnapshot]) -> CollectorRegistry:
    """A private registry whose one collector renders a fresh snapshot on every scrape."""
    from prometheus_client.registry import Collector, CollectorRegistry

    class _Snapshot(Collector):
        def collect(self) -> Iterator[Any]:
            return families(status())

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Snapshot())
    return reg


def render(status: RunnerSnapshot) -> str:
    """Everything in the snapshot, in the Prometheus text exposition format (version 0.0.4)."""
    from prometheus_client.exposition import generate_latest

    return generate_latest(registry(lambda: status)).decode()


# -- the server ------------------------------------------------------------------------


class MetricsServer:
    """Serves one runner's health and metrics on already-bound listeners."""

    def __init__(
        self, status: Callable[[], RunnerSnapshot], listeners: list[trio.SocketListener]
    ) -> None:
        self.status = status
        self.registry = registry(status)
        self.listeners = listeners
        self.server = Server(
            self,
            limits=ConnectionLimits(
                head_timeout=REQUEST_TIMEOUT,
                body_timeout=REQUEST_TIMEOUT,
                max_head=MAX_REQUEST_HEAD,
                max_connections=MAX_CONNECTIONS,
            ),
        )
        sockname = listeners[0].socket.getsockname()
        self.host, self.port = str(sockname[0]), int(sockname[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def serve(self) -> None:
        """Answer requests until cancelled (the listeners are closed then)."""
        log.info("health and metrics on %s/healthz and %s/metrics", self.url, self.url)
        await self.server.serve_listeners(self.listeners)

    def respond(self, method: str, target: str) -> tuple[int, str, str]:
        """(status, content type, body) for one request."""
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, "text/plain; charset=utf-8", "only GET and HEAD\n"
        if path in ("/healthz", "/readyz"):  # /readyz: the same, for a readiness probe
            healthy, reason = self.status().health()
            return (200 if healthy else 503), "text/plain; charset=utf-8", reason + "\n"
        if path == "/livez":  # the event loop answers: for a liveness probe
            return 200, "text/plain; charset=utf-8", "ok\n"
        if path == "/metrics":
            from prometheus_client.exposition import generate_latest

            return 200, CONTENT_TYPE, generate_latest(self.registry).decode()
        return (
            404,
            "text/plain; charset=utf-8",
            "not found: try /healthz, /readyz, /livez or /metrics\n",
        )

    async def http(self, req: Request) -> None:
        """One request, answered whole (the body left out for HEAD)."""
        scope = req.scope
        status, content_type, text = self.respond(scope["method"], scope["path"])
        body = text.encode()
        resp = req.resp
        head = resp.head(
            status,
            [
                (b"content-type", content_type.encode()),
                (b"content-length", b"%d" % len(body)),
                (b"cache-control", b"no-store"),
            ],
        )
        resp.write_nowait(body, head, end=True)
        await resp.flush()


async def open_metrics(host: str, port: int, status: Callable[[], RunnerSnapshot]) -> MetricsServer:
    """Bind ``host:port`` now (OSError when that fails: a busy port fails the start)."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    return MetricsServer(status, listeners)
