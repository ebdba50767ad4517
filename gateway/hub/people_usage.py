"""``alp-gateway hub usage --by person``: the front door's usage per person who signed in (the
keys each owns) and model, read from the store's hourly totals."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence

import trio

from gateway.hub.store import Store
from gateway.hub.store import people_ops as ops
from gateway.hub.store.people_ops import PersonUsage

Table = Callable[[Sequence[str], Sequence[Sequence[str]], int], list[str]]
HEADER = ("PERSON", "EMAIL", "MODEL", "TURNS", "PROMPT TOKENS", "COMPLETION TOKENS", "ERRORS")


def usage_by_person(store: Store, since: float, table: Table) -> int:
    """Print the usage per person and model since ``since`` (Unix time; its hour counted
    whole), the keys no person owns (the admin's) as person ``-``; ``table`` lays it out."""
    rows = trio.run(_rows, store, since)
    start = datetime.datetime.fromtimestamp(since, datetime.UTC)
    when = start.replace(minute=0, second=0, microsecond=0).strftime("%Y-%m-%d %H:%M:%S UTC")
    if not rows:
        print(f"no usage since {when}")
        return 0
    print(f"usage per person since {when} (from the hourly totals: the first hour counted whole)")
    totals: dict[tuple[str, str, str], list[int]] = {}
    for r in rows:
        kept = totals.setdefault((r.sub or "-", r.email or "-", r.model or "-"), [0] * 5)
        values = (r.turns, r.prompt_tokens, r.completion_tokens, r.errors, r.estimated)
        for i, value in enumerate(values):
            kept[i] += value
    lines = [(*who, *(str(v) for v in values)) for who, values in sorted(totals.items())]
    print("\n".join(table((*HEADER, "ESTIMATED"), lines, 3)))
    return 0


async def _rows(store: Store, since: float) -> list[PersonUsage]:
    try:
        return await store.people(ops.person_usage(since))
    finally:
        await store.close()
