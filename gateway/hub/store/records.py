"""The hub store's records: runner registrations, API keys and their limits, jobs, sessions, model
lists and usage totals, as every backend reads and writes them. Pure: values only, no I/O."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.hub.money import Price

HOUR = 3600
DEFAULT_KEY_PROJECT = "local/chat"
# the outcomes counted as errors in the totals (``gateway.hub.turn.State``: failed, lost, refused,
# cut by the hub stopping)
ERROR_OUTCOMES = ("error", "lost", "refused", "cut")
LIMIT_NAMES = ("rpm", "tpm", "tokens_per_day", "max_streams")


@dataclass(frozen=True, slots=True)
class Registration:
    """A runner's registration as the hub keeps it (the token itself never, only its hash)."""

    id: str
    name: str
    owner: str
    project: str
    labels: tuple[str, ...]
    registered_at: str
    token_hash: str


@dataclass(frozen=True, slots=True)
class Enrollment:
    """A project's enrollment token as the hub keeps it (its hash only): it registers runners
    in that project, until it expires (Unix time), is used up or is revoked."""

    id: str
    owner: str
    project: str
    created_at: str
    expires_at: float | None  # None: never
    uses_left: int | None  # registrations it may still make (None: any number)
    used: int
    revoked: bool

    def refusal(self, now: float) -> str | None:
        """Why it registers no runner now (revoked, expired, used up), or None."""
        if self.revoked:
            return "this enrollment token was revoked"
        if self.expires_at is not None and now >= self.expires_at:
            return "this enrollment token has expired"
        if self.uses_left is not None and self.uses_left <= 0:
            return "this enrollment token is used up"
        return None

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "project": f"{self.owner}/{self.project}",
            "createdAt": self.created_at,
            "expiresAt": self.expires_at,
            "usesLeft": self.uses_left,
            "used": self.used,
            "revoked": self.revoked,
        }


@dataclass(frozen=True, slots=True)
class RunnerRecord:
    """A runner's registration as ``hub runners list`` shows it: revoked or not, last seen
    (Unix time, as a hub last wrote it), its models, its live sessions."""

    id: str
    name: str
    owner: str
    project: str
    registered_at: str
    revoked_at: str | None
    last_seen: float | None
    models: tuple[str, ...] | None
    sessions: int


@dataclass(frozen=True, slots=True)
class ApiKey:
    """An active front-door API key: who may chat, and in which project."""

    name: str
    owner: str
    project: str
    id: str = ""  # ``key_id_of`` its hash: what its chat sessions are keyed by


@dataclass(frozen=True)
class KeyLimits:
    """An API key's limits (None: none): requests and tokens a minute, tokens a day (UTC),
    turns in flight at once."""

    rpm: int | None = None
    tpm: int | None = None
    tokens_per_day: int | None = None
    max_streams: int | None = None

    def describe(self) -> str:
        """``rpm=3 tpm=1000 tokens/day=50000 streams=2`` (only the limits set), or ``-``."""
        parts = [
            f"{label}={value}"
            for label, value in (
                ("rpm", self.rpm),
                ("tpm", self.tpm),
                ("tokens/day", self.tokens_per_day),
                ("streams", self.max_streams),
            )
            if value is not None
        ]
        return " ".join(parts) or "-"

    def as_json(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in LIMIT_NAMES}

    def values(self) -> tuple[int | None, ...]:
        """The limits in ``LIMIT_NAMES`` order (0 or None: no limit, None)."""
        return tuple(getattr(self, name) or None for name in LIMIT_NAMES)


def limits_of(
    rpm: int | None = None,
    tpm: int | None = None,
    tokens_per_day: int | None = None,
    max_streams: int | None = None,
) -> KeyLimits:
    """KeyLimits from given values, 0 (or None) meaning no limit; ValueError on a negative or
    non-integer value."""
    values: dict[str, int | None] = {}
    for name, value in zip(LIMIT_NAMES, (rpm, tpm, tokens_per_day, max_streams), strict=True):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise ValueError(f"the limit {name} must be a whole number, 0 for none, not {value!r}")
        values[name] = value or None
    return KeyLimits(**values)


@dataclass(frozen=True)
class HourlyUsage:
    """One key's use in one hour (UTC, the hour's start as a Unix time)."""

    hour: int
    key_name: str
    model: str | None
    turns: int
    prompt_tokens: int
    completion_tokens: int
    errors: int = 0  # turns that ended in error, lost or refused (by the hub, not its limits)
    estimated: int = 0  # turns whose tokens are the hub's estimate (ended before the backend said)
    cost: float = 0.0  # in the hub's currency, at the prices in force as each turn ended
    ref_cost: float = 0.0  # the same tokens at the reference prices
    unpriced: int = 0  # turns whose model had no price (they cost 0)


class UsageRecord(msgspec.Struct, frozen=True):
    """One ended front-door turn as the usage ledger keeps it (a row; its key's hourly totals).

    ``model`` is the ledger's name of the model (``""``: the runner's default); ``estimated``:
    the tokens are the hub's estimate (the turn ended before the backend said its usage);
    ``continued``: another runner or backend finished the answer after a fault (the tokens are
    both parts', the continuation's prompt counted).

    A frozen ``msgspec.Struct``, not a frozen dataclass: every turn builds two (its journal's
    start and end lines), and a frozen dataclass's ``__init__`` sets each of its 17 fields
    through ``object.__setattr__`` (some 16× the Struct's, ~4.7 against 0.29 µs); JSON of it is
    the same object, field for field (``msgspec.structs.replace`` for a changed copy)."""

    key_id: str
    key_name: str
    session: str
    api: str
    model: str
    stream: bool
    outcome: str
    runner_id: str | None = None
    job_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft: float | None = None
    duration: float | None = None
    estimated: bool = False
    continued: bool = False
    cost: float | None = None  # at the model's price as the turn ended (None: it had none)
    ref_cost: float | None = None  # the same tokens at the reference price (None: none named)


@dataclass(frozen=True, slots=True)
class UsageTotal:
    """One key's use of one model over a span: turns, tokens, errors (``model`` "" when the
    runner's default served)."""

    key_name: str
    model: str
    turns: int
    prompt_tokens: int
    completion_tokens: int
    errors: int
    estimated: int = 0  # turns whose tokens are the hub's estimate
    cost: float = 0.0  # in the hub's currency, at the prices in force as each turn ended
    ref_cost: float = 0.0  # the same tokens at the reference prices
    unpriced: int = 0  # turns whose model had no price (they cost 0)


@dataclass(slots=True)
class StoredJob:
    """A Chat Job as the database keeps it (``reports``: every status report received, in order)."""

    id: str
    owner: str
    project: str
    needs: list[str]
    agent_definition: dict[str, Any]
    origin: str = "api"  # "api" (enqueue_job) or "frontdoor" (a /v1 chat session)
    run_id: str | None = None
    claimed_by: str | None = None
    runner_name: str | None = None
    status: str = "queued"
    conclusion: str | None = None
    final_reported: bool = False  # a runner's "completed" report was accepted
    cancelled: bool = False
    cancel_reason: str | None = None
    reports: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ModelList:
    """The last ``chat.models.response`` a runner gave, and when (Unix time)."""

    runner_id: str
    owner: str
    project: str
    models: tuple[str, ...]
    answered_at: float


@dataclass(frozen=True, slots=True)
class AdminCredential:
    """The hub's admin credential: its hash (what a bearer is checked against), the token
    itself where this hub knows it (None: another replica made it and keeps it), and whether
    it was made now (then it is shown once)."""

    token: str | None
    hash: str
    created: bool = False


@dataclass(frozen=True, slots=True)
class StoredSession:
    """A front-door chat session: (API key, X-Chat-Session) -> its Chat Job. ``key_id``: the
    key's id (empty in rows stored before keys had one: then the key is found by name)."""

    key_name: str
    session_id: str
    owner: str
    project: str
    job_id: str
    key_id: str = ""


def job_values(job: StoredJob) -> tuple[Any, ...]:
    """A job's columns as every backend writes them: id, run_id, owner, project, needs (JSON),
    agent_definition (JSON), origin, claimed_by, runner_name, status, conclusion, final_reported,
    cancelled, cancel_reason."""
    return (
        job.id,
        job.run_id,
        job.owner,
        job.project,
        json.dumps(job.needs),
        json.dumps(job.agent_definition),
        job.origin,
        job.claimed_by,
        job.runner_name,
        job.status,
        job.conclusion,
        int(job.final_reported),
        int(job.cancelled),
        job.cancel_reason,
    )


def job_of(row: tuple[Any, ...], reports: list[dict[str, Any]]) -> StoredJob:
    """A job from its row as every backend reads it: id, owner, project, needs (JSON),
    agent_definition (JSON), origin, run_id, claimed_by, runner_name, status, conclusion,
    final_reported, cancelled, cancel_reason."""
    return StoredJob(
        id=row[0],
        owner=row[1],
        project=row[2],
        needs=json.loads(row[3]),
        agent_definition=json.loads(row[4]),
        origin=row[5],
        run_id=row[6],
        claimed_by=row[7],
        runner_name=row[8],
        status=row[9],
        conclusion=row[10],
        final_reported=bool(row[11]),
        cancelled=bool(row[12]),
        cancel_reason=row[13],
        reports=reports,
    )


def registration_of(row: tuple[Any, ...]) -> Registration:
    """A registration from its row: id, name, owner, project, labels (JSON), registered_at,
    token_hash."""
    labels = tuple(json.loads(row[4]))
    return Registration(row[0], row[1], row[2], row[3], labels, row[5], row[6])


def enrollment_of(row: tuple[Any, ...]) -> Enrollment:
    """An enrollment token from its row: id, owner, project, created_at, expires_at, uses_left,
    used, revoked."""
    return Enrollment(row[0], row[1], row[2], row[3], row[4], row[5], row[6], bool(row[7]))


def hour_of(at: float) -> int:
    """The start of the UTC hour ``at`` (a Unix time) falls in; 0 for a time not after 0."""
    return int(at) // HOUR * HOUR if at > 0 else 0


def utc_now() -> str:
    """The current time as an ISO 8601 UTC string (``...Z``), as the store's rows keep it."""
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    return now.isoformat().replace("+00:00", "Z")


Hourly = dict[tuple[int, str, str], list[Any]]  # (hour, key id, model) -> [name, counts...]


def hourly_totals(rows: Iterable[tuple[UsageRecord, float]]) -> Hourly:
    """Ended turns summed per hour, key id and model: the key's latest name, then the turns,
    prompt tokens, completion tokens, errors, estimated turns, cost, reference cost and unpriced
    turns (what a batch adds to the hourly totals)."""
    hourly: Hourly = {}
    for record, at in rows:
        group = (int(at) // HOUR * HOUR, record.key_id, record.model)
        totals = hourly.get(group)
        if totals is None:
            totals = hourly[group] = [record.key_name, 0, 0, 0, 0, 0, 0.0, 0.0, 0]
        totals[0] = record.key_name  # the latest name of the key
        totals[1] += 1
        totals[2] += record.prompt_tokens or 0
        totals[3] += record.completion_tokens or 0
        totals[4] += int(record.outcome in ERROR_OUTCOMES)
        totals[5] += int(record.estimated)
        totals[6] += record.cost or 0.0
        totals[7] += record.ref_cost or 0.0
        totals[8] += int(record.cost is None)
    return hourly


def price_values(price: Price) -> tuple[Any, ...]:
    """A price's columns as every backend writes them: model, input, output, reference,
    ref_input, ref_output, watts, kwh_price."""
    return (
        price.model,
        price.input,
        price.output,
        price.reference,
        price.ref_input,
        price.ref_output,
        price.watts,
        price.kwh_price,
    )


def rates(prompt: float, prefill: float, completion: float, decode: float) -> tuple[float, float]:
    """Tokens a second of prefill and of decoding from the ledger's sums (prompt tokens and
    the seconds to their first token; completion tokens and the seconds after it): 0 where
    nothing was measured."""
    return (
        float(prompt) / float(prefill) if prefill else 0.0,
        float(completion) / float(decode) if decode else 0.0,
    )
