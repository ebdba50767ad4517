"""The hub's runners as the admin manages them: enrollment tokens made and revoked, runner
registrations listed and revoked (refused at once, their jobs ended, their channels closed, their
sessions free to move), the revocations another process made applied within a second, and the
registration each runner token presented is (kept once found, until its revocation)."""

from __future__ import annotations

import logging
import time

import trio

from gateway.hub.board import JobBoard
from gateway.hub.channel import CLOSE_OFFLINE, Channels
from gateway.hub.store import Enrollment, Registration, RunnerRecord, Store, StoreError

log = logging.getLogger("gateway.hub")

REVOCATION_CHECK = 0.5  # s: a revocation made by another process (the CLI, a replica) applies
SEEN_EVERY = 30.0  # s: how often the runners seen are written down (``hub runners list``)
TOKEN_CACHE = 100_000  # registrations kept by token at most (only tokens the store knew)


class RunnerNotFound(ValueError):
    """No registration is named so, or several are (the message says which and what to give)."""


class RunnerAdmin:
    """Enrollment tokens and runner revocation for one hub."""

    def __init__(self, store: Store, board: JobBoard, channels: Channels) -> None:
        self.store = store
        self.board = board
        self.channels = channels
        self.cut: set[str] = set()  # runners whose revocation this hub applied
        # revoked runners this hub did not know when it saw their revocation: they cannot come
        # back (their token is refused), so they are looked for again every ``SEEN_EVERY`` s
        # only (a job restored after a start may name one), not at every check
        self._unknown: set[str] = set()
        self._by_token: dict[str, Registration] = {}  # a runner token -> its registration
        self._token_of: dict[str, str] = {}  # a registration's id -> its token kept above

    async def by_token(self, token: str) -> Registration | None:
        """The active registration runner token ``token`` is, or None. Found in the store
        once, then kept until the runner's revocation is applied here (``apply``: at once for
        one made here, within ``REVOCATION_CHECK`` for one another process made): a fleet's
        polls, reports and channels ask for it thousands of times a minute. A token the store
        does not know is asked again each time (a runner registered meanwhile is found)."""
        kept = self._by_token.get(token)
        if kept is not None:
            return kept
        found = await self.store.registration_by_token(token)
        if found is not None and found.id not in self.cut:
            if len(self._by_token) >= TOKEN_CACHE:
                self._by_token.clear()
                self._token_of.clear()
            self._by_token[token] = found
            self._token_of[found.id] = token
        return found

    async def enroll(
        self, project: str, expires_in: float | None, uses: int | None
    ) -> tuple[Enrollment, str]:
        """A new enrollment token (returned, shown once) that registers runners in
        ``project`` for ``expires_in`` s and ``uses`` registrations (None: no bound)."""
        if uses is not None and uses < 1:
            raise ValueError("--uses must be a positive number")
        if expires_in is not None and expires_in <= 0:
            raise ValueError("--expires must be a positive duration")
        expires_at = None if expires_in is None else time.time() + expires_in
        return await self.store.create_enrollment(project, expires_at, uses)

    async def find(self, which: str) -> RunnerRecord:
        """The active registration whose id or name is ``which``: RunnerNotFound when none
        is, or when several runners share that name."""
        return pick(await self.store.list_runners(), which)

    async def revoke(self, which: str) -> RunnerRecord:
        """Revoke the registration whose id or name is ``which``, and apply it here at once."""
        found = await self.find(which)
        await self.store.revoke_runner(found.id)
        await self.apply(found.id)
        return found

    async def apply(self, runner_id: str) -> None:
        """A revoked runner's token forgotten, its jobs ended and its channels closed on this
        hub (once)."""
        token = self._token_of.pop(runner_id, None)
        if token is not None:
            self._by_token.pop(token, None)
        if runner_id in self.cut:
            return
        self.cut.add(runner_id)
        forced = await self.board.revoked(runner_id)
        self.channels.close_runner(runner_id, CLOSE_OFFLINE, "runner revoked")
        log.warning(
            "runner %s revoked: %d job(s) ended, its channels closed", runner_id, len(forced)
        )

    def known(self) -> set[str]:
        """The runners this hub knows now: seen, holding a job or a channel, or their token
        kept."""
        board = self.board
        held = {job.claimed_by for job in board.jobs.values() if job.claimed_by and not job.over}
        return set(board.last_seen) | self.channels.runners() | held | set(self._token_of)

    async def run(self) -> None:
        """Until cancelled: every ``REVOCATION_CHECK`` s the revocations of the store applied to
        the runners this hub knows; every ``SEEN_EVERY`` s the live ones' last sign of life
        written (for ``hub runners list``)."""
        next_seen = trio.current_time()
        while True:
            await trio.sleep(REVOCATION_CHECK)
            try:
                fresh = await self.store.revoked_runners() - self.cut - self._unknown
                if fresh:  # the walk over what this hub knows: only for a new revocation
                    known = self.known()
                    for runner_id in fresh:
                        if runner_id in known:
                            await self.apply(runner_id)
                        else:
                            self._unknown.add(runner_id)
                if trio.current_time() >= next_seen:
                    next_seen = trio.current_time() + SEEN_EVERY
                    self._unknown.clear()
                    alive = [rid for rid in self.board.last_seen if self.board.alive(rid)]
                    if alive:
                        await self.store.runners_seen(alive, time.time())
            except StoreError as exc:  # the store says so once; tried again at the next check
                log.debug("runners' revocations not read: %s", exc)


def pick(runners: list[RunnerRecord], which: str) -> RunnerRecord:
    """The active registration whose id (or name) is ``which`` among ``runners``."""
    active = [r for r in runners if r.revoked_at is None]
    by_id = [r for r in active if r.id == which]
    if by_id:
        return by_id[0]
    named = [r for r in active if r.name == which]
    if len(named) == 1:
        return named[0]
    if named:
        ids = ", ".join(r.id for r in named)
        raise RunnerNotFound(
            f"{len(named)} active runners are named {which!r} ({ids}): give the id of one"
        )
    if any(r.id == which or r.name == which for r in runners):
        raise RunnerNotFound(f"runner {which!r} is revoked already")
    raise RunnerNotFound(f"no runner has the id or name {which!r} (`hub runners list` lists them)")
