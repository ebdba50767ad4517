"""A typed, read-only picture of a running hub: what the admin routes, ``/metrics`` and the
status page read (``take`` builds it from the parts; nothing else reads their insides).

To show something new, add a field here (with a default) and fill it in ``take``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import trio

from gateway.hub.accounting import Accounting
from gateway.hub.board import JobBoard
from gateway.hub.catalog import Catalog
from gateway.hub.channel import Channels
from gateway.hub.counters import HubCounters
from gateway.hub.dispatcher import Dispatcher
from gateway.hub.sessions import Sessions
from gateway.wire.protocol import FALLBACK_TIER

FORGET_DOWN_AFTER = 3600.0  # s: a runner silent this long leaves the runners listed


@dataclass(frozen=True)
class RunnerStatus:
    """One runner seen since the hub started (silent under ``FORGET_DOWN_AFTER``)."""

    id: str
    name: str | None
    labels: tuple[str, ...]
    owner: str
    project: str
    capabilities: tuple[str, ...] | None  # what its last poll advertised (None: none yet)
    models: tuple[str, ...] | None  # what it listed last (None: not known)
    up: bool  # a sign of life within offline_after, and its last poll did not say it stops
    connected: bool  # a Chat Channel of it is open
    last_seen_seconds: float | None
    jobs: int  # live jobs it holds
    sessions: int  # live sessions on it
    turns_in_flight: int
    tier: str = "primary"  # or "fallback": its polls say so (docs/protocol.md §6)


@dataclass(frozen=True)
class SessionStatus:
    key: str  # the API key's name
    session: str
    job_id: str | None
    runner_id: str | None
    turns: int
    idle_seconds: float


@dataclass(frozen=True)
class TurnStatus:
    """One turn in flight, with its pace (chunks a second since the first)."""

    key: str
    session: str
    api: str
    model: str | None
    stream: bool
    state: str
    runner_id: str | None
    age_seconds: float
    ttft_seconds: float | None
    chunks: int
    tokens_per_second: float | None


@dataclass(frozen=True)
class QueueStatus:
    """The front door's queues now, and the waits so far."""

    depth: Mapping[str, int]  # "owner/project" -> turns waiting now (projects with any)
    waits: int  # turns that waited and are done waiting (served, timed out, or left)
    wait_seconds: float  # their waits, summed
    longest_wait: float  # s: the longest of them
    recent_waits: tuple[float, ...]  # s: the last of them, oldest first


@dataclass(frozen=True)
class ReplicaStatus:
    """The hub as a replica of a team: its id, the address the others reach it at, its version."""

    id: str
    url: str | None  # None until the address it serves on is known
    version: str


@dataclass(frozen=True)
class HubSnapshot:
    runners: tuple[RunnerStatus, ...]
    sessions: tuple[SessionStatus, ...]
    turns: tuple[TurnStatus, ...]
    queue: QueueStatus
    counters: Mapping[str, int] = field(default_factory=dict)  # HubCounters, snake_case
    channels_open: int = 0
    late_reports: int = 0  # runner reports dropped: they came after the job's final one
    replica: ReplicaStatus | None = None  # a team's replica only (None: a hub serving alone)


def take(
    *,
    board: JobBoard,
    channels: Channels,
    sessions: Sessions,
    dispatcher: Dispatcher,
    catalog: Catalog,
    accounting: Accounting,
    counters: HubCounters,
    connected: set[str] | None = None,
    replica: ReplicaStatus | None = None,
) -> HubSnapshot:
    """The hub as it is now, read from its parts (``connected``: the runners with a channel on
    any replica of a team, when it is one; ``replica``: this hub's identity in the team)."""
    now = trio.current_time()
    sessions_by_runner: dict[str, int] = {}
    session_list = []
    for (_key_id, sid), session in list(sessions.live.items()):
        job = board.jobs.get(session.job_id) if session.job_id else None
        runner = job.claimed_by if job is not None else None
        if runner is not None:
            sessions_by_runner[runner] = sessions_by_runner.get(runner, 0) + 1
        session_list.append(
            SessionStatus(
                session.key_name,
                sid,
                session.job_id,
                runner,
                session.turns,
                round(max(0.0, now - session.last_used), 1),
            )
        )
    turns = []
    in_flight: dict[str, int] = {}
    for turn in list(accounting.in_flight.values()):
        if turn.runner_id is not None:
            in_flight[turn.runner_id] = in_flight.get(turn.runner_id, 0) + 1
        first = turn.first_token
        pace = None
        if first is not None and now - first > 0:
            pace = round(turn.chunks / (now - first), 1)
        turns.append(
            TurnStatus(
                turn.key_name,
                turn.session,
                turn.api,
                turn.model,
                turn.stream,
                turn.state.label,
                turn.runner_id,
                round(max(0.0, now - turn.started), 1),
                None if turn.ttft is None else round(turn.ttft, 3),
                turn.chunks,
                pace,
            )
        )
    turns.sort(key=lambda t: -t.age_seconds)
    connected = channels.runners() | (connected or set())
    runners = []
    for runner_id, state in list(board.runners.items()):
        last = board.last_seen.get(runner_id)
        silent = None if last is None else max(0.0, now - last)
        if silent is not None and silent > FORGET_DOWN_AFTER and runner_id not in connected:
            continue
        models = catalog.of_runner(runner_id)
        runners.append(
            RunnerStatus(
                runner_id,
                state.name,
                tuple(state.labels),
                state.owner,
                state.project,
                None if state.capabilities is None else tuple(sorted(state.capabilities)),
                None if models is None else tuple(models),
                board.up(runner_id),
                runner_id in connected,
                None if silent is None else round(silent, 1),
                board.held(runner_id),
                sessions_by_runner.get(runner_id, 0),
                in_flight.get(runner_id, 0),
                "fallback"
                if state.capabilities is not None and FALLBACK_TIER in state.capabilities
                else "primary",
            )
        )
    waits = dispatcher.waits
    queue = QueueStatus(
        dispatcher.depth(),
        waits.count,
        waits.total,
        waits.longest,
        tuple(waits.recent),
    )
    return HubSnapshot(
        tuple(runners),
        tuple(session_list),
        tuple(turns),
        queue,
        asdict(counters),
        len(channels.all()),
        board.late_reports,
        replica,
    )


def as_json(status: Any) -> dict[str, Any]:
    """A status dataclass as the admin routes answer it: camelCase keys."""
    return {camel(k): v for k, v in asdict(status).items()}


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)
