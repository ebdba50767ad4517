"""The dispatcher's pure step (``gateway.hub.dispatchplan.plan``) driven in memory, as h11's tests
drive a Connection: which waiting turn is served, which jobs are opened, retargeted or withdrawn,
which session moves, who is refused and why, and when the next step falls due. No socket, no
trio: a step is a function of the turns, the runners and the jobs."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from walks import walk_counting

from gateway.hub.dispatchfleet import CANDIDATES, WALK_AT_MOST
from gateway.hub.dispatchplan import (
    Assign,
    DispatchLimits,
    FairQueue,
    Fleet,
    JobView,
    Move,
    Open,
    Plan,
    Refusal,
    Refuse,
    Retarget,
    RunnerView,
    Waiter,
    Withdraw,
    eligible,
    plan,
)

LIMITS = DispatchLimits(queue_length=3, queue_wait=10.0, dial_within=30.0, redial_within=5.0)
_sessions = itertools.count()


def waiter(lane: str = "k", model: str | None = "m", at: float = 0.0, **kw: object) -> Waiter:
    return Waiter(lane, kw.pop("session", next(_sessions)), model, at, **kw)  # type: ignore[arg-type]


def runner(
    rid: str, *, alive: bool = True, free: bool | None = True, held: int = 0, models: object = None
) -> RunnerView:
    listed = None if models is None else frozenset(models)  # type: ignore[arg-type]
    return RunnerView(rid, alive, free, held, listed)


def kinds(out: Plan) -> list[str]:
    return [type(a).__name__ for a in out.actions]


def step(
    queue: FairQueue,
    waiters: list[Waiter],
    runners: list[RunnerView],
    jobs: dict[str, JobView] | None = None,
    now: float = 0.0,
    limits: DispatchLimits = LIMITS,
) -> Plan:
    return plan(queue, waiters, {r.id: r for r in runners}, jobs or {}, limits, now)


# -- no runner: refused at once, naming why ------------------------------------------------


def test_no_runner_alive_is_refused_at_once() -> None:
    w = waiter()
    out = step(FairQueue(), [w], [runner("r", alive=False)])
    assert out.actions == [Refuse(w, Refusal.NO_RUNNER_CONNECTED, live=0)]


def test_runners_alive_none_capable_none_busy_is_refused_at_once() -> None:
    w = waiter()
    out = step(FairQueue(), [w], [runner("r", free=False)])
    assert out.actions == [Refuse(w, Refusal.NO_CAPABLE_RUNNER, live=1)]


def test_a_queued_turn_waits_on_while_its_busy_runner_looks_down_until_queue_wait() -> None:
    """A runner at capacity whose job just ended has not polled again yet (on a team: its
    presence is read after the job's end): it looks down (chat-llm:v1 withdrawn, no job). The
    turns queued for it wait on, within ``queue_wait``, and are refused only after it; a
    newcomer is refused at once as before."""
    queue = FairQueue()
    queued = [waiter("bg", at=0.0), waiter("bg", at=0.1)]
    step(queue, queued, [runner("r", free=False, held=1)])
    assert all(w.queued for w in queued)
    newcomer = waiter("ia", at=1.0)
    looks_down = [runner("r", free=False, held=0)]
    out = step(queue, [*queued, newcomer], looks_down, now=1.0)
    assert out.actions == [Refuse(newcomer, Refusal.NO_CAPABLE_RUNNER, live=1)]
    assert out.wake == LIMITS.queue_wait
    out = step(queue, queued, looks_down, now=LIMITS.queue_wait + 0.1)
    assert out.actions == [Refuse(w, Refusal.NO_CAPABLE_RUNNER, live=1) for w in queued]


# -- a new session's job --------------------------------------------------------------------


def test_a_free_runner_gets_a_job_for_the_turn_and_the_job_goes_only_where_the_model_is() -> None:
    w = waiter(model="coder")
    runners = [runner("a", models={"chat"}), runner("b", models={"coder"})]
    out = step(FairQueue(), [w], runners)
    assert out.actions == [Open(w, frozenset({"b"}))]  # never to a runner without the model
    assert out.wake == LIMITS.dial_within and not w.queued


def test_a_runner_whose_models_are_not_known_yet_may_take_the_job() -> None:
    w = waiter(model="coder")
    out = step(FairQueue(), [w], [runner("a", models={"chat"}), runner("new")])
    assert out.actions == [Open(w, frozenset({"new"}))]
    assert eligible([runner("x")], None) is None  # no model asked: any runner


def test_a_model_no_runner_lists_is_refused_once_every_list_is_known() -> None:
    w = waiter(model="gpt-nope")
    runners = [runner("a", models={"chat"}), runner("b", free=False, models={"coder"})]
    out = step(FairQueue(), [w], runners)
    assert out.actions == [Refuse(w, Refusal.UNKNOWN_MODEL, models=("chat", "coder"))]
    # while a runner's list is not known, it may serve it: the turn is not refused
    out = step(FairQueue(), [w], [*runners, runner("new")])
    assert kinds(out) == ["Open"]


def test_the_claimed_job_is_served_once_its_channel_is_open() -> None:
    queue = FairQueue()
    w = waiter()
    step(queue, [w], [runner("r", models={"m"})])
    w.job_id, w.opened = "j", True
    claimed = {"j": JobView("j", "r", over=False, channel=False)}
    dialling = step(queue, [w], [runner("r", free=False, held=1, models={"m"})], claimed, 1.0)
    assert dialling.actions == [] and dialling.wake == 1.0 + LIMITS.dial_within
    assert w not in queue  # served: out of the queue, its lane's turn over
    opened = {"j": JobView("j", "r", over=False, channel=True)}
    assert step(queue, [w], [runner("r", free=False, held=1)], opened, 2.0).actions == [
        Assign(w, "j")
    ]


def test_a_turn_waits_for_its_runners_first_model_list_before_it_is_served() -> None:
    w = waiter(job_id="j", opened=True, claimed_at=0.0)
    learning = replace(runner("r", free=False, held=1), listing=True)
    opened = {"j": JobView("j", "r", over=False, channel=True)}
    assert step(FairQueue(), [w], [learning], opened).actions == []  # the answer is a change
    assert step(FairQueue(), [w], [runner("r", free=False, held=1)], opened).actions == [
        Assign(w, "j")
    ]


def test_a_job_claimed_but_never_dialled_is_refused_after_dial_within() -> None:
    w = waiter(job_id="j", opened=True, claimed_at=0.0)
    claimed = {"j": JobView("j", "r", over=False, channel=False)}
    out = step(FairQueue(), [w], [runner("r", free=False, held=1)], claimed, LIMITS.dial_within)
    assert out.actions == [Refuse(w, Refusal.NO_RUNNER)]


# -- the fair queue -----------------------------------------------------------------------


def test_while_every_runner_is_busy_only_the_first_holds_a_job_the_rest_queue_fairly() -> None:
    queue = FairQueue()
    a1, a2, b1 = waiter("A"), waiter("A", at=0.1), waiter("B", at=0.2)
    busy = [runner("r", free=False, held=1, models={"m"})]
    out = step(queue, [a1, a2, b1], busy)
    assert kinds(out) == ["Open"] and out.actions[0] == Open(a1, frozenset({"r"}))
    assert queue.order() == [a1, b1, a2]  # lanes take turns: B's one before A's second
    assert out.newly_queued == [a1, b1, a2] and out.wake == LIMITS.queue_wait


def test_past_queue_length_a_newcomer_is_refused_at_once_with_its_place() -> None:
    queue = FairQueue()
    busy = [runner("r", free=False, held=1)]
    early = [waiter(at=float(i)) for i in range(3)]
    step(queue, early, busy)
    late = waiter("other", at=5.0)
    out = step(queue, [*early, late], busy, now=5.0)
    assert Refuse(late, Refusal.QUEUE_FULL, busy=1, position=2, of=4) in out.actions
    assert late not in queue and len(queue) == 3


def test_a_queued_turn_gives_up_after_queue_wait() -> None:
    queue = FairQueue()
    busy = [runner("r", free=False, held=1)]
    w = waiter()
    step(queue, [w], busy)
    w.job_id = None  # (its job taken back: it waits without one)
    out = step(queue, [w], busy, now=LIMITS.queue_wait)
    assert Refuse(w, Refusal.QUEUE_TIMEOUT, busy=1, position=1, of=1) in out.actions


def test_a_job_no_runner_claims_is_given_back_by_all_but_the_first() -> None:
    queue = FairQueue()
    a, b = waiter("A"), waiter("B", at=0.1)
    out = step(queue, [a, b], [runner("r", models={"m"})])
    assert kinds(out) == ["Open", "Open"]  # a runner was free: both opened at once
    a.job_id, a.opened, b.job_id, b.opened = "ja", True, "jb", True
    jobs = {j: JobView(j, None, over=False, channel=False) for j in ("ja", "jb")}
    now_busy = [runner("r", free=False, held=1, models={"m"})]
    out = step(queue, [a, b], now_busy, jobs, 1.0)
    assert Withdraw(b, "jb") in out.actions and Retarget("ja", frozenset({"r"})) in out.actions
    assert queue.order() == [a, b]  # its place is kept: by arrival and lane, never by job


def test_turns_of_one_session_share_its_new_job() -> None:
    session = object()
    first, second = waiter(session=session), waiter(session=session, at=0.5)
    out = step(FairQueue(), [first, second], [runner("r")])
    assert out.actions == [Open(first, frozenset({"r"}))] and second.follows is first


# -- a session's channel gone: wait for the redial, or move at once ------------------------


def test_the_channel_gone_and_another_runner_free_moves_the_session_at_once() -> None:
    w = waiter(job_id="j")
    jobs = {"j": JobView("j", "dead", over=False, channel=False)}
    out = step(FairQueue(), [w], [runner("dead", free=False, held=1), runner("b")], jobs)
    assert out.actions[0] == Move(w, "j", "channel lost", immediate=True)
    assert isinstance(out.actions[1], Open)  # and a new job for it, in the same step


def test_with_no_other_runner_the_redial_is_waited_for_then_the_session_moves() -> None:
    w = waiter(job_id="j")
    jobs = {"j": JobView("j", "r", over=False, channel=False)}
    alone = [runner("r", free=False, held=1)]
    out = step(FairQueue(), [w], alone, jobs)
    assert out.actions == [] and out.wake == LIMITS.redial_within and out.redialling == [w]
    back = {"j": JobView("j", "r", over=False, channel=True)}
    assert step(FairQueue(), [w], alone, back, 1.0).actions == [Assign(w, "j")]
    w2 = waiter(job_id="j")
    step(FairQueue(), [w2], alone, jobs)
    late = step(FairQueue(), [w2], alone, jobs, LIMITS.redial_within)
    assert late.actions[0] == Move(w2, "j", "channel lost")


def test_a_restarted_hubs_job_waits_for_its_runners_redial_though_another_is_free() -> None:
    """After a hub restart a session's runner redials its job within a second or so: its next
    turn waits for that (the runner's KV cache), until ``redial_by``, then moves at once."""
    w = waiter(job_id="j")
    restored = {"j": JobView("j", "r", over=False, channel=False, redial_by=5.0)}
    both = [runner("r", held=1), runner("b")]
    out = step(FairQueue(), [w], both, restored, 0.5)
    assert out.actions == [] and out.wake == 5.0 and w.job_id == "j"
    back = {"j": JobView("j", "r", over=False, channel=True, redial_by=5.0)}
    assert step(FairQueue(), [w], both, back, 1.0).actions == [Assign(w, "j")]
    w2 = waiter(job_id="j")
    late = step(FairQueue(), [w2], both, restored, 5.0)
    assert late.actions[0] == Move(w2, "j", "channel lost", immediate=True)


def test_a_job_its_runner_ended_needs_no_redial() -> None:
    w = waiter(job_id="j")
    ended = {"j": JobView("j", "r", over=True, channel=False)}
    out = step(FairQueue(), [w], [runner("r")], ended)
    assert kinds(out) == ["Open"] and w.redial_until is None


def test_a_turn_for_a_model_its_runner_lacks_moves_the_session() -> None:
    w = waiter(model="coder", job_id="j")
    jobs = {"j": JobView("j", "chatbox", over=False, channel=True)}
    runners = [runner("chatbox", models={"chat"}), runner("coderbox", models={"coder"})]
    out = step(FairQueue(), [w], runners, jobs)
    assert out.actions[0] == Move(w, "j", "its runner does not serve coder")
    assert out.actions[1] == Open(w, frozenset({"coderbox"}))


@pytest.mark.parametrize("n", [2, 5])
def test_placement_by_model_never_wrong_among_many(n: int) -> None:
    """Each of n sessions for each model opens a job only runners listing its model may take."""
    runners = [runner("a", models={"sim-model"}), runner("b", models={"slow-model"})]
    waiters = [waiter(f"k{i}", model=m) for i in range(n) for m in ("sim-model", "slow-model")]
    out = step(FairQueue(), waiters, runners)
    for action in out.actions:
        if isinstance(action, Open):
            want = "a" if action.waiter.model == "sim-model" else "b"
            assert action.runners == frozenset({want})
    assert math.isfinite(out.wake)


def test_a_new_job_claimed_by_a_runner_found_not_to_serve_the_model_is_left() -> None:
    """A runner whose list was not known yet took the job; its list came without the model: the
    job is left (its runner told) and the turn seeks another, its place kept."""
    queue = FairQueue()
    w = waiter(model="coder")
    step(queue, [w], [runner("new"), runner("coderbox", models={"coder"})])
    w.job_id, w.opened = "j", True
    claimed = {"j": JobView("j", "new", over=False, channel=True)}
    known = [
        runner("new", free=False, held=1, models={"chat"}),
        runner("coderbox", models={"coder"}),
    ]
    out = step(queue, [w], known, claimed, 1.0)
    assert out.actions[0] == Move(w, "j", "its runner does not serve coder")
    assert out.actions[1] == Open(w, frozenset({"coderbox"})) and w in queue


# -- tiers (issue 37, point 7): a fallback runner only when no primary can serve ---------------

TIERED = replace(LIMITS, fallback_after=3.0)


def fallback(rid: str, **kw: object) -> RunnerView:
    return replace(runner(rid, **kw), fallback=True)  # type: ignore[arg-type]


def test_a_new_job_goes_to_the_primary_runners_only_while_one_can_serve() -> None:
    w = waiter()
    out = step(FairQueue(), [w], [runner("gpu"), fallback("cloud")], limits=TIERED)
    assert out.actions == [Open(w, frozenset({"gpu"}))]
    assert out.wake == 3.0  # when the fallback may take it too
    # no model named: still the primary tier only
    anyone = waiter(model=None)
    out = step(FairQueue(), [anyone], [runner("gpu"), fallback("cloud")], limits=TIERED)
    assert out.actions == [Open(anyone, frozenset({"gpu"}))]


def test_the_fallback_gets_the_job_when_no_primary_can_serve() -> None:
    down, other = runner("gpu", free=False), runner("x", models=["n"])
    for primary in (runner("gpu", alive=False), down, other):
        w = waiter()
        out = step(FairQueue(), [w], [primary, fallback("cloud")], limits=TIERED)
        assert out.actions == [Open(w, frozenset({"cloud"}))], primary


def test_a_job_no_primary_took_within_fallback_after_is_offered_to_the_fallback_too() -> None:
    queue, w = FairQueue(), waiter()
    runners = [runner("gpu"), fallback("cloud")]
    assert step(queue, [w], runners, limits=TIERED).actions == [Open(w, frozenset({"gpu"}))]
    w.job_id, w.opened = "j1", True
    jobs = {"j1": JobView("j1", None, False, False)}
    out = step(queue, [w], runners, jobs, now=2.9, limits=TIERED)
    assert out.actions == [Retarget("j1", frozenset({"gpu"}))]
    out = step(queue, [w], runners, jobs, now=3.0, limits=TIERED)
    assert out.actions == [Retarget("j1", frozenset({"gpu", "cloud"}))]


def test_a_busy_primary_is_waited_for_not_spilled_to_the_fallback() -> None:
    queue, w = FairQueue(), waiter()
    runners = [runner("gpu", free=False, held=1), fallback("cloud")]
    out = step(queue, [w], runners, limits=TIERED)
    assert out.actions == [Open(w, frozenset({"gpu"}))] and w.queued
    w.job_id, w.opened = "j1", True
    jobs = {"j1": JobView("j1", None, False, False)}
    out = step(queue, [w], runners, jobs, now=5.0, limits=TIERED)
    assert out.actions == [Retarget("j1", frozenset({"gpu"}))]


def test_without_a_fallback_runner_targets_are_as_before() -> None:
    assert eligible([runner("a"), runner("b")], None) is None
    assert eligible([runner("a", models=["m"]), runner("b", models=["n"])], "m") == {"a"}


# -- a fleet kept between steps ------------------------------------------------------------------


_Walked = walk_counting(dict)  # a project's runners counting the walks over them


def test_a_fleet_kept_between_steps_decides_as_its_runners_do_without_walking_them_again() -> None:
    """The dispatcher keeps a project's ``Fleet`` while its runners do not change: a step with it
    decides what a step with the runners themselves decides, and walks none of the 1,000 runners
    (the pool, the models listed, a model's runners: worked out once, by the first step)."""
    views = [
        runner(f"r{i}", models=["m", "n"] if i % 2 else ["m"], held=i % 3) for i in range(1000)
    ]
    runners = _Walked({r.id: r for r in views})
    fleet = Fleet(runners)
    for n, model in enumerate(["m", "n", "m", "unknown", None]):
        waiters = [waiter(model=model, session=f"s{n}"), waiter(model=model, session=f"t{n}")]
        alike = [replace(w) for w in waiters]
        by_fleet = plan(FairQueue(), waiters, fleet, {}, LIMITS, float(n))
        walks = runners.walks
        again = plan(FairQueue(), alike, {r.id: r for r in views}, {}, LIMITS, float(n))
        assert kinds(by_fleet) == kinds(again) and by_fleet.wake == again.wake
        for mine, theirs in zip(by_fleet.actions, again.actions, strict=True):
            assert getattr(mine, "runners", None) == getattr(theirs, "runners", None)
            assert getattr(mine, "why", None) == getattr(theirs, "why", None)
        if n > 0:  # the first step with the fleet worked out what every later one needs...
            assert runners.walks == walks, model  # ...or only what a new model needs
    assert kinds(plan(FairQueue(), [waiter(model="m")], fleet, {}, LIMITS, 9.0)) == ["Open"]
    assert runners.walks <= 6  # the pool once, and the runners of each model once


def test_a_fleet_updated_for_held_jobs_decides_as_one_built_anew() -> None:
    """A claim or a job's end changes how many jobs a free runner holds, and nothing a step
    derives from the runners but the fewest held: ``Fleet.updated`` keeps the rest and decides
    as a fleet built anew; any other change (a runner that stops advertising chat-llm:v1, a
    model list) is not an update (None: built anew)."""
    views = {f"r{i}": runner(f"r{i}", models=["m"], held=1) for i in range(50)}
    fleet = Fleet(views)
    assert fleet.least_held == 1 and fleet.targets("m", False)[1] == 50
    claimed = {"r7": replace(views["r7"], held=0), "r9": replace(views["r9"], held=3)}
    updated = fleet.updated(claimed)
    assert updated is not None and updated.least_held == 0 and updated.get("r9") == claimed["r9"]
    anew = Fleet({**views, **claimed})
    for model in ("m", None, "other"):
        a = plan(FairQueue(), [waiter(model=model, session="a")], updated, {}, LIMITS, 0.0)
        b = plan(FairQueue(), [waiter(model=model, session="a")], anew, {}, LIMITS, 0.0)
        assert [(type(x), getattr(x, "runners", None)) for x in a.actions] == [
            (type(x), getattr(x, "runners", None)) for x in b.actions
        ]
    assert fleet.least_held == 1  # the fleet it came from is as it was
    assert fleet.updated({"r1": replace(views["r1"], capable=False)}) is None
    assert fleet.updated({"r1": replace(views["r1"], models=frozenset({"n"}))}) is None
    assert fleet.updated({"new": runner("new")}) is None


def test_a_new_jobs_runner_is_chosen_in_a_short_walk_that_starts_past_the_unable() -> None:
    """``Fleet.choose``: the fewest held of the first ``CANDIDATES`` that may take the job, the
    longest unchosen first, whatever the fleet's size; runners no push reaches, or at capacity,
    go to the back as the walk passes them, so later walks start past them; a model few serve
    is looked for among its runners. A runner that only polls and holds nothing (the fleet's
    fewest held, never chosen by a push) no longer makes every new session walk the fleet."""
    views = {f"r{i}": runner(f"r{i}", models=["m"], held=5) for i in range(1000)}
    views["poller"] = runner("poller", models=["m"], held=0)  # the fewest held: polls only
    views["full"] = runner("full", models=["m"], held=9, free=False)
    views["r500"] = replace(views["r500"], held=4)  # far back: not looked at
    views["r7"] = replace(views["r7"], held=4)
    silent = {f"s{i}": runner(f"s{i}", models=["m"], alive=False) for i in range(300)}
    fleet = Fleet({**views, **silent})
    order = dict.fromkeys(["poller", "full", *silent, *(f"r{i}" for i in range(1000))])
    looked: list[str] = []

    def reachable(runner_id: str) -> bool:
        looked.append(runner_id)
        return runner_id != "poller"

    never = lambda runner_id: False  # noqa: E731
    assert fleet.choose(order, reachable, set(), never, None) == "r7"  # best of the first 16
    assert looked == ["poller", *(f"r{i}" for i in range(CANDIDATES))]  # (the rest not asked)
    assert list(order)[-302:] == ["poller", "full", *silent]  # behind the others now
    looked.clear()
    # the next walk starts past them; the floor (the poller's 0) is never met, and still short
    assert fleet.choose(order, reachable, {"r0", "r1"}, never, None) == "r7"
    assert looked == [f"r{i}" for i in range(CANDIDATES + 2)]
    looked.clear()
    # a model few runners serve: looked for among them, not the fleet
    assert fleet.choose(order, reachable, set(), never, frozenset({"r900", "gone"})) == "r900"
    assert looked == ["r900"]
    # a runner passed over lately comes after the rest: the next fewest held of the window
    assert fleet.choose(order, lambda r: True, set(), lambda r: r == "r7", None) != "r7"
    # with every runner equal the first is no worse than any: taken at once
    even = Fleet({f"e{i}": runner(f"e{i}", models=["m"], held=2) for i in range(100)})
    looked.clear()
    assert even.choose(dict.fromkeys(even.runners), reachable, set(), never, None) == "e0"
    assert looked == ["e0"]
    # none can take it: None (the job then goes to every eligible runner's poll), walk bounded
    assert Fleet(silent).choose(dict.fromkeys(silent), reachable, set(), never, None) is None
    big = {f"x{i}": runner(f"x{i}", free=False) for i in range(WALK_AT_MOST + 10)}
    looked.clear()
    assert Fleet(big).choose(dict.fromkeys(big), reachable, set(), never, None) is None
