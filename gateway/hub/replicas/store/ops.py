"""The team's statements on PostgreSQL, sans-IO (as ``postgres_ops``): each operation a generator
of ``Query``s, sent each one's rows.

A change another replica must see notifies in the same statement (``pg_notify`` on the channel
``NOTIFY_CHANNEL``, only when the change happened: ``_notifying``), so the notification leaves
with the commit and never without it. A decision two replicas could race for is one conditional
statement (a claim, an end, a withdrawal, a session's job, a dead replica's cleanup)."""

from __future__ import annotations

import json
from typing import Any

from gateway.hub.replicas.store.base import (
    CHANNEL,
    JOB,
    MODELS,
    PRESENCE,
    REPLICA,
    SESSION,
    Admission,
    ChannelRow,
    Note,
    Presence,
    Release,
    ReplicaRow,
    Suspended,
    TeamJob,
)
from gateway.hub.replicas.store.usage import settle_rows
from gateway.hub.store.postgres_ops import BEGIN, COMMIT, Op, Query
from gateway.hub.store.records import (
    StoredJob,
    StoredSession,
    job_of,
    job_values,
    utc_now,
)
from gateway.hub.store.replica_schema import ADMIT_CALLS, MONTH, NOW

NOTIFY_CHANNEL = "alp_hub"
_JOB_COLUMNS = (
    "id, owner, project, needs, agent_definition, origin, run_id, claimed_by,"
    " runner_name, status, conclusion, final_reported, cancelled, cancel_reason,"
    " offered_to, replica"
)


def payload(kind: str, replica: str, *subject: str) -> str:
    """A notification's text (JSON: kind, replica, subject...)."""
    return json.dumps([kind, replica, *subject], separators=(",", ":"))


def note_of(text: str) -> Note | None:
    """A notification's text read back; None when it is not one of ours."""
    try:
        found = json.loads(text)
    except ValueError:
        return None
    if not isinstance(found, list) or len(found) < 2 or not all(isinstance(x, str) for x in found):
        return None
    return Note(found[0], found[1], tuple(found[2:]))


def _notifying(sql: str, columns: str, n: int) -> str:
    """``sql`` (a data-modifying statement with RETURNING) whose rows are returned with a
    notification ($``n``) sent once a row is, none when no row is."""
    return (
        f"WITH changed AS ({sql}) SELECT {columns}, pg_notify('{NOTIFY_CHANNEL}', ${n}) IS NULL"
        " FROM changed"
    )


def notify(kind: str, replica: str, *subject: str) -> Query:
    return Query(
        f"SELECT pg_notify('{NOTIFY_CHANNEL}', $1) IS NULL", (payload(kind, replica, *subject),)
    )


def _team_job(row: tuple[Any, ...], reports: list[dict[str, Any]]) -> TeamJob:
    offered = None if row[14] is None else frozenset(json.loads(row[14]))
    return TeamJob(job_of(row[:14], reports), offered, row[15])


# -- replicas -------------------------------------------------------------------------------


def heartbeat(replica: str, url: str, version: str) -> Op[None]:
    yield Query(
        "INSERT INTO replicas (id, url, version, started_at, heartbeat_at, stopped)"
        f" VALUES ($1, $2, $3, {NOW}, {NOW}, false) ON CONFLICT (id) DO UPDATE SET"
        " url = excluded.url, version = excluded.version, heartbeat_at = excluded.heartbeat_at,"
        " stopped = false, started_at = CASE WHEN replicas.stopped THEN excluded.started_at"
        " ELSE replicas.started_at END",
        (replica, url, version),
    )


def started(replica: str) -> Op[None]:
    """Tell the others this replica (re)started."""
    yield notify(REPLICA, replica)


def replicas() -> Op[list[ReplicaRow]]:
    rows = yield Query(
        f"SELECT id, url, version, {NOW} - started_at, {NOW} - heartbeat_at, stopped"
        " FROM replicas ORDER BY started_at, id"
    )
    return [ReplicaRow(*row) for row in rows]


def retire(me: str, replica: str, older_than: float | None) -> Op[bool]:
    """Mark ``replica`` stopped (when silent ``older_than`` s, unless it is this one), then end
    its channels, its turns in flight and its suspended requests."""
    yield BEGIN
    if older_than is None:
        rows = yield Query(
            "UPDATE replicas SET stopped = true WHERE id = $1 RETURNING id", (replica,)
        )
    else:
        rows = yield Query(
            "UPDATE replicas SET stopped = true WHERE id = $1 AND NOT stopped"
            f" AND heartbeat_at < {NOW} - $2 RETURNING id",
            (replica, older_than),
        )
    if not rows:
        yield COMMIT
        return False
    gone = yield Query("DELETE FROM channels WHERE replica = $1 RETURNING job_id", (replica,))
    yield from settle_rows(replica)  # its turns' rows, cut, with what was known
    yield Query(
        f"UPDATE team_turns SET ended_at = {NOW}, tokens = COALESCE(tokens, 0)"
        " WHERE replica = $1 AND ended_at IS NULL",
        (replica,),
    )
    yield Query("DELETE FROM suspended_requests WHERE replica = $1", (replica,))
    for (job_id,) in gone:
        yield notify(CHANNEL, me, job_id)
    yield notify(REPLICA, me, replica)
    yield COMMIT
    return True


# -- jobs -----------------------------------------------------------------------------------


def save_job(replica: str, job: StoredJob, offered_to: frozenset[str] | None) -> Op[None]:
    offered = None if offered_to is None else json.dumps(sorted(offered_to))
    yield Query(
        _notifying(
            "INSERT INTO jobs (id, run_id, owner, project, needs, agent_definition, origin,"
            " claimed_by, runner_name, status, conclusion, final_reported, cancelled,"
            " cancel_reason, created_at, updated_at, replica, offered_to)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $15,"
            " $16, $17) ON CONFLICT (id) DO UPDATE SET"
            # merged: what another replica wrote first (a claim, an end) is never undone
            " run_id = COALESCE(jobs.run_id, excluded.run_id),"
            " claimed_by = COALESCE(jobs.claimed_by, excluded.claimed_by),"
            " runner_name = COALESCE(jobs.runner_name, excluded.runner_name),"
            " status = CASE WHEN jobs.status = 'completed' OR excluded.status = 'queued'"
            " THEN jobs.status ELSE excluded.status END,"
            " conclusion = COALESCE(jobs.conclusion, excluded.conclusion),"
            " final_reported = GREATEST(jobs.final_reported, excluded.final_reported),"
            " cancelled = GREATEST(jobs.cancelled, excluded.cancelled),"
            " cancel_reason = COALESCE(jobs.cancel_reason, excluded.cancel_reason),"
            " offered_to = CASE WHEN jobs.claimed_by IS NULL THEN excluded.offered_to"
            " ELSE jobs.offered_to END, updated_at = excluded.updated_at RETURNING id",
            "id",
            18,
        ),
        (
            *job_values(job),
            utc_now(),
            replica,
            offered,
            payload(JOB, replica, job.id),
        ),
    )


def claim_job(
    replica: str, job_id: str, runner_id: str, name: str, run_id: str
) -> Op[TeamJob | None]:
    rows = yield Query(
        _notifying(
            "UPDATE jobs SET claimed_by = $2, runner_name = $3, run_id = $4, updated_at = $5"
            " WHERE id = $1 AND claimed_by IS NULL AND status = 'queued' AND cancelled = 0"
            f" RETURNING {_JOB_COLUMNS}",
            _JOB_COLUMNS,
            6,
        ),
        (job_id, runner_id, name, run_id, utc_now(), payload(JOB, replica, job_id)),
    )
    if not rows:
        return None
    return (yield from load_job(job_id))


def complete_job(replica: str, job_id: str, conclusion: str, final_reported: bool) -> Op[bool]:
    rows = yield Query(
        _notifying(
            "UPDATE jobs SET status = 'completed', conclusion = $2, final_reported = $3,"
            " updated_at = $4 WHERE id = $1 AND status <> 'completed' RETURNING id",
            "id",
            5,
        ),
        (job_id, conclusion, int(final_reported), utc_now(), payload(JOB, replica, job_id)),
    )
    return bool(rows)


def withdraw_job(replica: str, job_id: str, reason: str) -> Op[str | None]:
    yield BEGIN
    rows = yield Query(
        "UPDATE jobs SET cancelled = 1, cancel_reason = COALESCE(cancel_reason, $2),"
        " updated_at = $3 WHERE id = $1 AND status <> 'completed' RETURNING claimed_by",
        (job_id, reason, utc_now()),
    )
    if not rows:
        yield COMMIT
        return None
    outcome = "claimed"
    if rows[0][0] is None:
        yield Query(
            "WITH gone_reports AS (DELETE FROM job_reports WHERE job_id = $1),"
            " gone_sessions AS (DELETE FROM sessions WHERE job_id = $1)"
            " DELETE FROM jobs WHERE id = $1",
            (job_id,),
        )
        outcome = "deleted"
    yield notify(JOB, replica, job_id)
    yield COMMIT
    return outcome


def load_job(job_id: str) -> Op[TeamJob | None]:
    rows = yield Query(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = $1", (job_id,))
    if not rows:
        return None
    bodies = yield Query("SELECT body FROM job_reports WHERE job_id = $1 ORDER BY seq", (job_id,))
    return _team_job(rows[0], [json.loads(body) for (body,) in bodies])


def load_jobs() -> Op[list[TeamJob]]:
    reports: dict[str, list[dict[str, Any]]] = {}
    for job_id, body in (
        yield Query(
            "SELECT job_id, body FROM job_reports WHERE job_id IN"
            " (SELECT id FROM jobs WHERE status <> 'completed') ORDER BY job_id, seq"
        )
    ):
        reports.setdefault(job_id, []).append(json.loads(body))
    rows = yield Query(
        f"SELECT {_JOB_COLUMNS} FROM jobs WHERE status <> 'completed' ORDER BY created_at, seq"
    )
    return [_team_job(r, reports.get(r[0], [])) for r in rows]


def orphan_jobs(replica: str) -> Op[list[str]]:
    """The live front-door jobs ``replica`` made that no session points at (its turns that
    waited for them are gone with it)."""
    rows = yield Query(
        "SELECT id FROM jobs j WHERE j.replica = $1 AND j.status <> 'completed'"
        " AND j.cancelled = 0 AND j.origin IN ('frontdoor', 'listing')"
        " AND NOT EXISTS (SELECT 1 FROM sessions s WHERE s.job_id = j.id)",
        (replica,),
    )
    return [row[0] for row in rows]


# -- channels -------------------------------------------------------------------------------


def channel_opened(replica: str, job_id: str, runner_id: str) -> Op[None]:
    yield Query(
        _notifying(
            "INSERT INTO channels (job_id, replica, runner_id, opened_at)"
            f" VALUES ($1, $2, $3, {NOW}) ON CONFLICT (job_id) DO UPDATE SET"
            " replica = excluded.replica, runner_id = excluded.runner_id,"
            " opened_at = excluded.opened_at RETURNING job_id",
            "job_id",
            4,
        ),
        (job_id, replica, runner_id, payload(CHANNEL, replica, job_id)),
    )


def channel_closed(replica: str, job_id: str) -> Op[None]:
    yield Query(
        _notifying(
            "DELETE FROM channels WHERE job_id = $1 AND replica = $2 RETURNING job_id",
            "job_id",
            3,
        ),
        (job_id, replica, payload(CHANNEL, replica, job_id)),
    )


def channels() -> Op[list[ChannelRow]]:
    rows = yield Query("SELECT job_id, replica, runner_id FROM channels")
    return [ChannelRow(*row) for row in rows]


def channel(job_id: str) -> Op[ChannelRow | None]:
    rows = yield Query(
        "SELECT job_id, replica, runner_id FROM channels WHERE job_id = $1", (job_id,)
    )
    return ChannelRow(*rows[0]) if rows else None


# -- runners' presence ----------------------------------------------------------------------

_PRESENCE_TYPES = "text text text text text float8 text float8 bool".split()


def write_presence(replica: str, seen: list[Presence], changed: bool) -> Op[None]:
    columns: list[list[Any]] = [[] for _ in _PRESENCE_TYPES]
    for p in seen:
        caps = None if p.capabilities is None else json.dumps(sorted(p.capabilities))
        row = (p.runner_id, p.owner, p.project, p.name, json.dumps(list(p.labels)), p.seen_age)
        for column, value in zip(columns, (*row, caps, p.polled_age, p.stopped), strict=True):
            column.append(value)
    arrays = ", ".join(f"${n}::{kind}[]" for n, kind in enumerate(_PRESENCE_TYPES, 1))
    yield Query(
        "INSERT INTO runner_presence (runner_id, owner, project, name, labels, seen_at,"
        f" capabilities, polled_at, stopped) SELECT r.id, r.owner, r.project, r.name, r.labels,"
        f" {NOW} - r.seen, r.caps, {NOW} - r.polled, r.stopped FROM unnest({arrays})"
        " AS r(id, owner, project, name, labels, seen, caps, polled, stopped)"
        " ON CONFLICT (runner_id) DO UPDATE SET owner = excluded.owner,"
        " project = excluded.project, name = COALESCE(excluded.name, runner_presence.name),"
        " labels = excluded.labels,"
        " seen_at = GREATEST(runner_presence.seen_at, excluded.seen_at),"
        " capabilities = CASE WHEN excluded.polled_at IS NOT NULL AND"
        " (runner_presence.polled_at IS NULL OR excluded.polled_at >= runner_presence.polled_at)"
        " THEN excluded.capabilities ELSE runner_presence.capabilities END,"
        " stopped = CASE WHEN excluded.polled_at IS NOT NULL AND"
        " (runner_presence.polled_at IS NULL OR excluded.polled_at >= runner_presence.polled_at)"
        " THEN excluded.stopped ELSE runner_presence.stopped END,"
        " polled_at = GREATEST(runner_presence.polled_at, excluded.polled_at)",
        tuple(columns),
    )
    if changed:
        yield notify(PRESENCE, replica)


def read_presence(within: float) -> Op[list[Presence]]:
    rows = yield Query(
        "SELECT runner_id, owner, project, name, labels, now_ - seen_at, capabilities,"
        f" now_ - polled_at, stopped FROM runner_presence, (SELECT {NOW} AS now_) n"
        " WHERE seen_at > now_ - $1",
        (within,),
    )
    return [
        Presence(
            r[0],
            r[1],
            r[2],
            r[3],
            tuple(json.loads(r[4])),
            max(0.0, r[5]),
            None if r[6] is None else frozenset(json.loads(r[6])),
            None if r[7] is None else max(0.0, r[7]),
            bool(r[8]),
        )
        for r in rows
    ]


def models_changed(replica: str, runner_id: str) -> Op[None]:
    yield notify(MODELS, replica, runner_id)


# -- sessions -------------------------------------------------------------------------------


def bind_session(replica: str, session: StoredSession, expected: str | None) -> Op[str | None]:
    key = (session.key_name, session.session_id)
    note = payload(SESSION, replica, *key)
    if not session.job_id:  # unbind: only while it points at ``expected``
        yield Query(
            _notifying(
                "DELETE FROM sessions WHERE key_name = $1 AND session_id = $2"
                " AND job_id IS NOT DISTINCT FROM $3 RETURNING key_name",
                "key_name",
                4,
            ),
            (*key, expected, note),
        )
        rows = yield Query(
            "SELECT job_id FROM sessions WHERE key_name = $1 AND session_id = $2", key
        )
        return rows[0][0] if rows else None
    values = (*key, session.owner, session.project, session.job_id, session.key_id)
    if expected is None:  # a new row, or one another replica removed meanwhile
        rows = yield Query(
            _notifying(
                "INSERT INTO sessions (key_name, session_id, owner, project, job_id, key_id,"
                f" last_used) VALUES ($1, $2, $3, $4, $5, $6, {NOW})"
                " ON CONFLICT (key_name, session_id) DO UPDATE SET owner = excluded.owner,"
                " project = excluded.project, job_id = excluded.job_id,"
                " key_id = excluded.key_id, last_used = excluded.last_used"
                " WHERE sessions.key_id <> excluded.key_id RETURNING job_id",
                "job_id",
                7,
            ),
            (*values, note),
        )
    else:
        rows = yield Query(
            _notifying(
                "UPDATE sessions SET owner = $3, project = $4, job_id = $5, key_id = $6,"
                f" last_used = {NOW} WHERE key_name = $1 AND session_id = $2 AND job_id = $7"
                " RETURNING job_id",
                "job_id",
                8,
            ),
            (*values, expected, note),
        )
    if rows:
        return session.job_id
    rows = yield Query("SELECT job_id FROM sessions WHERE key_name = $1 AND session_id = $2", key)
    if rows or expected is None:
        return rows[0][0] if rows else None
    # its row went meanwhile (ended on another replica): a new one
    return (yield from bind_session(replica, session, None))


def load_session(key_name: str, session_id: str) -> Op[StoredSession | None]:
    rows = yield Query(
        "SELECT key_name, session_id, owner, project, job_id, key_id FROM sessions"
        " WHERE key_name = $1 AND session_id = $2",
        (key_name, session_id),
    )
    return StoredSession(*rows[0]) if rows else None


_SESSION_COLUMNS = "key_name, session_id, owner, project, job_id, key_id"


def idle_sessions(replica: str, idle: float) -> Op[list[StoredSession]]:
    rows = yield Query(
        _notifying(
            f"DELETE FROM sessions s WHERE last_used < {NOW} - $1 AND NOT EXISTS"
            " (SELECT 1 FROM team_turns t WHERE t.key_id = s.key_id AND t.session ="
            f" s.session_id AND t.ended_at IS NULL) RETURNING {_SESSION_COLUMNS}",
            _SESSION_COLUMNS,
            2,
        ),
        (idle, payload(SESSION, replica)),
    )
    return [StoredSession(*row[:6]) for row in rows]


def revoked_sessions(replica: str, active: set[str]) -> Op[list[StoredSession]]:
    rows = yield Query(
        _notifying(
            "DELETE FROM sessions WHERE key_id <> '' AND NOT (key_id = ANY($1::text[]))"
            f" RETURNING {_SESSION_COLUMNS}",
            _SESSION_COLUMNS,
            2,
        ),
        (sorted(active), payload(SESSION, replica)),
    )
    return [StoredSession(*row[:6]) for row in rows]


def sessions_listing() -> Op[list[dict[str, Any]]]:
    rows = yield Query(
        "SELECT s.key_name, s.session_id, s.job_id, j.claimed_by,"
        f" CASE WHEN s.last_used > 0 THEN {NOW} - s.last_used END,"
        " (SELECT COUNT(*) FROM team_turns t WHERE t.key_id = s.key_id AND"
        " t.session = s.session_id AND t.ended_at IS NULL)"
        ' FROM sessions s LEFT JOIN jobs j ON j.id = s.job_id ORDER BY s.key_name COLLATE "C",'
        ' s.session_id COLLATE "C"'
    )
    return [
        {
            "key": r[0],
            "session": r[1],
            "job_id": r[2],
            "runner_id": r[3],
            "idle_seconds": None if r[4] is None else round(max(0.0, r[4]), 1),
            "turns": int(r[5]),
        }
        for r in rows
    ]


# -- admissions -----------------------------------------------------------------------------


def admit(
    replica: str,
    turn_id: str,
    key_id: str,
    key_name: str,
    session: str,
    reserved: int,
    limits: tuple[int | None, int | None, int | None, int | None],
    max_sessions: int,
    expiry: float,
    record: str | None = None,
    budget: tuple[float, float | None, float | None] | None = None,
) -> Op[Admission]:
    """``record``: the turn's usage row were it cut now (JSON), kept with it until it is
    settled (``settle``), by this replica or, when it is dead, by a survivor (``retire``);
    ``budget``: the turn's reserved cost and the key's daily and monthly budgets, checked first
    in the same transaction. One statement, one round trip, whichever of them is given."""
    params: tuple[Any, ...] = (
        turn_id,
        key_id,
        key_name,
        session,
        replica,
        reserved,
        *limits,
        max_sessions,
        expiry,
    )
    if budget is not None:
        params = (*params, *budget)
    if record is not None:
        params = (record, *params)
    rows = yield Query(ADMIT_CALLS[(budget is not None, record is not None)], params)
    return Admission(*rows[0])


def release(ended: list[Release]) -> Op[None]:
    columns = (
        [r.turn_id for r in ended],
        [r.tokens for r in ended],
        [r.key_name for r in ended],
        [r.session for r in ended],
        [r.cost for r in ended],
    )
    # the day's tokens, and the day's and month's cost, added where the key counts that day
    # or month (else read again from the hourly totals at its next admission)
    yield Query(
        f"WITH n AS (SELECT {NOW} AS t),"
        " r AS (SELECT * FROM unnest($1::text[], $2::int8[], $3::text[], $4::text[],"
        " $5::float8[]) AS r(id, tokens, key_name, session, cost)),"
        " ended AS (UPDATE team_turns f SET ended_at = n.t, tokens = r.tokens, record = NULL"
        " FROM r, n"
        " WHERE f.id = r.id AND f.ended_at IS NULL RETURNING f.key_id, r.tokens, r.cost),"
        " days AS (UPDATE team_keys k SET day_tokens = k.day_tokens + CASE WHEN"
        " k.day = (floor(n.t / 86400) * 86400)::int8 THEN e.tokens ELSE 0 END,"
        " day_cost = k.day_cost + CASE WHEN"
        " k.cost_day = (floor(n.t / 86400) * 86400)::int8 THEN e.cost ELSE 0 END,"
        f" month_cost = k.month_cost + CASE WHEN k.cost_month = {MONTH.format(t='n.t')}"
        " THEN e.cost ELSE 0 END"
        " FROM (SELECT key_id, SUM(tokens) AS tokens, SUM(cost) AS cost FROM ended"
        " GROUP BY key_id) e, n WHERE k.key_id = e.key_id),"
        " used AS (UPDATE sessions s SET last_used = n.t FROM r, n"
        " WHERE s.key_name = r.key_name AND s.session_id = r.session)"
        " SELECT COUNT(*) FROM ended",
        columns,
    )


# -- requests suspended for a resume --------------------------------------------------------


def suspend(replica: str, job_id: str, request_id: str, frames: int) -> Op[None]:
    yield Query(
        "INSERT INTO suspended_requests (job_id, request_id, replica, frames, since)"
        f" VALUES ($1, $2, $3, $4, {NOW}) ON CONFLICT (job_id, request_id) DO UPDATE SET"
        " replica = excluded.replica, frames = excluded.frames, since = excluded.since",
        (job_id, request_id, replica, frames),
    )


def unsuspend(job_id: str, request_id: str) -> Op[None]:
    yield Query(
        "DELETE FROM suspended_requests WHERE job_id = $1 AND request_id = $2",
        (job_id, request_id),
    )


def suspended(job_id: str, within: float) -> Op[list[Suspended]]:
    rows = yield Query(
        "WITH taken AS (DELETE FROM suspended_requests WHERE job_id = $1"
        " RETURNING job_id, request_id, replica, frames, since)"
        f" SELECT job_id, request_id, replica, frames FROM taken WHERE since > {NOW} - $2",
        (job_id, within),
    )
    return [Suspended(*row) for row in rows]
