"""The usage journal: a hub killed mid-flight loses no turn's row, and writes none twice (issue 27
point 5). Real files and a real SQLite store; a kill is a store dropped without its writer's
last batch (what SIGKILL leaves: the journal's appends, the ledger's committed batches)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.hub.store import UsageRecord, open_store
from gateway.hub.store.journal import CUT, MAPPED, Journal


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
    *done, current = journal.segments()  # the open one, and at most one kept for reuse:
    assert current == journal.seq and len(done) <= 1  # its lines zeroed, its number done
    assert all(not (tmp_path / f"usage-journal.{seq}").read_bytes().strip(b"\0") for seq in done)
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


KILLED = """
import sys
from pathlib import Path
from gateway.hub.store import UsageRecord
from gateway.hub.store.journal import CUT, MAPPED, Journal

journal = Journal(Path(sys.argv[1]))
journal.recover(0)
n = 0
def rec(session, outcome):
    return UsageRecord("kid", "alice", session, "chat", "m", True, outcome, "r", "j", 2, 3)
while journal._current.at < 2 * MAPPED:  # past the first map's end: the map grew
    journal.started(f"t{n}", rec(f"s{n}", CUT), 100.0 + n)
    if n % 2 == 0:
        journal.ended(f"t{n}", rec(f"s{n}", "ok"), 100.5 + n)
    n += 1
print(n, flush=True)
sys.stdin.read()  # killed here: the segment never closed, its map never let go
"""


def test_a_hub_killed_with_its_segment_mapped_loses_no_line(tmp_path: Path) -> None:
    """The appends are copies into a shared map of the segment, no write: a process SIGKILLed
    after them leaves every line in the file (the kernel's page cache keeps the map's pages),
    the map's grown part included, and its unused tail of NUL bytes is no line."""
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert child.stdout is not None
        turns = int(child.stdout.readline())
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    (seq,) = Journal(tmp_path).segments()
    assert (tmp_path / f"usage-journal.{seq}").read_bytes().endswith(b"\0")  # left mapped
    rows, last = Journal(tmp_path).recover(0)
    assert last == seq and len(rows) == turns > 1000
    outcomes = {r.session: r.outcome for r, _ in rows}
    assert outcomes == {f"s{n}": "ok" if n % 2 == 0 else CUT for n in range(turns)}


def test_a_full_disk_stops_the_segment_not_the_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A segment whose map cannot grow (its blocks not allocated: the disk is full) keeps what
    it holds, cut to it, and takes no more lines; the next seal opens a new one that does."""
    journal = Journal(tmp_path)
    journal.recover(0)
    journal.started("t1", record("s1", CUT), 100.0)
    full = journal.seq

    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    big = record("s2" + "x" * MAPPED, CUT)
    journal.started("t2", big, 101.0)  # past the map's end: it cannot grow
    assert "could not be written" in caplog.text
    assert (tmp_path / f"usage-journal.{full}").stat().st_size < 1000  # cut to its one line
    journal.ended("t1", record("s1"), 102.0)  # dropped: the segment is closed
    monkeypatch.undo()
    journal.seal()  # a new segment, carrying both starts
    journal.ended("t1", record("s1"), 103.0)
    journal.close()
    rows, _ = Journal(tmp_path).recover(0)
    assert sorted((r.session[:2], r.outcome) for r, _ in rows) == [("s1", "ok"), ("s2", CUT)]


async def test_a_committed_segment_reused_as_the_next_is_never_read_twice(tmp_path: Path) -> None:
    """A segment whose batch is in is zeroed and kept under its number (which the ledger's
    mark covers), then renamed to be the next segment: after batches that went that way and a
    kill (nothing closed), the next start writes only the rows of the batch not taken."""
    store = open_store(tmp_path)
    journal = Journal(tmp_path)
    await store.recover_journal(journal)
    for n in range(4):
        journal.started(f"t{n}", record(f"s{n}", CUT), 100.0 + n)
        journal.ended(f"t{n}", record(f"s{n}"), 100.5 + n)
        store.queue_usage(record(f"s{n}"), 100.5 + n)
        await store.flush_usage()
        kept, current = journal.segments()  # the batch's, zeroed, under its number; the next
        assert kept <= await store.journal_mark(journal.id) < current == journal.seq
        assert not (tmp_path / f"usage-journal.{kept}").read_bytes().strip(b"\0")
    journal.started("t4", record("s4", CUT), 104.0)  # in the renamed file, past its zeroes
    journal.ended("t4", record("s4", tokens=9), 104.5)
    store.queue_usage(record("s4", tokens=9), 104.5)
    journal.started("t5", record("s5", CUT), 105.0)
    await store._close()  # the kill: no last batch, the journal's files left as they are

    again = open_store(tmp_path)
    assert await again.recover_journal(Journal(tmp_path)) == 2  # t4 ended, t5 cut
    rows = sorted(
        (r["session"], r["outcome"], r["completion_tokens"]) for r in await again.usage_rows()
    )
    assert rows == [(f"s{n}", "ok", 3) for n in range(4)] + [("s4", "ok", 9), ("s5", CUT, 3)]
    await again.close()


def test_a_reused_segment_whose_zeroes_were_lost_gives_its_own_lines_only(tmp_path: Path) -> None:
    """Each line carries its segment's number: a file reused as segment 7 whose earlier lines
    (segment 5's, in the ledger already) a machine's crash brought back past its rename yields
    segment 7's lines only; an older hub's untagged lines are read as they were."""
    journal = Journal(tmp_path)
    journal.recover(0)
    journal.started("new", record("s-new", CUT), 103.0)
    journal.ended("new", record("s-new"), 104.0)
    journal.close()
    (ours,) = Journal(tmp_path).segments()
    lines = (tmp_path / f"usage-journal.{ours}").read_bytes()
    assert lines.startswith(b"%d [" % ours)
    old = lines.replace(b"%d " % ours, b"%d " % (ours - 1)).replace(b"s-new", b"s-old")
    legacy = b'["leg",true,99.0,' + lines.split(b",false,103.0,")[1].split(b"\n")[0] + b"\n"
    (tmp_path / f"usage-journal.{ours}").write_bytes(old + lines)
    (tmp_path / f"usage-journal.{ours + 1}").write_bytes(legacy.replace(b"s-new", b"s-leg"))
    rows, last = Journal(tmp_path).recover(0)
    assert sorted((r.session, r.outcome) for r, _ in rows) == [("s-leg", CUT), ("s-new", "ok")]
    assert last == ours + 1
