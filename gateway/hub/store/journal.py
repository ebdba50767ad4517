"""The usage journal: every front-door turn's start and end, appended to a file of the hub's data
directory as it happens, so that a hub killed mid-flight loses no turn (issue 27, point 5).

The ledger's rows are written in batches, off the turn's path (``Store.queue_usage``): a hub
killed between a turn's end and its batch would lose that row, and a turn cut by the kill would
leave none. So each turn also costs two appends here (one ``write`` each, no fsync: what a
killed process wrote is in the kernel's page cache and survives it; only the machine's own
crash can lose the last of them): its start (its row as a cut turn would have it) and its end
(its row). Nothing here runs per chunk.

The journal is a run of segment files, ``usage-journal.<seq>``; the batch writer ``seal``s the
current one as it takes a batch (a new segment opens, carrying the starts of the turns still in
flight), and once the batch is written ``committed`` deletes the sealed segments. The batch's
transaction records the sealed number (``Store`` ``journal_mark``) so that a kill between the
write and the deletion never writes a row twice. At start, ``recover`` reads the segments past
that number: every ended turn's row is written, and every turn started and never ended is
written as cut.

Pure: files and bytes, no trio.
"""

from __future__ import annotations

import logging
import os
import pathlib
import uuid

import msgspec

from gateway.hub.store.records import UsageRecord
from gateway.privatefs import make_private_dirs

log = logging.getLogger("gateway.hub.store")

PREFIX = "usage-journal."
ID_FILE = "usage-journal.id"
CUT = "cut"  # the outcome of a turn the hub's end cut (as ``State.CUT`` says it)


class _Line(msgspec.Struct, array_like=True):
    """One journal line: a turn's start (``ended`` False: its row as a cut turn) or end."""

    turn: str
    ended: bool
    at: float  # Unix time
    record: UsageRecord


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(_Line).decode


class Journal:
    """The journal of one hub's data directory (``id``: which hub, where several share a
    database: the batch writer's mark is kept per journal)."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        make_private_dirs(directory)
        id_file = directory / ID_FILE
        try:
            self.id = id_file.read_text().strip()
        except FileNotFoundError:
            self.id = ""
        if not self.id:
            self.id = uuid.uuid4().hex
            _write_private(id_file, self.id.encode())
        self._open: dict[str, bytes] = {}  # turns in flight: their start lines
        self.seq = max(self.segments(), default=0)
        self._fd = -1

    def segments(self) -> list[int]:
        """The numbers of the segment files there, in order."""
        found = []
        for path in self.directory.glob(PREFIX + "*"):
            suffix = path.name[len(PREFIX) :]
            if suffix.isdigit():
                found.append(int(suffix))
        return sorted(found)

    def _path(self, seq: int) -> pathlib.Path:
        return self.directory / f"{PREFIX}{seq}"

    def recover(self, committed: int) -> tuple[list[tuple[UsageRecord, float]], int]:
        """The rows the segments past ``committed`` hold that the ledger has not: every ended
        turn's, and a cut row for every turn started and never ended; and the last segment
        number read (what the ledger records once they are written). Opens a new segment."""
        ended: dict[str, tuple[UsageRecord, float]] = {}
        started: dict[str, tuple[UsageRecord, float]] = {}
        last = committed
        for seq in self.segments():
            if seq <= committed:
                continue
            last = seq
            for raw in self._path(seq).read_bytes().splitlines():
                try:
                    line = _decode(raw)
                except msgspec.DecodeError:
                    continue  # a line the kill cut short
                if line.ended:
                    ended[line.turn] = (line.record, line.at)
                    started.pop(line.turn, None)
                elif line.turn not in ended:
                    started[line.turn] = (line.record, line.at)
        rows = list(ended.values())
        rows += [(msgspec.structs.replace(r, outcome=CUT), at) for r, at in started.values()]
        rows.sort(key=lambda row: row[1])
        self.seq = max(last, self.seq)
        self._start_segment()
        return rows, last

    def _start_segment(self) -> None:
        """A new segment, beginning with the starts of the turns in flight."""
        if self._fd >= 0:
            os.close(self._fd)
        self.seq += 1
        self._fd = os.open(
            self._path(self.seq), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o600
        )
        if self._open:
            os.write(self._fd, b"".join(self._open.values()))

    def started(self, turn: str, record: UsageRecord, at: float) -> None:
        """A turn began (``record``: its row were it cut now)."""
        line = _encode(_Line(turn, False, at, record)) + b"\n"
        self._open[turn] = line
        self._append(line)

    def ended(self, turn: str, record: UsageRecord, at: float) -> None:
        """A turn ended: its row."""
        self._open.pop(turn, None)
        self._append(_encode(_Line(turn, True, at, record)) + b"\n")

    def _append(self, line: bytes) -> None:
        if self._fd < 0:
            return
        try:
            os.write(self._fd, line)
        except OSError as exc:  # a full disk: the ledger's batches still go on
            log.warning("the usage journal %s could not be written: %s", self.directory, exc)
            os.close(self._fd)
            self._fd = -1

    def seal(self) -> int:
        """The current segment is closed (what the batch now taken was journalled in, and
        earlier); a new one opens. Returns the sealed segment's number."""
        sealed = self.seq
        self._start_segment()
        return sealed

    def committed(self, sealed: int) -> None:
        """The rows of every segment up to ``sealed`` are in the ledger: those files go."""
        for seq in self.segments():
            if seq <= sealed:
                try:
                    self._path(seq).unlink()
                except FileNotFoundError:
                    pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _write_private(path: pathlib.Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
