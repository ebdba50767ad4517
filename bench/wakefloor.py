"""``python -m bench.wakefloor``: what one idle event costs a server on this machine at the least,
the baseline that ``bench.fleet`` reads its idle figure against.

A peer process sends a WebSocket ping frame (6 bytes, masked) every ``--gap`` s over loopback
TCP and waits for each 2-byte pong; the server answers each ping and nothing else, first as a
bare ``select.epoll`` loop, then as a bare trio loop (``wait_readable``, ``recv``, ``send``: the
least a trio server does per event). Printed as one JSON line: each loop's CPU (its thread's
user + system time) per event, in µs. Spaced events are what an idle hub serves: each finds the
process asleep, so each pays a wake of the process (and a loopback send that wakes the peer),
which on a virtual machine can cost more than the work itself.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import sys
import time

import trio

PING = b"\x89\x80\x00\x00\x00\x00"  # a masked ping frame, empty
PONG = b"\x8a\x00"


def _pair() -> tuple[socket.socket, socket.socket]:
    """A connected loopback TCP pair (server side, peer side), without Nagle's delay."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        peer = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    for sock in (server, peer):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return server, peer


def _peer(sock: socket.socket, events: int, gap: float) -> None:
    """The peer: ``events`` pings, each answered before the next, ``gap`` s apart; then closed."""
    for _ in range(events):
        sock.sendall(PING)
        if not sock.recv(16):
            break
        time.sleep(gap)
    sock.close()


def _start_peer(events: int, gap: float) -> tuple[socket.socket, int]:
    server, peer = _pair()
    pid = os.fork()
    if pid == 0:  # the peer's process
        server.close()
        try:
            _peer(peer, events, gap)
        finally:
            os._exit(0)
    peer.close()
    server.setblocking(False)
    return server, pid


def epoll_loop(events: int, gap: float) -> float:
    """µs of CPU per event for a bare epoll loop."""
    sock, pid = _start_peer(events, gap)
    poller = select.epoll()
    poller.register(sock.fileno(), select.EPOLLIN)
    served = 0
    started = time.thread_time()
    while True:
        poller.poll()
        if not sock.recv(65536):
            break
        sock.send(PONG)
        served += 1
    cpu = time.thread_time() - started
    poller.close()
    sock.close()
    os.waitpid(pid, 0)
    return 1e6 * cpu / max(served, 1)


def trio_loop(events: int, gap: float) -> float:
    """µs of CPU per event for a bare trio loop."""
    sock, pid = _start_peer(events, gap)

    async def serve() -> float:
        served = 0
        started = time.thread_time()
        while True:
            await trio.lowlevel.wait_readable(sock)
            if not sock.recv(65536):
                break
            sock.send(PONG)
            served += 1
        return 1e6 * (time.thread_time() - started) / max(served, 1)

    try:
        return trio.run(serve)
    finally:
        sock.close()
        os.waitpid(pid, 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.wakefloor", description=__doc__)
    p.add_argument("--gap", type=float, default=0.002, help="s between events")
    p.add_argument("--events", type=int, default=2000)
    args = p.parse_args(argv)
    out = {
        "gap_ms": round(1e3 * args.gap, 2),
        "events": args.events,
        "epoll_us": round(epoll_loop(args.events, args.gap), 1),
        "trio_us": round(trio_loop(args.events, args.gap), 1),
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
