"""The chat sessions' table in memory (issue 39): a new session's per-key cap is checked on its
key's own sessions, never by walking every session of the hub; the table's index by key kept in
step however sessions come and go."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gateway.hub.sessions import Session, Sessions, SessionTable
from gateway.hub.store import ApiKey, open_store

CAP = 3


class _Unwalkable(SessionTable):
    """A table that fails any walk over all its sessions while ``armed``."""

    armed = False

    def _walked(self) -> None:
        if self.armed:
            raise AssertionError("the whole table was walked")

    def items(self) -> Any:
        self._walked()
        return super().items()

    def values(self) -> Any:
        self._walked()
        return super().values()

    def keys(self) -> Any:
        self._walked()
        return super().keys()

    def __iter__(self) -> Iterator[tuple[str, str]]:
        self._walked()
        return super().__iter__()


def _sessions() -> Sessions:
    async def end_job(job_id: str, reason: str) -> None:
        return None

    return Sessions(
        open_store(None),
        idle_timeout=lambda: 3600.0,
        max_per_key=lambda: CAP,
        key_check_interval=lambda: 60.0,
        job_over=lambda job_id: False,
        end_job=end_job,
    )


async def test_a_new_session_at_its_key_s_cap_evicts_without_walking_every_session() -> None:
    """1,000 sessions of 500 other keys (2 each); a key at its cap opens one more: its least recently
    used idle session is evicted, and the table is never walked whole."""
    sessions = _sessions()
    table = sessions.live = _Unwalkable()
    for n in range(1000):
        key = ApiKey(f"k{n % 500}", "o", "p", f"id{n % 500}")
        session, _ = await sessions.enter(key, f"s{n}")
        session.job_id = f"job-{n}"  # a session with a job stays when its turn leaves
        sessions.leave(session)
    mine = ApiKey("mine", "o", "p", "id-mine")
    for n in range(CAP):
        session, evicted = await sessions.enter(mine, f"m{n}")
        assert evicted is None
        session.job_id = f"job-m{n}"
        sessions.leave(session)
    table.armed = True
    session, evicted = await sessions.enter(mine, "m-new")
    table.armed = False
    assert evicted is not None and evicted.key == ("id-mine", "m0")  # the least recently used
    assert sorted(s.key[1] for s in table.of_key("id-mine")) == ["m-new", "m1", "m2"]
    assert len(table) == 1000 + CAP


async def test_the_index_by_key_follows_every_write() -> None:
    table = SessionTable()
    a1, a2, b1 = ("a", "1"), ("a", "2"), ("b", "1")
    for key in (a1, a2, b1):
        table[key] = Session(key, "o", "p", key[0])
    assert [s.key for s in table.of_key("a")] == [a1, a2]
    del table[a1]
    assert [s.key for s in table.of_key("a")] == [a2]
    assert table.pop(a2).key == a2 and table.of_key("a") == []
    assert table.pop(a2, None) is None
    with pytest.raises(KeyError):
        del table[a2]
    assert [s.key for s in table.of_key("b")] == [b1] and list(table) == [b1]


async def test_an_idle_hub_walks_its_sessions_only_when_one_falls_due_or_a_job_ends(
    autojump_clock: Any,
) -> None:
    """Issue 39: the key check every ``key_check_interval`` looks at the keys that hold sessions,
    not at every session; the walk over them all (idle ones ended, finished ones forgotten) comes
    at the first idle due, or after a job ended."""
    import trio

    ended: list[str] = []

    async def end_job(job_id: str, reason: str) -> None:
        ended.append(job_id)

    sessions = Sessions(
        open_store(None),
        idle_timeout=lambda: 3600.0,
        max_per_key=lambda: 0,
        key_check_interval=lambda: 60.0,
        job_over=lambda job_id: False,
        end_job=end_job,
    )
    table = sessions.live = _Unwalkable()
    for n in range(1000):
        key = ApiKey(f"k{n % 50}", "o", "p", "")  # by name: never revoked in this store
        session, _ = await sessions.enter(key, f"s{n}")
        session.job_id = f"job-{n}"
        sessions.leave(session)
    assert await sessions.reap_here() == 60.0 + trio.current_time()  # the first walk
    table.armed = True
    for _ in range(50):  # 50 key checks in 3,000 s: none walks the sessions
        await trio.sleep(60.0)
        await sessions.reap_here()
    sessions.job_ended("job-7")
    with pytest.raises(AssertionError, match="walked"):
        await sessions.reap_here()
    table.armed = False
    await trio.sleep(3600.0)  # every session idle: the walk ends them all
    await sessions.reap_here()
    assert len(ended) == 1000 and not table
