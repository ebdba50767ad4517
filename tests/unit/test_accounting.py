"""The hub's accounting and its sessions table driven in memory (a store in memory, no socket):
limits exact under concurrent turns, token limits that reserve what a turn may use, every
delivered token charged; sessions evicted least recently used, refused when all are busy, ended
when their key is revoked or they idle."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from gateway.apis.dialects import CHAT
from gateway.hub.accounting import Accounting, LimitExceeded
from gateway.hub.sessions import Sessions, TooManySessions
from gateway.hub.settings import HubSettings
from gateway.hub.store import ApiKey, KeyLimits, open_store
from gateway.hub.turn import Turn
from gateway.hub.turnstate import State


class _Resp:
    """A response nobody reads (the accounting never writes one)."""

    started = finished = gone = False
    backlog = 0


def turn(key: ApiKey, max_tokens: int | None = None, reserved: int = 0) -> Turn:
    return Turn(
        "t",
        key.id,
        key.name,
        "s",
        b'{"messages":[{"role":"user","content":"' + b"word " * 40 + b'"}]}',
        CHAT,
        _Resp(),  # type: ignore[arg-type]
        model="m",
        stream=True,
        bound=1,
        max_answer=1,
        reserved=reserved,
        now=trio.current_time(),
    )


async def keyed(limits: KeyLimits, **settings: Any) -> tuple[Accounting, ApiKey]:
    store = open_store(None)
    await store.create_api_key("k", "o/p", limits)
    found = await store.key_limits("k")
    assert found is not None
    key = ApiKey("k", "o", "p", found[0])
    return Accounting(store, HubSettings(**settings)), key


async def test_rpm_is_exact_under_concurrent_turns() -> None:
    book, key = await keyed(KeyLimits(rpm=3))
    admitted, refused = [], []

    async def one() -> None:
        t = turn(key)
        try:
            await book.admit(t)
            admitted.append(t)
        except LimitExceeded as exc:
            refused.append(exc)

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(one)
    assert len(admitted) == 3 and len(refused) == 2
    assert {exc.limit for exc in refused} == {"rpm"} and all(e.retry_after >= 1 for e in refused)


async def test_max_streams_counts_turns_in_flight_until_they_end() -> None:
    book, key = await keyed(KeyLimits(max_streams=2))
    first, second = turn(key), turn(key)
    await book.admit(first)
    await book.admit(second)
    with pytest.raises(LimitExceeded) as caught:
        await book.admit(turn(key))
    assert caught.value.limit == "max_streams"
    first.sent("r", "runner", "job")  # a turn is done once a runner had it
    first._end(State.DONE)
    book.ended(first)
    await book.admit(turn(key))  # a slot is free again


async def test_token_limits_reserve_a_turns_max_tokens_so_concurrent_turns_cannot_overshoot() -> (
    None
):
    """Issue 30 row 9: a key with tpm 20 starting 6 turns at once had all 6 admitted. A turn
    holds its max_tokens and its prompt's estimate (here 200 characters: 50 tokens, and the
    chat template's 8: one message's 5, the answer's 3)."""
    book, key = await keyed(KeyLimits(tpm=200))
    admitted: list[Turn] = []
    for _ in range(6):
        t = turn(key, reserved=book.reservation(16))
        try:
            await book.admit(t)
            admitted.append(t)
        except LimitExceeded as exc:
            assert exc.limit == "tpm" and "held by turns in flight" in exc.message
    # admitted on 0, 74 and 148 held (< 200); the rest refused: what the turns in flight
    # may use passes the limit by at most one turn's reservation
    assert [t.reserved for t in admitted] == [16 + 58] * 3


async def test_a_long_prompt_with_a_small_max_tokens_holds_its_prompt_too() -> None:
    """A turn is charged its prompt as well as its answer: six turns of 1,000-token prompts and
    ``max_tokens: 1`` held 1 token each, so a tpm of 2,000 admitted all six (6,000 tokens)."""
    book, key = await keyed(KeyLimits(tpm=2000))
    body = b'{"messages":[{"role":"user","content":"' + b"x" * 4000 + b'"}]}'
    admitted = 0
    for _ in range(6):
        t = turn(key, reserved=book.reservation(1))
        t.body = body
        try:
            await book.admit(t)
            admitted += 1
        except LimitExceeded:
            pass
    assert admitted == 2 and book._keys[key.id].reserved == 2 * (1 + 1000 + 8)
    unlimited, free_key = await keyed(KeyLimits(rpm=100))
    t = turn(free_key, reserved=unlimited.reservation(1))
    await unlimited.admit(t)
    assert t.reserved == 0  # no token limit: nothing held (and no prompt read)


async def test_a_turn_ended_early_is_charged_what_it_delivered_estimated() -> None:
    """Issue 30 row 2: a client that reads part of an answer and leaves was charged nothing."""
    book, key = await keyed(KeyLimits(tokens_per_day=100))
    t = turn(key)
    await book.admit(t)
    t.sent("r", "runner", "job")
    t.chunks = 150  # what reached the client before it left
    t._end(State.CLIENT_GONE)
    book.ended(t)
    assert t.estimated and t.completion_tokens == 150 and t.prompt_tokens is not None
    assert t.prompt_tokens > 0 and t.model_label == "m"
    with pytest.raises(LimitExceeded) as caught:  # the day's tokens are spent
        await book.admit(turn(key))
    assert caught.value.limit == "tokens_per_day"
    rows = await book.store.usage_rows()  # type: ignore[union-attr]
    assert [(r["outcome"], r["completion_tokens"], r["estimated"]) for r in rows] == [
        ("client_gone", 150, True)
    ]


async def test_a_refused_turn_is_told_to_observers_and_never_stored() -> None:
    book, key = await keyed(KeyLimits(rpm=1))
    seen: list[Turn] = []
    book.observers.append(seen.append)
    await book.admit(turn(key))
    t = turn(key)
    with pytest.raises(LimitExceeded):
        await book.admit(t)
    book.refused(t)  # (a refused turn answers its client; the book only observes it)
    assert seen == [t] and await book.store.usage_rows() == []  # type: ignore[union-attr]


# -- sessions ----------------------------------------------------------------------------


class Ended(list[tuple[str, str]]):
    """The jobs the sessions table ended, and a wait for one."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = trio.Event()

    async def until(self, item: tuple[str, str]) -> None:
        while item not in self:
            await self.changed.wait()


def sessions_of(store: Any, ended: list[tuple[str, str]], **settings: Any) -> Sessions:
    s = HubSettings(**settings)

    async def end_job(job_id: str, reason: str) -> None:
        ended.append((job_id, reason))
        if isinstance(ended, Ended):
            ended.changed.set()
            ended.changed = trio.Event()

    return Sessions(
        store,
        idle_timeout=lambda: s.session_idle_timeout,
        max_per_key=lambda: s.max_sessions_per_key,
        key_check_interval=lambda: s.key_check_interval,
        job_over=lambda job_id: False,
        end_job=end_job,
    )


async def test_a_key_at_its_bound_ends_its_least_recently_used_idle_session() -> None:
    store = open_store(None)
    ended: list[tuple[str, str]] = []
    table = sessions_of(store, ended, max_sessions_per_key=2)
    key = ApiKey("k", "o", "p", "kid")
    for sid, job in (("s1", "j1"), ("s2", "j2")):
        session, evicted = await table.enter(key, sid)
        await table.bind(session, job)
        table.leave(session)
    again, _ = await table.enter(key, "s1")  # s1 used again: s2 is the least recently used
    table.leave(again)
    third, evicted = await table.enter(key, "s3")
    assert evicted is not None and evicted.key[1] == "s2"
    await table.end_evicted(evicted)
    assert ended == [("j2", "session ended: its API key opened too many")]
    assert set(table.listing()) == {("k", "s1"), ("k", "s3")}
    # every session busy: a new one is refused, none ended
    busy, _ = await table.enter(key, "s1")
    with pytest.raises(TooManySessions):
        await table.enter(key, "s4")
    assert len(ended) == 1 and busy.turns == 1 and third.turns == 1


async def test_a_revoked_keys_sessions_end_and_idle_ones_end_with_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = open_store(None)
    await store.create_api_key("alice")
    await store.create_api_key("bob")
    ids = {k["name"]: (await store.key_limits(k["name"]))[0] for k in await store.list_api_keys()}  # type: ignore[index]
    ended = Ended()
    table = sessions_of(store, ended, session_idle_timeout=60.0, key_check_interval=5.0)
    for name, job in (("alice", "ja"), ("bob", "jb")):
        session, _ = await table.enter(ApiKey(name, "local", "chat", ids[name]), "s")
        await table.bind(session, job)
        table.leave(session)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(table.run)
        await store.revoke_api_key("alice")  # by another process: seen at the next key check
        with trio.fail_after(10):  # the key check's interval (5 s), on the virtual clock
            await ended.until(("ja", "api key revoked"))
        assert set(table.listing()) == {("bob", "s")}
        with trio.fail_after(120):  # the idle timeout (60 s)
            await ended.until(("jb", "idle"))
        assert table.listing() == {}
        nursery.cancel_scope.cancel()
