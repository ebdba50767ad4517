"""``gateway.wire.park``: a task parked until woken or until its socket's peer ends the
connection (without epoll: until it is readable), over real socket pairs."""

from __future__ import annotations

import select
import socket
from collections.abc import Callable

import pytest
import trio
import trio.testing

from gateway.wire import park as park_module
from gateway.wire.park import Park


@pytest.fixture(autouse=True, params=[True, False], ids=["epoll", "no-epoll"])
def epoll(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test with the module's epoll and with its fallback (trio's ``wait_readable``)."""
    monkeypatch.setattr(park_module, "_EPOLL", request.param)


async def _parked(
    park: Park, sock: socket.socket | None, then: Callable[[list[bool]], None]
) -> list[bool]:
    """``park`` waiting on ``sock`` in a task of its own; ``then`` called with what its wait has
    returned so far once it waits; what it returned in the end."""
    woke: list[bool] = []

    async def wait() -> None:
        woke.append(await park.wait(sock))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        then(woke)
    return woke


async def test_a_wake_returns_false_and_the_peers_end_true() -> None:
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
            peer.send(b"x")  # pipelined bytes: they wait in the socket (with epoll)
            await trio.testing.wait_all_tasks_blocked()
            if park_module._EPOLL:
                assert results == [False]
                park.cancel()
        park = Park()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            peer.shutdown(socket.SHUT_WR)  # the client leaves
        assert results == [False, not park_module._EPOLL, True]
        assert ours.recv(2) == b"x"  # not read by the park
        park.cancel()  # none parked: nothing happens


async def test_a_socket_stays_watched_from_park_to_park() -> None:
    """A socket is put in the watch's epoll at its first park and left there: the next parks
    on it cost no system call, and still see its peer leave, also while none was parked."""
    if not park_module._EPOLL:
        pytest.skip("the watch's epoll only")
    ours, peer = socket.socketpair()
    with ours, peer:
        ours.setblocking(False)
        park = Park()
        with trio.move_on_after(0):
            await park.wait(ours)
        watch = park_module._watch()
        assert watch.watched[ours.fileno()] is ours  # still in the epoll, nobody parked
        with pytest.raises(FileExistsError):
            watch.epoll.register(ours.fileno(), select.EPOLLIN)
        peer.shutdown(socket.SHUT_WR)  # the client leaves while no task is parked
        await trio.testing.wait_all_tasks_blocked()
        assert ours.fileno() not in watch.watched  # taken out when the watch saw it
        with trio.fail_after(5):
            assert await Park().wait(ours) is True  # the next park: at once


async def test_a_closed_sockets_number_used_again_is_watched_anew() -> None:
    """A socket closed while in the epoll leaves it (the kernel's doing) but not the watch's
    table: a new socket given the same number is put in the epoll at its first park."""
    if not park_module._EPOLL:
        pytest.skip("the watch's epoll only")
    ours, peer = socket.socketpair()
    number = ours.fileno()
    with peer:
        with ours:
            with trio.move_on_after(0):
                await Park().wait(ours)
        again, other = socket.socketpair()
        with again, other:
            assert again.fileno() == number  # the lowest free number: the closed one's
            again.setblocking(False)
            woke = await _parked(Park(), again, lambda _: other.shutdown(socket.SHUT_WR))
            assert woke == [True]


async def test_a_cancelled_park_lets_its_socket_go() -> None:
    ours, peer = socket.socketpair()
    with ours, peer:
        ours.setblocking(False)
        park = Park()
        with trio.move_on_after(0) as scope:
            await park.wait(ours)
        assert scope.cancelled_caught
        # parked again on the same socket: the wake still comes
        woke = await _parked(Park(), ours, lambda _: peer.shutdown(socket.SHUT_WR))
        assert woke == [True]
        park.cancel()  # a cancelled park's wake: nothing happens


async def test_a_park_without_a_socket_waits_for_its_wake_only() -> None:
    park = Park()

    def then(woke: list[bool]) -> None:
        assert woke == []
        park.cancel()

    assert await _parked(park, None, then) == [False]
