"""The request path: short turns (a 20-token answer) one at a time, and under an open-loop load.

Per-request cost, beside the chunk path's per-chunk cost: what a path adds to a short turn
(an agent's tool-routing call, a title) over the client calling the simulator itself.

- ``WholeClient``: POSTs a non-streamed request and reads the whole answer (``Content-Length``
  or chunked), kept-alive connections over raw trio sockets, as ``SSEClient`` does for streams.
- ``Turns``: one path's two kinds of short turn (``whole``: ``"stream": false``; ``stream``:
  SSE, read to ``[DONE]``), each returning (first byte of the answer, end, error).
- ``idle``: short turns one at a time on an idle path, the paths alternating turn by turn:
  time to first token of a streamed turn, time to the whole answer of a non-streamed one.
- ``sweep``: the load sweep. ``clients`` (64) clients send short turns on a fixed-rate
  schedule (open loop: client ``j``'s ``k``-th turn is due at ``t0 + (k * clients + j) / rate``,
  sent when due or, if its previous turn is still out, as soon as that ends), and a turn's
  latency is counted from when it was due, not from when it could be sent: a path that falls
  behind shows it in its latency instead of slowing the load down (no coordinated omission).
  The rate climbs a ladder; at each rung every path still in the sweep runs in turn (the order
  reversed every other rung), the direct path first among equals: a path's *added* p99 at a rung
  is its p99 minus the direct path's at that rung. A path passes a rung with no error and added
  p99 ≤ ``ADDED_P99_MS``, at a rung where the direct path's own p99 is within that bound: its
  figure is the highest rung it passed. A rung failed is run once more (``ATTEMPTS``) and the
  better attempt kept, the direct path's too: on a shared machine another process's burst only
  ever adds latency. A path also *keeps pace* at a rung with no error and at least ``PACE`` of
  the offered rate done, whatever the latency (its capacity: Portkey's gateway holds every
  stream's first chunk 25 ms, so it never passes a streamed rung); it leaves the sweep after two
  rungs in a row where it does neither. A path joins the ladder at ``JOIN`` turns/s (LiteLLM, at
  the ladder's foot). Every process's CPU per turn comes from its /proc counters over the rung.
  The direct path's ceiling (the simulator and the bench's clients on this machine) caps every
  path: when it cannot keep pace with a rung, the sweep ends.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from bench.common import percentile
from bench.sinks import SSEClient, Stream, _send_all, _socket, clock

if TYPE_CHECKING:
    from bench.common import Child
    from bench.paths import HttpPath

TOKENS = 20  # the short turn's answer: 20 content chunks (streamed) or one 20-token completion
ADDED_P99_MS = 10.0  # a rung is sustained with the path's p99 at most this over direct's
CLIENTS = 64
SESSIONS = 8
KINDS = ("whole", "stream")  # non-streamed and streamed short turns
# the ladder of offered rates (turns/s): a geometric climb from ``start`` by ``factor``
LADDER = {"full": (10.0, 1.3, 2.0), "quick": (10.0, 1.5, 1.0)}  # start, factor, s
JOIN = 90.0  # turns/s: the rung a path joins the ladder at (the ladder's foot is LiteLLM's)
JOIN_AT = {"direct": 0.0, "litellm": 0.0}
PACE = 0.95  # a path keeps pace at a rung when it completes this share of the offered rate
ATTEMPTS = 2  # a rung failed is tried once more: the better attempt counts
MAX_RATE = 20000.0
IDLE_GAP = 0.002  # s of idle between two idle turns
_RECV = 262144


def short_body(stream: bool) -> bytes:
    """A short turn's request (the simulator answers it with ``TOKENS`` tokens)."""
    return json.dumps(
        {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "name this chat"}],
            "stream": stream,
        }
    ).encode()


class WholeClient:
    """POSTs non-streamed requests to ``host:port`` and reads each whole answer (kept-alive)."""

    def __init__(
        self, host: str, port: int, path: str, headers: dict[str, str] | None = None
    ) -> None:
        self.host = host
        self.port = port
        self.path = path
        self.headers = headers or {}
        self.idle: list[trio.socket.SocketType] = []

    def head(self, body: bytes, session: str | None) -> bytes:
        headers = {**self.headers}
        if session is not None:
            headers["x-chat-session"] = session
        return (
            f"POST {self.path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            "content-type: application/json\r\naccept: application/json\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            + f"content-length: {len(body)}\r\n\r\n"
        ).encode()

    async def post(self, data: bytes) -> tuple[float | None, bytes, str | None]:
        """Send ``data`` (head and body); (when the answer's first bytes came, its body, error).

        A kept-alive connection the server closed while idle (uvicorn and Node close them after
        5 s) is found closed before the answer's head: the request goes again on a new one."""
        for fresh in (False, True):
            reused = bool(self.idle) and not fresh
            sock = self.idle.pop() if reused else _socket()
            reusable = False
            first: float | None = None
            body = b""
            error: str | None = None
            try:
                if not reused:
                    await sock.connect((self.host, self.port))
                await _send_all(sock, data)
                first, body, error, reusable = await _read_whole(sock)
            except OSError as exc:
                error = f"closed before the answer's head ({exc.__class__.__name__})"
            finally:
                if reusable:
                    self.idle.append(sock)
                else:
                    sock.close()
            if not (reused and error is not None and error.startswith("closed before")):
                return first, body, error
        return None, b"", "unreachable"  # pragma: no cover (the loop returns)


async def _read_whole(sock: trio.socket.SocketType) -> tuple[float | None, bytes, str | None, bool]:
    """One HTTP/1.1 answer: (first bytes at, body, error, connection reusable)."""
    buf = b""
    first: float | None = None
    while b"\r\n\r\n" not in buf:
        data = await sock.recv(_RECV)
        if first is None:
            first = clock()
        if not data:
            return first, b"", "closed before the answer's head", False
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    lower = head.lower()
    close = b"connection: close" in lower
    if b"transfer-encoding: chunked" in lower:
        body = b""
        while True:
            while b"\r\n" not in rest:
                data = await sock.recv(_RECV)
                if not data:
                    return first, body, "closed mid-answer", False
                rest += data
            line, _, rest = rest.partition(b"\r\n")
            size = int(line.split(b";")[0], 16)
            while len(rest) < size + 2:
                data = await sock.recv(_RECV)
                if not data:
                    return first, body, "closed mid-answer", False
                rest += data
            if size == 0:
                break
            body += rest[:size]
            rest = rest[size + 2 :]
    else:
        length = 0
        for line in lower.split(b"\r\n")[1:]:
            if line.startswith(b"content-length:"):
                length = int(line[15:])
        while len(rest) < length:
            data = await sock.recv(_RECV)
            if not data:
                return first, rest, "closed mid-answer", False
            rest += data
        body = rest[:length]
    if status != 200:
        return first, body, f"HTTP {status}: {body[:300]!r}", False
    return first, body, None, not close


@dataclass
class Shot:
    """One turn: when it was due (its schedule, or its send when idle), first bytes, end."""

    due: float
    first: float | None = None
    end: float | None = None
    error: str | None = None


class Turns:
    """A path's short turns: ``await turns.run(kind, client_no, due)`` → a ``Shot``."""

    def __init__(self, path: HttpPath) -> None:
        self.path = path
        sse = path.client
        self.sse = SSEClient(sse.host, sse.port, sse.path, dict(sse.headers))
        self.whole = WholeClient(sse.host, sse.port, sse.path, dict(sse.headers))
        self.bodies = {kind: short_body(kind == "stream") for kind in KINDS}
        # the non-streamed request of each session, head and body, made once
        self.requests = {
            s: self.whole.head(self.bodies["whole"], s) + self.bodies["whole"]
            for s in self.sessions()
        }

    def sessions(self) -> list[str | None]:
        return [f"bench-{i}" for i in range(SESSIONS)] if self.path.sessions else [None]

    def session(self, client_no: int) -> str | None:
        return f"bench-{client_no % SESSIONS}" if self.path.sessions else None

    async def run(self, kind: str, client_no: int, due: float | None = None) -> Shot:
        session = self.session(client_no)
        if kind == "whole":
            data = self.requests[session]
            shot = Shot(clock() if due is None else due)
            shot.first, body, shot.error = await self.whole.post(data)
            shot.end = clock()
            if shot.error is None and b'"chat.completion"' not in body:
                shot.error = f"not a chat.completion: {body[:200]!r}"
            return shot
        stream = Stream("short")
        sent = clock()
        await self.sse.stream(self.bodies["stream"], stream, session)
        shot = Shot(sent if due is None else due, stream.first_at, clock(), stream.error)
        if shot.error is None and stream.events < TOKENS:
            shot.error = f"{stream.events} events, not {TOKENS}+"
        return shot

    async def check(self) -> None:
        """One turn of each kind: the answer holds the 20 tokens (RuntimeError if not)."""
        data = self.requests[self.session(0)]
        _first, body, error = await self.whole.post(data)
        if error is not None or f"tok{TOKENS - 1} ".encode() not in body:
            raise RuntimeError(
                f"{self.path.name}: a short non-streamed turn failed: {error or body[:300]!r}"
            )
        shot = await self.run("stream", 0)
        if shot.error is not None:
            raise RuntimeError(f"{self.path.name}: a short streamed turn failed: {shot.error}")

    async def warm(self, kind: str, clients: int) -> None:
        """One turn per client at once: every kept-alive connection open before a rung."""
        async with trio.open_nursery() as nursery:
            for j in range(clients):
                nursery.start_soon(self.run, kind, j)


# -- one at a time --------------------------------------------------------------------------


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


async def idle(turns: dict[str, Turns], n: int) -> dict[str, dict[str, Any]]:
    """``n`` rounds of short turns on idle paths: each round, every path serves one streamed
    turn (its time to first token) then one non-streamed turn (its time to the answer), the
    paths alternating turn by turn (the order reversed every other round)."""
    names = list(turns)
    samples: dict[str, dict[str, list[float]]] = {
        name: {"ttft": [], "stream_end": [], "whole": []} for name in names
    }
    errors: dict[str, list[str]] = {name: [] for name in names}
    for i in range(n):
        for name in names if i % 2 == 0 else names[::-1]:
            for kind in KINDS[::-1]:  # streamed first
                with trio.move_on_after(30):
                    shot = await turns[name].run(kind, 0)
                if shot.error is not None or shot.end is None:
                    errors[name].append(shot.error or "no answer within 30 s")
                elif kind == "stream":
                    if shot.first is not None:
                        samples[name]["ttft"].append(shot.first - shot.due)
                    samples[name]["stream_end"].append(shot.end - shot.due)
                else:
                    samples[name]["whole"].append(shot.end - shot.due)
                await trio.sleep(IDLE_GAP)
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        row: dict[str, Any] = {"turns": n}
        for figure, values in samples[name].items():
            row[f"{figure}_ms"] = {
                "p50": _ms(percentile(values, 50)),
                "p99": _ms(percentile(values, 99)),
            }
        if errors[name]:
            row["errors"] = errors[name][:5]
            row["error_count"] = len(errors[name])
        out[name] = row
    return out


# -- under load -----------------------------------------------------------------------------


async def open_loop(
    run: Callable[[int, float], Awaitable[Shot]], rate: float, seconds: float, clients: int
) -> tuple[list[Shot], float, float]:
    """``clients`` clients, turns due at ``rate`` in all for ``seconds``: (shots, start, end).

    Every turn due is sent (late if its client's previous one is still out), so a path that
    cannot keep up ends later and its turns' latencies (from when each was due) grow."""
    shots: list[Shot] = []
    offset = trio.current_time() - clock()  # trio's clock minus perf_counter
    t0 = clock() + 0.01
    count = max(clients, round(rate * seconds))
    bound = seconds * 3 + 20  # an overwhelmed path: what is not back by then is an error

    async def client(j: int) -> None:
        k = j
        while k < count:
            due = t0 + k / rate
            await trio.sleep_until(due + offset)
            shots.append(await run(j, due))
            k += clients

    with trio.move_on_after(bound):
        async with trio.open_nursery() as nursery:
            for j in range(min(clients, count)):
                nursery.start_soon(client, j)
    missing = count - len(shots)
    shots.extend(Shot(t0, error="not answered in time") for _ in range(missing))
    end = max((s.end for s in shots if s.end is not None), default=clock())
    return shots, t0, end


@dataclass
class Rung:
    """One path at one offered rate."""

    rate: float
    turns: int = 0
    errors: int = 0
    first_error: str | None = None
    achieved: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    ttft_p99_ms: float | None = None
    added_p99_ms: float | None = None
    passed: bool = False
    paced: bool = False  # no error, and at least PACE of the offered rate completed
    attempts: int = 1
    cpu_us_per_turn: dict[str, float] = field(default_factory=dict)
    bench_busy: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


async def rung(
    turns: Turns,
    kind: str,
    rate: float,
    seconds: float,
    procs: dict[str, tuple[Child, bool]],
    clients: int = CLIENTS,
) -> Rung:
    """One path at one rate: warmed (one turn per client), then measured."""
    await turns.warm(kind, clients)

    async def run(j: int, due: float) -> Shot:
        return await turns.run(kind, j, due)

    cpu0 = {k: c.cpu(tree) for k, (c, tree) in procs.items()}
    own0 = time.process_time()
    shots, t0, end = await open_loop(run, rate, seconds, clients)
    own1 = time.process_time()
    cpu1 = {k: c.cpu(tree) for k, (c, tree) in procs.items()}
    good = [s for s in shots if s.error is None and s.end is not None]
    bad = [s for s in shots if s.error is not None]
    latencies = [s.end - s.due for s in good if s.end is not None]
    firsts = [s.first - s.due for s in good if s.first is not None]
    out = Rung(rate=round(rate, 1), turns=len(shots), errors=len(bad))
    out.first_error = bad[0].error if bad else None
    elapsed = max(end - t0, 1e-9)
    out.achieved = round(len(good) / elapsed, 1)
    out.p50_ms = _ms(percentile(latencies, 50))
    out.p99_ms = _ms(percentile(latencies, 99))
    if kind == "stream":
        out.ttft_p99_ms = _ms(percentile(firsts, 99))
    out.cpu_us_per_turn = {
        k: round((cpu1[k] - cpu0[k]) / max(len(good), 1) * 1e6, 1) for k in procs
    }
    out.bench_busy = round((own1 - own0) / elapsed, 3)
    return out


def ladder(start: float, factor: float, top: float = MAX_RATE) -> list[float]:
    rates, rate = [], start
    while rate <= top:
        rates.append(round(rate, 1))
        rate *= factor
    return rates


async def sweep(
    turns: dict[str, Turns],
    kind: str,
    rates: list[float],
    seconds: float,
    procs: dict[str, dict[str, tuple[Child, bool]]],
    log: Callable[[str], None],
    flip: bool = False,
) -> dict[str, dict[str, Any]]:
    """Every path up the ladder of ``rates`` (``direct`` first at each rung, the others after
    it, their order reversed every other rung, and at once with ``flip``); per path its rungs
    and the highest rate it sustained."""
    others = [n for n in turns if n != "direct"]
    rungs: dict[str, list[Rung]] = {n: [] for n in turns}
    failed: dict[str, int] = {n: 0 for n in turns}
    capped = None
    for i, rate in enumerate(rates):
        live = [n for n in others if failed[n] < 2 and rate >= JOIN_AT.get(n, JOIN)]
        if not live and any(failed[n] < 2 for n in others):
            continue  # below every path's join
        if not live:
            break

        async def attempt(
            name: str, floor_p99: float | None, floor_ok: bool = True, rate: float = rate
        ) -> Rung:
            """The path at this rung, once more if it fails (the machine is shared: another
            process's burst only ever adds latency, so the better attempt is the path's)."""
            best: Rung | None = None
            for n in range(1, ATTEMPTS + 1):
                got = await rung(turns[name], kind, rate, seconds, procs[name])
                if got.p99_ms is not None:  # the direct path: its own p99 is held to the bound
                    own = got.p99_ms - (floor_p99 if floor_p99 is not None else 0.0)
                    got.added_p99_ms = round(own, 3) if floor_p99 is not None else 0.0
                got.passed = (
                    floor_ok  # over a direct p99 of more than the bound, nothing passes
                    and got.errors == 0
                    and got.p99_ms is not None
                    and got.p99_ms - (floor_p99 or 0.0) <= ADDED_P99_MS
                )
                got.paced = got.errors == 0 and got.achieved >= PACE * rate
                got.attempts = n
                log(_line(name, kind, got))
                if best is None or _rank(got) > _rank(best):
                    best = got
                if got.passed or (not floor_ok and got.paced):
                    break
            assert best is not None
            return best

        floor = await attempt("direct", None)
        rungs["direct"].append(floor)
        if not floor.paced:  # the simulator and the bench's clients are at their ceiling
            capped = rate
            break
        for name in live if (i % 2 == 0) != flip else live[::-1]:
            got = await attempt(name, floor.p99_ms, floor.passed)
            failed[name] = 0 if got.passed or got.paced else failed[name] + 1
            rungs[name].append(got)
    out: dict[str, dict[str, Any]] = {}
    for name, ran in rungs.items():
        passed = [r for r in ran if r.passed]
        best = max(passed, key=lambda r: r.rate) if passed else None
        paced = [r for r in ran if r.paced]
        fastest = max(paced, key=lambda r: r.rate) if paced else None
        out[name] = {
            "max_rate": best.rate if best else None,
            "at_max": best.as_json() if best else None,
            "max_paced_rate": fastest.rate if fastest else None,
            "at_max_paced": fastest.as_json() if fastest else None,
            # still sustaining its last rung when the direct path could go no higher
            "capped_by_direct": capped is not None and bool(ran) and ran[-1].passed,
            "rungs": [r.as_json() for r in ran],
        }
    return out


def _rank(r: Rung) -> tuple[bool, bool, float]:
    return r.passed, r.paced, -(r.p99_ms if r.p99_ms is not None else 1e9)


def _line(name: str, kind: str, r: Rung) -> str:
    cpu = " ".join(f"{k} {v}" for k, v in r.cpu_us_per_turn.items())
    return (
        f"  {kind:6} {name:10} {r.rate:8.0f}/s: {r.achieved:8.1f}/s done, p50 {r.p50_ms} "
        f"p99 {r.p99_ms} ms (added {r.added_p99_ms}), CPU µs/turn {cpu}, bench busy "
        f"{r.bench_busy:.0%}{'' if r.passed else ' — over' if r.paced else ' — FAIL'}"
        + (f" ({r.errors} errors: {r.first_error})" if r.errors else "")
    )
