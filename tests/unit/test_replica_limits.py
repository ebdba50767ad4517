"""An API key's limits across replicas (``gateway.hub.replicas.limits.ReplicaLimits``) in memory, with a
fake store that answers what the test scripts, on trio's autojump clock. The store's verdict
becomes the refusal the caller's API shows; an admitted turn's session learns its job and an
evicted session is ended; a key's next admission on this replica waits for the key's releases
to be written (bounded), another key's does not; a store that is away keeps its releases."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import trio
import trio.testing

from gateway.hub.accounting import LimitExceeded
from gateway.hub.replicas.limits import RETRY, ReplicaLimits
from gateway.hub.replicas.store.base import Admission, Release
from gateway.hub.sessions import TooManySessions
from gateway.hub.settings import HubSettings
from gateway.hub.store import KeyLimits, StoreError, StoreUnavailable, UsageRecord


@dataclass
class FakeTurn:
    """What of a turn the limits read."""

    id: str
    key_id: str = "k1"
    key_name: str = "key-one"
    session: str = "s1"
    reserved: int = 10
    tokens: int = 7
    cost: float | None = None


def admission(verdict: str = "ok", **fields: object) -> Admission:
    values: dict[str, object] = {
        "verdict": verdict,
        "wait": 2.5,
        "used": 3,
        "held": 0,
        "job_id": "job-1",
        "evicted_session": None,
        "evicted_job": None,
    }
    values.update(fields)
    return Admission(**values)  # type: ignore[arg-type]


class FakeStore:
    """The team store's three calls the limits make: ``admit`` answers ``verdict`` (and notes
    when), ``release`` raises ``unavailable`` times first, then waits for ``gate``."""

    def __init__(self) -> None:
        self.verdict = admission()
        self.admitted: list[tuple[str, float]] = []  # turn id, trio time
        self.released: list[list[Release]] = []
        self.settled: list[Release] = []
        self.unavailable = 0
        self.gate: trio.Event | None = None
        self.written = trio.Event()  # set by the first release written

    async def admit(self, turn_id: str, *args: object) -> Admission:
        self.admitted.append((turn_id, trio.current_time()))
        return self.verdict

    async def release(self, batch: list[Release]) -> None:
        if self.unavailable:
            self.unavailable -= 1
            raise StoreUnavailable("the database is away")
        if self.gate is not None:
            await self.gate.wait()
        self.released.append(list(batch))
        self.written.set()

    async def settle(self, release: Release, record: UsageRecord, at: float) -> bool:
        self.settled.append(release)
        return True


def limits(store: FakeStore) -> tuple[ReplicaLimits, dict[object, str | None], list[tuple]]:
    learned: dict[object, str | None] = {}
    evicted: list[tuple] = []

    async def on_evicted(key: str, session: str, job: str | None) -> None:
        evicted.append((key, session, job))

    team = ReplicaLimits(store, HubSettings(), learned, on_evicted, 3600.0)  # type: ignore[arg-type]
    return team, learned, evicted


async def test_an_admitted_turns_session_learns_its_job_and_an_evicted_one_is_ended() -> None:
    store = FakeStore()
    team, learned, evicted = limits(store)
    await team.admit(FakeTurn("t1"), KeyLimits())  # type: ignore[arg-type]
    assert learned == {("k1", "s1"): "job-1"} and evicted == []
    store.verdict = admission(job_id=None, evicted_session="old", evicted_job="job-0")
    await team.admit(FakeTurn("t2", session="s2"), KeyLimits())  # type: ignore[arg-type]
    assert learned[("k1", "s2")] is None
    assert evicted == [("key-one", "old", "job-0")]


@pytest.mark.parametrize(
    ("verdict", "limit", "bound"),
    [("rpm", KeyLimits(rpm=3), 3), ("max_streams", KeyLimits(max_streams=2), 2)],
)
async def test_the_stores_refusal_names_the_limit_its_bound_and_when_to_retry(
    verdict: str, limit: KeyLimits, bound: int
) -> None:
    store = FakeStore()
    store.verdict = admission(verdict, wait=2.5)
    team, learned, _ = limits(store)
    with pytest.raises(LimitExceeded) as refused:
        await team.admit(FakeTurn("t"), limit)  # type: ignore[arg-type]
    assert refused.value.limit == verdict and refused.value.retry_after == 3  # 2.5 s, whole
    assert str(bound) in refused.value.message and learned == {}


async def test_a_session_cap_and_an_unknown_verdict_are_refused() -> None:
    store = FakeStore()
    team, _, _ = limits(store)
    store.verdict = admission("max_sessions")
    with pytest.raises(TooManySessions):
        await team.admit(FakeTurn("t1"), KeyLimits())  # type: ignore[arg-type]
    store.verdict = admission("who-knows")
    with pytest.raises(StoreError, match="who-knows"):
        await team.admit(FakeTurn("t2"), KeyLimits())  # type: ignore[arg-type]


async def test_a_spent_budget_is_refused_with_the_budget_it_passed() -> None:
    store = FakeStore()
    store.verdict = admission("budget_daily", spent=5.0, holding=0.5, wait=3600.0)
    team, _, _ = limits(store)
    with pytest.raises(LimitExceeded) as refused:
        await team.admit(FakeTurn("t"), KeyLimits(), funds=(0.5, 5.0, None))  # type: ignore[arg-type]
    assert refused.value.limit == "budget_daily" and "daily budget of 5" in refused.value.message


async def test_a_keys_next_admission_waits_for_its_release_and_another_keys_does_not(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FakeStore()
    store.gate = trio.Event()
    team, _, _ = limits(store)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(team.run)
        team.release(FakeTurn("ended"))  # type: ignore[arg-type]
        start = trio.current_time()
        async with trio.open_nursery() as admissions:
            admissions.start_soon(team.admit, FakeTurn("same-key"), KeyLimits())
            admissions.start_soon(team.admit, FakeTurn("other-key", key_id="k2"), KeyLimits())
            await trio.sleep(0.5)
            assert [turn for turn, _ in store.admitted] == ["other-key"]
            store.gate.set()  # the release is written: the key's admission goes on at once
        assert store.released == [[Release("ended", "k1", "key-one", "s1", 7, 0.0)]]
        assert [turn for turn, _ in store.admitted] == ["other-key", "same-key"]
        assert store.admitted[1][1] - start == pytest.approx(0.5)
        nursery.cancel_scope.cancel()


async def test_a_release_never_written_delays_the_keys_admission_by_retry_at_most(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FakeStore()
    team, _, _ = limits(store)
    team.ending(FakeTurn("ending"))  # type: ignore[arg-type]  # settle never comes
    start = trio.current_time()
    await team.admit(FakeTurn("next"), KeyLimits())  # type: ignore[arg-type]
    assert store.admitted[0][1] - start == pytest.approx(RETRY)


async def test_releases_the_store_refused_are_written_when_it_is_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FakeStore()
    store.unavailable = 2
    team, _, _ = limits(store)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(team.run)
        team.release(FakeTurn("a"))  # type: ignore[arg-type]
        team.release(FakeTurn("b", key_id="k2"))  # type: ignore[arg-type]
        start = trio.current_time()
        await team.admit(FakeTurn("c"), KeyLimits())  # type: ignore[arg-type]
        # k1's admission waited RETRY for its release (the store was away), then went on
        assert store.admitted[0][1] - start == pytest.approx(RETRY)
        await store.written.wait()
        assert [[r.turn_id for r in batch] for batch in store.released] == [["a", "b"]]
        assert trio.current_time() - start == pytest.approx(2 * RETRY)
        nursery.cancel_scope.cancel()
