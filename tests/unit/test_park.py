"""``gateway.wire.park``: a task parked until woken or until its socket is readable, over a real
socket pair."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from gateway.wire import park as park_module
from gateway.wire.park import Park


@pytest.fixture(autouse=True, params=[True, False], ids=["epoll", "no-epoll"])
def epoll(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test with the module's epoll and with its fallback (trio's ``wait_readable``)."""
    monkeypatch.setattr(park_module, "_EPOLL", request.param)


async def test_a_wake_returns_false_and_a_readable_socket_true() -> None:
    ours, peer = socket.socketpair()
    with ours, peer:
        ours.setblocking(False)
        results: list[bool] = []
        park = Park()

        async def wait() -> None:
            results.append(await park.wait(ours))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            park.cancel()
        park = Park()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            peer.send(b"x")  # pipelined bytes
        park = Park()
        ours.recv(1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            peer.shutdown(socket.SHUT_WR)  # the client leaves
        assert results == [False, True, True]
        park.cancel()  # none parked: nothing happens


async def test_a_cancelled_park_lets_its_socket_go() -> None:
    ours, peer = socket.socketpair()
    with ours, peer:
        ours.setblocking(False)
        park = Park()
        with trio.move_on_after(0) as scope:
            await park.wait(ours)
        assert scope.cancelled_caught
        # parked again on the same socket (it left the epoll): the wake still comes
        again = Park()
        woke: list[bool] = []

        async def wait() -> None:
            woke.append(await again.wait(ours))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            peer.send(b"x")
        assert woke == [True]
        park.cancel()  # a cancelled park's wake: nothing happens


async def test_a_park_without_a_socket_waits_for_its_wake_only() -> None:
    park = Park()
    woke: list[bool] = []

    async def wait() -> None:
        woke.append(await park.wait(None))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert woke == []
        park.cancel()
    assert woke == [False]
