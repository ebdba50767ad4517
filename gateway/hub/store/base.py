"""The hub's store as one async interface (``Store``), whatever database is behind it, and the
write-behind batch of per-turn usage rows every backend shares.

Nothing outside ``gateway.hub.store`` knows the database: callers ``await`` these methods and
catch ``StoreError`` (``StoreUnavailable`` when the database cannot be used right now). An ended
turn's row is queued (``queue_usage``, no I/O) and written by the store's writer task (``run``)
with the rows queued beside it, in one transaction, ``batch_interval`` s after the first of them
or as soon as ``batch_rows`` wait, and at stop; every read of usage writes what is queued first,
so a reader in the same process sees every turn that ended. A crash loses at most the rows of
that window. Pruning rides on those writes: after a batch, rows older than ``usage_retention``
(relative to the newest row written) are deleted, at most ``PRUNE_BATCH`` at a time.

A database that cannot be used (``StoreUnavailable``) is said once, in one log line, when it
goes, and once when it is back (``_unavailable``, ``_available``), however many requests fail
meanwhile; the rows of a batch it refused stay queued (up to ``KEEP_ROWS``) for when it is back."""

from __future__ import annotations

import abc
import logging
import math
import pathlib
import time
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from gateway.config import STORE_POOL
from gateway.hub.money import KeyBudget, Price
from gateway.hub.store.journal import Journal
from gateway.hub.store.records import (
    DEFAULT_KEY_PROJECT,
    AdminCredential,
    ApiKey,
    Enrollment,
    HourlyUsage,
    KeyLimits,
    ModelList,
    Registration,
    RunnerRecord,
    StoredJob,
    StoredSession,
    UsageRecord,
    UsageTotal,
)

if TYPE_CHECKING:
    from gateway.hub.store.postgres_ops import Op

T = TypeVar("T")

log = logging.getLogger("gateway.hub.store")

BATCH_INTERVAL = 0.1  # s: a queued usage row is written at most this long after its turn ended
BATCH_ROWS = 256  # ...or as soon as this many rows wait
PRUNE_BATCH = 500  # per-turn rows deleted at most per prune (bounded work at write time)
PRUNE_EVERY = 60.0  # s (of the rows' time) between prunes once nothing old is left
POOL_SIZE = STORE_POOL  # connections to a database server at most, unless told (store_pool)
KEEP_ROWS = 65536  # usage rows kept queued while the database is unavailable; older ones go

UsageRow = tuple[UsageRecord, float]  # an ended turn and when it ended (Unix time)


class StoreError(Exception):
    """The store refused or failed an operation; the message is one line that says why."""


class StoreMissing(StoreError):
    """There is no hub store where one was to be opened (and it was not to be made)."""


class StoreUnavailable(StoreError):
    """The database cannot be used right now (locked, unreachable, out of space): try later."""


class Store(abc.ABC):
    """The hub's store: registrations, API keys (and their limits), jobs and reports, sessions,
    model lists, usage (a row per front-door turn, kept ``usage_retention`` s; hourly totals
    per key and model, kept for good). A backend implements the abstract methods."""

    where: str = "(memory)"  # the database, for messages (a path; never a credential)

    def __init__(
        self,
        *,
        usage_retention: float = math.inf,
        batch_interval: float = BATCH_INTERVAL,
        batch_rows: int = BATCH_ROWS,
    ) -> None:
        self.usage_retention = usage_retention
        self.batch_interval = batch_interval
        self.batch_rows = batch_rows
        self._pending: list[UsageRow] = []
        self._queued = trio.Event()  # a row waits
        self._full = trio.Event()  # ``batch_rows`` rows wait
        self._next_prune = -math.inf  # of the rows' time
        self._closed = False
        self.rows_written = 0  # usage rows written since opened
        self._down_since: float | None = None  # time.monotonic() when it became unavailable
        self.journal: Journal | None = None  # every turn's start and end, till its row is in
        self._dropped = 0  # usage rows dropped (past KEEP_ROWS) while unavailable

    # -- the database's availability, said once each way ----------------------------------

    @property
    def available(self) -> bool:
        """False from a failure that says the database cannot be used until a call succeeds."""
        return self._down_since is None

    def _unavailable(self, detail: str) -> StoreUnavailable:
        """The error of a call the database could not serve now; the first since it was last
        available is logged (one line), the others are not."""
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning(
                "the hub store %s is unavailable: %s; what needs it is answered 503 "
                "store_unavailable until it is back",
                self.where,
                detail,
            )
        return StoreUnavailable(f"the hub store {self.where}: {detail}")

    def _available(self, started: float | None = None) -> None:
        """A call succeeded: if the database was unavailable, say (once) that it is back. A
        call ``started`` (``time.monotonic()``) before the database was found unavailable says
        nothing: it may have finished on a connection the server was still ending."""
        if self._down_since is not None and (started is None or started >= self._down_since):
            out = time.monotonic() - self._down_since
            self._down_since = None
            log.info("the hub store %s is back after %.1f s", self.where, out)

    # -- the write-behind batch of usage rows ----------------------------------------------

    def queue_usage(self, record: UsageRecord, at: float) -> None:
        """An ended turn (``at``: when, Unix time), written by the writer with the next batch:
        its row, and its key's hourly totals. No I/O: this is what the turn's path calls."""
        self._pending.append((record, at))
        if len(self._pending) == 1:
            self._queued.set()
        if len(self._pending) >= self.batch_rows:
            self._full.set()

    async def add_usage(self, record: UsageRecord, at: float) -> None:
        """An ended turn written now (with any queued before it); StoreError when it cannot be."""
        self._pending.append((record, at))
        rows, self._pending = self._pending, []
        await self._write_batch(rows, self._seal())

    def _seal(self) -> int | None:
        """The journal's segment sealed as a batch is taken (None: no journal)."""
        return self.journal.seal() if self.journal is not None else None

    async def recover_journal(self, journal: Journal) -> int:
        """Take on ``journal``: the rows it holds that the ledger lacks (turns that ended, or
        were cut, while the hub was killed) written now; how many."""
        committed = await self.journal_mark(journal.id)
        rows, last = journal.recover(committed)
        self.journal = journal
        if rows:
            await self._write_batch(rows, last)
        journal.committed(last)  # and any a kill left after their rows were written
        return len(rows)

    async def flush_usage(self) -> None:
        """Write the queued rows now, in one transaction (then prune when due). A database that
        is unavailable keeps them queued for the next try (the oldest beyond ``KEEP_ROWS``
        dropped, said once); one that refuses them, or a closed store, costs those rows, with
        one warning line: serving goes on."""
        await self._flush()

    async def _flush(self) -> bool:
        """``flush_usage``; False when the rows stay queued for a later try."""
        if not self._pending:
            return True
        rows, self._pending = self._pending, []
        sealed = self._seal()
        try:
            await self._write_batch(rows, sealed)
        except StoreUnavailable as exc:
            if self._closed:
                log.warning("could not record the usage of %d turn(s): %s", len(rows), exc)
                return True
            self._pending[:0] = rows  # before what was queued meanwhile
            excess = len(self._pending) - KEEP_ROWS
            if excess > 0:
                del self._pending[:excess]
                if not self._dropped:
                    log.warning(
                        "the hub store %s is still unavailable: usage rows beyond the %d kept "
                        "are dropped, the oldest first",
                        self.where,
                        KEEP_ROWS,
                    )
                self._dropped += excess
            return False
        except StoreError as exc:
            log.warning("could not record the usage of %d turn(s): %s", len(rows), exc)
            return True
        if self._dropped:
            log.warning(
                "%d usage row(s) were dropped while the hub store was unavailable", self._dropped
            )
            self._dropped = 0
        return True

    async def _write_batch(self, rows: list[UsageRow], sealed: int | None) -> None:
        journal = self.journal
        mark = (journal.id, sealed) if journal is not None and sealed is not None else None
        await self._write_usage(rows, mark)
        if journal is not None and sealed is not None:
            journal.committed(sealed)
        self.rows_written += len(rows)
        newest = max(at for _record, at in rows)
        if not math.isfinite(self.usage_retention) or newest < self._next_prune:
            return
        try:
            deleted = await self.prune_usage(newest - self.usage_retention, PRUNE_BATCH)
        except StoreError as exc:  # the rows are written: pruning is tried again next time
            log.warning("could not prune the usage rows older than the retention: %s", exc)
            return
        self._next_prune = newest if deleted >= PRUNE_BATCH else newest + PRUNE_EVERY

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer, until cancelled: a batch ``batch_interval`` s after its first row was
        queued (sooner when ``batch_rows`` wait); at stop, what is left."""
        task_status.started()
        try:
            while True:
                # only the writer renews its events, each right before it looks (no lost wake-up)
                self._queued = trio.Event()
                if not self._pending:
                    await self._queued.wait()
                self._full = trio.Event()
                if len(self._pending) < self.batch_rows:
                    with trio.move_on_after(self.batch_interval):
                        await self._full.wait()
                if not await self._flush():  # kept for when the database is back
                    await trio.sleep(self.batch_interval)
        finally:
            with trio.CancelScope(shield=True):
                await self.flush_usage()

    async def close(self) -> None:
        """Write what is queued, then let the database go (idempotent)."""
        await self.flush_usage()
        self._closed = True
        if self.journal is not None:
            self.journal.close()
        if self._pending:  # the database is unavailable: they cannot be written
            log.warning(
                "could not record the usage of %d turn(s): the hub store %s is unavailable",
                len(self._pending),
                self.where,
            )
            self._pending = []
        await self._close()

    # -- what a backend implements -----------------------------------------------------------

    @abc.abstractmethod
    async def _close(self) -> None: ...

    @abc.abstractmethod
    def admin_credential(self, data_dir: pathlib.Path | None) -> AdminCredential:
        """The hub's admin credential, made at its first start. Blocking, as opening is: called
        once, before serving. StoreError (one line) when the store cannot say it."""

    @abc.abstractmethod
    async def _write_usage(self, rows: list[UsageRow], mark: tuple[str, int] | None) -> None:
        """The rows and their keys' hourly totals, in one transaction (with ``mark``: a usage
        journal's name, and the number of the segment these rows complete)."""

    @abc.abstractmethod
    async def journal_mark(self, name: str) -> int:
        """The last segment of usage journal ``name`` whose rows are written (0: none)."""

    # jobs

    @abc.abstractmethod
    async def save_job(self, job: StoredJob) -> None:
        """Insert or update a job's row (its reports are kept apart: ``add_job_report``)."""

    @abc.abstractmethod
    async def delete_job(self, job_id: str) -> None:
        """Forget a job, its reports and the sessions on it (a queued job withdrawn)."""

    @abc.abstractmethod
    async def add_job_report(self, job_id: str, body: dict[str, Any]) -> None:
        """Append one status report received for ``job_id`` (accepted or not)."""

    @abc.abstractmethod
    async def load_jobs(self, *, live_only: bool = False) -> list[StoredJob]:
        """Every stored job with its reports, oldest first (``live_only``: not completed)."""

    @abc.abstractmethod
    async def load_job(self, job_id: str) -> StoredJob | None:
        """One stored job with its reports, or None."""

    @abc.abstractmethod
    async def job_ids(self) -> list[str]:
        """The id of every stored job, oldest first."""

    @abc.abstractmethod
    async def count_jobs(self) -> int:
        """How many jobs are stored."""

    # front-door sessions

    @abc.abstractmethod
    async def save_session(self, session: StoredSession) -> None:
        """Insert or replace the row of (key name, session id)."""

    @abc.abstractmethod
    async def delete_session(
        self, key_name: str, session_id: str, job_id: str | None = None
    ) -> None:
        """Forget a session's row (with ``job_id``: only while it still points at that job, so
        a revoked key's ending session does not take a new same-named key's row with it)."""

    @abc.abstractmethod
    async def load_sessions(self) -> list[StoredSession]:
        """Every stored session, by key name and session id."""

    # model lists

    @abc.abstractmethod
    async def save_models(self, models: ModelList) -> None:
        """Keep a runner's latest model list (replacing the one before)."""

    @abc.abstractmethod
    async def load_models(self, owner: str, project: str) -> list[ModelList]:
        """Every runner's last model list in ``owner/project``, newest first."""

    # registrations

    @abc.abstractmethod
    async def add_registration(
        self,
        owner: str,
        project: str,
        name: str,
        labels: list[str],
        enrollment: str | None = None,
    ) -> tuple[Registration, str]:
        """Register a runner (``enrollment``: the id of the enrollment token it came with);
        returns its registration and token (shown once, stored hashed)."""

    @abc.abstractmethod
    async def registration_by_token(self, token: str) -> Registration | None:
        """The registration whose token this is, unless revoked (constant-time comparison
        against every hash)."""

    @abc.abstractmethod
    async def registration(self, runner_id: str) -> Registration | None:
        """The registration of runner ``runner_id``, or None."""

    @abc.abstractmethod
    async def list_runners(self) -> list[RunnerRecord]:
        """Every registration (revoked ones too), oldest first, with its models and sessions."""

    @abc.abstractmethod
    async def revoke_runner(self, runner_id: str) -> bool:
        """Revoke runner ``runner_id``'s registration for good; False when it has none active."""

    @abc.abstractmethod
    async def revoked_runners(self) -> set[str]:
        """The ids of every revoked registration."""

    @abc.abstractmethod
    async def runners_seen(self, runner_ids: list[str], at: float) -> None:
        """Note that these runners were seen at ``at`` (Unix time), for ``list_runners``."""

    # enrollment tokens

    @abc.abstractmethod
    async def create_enrollment(
        self, project: str, expires_at: float | None, uses: int | None
    ) -> tuple[Enrollment, str]:
        """A new enrollment token for ``project`` ("owner/project"), valid until
        ``expires_at`` (Unix time) for ``uses`` registrations (None: no bound); returns it
        and the token (shown once, stored hashed). ValueError on a malformed project."""

    @abc.abstractmethod
    async def list_enrollments(self) -> list[Enrollment]:
        """Every enrollment token (revoked, expired, used up ones too), oldest first."""

    @abc.abstractmethod
    async def enrollment_by_token(self, token: str) -> Enrollment | None:
        """The enrollment token this is, in whatever state (constant-time comparison)."""

    @abc.abstractmethod
    async def use_enrollment(self, enrollment_id: str, now: float) -> bool:
        """Count one registration against the token, in one statement: False when it is
        revoked, expired (at ``now``, Unix time) or used up."""

    @abc.abstractmethod
    async def revoke_enrollment(self, enrollment_id: str) -> bool:
        """Revoke an enrollment token; False when there is no active one of that id."""

    # API keys

    @abc.abstractmethod
    async def create_api_key(
        self, name: str, project: str = DEFAULT_KEY_PROJECT, limits: KeyLimits | None = None
    ) -> str:
        """Create an API key for ``project`` ("owner/project") with ``limits`` (none by
        default); returns the key (shown once). ValueError when the name is empty, the project
        malformed, or an active key already has this name (a revoked name may be reused)."""

    @abc.abstractmethod
    async def list_api_keys(self) -> list[dict[str, object]]:
        """Every key (revoked ones too), oldest first, with its limits (a KeyLimits)."""

    @abc.abstractmethod
    async def key_limits(self, name: str) -> tuple[str, KeyLimits] | None:
        """The id and limits of the active key named ``name``, or None."""

    @abc.abstractmethod
    async def set_key_limits(self, name: str, limits: KeyLimits) -> bool:
        """Replace the limits of the active key named ``name``; False when there is none."""

    @abc.abstractmethod
    async def revoke_api_key(self, name: str) -> bool:
        """Revoke the active key named ``name``; False when there is none."""

    @abc.abstractmethod
    async def check_api_key(self, key: str) -> ApiKey | None:
        """The active API key ``key`` is, or None (constant-time comparison against every hash)."""

    @abc.abstractmethod
    async def active_key_ids(self) -> set[str]:
        """The ids of every active (not revoked) API key."""

    @abc.abstractmethod
    async def active_key_id(self, name: str) -> str | None:
        """The id of the active API key named ``name``, or None."""

    # usage: every read writes the queued rows first

    @abc.abstractmethod
    async def prune_usage(self, before: float, limit: int) -> int:
        """Delete up to ``limit`` turn rows older than ``before`` (the oldest first; the hourly
        totals stay); returns how many. Rows are complete from ``usage_turns_from`` on."""

    @abc.abstractmethod
    async def usage_turns_from(self) -> float:
        """The Unix time from which every turn's row is kept (-inf: none was ever pruned)."""

    @abc.abstractmethod
    async def usage_rows(
        self, since: float = 0.0, key_name: str | None = None
    ) -> list[dict[str, Any]]:
        """The kept turn rows ended at or after ``since``, oldest first."""

    @abc.abstractmethod
    async def hourly_usage(self, since: float, key_name: str | None = None) -> list[HourlyUsage]:
        """Hourly totals per key name and model from the hour ``since`` falls in on, oldest
        first."""

    @abc.abstractmethod
    async def usage_totals(
        self, since: float, key_name: str | None = None
    ) -> tuple[list[UsageTotal], bool]:
        """Per key name and model, the use since ``since`` (Unix time); and whether that is
        exact (from the turn rows, all kept since then) or from the hourly totals (the hour
        ``since`` falls in counted whole)."""

    @abc.abstractmethod
    async def tokens_since(self, key_id: str, hour: int) -> int:
        """The key's prompt and completion tokens from ``hour`` (an hour's start) on."""

    # people (issue 34)

    @abc.abstractmethod
    async def people(self, op: Op[T]) -> T:
        """``op``, one of ``people_ops``' statements about people, their keys, page sessions
        and usage, run on this store (the queued usage rows written first)."""

    @abc.abstractmethod
    async def cost_since(self, key_id: str, hour: int) -> float:
        """The key's cost (the hub's currency) from ``hour`` (an hour's start) on."""

    @abc.abstractmethod
    async def throughput(self, model: str, since: float) -> tuple[float, float]:
        """The model's measured tokens a second, of prefill and of decoding, over the kept
        turn rows since ``since`` (0 where none measured)."""

    # prices and budgets

    @abc.abstractmethod
    async def set_price(self, price: Price) -> None:
        """Insert or replace the model's price."""

    @abc.abstractmethod
    async def delete_price(self, model: str) -> bool:
        """Forget the model's price (it costs 0 from now on); False when it had none."""

    @abc.abstractmethod
    async def list_prices(self) -> list[Price]:
        """Every model's price, by model."""

    @abc.abstractmethod
    async def key_budgets(self) -> dict[str, KeyBudget]:
        """Every active key's budgets and priority class, by name."""

    @abc.abstractmethod
    async def set_key_budget(self, name: str, budget: KeyBudget) -> bool:
        """Replace the active key ``name``'s budgets and priority; False when there is none."""
