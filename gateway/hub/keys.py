"""The hub's credentials: its admin credential, and the front door's API keys (created, listed,
limited, revoked, and checked with each answer kept ``key_check_interval`` s)."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import trio

from gateway.hub.money import KeyBudget
from gateway.hub.settings import HubSettings
from gateway.hub.store import (
    DEFAULT_KEY_PROJECT,
    ApiKey,
    KeyLimits,
    Store,
    limits_of,
    token_hash,
)

KEY_CACHE = 10_000  # API key answers kept at most (a flood of wrong keys cannot grow it)


class Keys:
    """The admin credential and the API keys of one hub; ``on_revoked`` and ``on_limits`` are
    told when a key is revoked (its sessions end) or its limits change (applied at once)."""

    def __init__(self, store: Store, settings: HubSettings, admin_hash: str) -> None:
        self.store = store
        self.settings = settings
        self._admin_hash = admin_hash  # the admin credential's hash (never the credential)
        self._answers: dict[str, tuple[ApiKey | None, float]] = {}  # token -> (key, until)
        self.on_revoked: list[Callable[[], None]] = []
        self.on_revoked_key: list[Callable[[str], None]] = []  # told the revoked key's id
        self.on_limits: list[Callable[[], None]] = []

    def is_admin(self, token: str) -> bool:
        """Whether ``token`` is the admin credential (compared in constant time)."""
        return hmac.compare_digest(token_hash(token), self._admin_hash)

    async def check(self, token: str) -> ApiKey | None:
        """The active API key ``token`` is, or None: from the store, the answer kept for
        ``key_check_interval`` s (a key revoked by another process is refused within that, as
        its sessions end; one revoked here is refused at once)."""
        now = trio.current_time()
        kept = self._answers.get(token)
        if kept is not None and kept[1] > now:
            return kept[0]
        key = await self.store.check_api_key(token)
        if len(self._answers) >= KEY_CACHE:
            self._answers.clear()
        self._answers[token] = (key, now + self.settings.key_check_interval)
        return key

    def keep_active(self, active: set[str]) -> None:
        """The sessions' key check found these keys active: drop what was kept of any other."""
        for token, (key, _until) in list(self._answers.items()):
            if key is not None and key.id not in active:
                del self._answers[token]

    async def create(
        self,
        name: str,
        project: str = DEFAULT_KEY_PROJECT,
        *,
        rpm: int | None = None,
        tpm: int | None = None,
        tokens_per_day: int | None = None,
        max_streams: int | None = None,
    ) -> str:
        """Create an API key (returned, shown once) with its limits (None or 0: no limit);
        ValueError on a bad name, project or limit."""
        limits = limits_of(rpm, tpm, tokens_per_day, max_streams)
        key = await self.store.create_api_key(name, project, limits)
        self._changed(self.on_limits)
        return key

    async def update_limits(self, name: str, limits: KeyLimits) -> bool:
        """Replace the active key ``name``'s limits (None or 0: no limit), applied at once;
        False when there is no such key, ValueError on a bad limit."""
        limits = limits_of(limits.rpm, limits.tpm, limits.tokens_per_day, limits.max_streams)
        updated = await self.store.set_key_limits(name, limits)
        self._changed(self.on_limits)
        return updated

    async def set_budget(self, name: str, budget: KeyBudget) -> bool:
        """Replace the active key ``name``'s budgets and priority class, applied at once;
        False when there is no such key."""
        updated = await self.store.set_key_budget(name, budget)
        self._changed(self.on_limits)
        return updated

    async def limits(self, name: str) -> KeyLimits | None:
        """The active key ``name``'s limits, or None when there is no such key."""
        found = await self.store.key_limits(name)
        return None if found is None else found[1]

    async def listing(self) -> list[dict[str, Any]]:
        """Every key (revoked ones too, never the key itself), with its limits."""
        return await self.store.list_api_keys()

    async def revoke(self, name: str) -> bool:
        """Revoke the active key ``name``: refused at once, its turns in flight and its chat
        sessions ended."""
        key_id = await self.store.active_key_id(name)
        revoked = await self.store.revoke_api_key(name)
        self._answers.clear()
        if revoked:
            if key_id is not None:
                for observe in self.on_revoked_key:
                    observe(key_id)
            self._changed(self.on_revoked)
        return revoked

    def _changed(self, observers: list[Callable[[], None]]) -> None:
        self._answers.clear()
        for observe in observers:
            observe()
