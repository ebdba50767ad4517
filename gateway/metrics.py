"""The runner's local health and metrics HTTP server: ``/healthz``, ``/livez`` and ``/metrics``.

Off unless ``--metrics-listen`` is given; a bare port binds loopback only. The protocol needs no
listening socket (PROTOCOL.md §5): this one is for the machine's own probes and Prometheus.

Why the Prometheus text format is written here and ``prometheus_client`` is not a dependency: the
numbers already live in ``runner.counters`` and ``runner.histograms`` (plain ints and lists, updated
on the hot path for free); the exposition format for a dozen families is ~60 lines, read-only, and
rendered only on a scrape. ``prometheus_client`` would bring its own global registry, default
process collectors and thread-based server we would not use, add import time to every start of the
frozen binary, and still need a custom Collector to read our counters. The tests check our output
with ``prometheus_client``'s reference parser instead (a test-only dependency).

The server is trio + h11 (both already in the process through trio and httpx): one request per
connection, GET/HEAD only, bounded head size and time, so a stuck client cannot hold anything.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import h11
import trio

from gateway import __version__
from gateway.observe import Histogram

if TYPE_CHECKING:
    from gateway.runner import Runner

log = logging.getLogger("gateway.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "alp_gateway_"
HEALTHY_WITHIN_POLLS = 3  # /healthz wants a successful poll within this many poll intervals
MAX_REQUEST_HEAD = 8192
REQUEST_TIMEOUT = 10.0

# counter name in runner.counters -> (metric family, help)
_COUNTERS: dict[str, tuple[str, str]] = {
    "chunks": ("chunks", "Chunk frames relayed from a backend to the Server."),
    "sessions_started": ("sessions_started", "Chat sessions (claimed Chat Jobs) started."),
    "sessions_ended": ("sessions_ended", "Chat sessions ended, whatever the outcome."),
    "reconnects": ("reconnects", "Chat Channels redialled after a drop."),
    "polls": ("polls", "Polls for jobs, successful or not."),
    "poll_errors": ("poll_errors", "Polls that failed (Server unreachable, timed out or 5xx)."),
    "heartbeats": ("heartbeats", "Progress heartbeats the Server accepted."),
}
_TURNS = {"turns_done": "done", "turns_error": "error", "turns_cancelled": "cancelled"}
_HISTOGRAM_HELP = {
    "ttft_seconds": "Time from a turn's request to the backend's first bytes.",
    "relay_seconds": "Time from a read from the backend to its frames queued for the Server.",
}
_NOT_A_NAME = re.compile(r"[^a-zA-Z0-9_]")


# -- health ------------------------------------------------------------------------------


def health(runner: Runner) -> tuple[bool, str]:
    """(healthy, reason): a poll succeeded within 3 poll intervals and a backend is up."""
    if runner.shutdown.is_set():
        return False, "shutting down"
    error = f": {runner.last_poll_error}" if runner.last_poll_error else ""
    if runner.last_poll_ok is None:
        return False, f"no successful poll yet{error}"
    age = trio.current_time() - runner.last_poll_ok
    limit = HEALTHY_WITHIN_POLLS * runner.config.poll_interval
    if age > limit:
        return False, f"last successful poll {age:.1f} s ago (limit {limit:g} s){error}"
    backends = list(runner.pool.backends)
    if not backends:
        return False, "no backend configured"
    if not any(getattr(b, "up", True) for b in backends):
        return False, "no backend is up: " + ", ".join(_backend_label(b) for b in backends)
    return True, "ok"


# -- the text format -----------------------------------------------------------------------


def _value(number: float) -> str:
    if isinstance(number, int):
        return str(number)
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "+Inf" if number > 0 else "-Inf"
    return repr(float(number))


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _backend_label(backend: object) -> str:
    name = getattr(backend, "name", None)
    return str(name) if name else _safe_url(str(getattr(backend, "url", "?")))


def _safe_url(url: str) -> str:
    """The URL without any ``user:password@`` part (a URL may carry a credential)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


class _Exposition:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> str:
        full = PREFIX + name
        help_text = help_text.replace("\\", "\\\\").replace("\n", "\\n")
        self.lines.append(f"# HELP {full} {help_text}")
        self.lines.append(f"# TYPE {full} {kind}")
        return full

    def sample(self, name: str, value: float, labels: Iterable[tuple[str, str]] = ()) -> None:
        text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
        self.lines.append(
            f"{name}{{{text}}} {_value(value)}" if text else f"{name} {_value(value)}"
        )

    def histogram(self, name: str, help_text: str, hist: Histogram) -> None:
        full = self.family(name, "histogram", help_text)
        running = 0
        for bound, count in zip(hist.buckets, hist.counts, strict=False):
            running += count
            self.sample(full + "_bucket", running, [("le", _value(float(bound)))])
        self.sample(full + "_bucket", hist.count, [("le", "+Inf")])
        self.sample(full + "_sum", float(hist.sum))
        self.sample(full + "_count", hist.count)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(runner: Runner) -> str:
    """Everything the runner counts, in the Prometheus text exposition format (version 0.0.4)."""
    counts = dict(runner.counters.values)
    out = _Exposition()
    out.sample(
        out.family("info", "gauge", "The running alp-gateway version."),
        1,
        [("version", __version__)],
    )
    healthy, _ = health(runner)
    out.sample(out.family("healthy", "gauge", "1 when /healthz answers 200, else 0."), int(healthy))
    out.sample(
        out.family("sessions_open", "gauge", "Chat sessions open now."), len(runner.sessions)
    )
    out.sample(
        out.family("max_sessions", "gauge", "Most chat sessions served at once."),
        runner.config.max_sessions,
    )
    if runner.last_poll_ok is not None:
        out.sample(
            out.family(
                "last_poll_ok_age_seconds", "gauge", "Seconds since the last successful poll."
            ),
            round(trio.current_time() - runner.last_poll_ok, 3),
        )

    # counters: the sample name (with _total) is the family name in the 0.0.4 text format
    turns = out.family("turns_total", "counter", "Chat turns finished, by outcome.")
    for key, outcome in _TURNS.items():
        out.sample(turns, counts.pop(key, 0), [("outcome", outcome)])
    for key, (name, help_text) in _COUNTERS.items():
        out.sample(out.family(name + "_total", "counter", help_text), counts.pop(key, 0))
    for key in sorted(counts):  # counters added elsewhere later show up without a change here
        name = _NOT_A_NAME.sub("_", key) + "_total"
        out.sample(out.family(name, "counter", f"Events counted as {key}."), counts[key])

    for key, hist in runner.histograms.items():
        out.histogram(_NOT_A_NAME.sub("_", key), _HISTOGRAM_HELP.get(key, key), hist)

    backends = list(runner.pool.backends)
    per_backend = (
        (
            "backend_up",
            "1 when the backend answers, else 0.",
            lambda b: int(bool(getattr(b, "up", True))),
        ),
        (
            "backend_in_flight",
            "Turns being served by the backend now.",
            lambda b: getattr(b, "in_flight", 0),
        ),
        (
            "backend_waiting",
            "Turns waiting for a free slot on the backend.",
            lambda b: getattr(b, "waiting", 0),
        ),
    )
    for name, help_text, read in per_backend:
        full = out.family(name, "gauge", help_text)
        for backend in backends:
            labels = [
                ("backend", _backend_label(backend)),
                ("url", _safe_url(str(getattr(backend, "url", "")))),
            ]
            out.sample(full, read(backend), labels)
    return out.text()


# -- the server ------------------------------------------------------------------------


class MetricsServer:
    """Serves one runner's health and metrics on already-bound listeners."""

    def __init__(self, runner: Runner, listeners: list[trio.SocketListener]) -> None:
        self.runner = runner
        self.listeners = listeners
        sockname = listeners[0].socket.getsockname()
        self.host, self.port = str(sockname[0]), int(sockname[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def serve(self) -> None:
        """Answer requests until cancelled (the listeners are closed then)."""
        log.info("health and metrics on %s/healthz and %s/metrics", self.url, self.url)
        await trio.serve_listeners(self._connection, self.listeners)

    def respond(self, method: str, target: str) -> tuple[int, str, str]:
        """(status, content type, body) for one request."""
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, "text/plain; charset=utf-8", "only GET and HEAD\n"
        if path == "/healthz":
            healthy, reason = health(self.runner)
            return (200 if healthy else 503), "text/plain; charset=utf-8", reason + "\n"
        if path == "/livez":  # the event loop answers: for a liveness probe
            return 200, "text/plain; charset=utf-8", "ok\n"
        if path == "/metrics":
            return 200, CONTENT_TYPE, render(self.runner)
        return 404, "text/plain; charset=utf-8", "not found: try /healthz, /livez or /metrics\n"

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD)
        try:
            with trio.move_on_after(REQUEST_TIMEOUT):
                request = await _read_request(stream, conn)
                if request is None:
                    return
                method = request.method.decode("ascii", "replace")
                status, content_type, text = self.respond(
                    method, request.target.decode("ascii", "replace")
                )
                body = text.encode()
                headers = [
                    ("content-type", content_type),
                    ("content-length", str(len(body))),
                    ("cache-control", "no-store"),
                    ("connection", "close"),
                ]
                data = conn.send(h11.Response(status_code=status, headers=headers)) or b""
                if method != "HEAD":
                    data += conn.send(h11.Data(data=body)) or b""
                data += conn.send(h11.EndOfMessage()) or b""
                await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            pass
        finally:
            await trio.aclose_forcefully(stream)


async def _read_request(stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(4096)
            conn.receive_data(data)  # b"" marks end of stream
            continue
        if isinstance(event, h11.Request):
            return event
        return None  # ConnectionClosed or anything else: nothing to answer


async def open_metrics(runner: Runner) -> MetricsServer | None:
    """Bind ``config.metrics_listen`` now (a busy port fails the start); None when it is off."""
    listen = runner.config.metrics_listen
    if listen is None:
        return None
    host, port = listen
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        from gateway.runner import RunnerExit

        raise RunnerExit(f"--metrics-listen {host}:{port}: {exc.strerror or exc}", 2) from None
    return MetricsServer(runner, listeners)
