"""A project's runners as the dispatcher's pure step sees them (``RunnerView``), and what the
step derives from them, worked out once and kept while they do not change (``Fleet``: the pool
of free and busy runners, the models listed, the runners a model's new job may go to). Pure: no
trio, no I/O (``gateway.hub.dispatchplan`` plans with them)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Container, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, replace

# a new job's runner is the best of this many that may take it, the longest unchosen first
CANDIDATES = 16
# runners looked at for a new job, at most (those that can take no job go to the back as they
# are passed, so a walk is this long only once after many went silent or full at once)
WALK_AT_MOST = 2048
# a model is rare when fewer than one runner in this many serves it: its runners are walked
RARE = 8


@dataclass(frozen=True)
class RunnerView:
    """One runner of the project as the board knows it now."""

    id: str
    alive: bool  # a sign of life within offline_after
    capable: bool | None  # its last poll advertised chat-llm:v1 (None: it has not polled)
    held: int  # live jobs it holds
    models: frozenset[str] | None  # the models it listed (None: not known)
    listing: bool = False  # it is being asked for its models right now (on a channel it opened)
    fallback: bool = False  # of the fallback tier: used only when no primary runner can serve


@dataclass
class _RunnerPool:
    """The project's runners by what they can do about a new job now."""

    free: list[RunnerView]  # alive, advertise chat-llm:v1 (or have not polled yet)
    busy: list[RunnerView]  # alive, at capacity (holding jobs, not advertising)
    live: int

    @classmethod
    def of(cls, runners: Iterable[RunnerView]) -> _RunnerPool:
        free, busy, live = [], [], 0
        for runner in runners:
            if not runner.alive:
                continue
            live += 1
            if _free(runner):
                free.append(runner)
            elif runner.held:
                busy.append(runner)
        return cls(free, busy, live)


class Fleet:
    """A project's runners as a step sees them, with what the plan derives from them (the pool,
    the models listed, the runners a model's new job may go to) worked out once: a dispatcher
    keeps one while its runners do not change, so a step costs what its waiting turns need, not
    a walk of the runners."""

    def __init__(self, runners: Mapping[str, RunnerView]) -> None:
        self.runners = runners
        self.pool = _RunnerPool.of(runners.values())
        self._alive: list[RunnerView] | None = None
        self._able: list[RunnerView] | None = None
        self._listed: list[str] | None = None
        self._all_known: bool | None = None
        self._least_held: int | None = None
        self._held_free: dict[int, int] | None = None  # held jobs -> free runners holding so many
        # (model, spilled) -> the runners its new job may go to, how many of them are free
        self._targets: dict[tuple[str | None, bool], tuple[frozenset[str] | None, int]] = {}
        # model -> the free runners a session that lost its channel could move to
        self._movable: dict[str | None, frozenset[str]] = {}

    def get(self, runner_id: str) -> RunnerView | None:
        return self.runners.get(runner_id)

    def choose(
        self,
        order: MutableMapping[str, None],
        reachable: Callable[[str], bool],
        passed: Container[str],
        passed_lately: Callable[[str], bool],
        targets: Collection[str] | None,
    ) -> str | None:
        """The runner a new job is offered to: of those a push reaches (``reachable``), alive,
        not at capacity, not ``passed`` over for it and among ``targets`` (None: any), the best
        of the first ``CANDIDATES`` in ``order`` (the longest unchosen first): not passed over
        lately, then known capable, then the fewest jobs held; None when there is none.

        The walk is short whatever the fleet's size: it stops at a runner no other can beat or
        after ``CANDIDATES`` that may take the job. A runner that can take no job now (gone,
        silent, at capacity, polling only) goes to the back of ``order``, so that later walks
        start past it; a model few runners serve is looked for among them, not the fleet; and
        no walk goes past ``WALK_AT_MOST`` runners."""
        walk: Iterable[str] = order
        if targets is not None and len(targets) * RARE < len(order):
            walk = [r for r in targets if r in order]  # a model few serve: its runners only
        best: tuple[bool, bool, int] | None = None
        chosen: str | None = None
        floor = (False, False, self.least_held)  # none beats it: the first such is taken
        unable: list[str] = []
        found = steps = 0
        for runner_id in walk:
            steps += 1
            if steps > WALK_AT_MOST:
                break
            view = self.runners.get(runner_id)
            if view is None or not view.alive or view.capable is False or not reachable(runner_id):
                unable.append(runner_id)
                continue
            if runner_id in passed or (targets is not None and runner_id not in targets):
                continue
            rank = (passed_lately(runner_id), view.capable is None, view.held)
            if best is None or rank < best:
                best, chosen = rank, runner_id
                if rank == floor:
                    break
            found += 1
            if found >= CANDIDATES:
                break
        for runner_id in unable:
            order[runner_id] = order.pop(runner_id)  # to the back
        return chosen

    @property
    def least_held(self) -> int:
        """The fewest jobs a free runner holds (0 when none is free)."""
        if self._least_held is None:
            self._least_held = min(self._held_counts(), default=0)
        return self._least_held

    def _held_counts(self) -> dict[int, int]:
        if self._held_free is None:
            self._held_free = {}
            for r in self.pool.free:
                self._held_free[r.held] = self._held_free.get(r.held, 0) + 1
        return self._held_free

    def updated(self, views: Mapping[str, RunnerView]) -> Fleet | None:
        """This fleet with ``views`` (runners viewed again) in it, when all that changed is how
        many jobs free runners hold (a claim, a job's end): what is derived from the runners
        stays as it is (a free runner's held jobs change none of it), only the fewest held
        moves. None when more changed: a fleet is built anew."""
        counts = dict(self._held_counts())
        for view in views.values():
            old = self.runners.get(view.id)
            if old is None or not _free(old) or replace(old, held=view.held) != view:
                return None
            counts[old.held] -= 1
            if not counts[old.held]:
                del counts[old.held]
            counts[view.held] = counts.get(view.held, 0) + 1
        fleet = copy.copy(self)  # the derived parts shared: they hold for both
        fleet.runners = {**self.runners, **views}
        fleet._held_free, fleet._least_held = counts, None
        return fleet

    @property
    def alive(self) -> list[RunnerView]:
        if self._alive is None:
            self._alive = [r for r in self.runners.values() if r.alive]
        return self._alive

    @property
    def able(self) -> list[RunnerView]:
        """The live runners that may take a new job: advertising chat-llm:v1 (or not polled
        yet), or holding jobs (at capacity); one that withdrew it holding none does not."""
        if self._able is None:
            self._able = [r for r in self.alive if r.capable is not False or r.held]
        return self._able

    @property
    def listed(self) -> list[str]:
        """Every model a live runner lists, sorted."""
        if self._listed is None:
            self._listed = sorted({m for r in self.alive for m in r.models or ()})
        return self._listed

    @property
    def all_known(self) -> bool:
        """Every runner that may take a new job has listed its models."""
        if self._all_known is None:
            self._all_known = all(r.models is not None for r in self.able)
        return self._all_known

    def targets(self, model: str | None, spill: bool) -> tuple[frozenset[str] | None, int]:
        """The runners a new job for ``model`` may go to (``eligible``), and how many are free."""
        key = (model, spill)
        found = self._targets.get(key)
        if found is None:
            targets = eligible(self.able, model, spill=spill)
            found = self._targets[key] = (
                targets,
                sum(1 for r in self.pool.free if in_targets(r, targets)),
            )
        return found

    def movable(self, model: str | None) -> frozenset[str]:
        """The free runners a session whose channel is gone may move to for ``model``."""
        found = self._movable.get(model)
        if found is None:
            targets = eligible(self.alive, model)
            found = self._movable[model] = frozenset(
                r.id for r in self.pool.free if in_targets(r, targets)
            )
        return found


def _free(runner: RunnerView) -> bool:
    """Alive, advertising chat-llm:v1 or not polled yet (a new job's runner)."""
    return runner.alive and (runner.capable is None or runner.capable)


def serves(runner: RunnerView, model: str | None) -> bool:
    """Whether the runner is known to serve ``model`` (any runner serves None)."""
    return model is None or (runner.models is not None and model in runner.models)


def eligible(
    runners: Iterable[RunnerView], model: str | None, spill: bool = False
) -> frozenset[str] | None:
    """The runners a new job for ``model`` may go to: those that list it, and those whose models
    are not known yet (the hub asks a runner for its list as it appears, so that lasts a moment);
    of them only the primary ones when one of those can serve (``spill``: the fallback ones
    too). None: any (no model asked, and no runner of the fallback tier)."""
    runners = list(runners)
    fits = [r for r in runners if model is None or r.models is None or model in r.models]
    if any(r.fallback for r in fits):
        primary = [r for r in fits if not r.fallback and _can_serve(r)]
        if primary and not spill:
            return frozenset(r.id for r in primary)
        return frozenset(r.id for r in fits if r.fallback or _can_serve(r))
    if model is None:
        return None
    return frozenset(r.id for r in fits)


def _can_serve(runner: RunnerView) -> bool:
    """Alive, and advertising ``chat-llm:v1`` (or not polled yet), or at capacity."""
    return runner.alive and (runner.capable is None or runner.capable or runner.held > 0)


def in_targets(runner: RunnerView, targets: frozenset[str] | None) -> bool:
    return targets is None or runner.id in targets
