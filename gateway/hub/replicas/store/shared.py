"""Whether a hub store is one several hubs share, and the replicas' statements on it: PostgreSQL's
(its driver imported only then), never SQLite's."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from gateway.hub.replicas.store.base import ReplicaStore


@runtime_checkable
class Shared(Protocol):
    """A hub store other hubs may share (PostgreSQL's): a pool the replicas' statements run on,
    and the database its listener connects to (``postgres._StorePool``)."""

    shareable: bool

    def _unavailable(self, detail: str) -> Exception: ...


def shared(store: object, replica: str) -> ReplicaStore | None:
    """The replicas' statements on ``store`` as replica ``replica``; None for a store no other
    hub shares (SQLite's: its hub is alone)."""
    if not isinstance(store, Shared) or not store.shareable:
        return None
    from gateway.hub.replicas.store.postgres import (
        PostgresReplicaStore,  # PostgreSQL's driver, lazily
    )

    return PostgresReplicaStore(store, replica)  # type: ignore[arg-type]
