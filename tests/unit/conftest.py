"""The unit layer runs in memory: a test here that binds or connects a network socket fails (socket
pairs, which the relay's rigs use, stay allowed). Tests that need loopback belong in tests/hub/ or
tests/runner/ (tests/README.md)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

_NETWORK = (socket.AF_INET, socket.AF_INET6)


def _refused(name: str, real: Any) -> Any:
    def guarded(sock: socket.socket, *args: Any) -> Any:
        if sock.family in _NETWORK:
            raise AssertionError(f"a unit test may not {name} a network socket: {args!r}")
        return real(sock, *args)

    return guarded


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("bind", "connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, _refused(name, getattr(socket.socket, name)))
    yield
