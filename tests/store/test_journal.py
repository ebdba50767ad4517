"""The usage journal: a hub killed mid-flight loses no turn's row, and writes none twice (issue 27
point 5). Real files and a real SQLite store; a kill is a store dropped without its writer's
last batch (what SIGKILL leaves: the journal's appends, the ledger's committed batches)."""

from __future__ import annotations

from pathlib import Path

from gateway.hub.store import UsageRecord, open_store
from gateway.hub.store.journal import CUT, Journal


def record(session: str, outcome: str = "ok", tokens: int = 3) -> UsageRecord:
    return UsageRecord("kid", "alice", session, "chat", "m", True, outcome, "r", "j", 2, tokens)


async def test_turns_ended_or_cut_by_a_kill_are_recorded_once_at_the_next_start(
    tmp_path: Path,
) -> None:
    store = open_store(tmp_path)
    journal = Journal(tmp_path)
    assert await store.recover_journal(journal) == 0
    journal.started("t1", record("s1", CUT), 100.0)
    journal.started("t2", record("s2", CUT), 101.0)
    journal.ended("t1", record("s1"), 102.0)
    store.queue_usage(record("s1"), 102.0)
    await store.flush_usage()  # t1's batch is written: its segment goes
    journal.started("t3", record("s3", CUT), 103.0)
    journal.ended("t3", record("s3", tokens=7), 104.0)
    store.queue_usage(record("s3", tokens=7), 104.0)  # queued, never written: the kill
    journal.close()
    await store._close()  # the database let go with t3's row still queued (no last batch)

    again = open_store(tmp_path)
    assert await again.recover_journal(Journal(tmp_path)) == 2  # t3 ended, t2 cut
    rows = await again.usage_rows()  # a cut turn's row is dated at its start
    assert sorted((r["session"], r["outcome"], r["completion_tokens"]) for r in rows) == [
        ("s1", "ok", 3),
        ("s2", CUT, 3),
        ("s3", "ok", 7),
    ]
    await again.close()
    third = open_store(tmp_path)  # a clean stop: nothing left to recover, nothing twice
    assert await third.recover_journal(Journal(tmp_path)) == 0
    assert len(await third.usage_rows()) == 3
    await third.close()


async def test_a_kill_between_the_batch_and_its_files_removal_writes_nothing_twice(
    tmp_path: Path,
) -> None:
    store = open_store(tmp_path)
    journal = Journal(tmp_path)
    await store.recover_journal(journal)
    journal.started("t1", record("s1", CUT), 100.0)
    journal.ended("t1", record("s1"), 101.0)
    sealed = journal.segments()
    keep = {seq: (tmp_path / f"usage-journal.{seq}").read_bytes() for seq in sealed}
    store.queue_usage(record("s1"), 101.0)
    await store.flush_usage()
    for seq, data in keep.items():  # as if the kill came before the files went
        (tmp_path / f"usage-journal.{seq}").write_bytes(data)
    journal.close()
    await store._close()

    again = open_store(tmp_path)
    assert await again.recover_journal(Journal(tmp_path)) == 0  # the ledger's mark says so
    assert len(await again.usage_rows()) == 1
    assert not set(Journal(tmp_path).segments()) & set(sealed)  # and the stale files went
    await again.close()


async def test_a_turn_in_flight_across_batches_is_carried_into_each_new_segment(
    tmp_path: Path,
) -> None:
    store = open_store(tmp_path)
    journal = Journal(tmp_path)
    await store.recover_journal(journal)
    journal.started("long", record("s", CUT), 100.0)
    for n in range(3):  # other turns' batches come and go while it runs
        journal.started(f"t{n}", record(f"o{n}", CUT), 101.0 + n)
        journal.ended(f"t{n}", record(f"o{n}"), 101.5 + n)
        store.queue_usage(record(f"o{n}"), 101.5 + n)
        await store.flush_usage()
    assert len(journal.segments()) == 1  # only the open one is left
    journal.close()
    await store._close()

    again = open_store(tmp_path)
    assert await again.recover_journal(Journal(tmp_path)) == 1
    outcomes = sorted((r["session"], r["outcome"]) for r in await again.usage_rows())
    assert outcomes == [("o0", "ok"), ("o1", "ok"), ("o2", "ok"), ("s", CUT)]
    await again.close()


def test_a_line_a_kill_cut_short_is_skipped(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    rows, _ = journal.recover(0)
    assert rows == []
    journal.started("t1", record("s1", CUT), 100.0)
    journal.close()
    path = tmp_path / f"usage-journal.{journal.seq}"
    path.write_bytes(path.read_bytes() + b'[["t2",fal')  # the last append, half written
    rows, last = Journal(tmp_path).recover(0)
    assert [(r.session, r.outcome) for r, _ in rows] == [("s1", CUT)] and last == journal.seq
    assert oct(path.stat().st_mode & 0o777) == "0o600"
