"""The store's people (issue 34, migration 7) on SQLite and on PostgreSQL: a page session kept
by its token's hash and ended, the keys a person owns, and usage per person from the ledger's
hourly totals (the keys no one owns apart)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gateway.hub.store import Store, UsageRecord, open_store, token_hash
from gateway.hub.store import people_ops as ops
from gateway.hub.store.credentials import key_id_of


@pytest.fixture(params=["sqlite", "postgresql"])
def store_place(request: pytest.FixtureRequest, tmp_path: Path) -> str | Path:
    if request.param == "sqlite":
        return tmp_path
    return str(request.getfixturevalue("pg_url"))


def _turn(key: str, name: str, prompt: int, completion: int) -> UsageRecord:
    digest = token_hash(key)
    return UsageRecord(
        key_id=key_id_of(digest),
        key_name=name,
        session="s",
        api="chat",
        model="m",
        stream=False,
        outcome="ok",
        prompt_tokens=prompt,
        completion_tokens=completion,
    )


async def test_people_sessions_owned_keys_and_usage_per_person(store_place: str | Path) -> None:
    store: Store = open_store(store_place)
    try:
        now = time.time()
        # -- a page session: found by its token's hash while live, gone once ended -------
        await store.people(
            ops.start_session("h-1", "bob", "bob@x.test", "Bob", "member", now, now + 60)
        )
        await store.people(ops.start_session("h-0", "old", None, None, "member", now - 9, now - 1))
        found = await store.people(ops.page_session("h-1", now))
        assert found == ops.PageSession("bob", "bob@x.test", "Bob", "member", now + 60)
        assert await store.people(ops.page_session("h-0", now)) is None  # expired
        assert await store.people(ops.page_session("h-1", now + 61)) is None
        await store.people(ops.end_session("h-1"))
        assert await store.people(ops.page_session("h-1", now)) is None

        # -- keys and their owners ----------------------------------------------------------
        bob_key = await store.create_api_key("bob-laptop", "acme/chat")
        admin_key = await store.create_api_key("ci", "acme/chat")
        digest = token_hash(bob_key)
        await store.people(
            ops.add_key_owner(digest, key_id_of(digest), "bob-laptop", "bob", "bob@x.test")
        )
        assert await store.people(ops.owner_of_active("bob-laptop")) == "bob"
        assert await store.people(ops.owner_of_active("ci")) is None
        owners = await store.people(ops.key_owners())
        assert list(owners.values()) == [("bob", "bob@x.test")]
        people = await store.people(ops.people())
        assert [(p["sub"], p["activeKeys"]) for p in people] == [("bob", 1), ("old", 0)]

        # -- the projects the admin allows a person (None: the hub's default) ----------------
        assert await store.people(ops.projects_of("bob")) is None
        assert await store.people(ops.set_projects("bob", ["acme/chat", "acme/eval"]))
        assert await store.people(ops.projects_of("bob")) == ["acme/chat", "acme/eval"]
        assert not await store.people(ops.set_projects("nobody", ["acme/chat"]))
        assert await store.people(ops.set_projects("bob", None))
        assert await store.people(ops.projects_of("bob")) is None

        # -- usage per person, from the hourly totals (queued rows written first) ------------
        store.queue_usage(_turn(bob_key, "bob-laptop", 10, 5), now)
        store.queue_usage(_turn(bob_key, "bob-laptop", 20, 7), now)
        store.queue_usage(_turn(admin_key, "ci", 3, 1), now)
        rows = await store.people(ops.person_usage(now - 60))
        got = {(r.sub, r.email): (r.turns, r.prompt_tokens, r.completion_tokens) for r in rows}
        assert got == {("bob", "bob@x.test"): (2, 30, 12), (None, None): (1, 3, 1)}
        only = await store.people(ops.person_usage(now - 60, "bob"))
        assert [(r.sub, r.turns) for r in only] == [("bob", 2)]

        # -- a revoked key stays counted for its owner, and is no longer theirs to revoke ---
        assert await store.revoke_api_key("bob-laptop")
        assert await store.people(ops.owner_of_active("bob-laptop")) is None
        people = await store.people(ops.people())
        assert [(p["sub"], p["activeKeys"]) for p in people][0] == ("bob", 0)
    finally:
        await store.close()
