"""The dying-path proxy itself: frozen paths carry nothing and stay open, NAT forgets idle ones."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import trio
from pathproxy import path_proxy


async def _echo(stream: trio.SocketStream) -> None:
    async with stream:
        async for data in stream:
            await stream.send_all(data)


@asynccontextmanager
async def echo_server() -> AsyncIterator[int]:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, _echo, 0, host="127.0.0.1"))
        yield listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()


async def _round_trip(stream: trio.SocketStream, data: bytes) -> bytes:
    await stream.send_all(data)
    return await stream.receive_some(65536)


async def test_freeze_stops_open_paths_and_lets_new_ones_pass() -> None:
    async with echo_server() as port, path_proxy(port) as proxy:
        old = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        assert await _round_trip(old, b"hello") == b"hello"
        assert proxy.freeze() == 1
        await old.send_all(b"lost")
        with trio.move_on_after(0.3) as silent:  # nothing comes back, and nothing closes
            await old.receive_some(65536)
        assert silent.cancelled_caught
        new = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        assert await _round_trip(new, b"again") == b"again"
        await old.aclose()
        await new.aclose()


async def test_nat_forgets_an_idle_path_only() -> None:
    async with echo_server() as port, path_proxy(port, nat_idle=0.2) as proxy:
        stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        for _ in range(3):  # busy: remembered
            assert await _round_trip(stream, b"x") == b"x"
        assert proxy.forgotten == 0
        await proxy.wait_until(lambda: proxy.forgotten == 1)
        await stream.send_all(b"after")
        with trio.move_on_after(0.3) as silent:
            await stream.receive_some(65536)
        assert silent.cancelled_caught
        await stream.aclose()


async def test_reap_closes_the_frozen_paths_only() -> None:
    async with echo_server() as port, path_proxy(port) as proxy:
        old = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        assert await _round_trip(old, b"hello") == b"hello"
        proxy.freeze()
        live = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        assert await _round_trip(live, b"live") == b"live"
        assert proxy.reap() == 1
        assert await old.receive_some(65536) == b""  # closed now: the end of its stream
        assert await _round_trip(live, b"still") == b"still"
        assert proxy.reap() == 0
        await old.aclose()
        await live.aclose()
