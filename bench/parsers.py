"""h11 vs httptools on a streamed chunked SSE response: the per-event cost of the HTTP/1.1 layer.

``python -m bench.parsers [--events 20000] [--rounds 5]``. A response head and then one
chunked SSE event per read (what a relay's backend read returns when a model server writes
each event on its own), fed to each parser; the body bytes are handed to a callback, as a
relay would hand them to its SSE splitter. Also ``--per-read N``: N events per read (a burst
that queued up). Pure CPU in one process: no sockets, so only the parser is timed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import h11
import httptools

HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def event(i: int) -> bytes:
    """One chunked SSE event shaped like the simulator's (an OpenAI chat.completion.chunk)."""
    data = (
        b'{"id":"chatcmpl-sim-1","object":"chat.completion.chunk","created":1700000000,'
        b'"model":"sim-model","choices":[{"index":0,"delta":{"content":"tok%d "},'
        b'"finish_reason":null}]}' % i
    )
    return b"%x\r\ndata: %b\n\n\r\n" % (len(data) + 8, data)


def reads(events: int, per_read: int) -> list[bytes]:
    out, batch = [], []
    for i in range(events):
        batch.append(event(i))
        if len(batch) == per_read:
            out.append(b"".join(batch))
            batch = []
    if batch:
        out.append(b"".join(batch))
    return out


def run_h11(chunks: list[bytes], sink: Callable[[bytes], None]) -> None:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/v1/chat/completions", headers=[("host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(HEAD)
    assert isinstance(conn.next_event(), h11.Response)
    receive, next_event, need, data_t = conn.receive_data, conn.next_event, h11.NEED_DATA, h11.Data
    for chunk in chunks:
        receive(chunk)
        while True:
            ev = next_event()
            if ev is need:
                break
            if type(ev) is data_t:
                sink(ev.data)


class _Proto:
    __slots__ = ("on_body",)

    def __init__(self, sink: Callable[[bytes], None]) -> None:
        self.on_body = sink


def run_httptools(chunks: list[bytes], sink: Callable[[bytes], None]) -> None:
    parser = httptools.HttpResponseParser(_Proto(sink))
    parser.feed_data(HEAD)
    feed = parser.feed_data
    for chunk in chunks:
        feed(chunk)


def measure(fn: Callable[..., None], chunks: list[bytes], events: int, rounds: int) -> list[float]:
    got: list[bytes] = []
    per_event = []
    for _ in range(rounds):
        got.clear()
        t0 = time.perf_counter()
        fn(chunks, got.append)
        per_event.append((time.perf_counter() - t0) / events * 1e6)
    body = b"".join(got)  # every event's bytes, and nothing but them, reached the callback
    assert body.count(b"data: ") == events and body.endswith(b"}\n\n"), fn.__name__
    return per_event


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.parsers", description=__doc__)
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"h11 {h11.__version__}, httptools {httptools.__version__}: µs per event")
    print("| events per read | h11 median (min) | httptools median (min) | h11 / httptools |")
    print("|---|---|---|---|")
    for per_read in (1, 8, 64):
        chunks = reads(args.events, per_read)
        a = measure(run_h11, chunks, args.events, args.rounds)
        b = measure(run_httptools, chunks, args.events, args.rounds)
        ma, mb = statistics.median(a), statistics.median(b)
        print(
            f"| {per_read} | {ma:.2f} ({min(a):.2f}) | {mb:.2f} ({min(b):.2f}) | {ma / mb:.1f}× |"
        )


if __name__ == "__main__":
    main()
