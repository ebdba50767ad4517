"""The job board's runners: what it knows of each (``RunnerState``: its project, what its last
poll advertised, its models), by id and by project (``RunnerTable``), with a version per project
that moves whenever something the dispatcher views of one of them changes, and the live jobs
each holds (``held``: kept as the board says, never counted by a walk)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# a runner's fields the dispatcher's view of it reads: a change to one is a change of its project's
# runners (``RunnerTable.version``)
VIEWED = frozenset({"capabilities", "models", "listing"})


@dataclass
class RunnerState:
    """What the board knows of one runner since the hub started: its project, and what its last
    poll advertised (None: it has not polled yet). A change to a field the dispatcher views
    (``VIEWED``) is told to the table that holds it, whoever makes it."""

    owner: str
    project: str
    capabilities: frozenset[str] | None = None
    polled_at: float | None = None  # trio clock
    models: frozenset[str] | None = None  # the models it listed last (None: not known yet)
    listing: bool = False  # asked for its models on a channel it opened; no answer yet
    name: str | None = None  # its registration's (known once it was seen with it)
    labels: tuple[str, ...] = ()
    stopped: bool = False  # its last poll said it stops: not ``up`` (placement still waits)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in VIEWED and getattr(self, name, value) != value:
            table = self.__dict__.get("_table")
            if table is not None:
                table.touch(self.owner, self.project, self.__dict__["_id"])
        object.__setattr__(self, name, value)


Project = tuple[str, str]


class RunnerTable(dict[str, RunnerState]):
    """The board's runners by id, and by project (``of``): a new session's placement looks at
    its project's runners only, never at every runner of the hub. ``version`` counts the changes
    to a project's runners (one added or gone, a viewed field, a held job), so whoever keeps a
    view of them knows when it is stale, and ``take_changed`` which of them changed (the
    dispatcher views those again, not all)."""

    def __init__(self) -> None:
        super().__init__()
        self._by_project: dict[Project, dict[str, RunnerState]] = {}
        self._versions: dict[Project, int] = {}
        # per project, the runners changed since ``take_changed`` (None: added or gone)
        self._changed: dict[Project, set[str] | None] = {}
        self._holds: dict[str, set[str]] = {}  # runner id -> the live jobs it holds
        self._holder: dict[str, str] = {}  # job id -> the runner it is counted for

    def of(self, owner: str, project: str) -> dict[str, RunnerState]:
        """The runners of ``owner/project`` by id (the table's own: not to be changed)."""
        return self._by_project.get((owner, project), {})

    def held(self, runner_id: str) -> int:
        """How many live jobs the runner holds (as ``count`` was told)."""
        return len(self._holds.get(runner_id, ()))

    def holding(self) -> set[str]:
        """The runners that hold a live job."""
        return set(self._holds)

    def count(self, job_id: str, holder: str | None) -> None:
        """The job is held by ``holder`` now (None: by nobody: queued, over, or gone)."""
        before = self._holder.get(job_id)
        if holder == before:
            return
        if before is not None:
            held = self._holds[before]
            held.discard(job_id)
            if not held:
                del self._holds[before]
            del self._holder[job_id]
        if holder is not None:
            self._holds.setdefault(holder, set()).add(job_id)
            self._holder[job_id] = holder
        for runner_id in (before, holder):
            state = self.get(runner_id) if runner_id is not None else None
            if state is not None:  # the dispatcher's view of it (its ``held``) changed
                self.touch(state.owner, state.project, runner_id)

    def version(self, owner: str, project: str) -> int:
        return self._versions.get((owner, project), 0)

    def touch(self, owner: str, project: str, runner_id: str | None = None) -> None:
        """Something the dispatcher views of ``runner_id`` of ``owner/project`` changed (None:
        a runner was added or left)."""
        key = (owner, project)
        self._versions[key] = self._versions.get(key, 0) + 1
        changed = self._changed.get(key, set())
        if changed is not None and runner_id is not None:
            changed.add(runner_id)
            self._changed[key] = changed
        else:
            self._changed[key] = None

    def take_changed(self, owner: str, project: str) -> set[str] | None:
        """The runners of ``owner/project`` changed since the last call (None: some were added
        or left, or their changes not kept), and forget them."""
        return self._changed.pop((owner, project), set())

    def __setitem__(self, runner_id: str, state: RunnerState) -> None:
        self._remove(runner_id)
        super().__setitem__(runner_id, state)
        object.__setattr__(state, "_table", self)
        object.__setattr__(state, "_id", runner_id)
        self._by_project.setdefault((state.owner, state.project), {})[runner_id] = state
        self.touch(state.owner, state.project)

    def __delitem__(self, runner_id: str) -> None:
        self._remove(runner_id)
        super().__delitem__(runner_id)

    def pop(self, runner_id: str, *default: Any) -> Any:  # type: ignore[override]
        self._remove(runner_id)
        return super().pop(runner_id, *default)

    # the rest of a dict's writes, through the two above (nothing changes it behind the index)
    def setdefault(self, runner_id: str, state: RunnerState) -> RunnerState:  # type: ignore[override]
        if runner_id not in self:
            self[runner_id] = state
        return self[runner_id]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for runner_id, state in dict(*args, **kwargs).items():
            self[runner_id] = state

    def popitem(self) -> tuple[str, RunnerState]:
        runner_id = next(reversed(self))
        return runner_id, self.pop(runner_id)

    def clear(self) -> None:
        for runner_id in list(self):
            del self[runner_id]

    def _remove(self, runner_id: str) -> None:
        state = self.get(runner_id)
        if state is None:
            return
        key = (state.owner, state.project)
        of = self._by_project.get(key)
        if of is not None and of.get(runner_id) is state:
            del of[runner_id]
            if not of:
                del self._by_project[key]
        object.__setattr__(state, "_table", None)
        self.touch(*key)
