"""The usage journal: every front-door turn's start and end, appended to a file of the hub's data
directory as it happens, so that a hub killed mid-flight loses no turn (issue 27, point 5).

The ledger's rows are written in batches, off the turn's path (``Store.queue_usage``): a hub
killed between a turn's end and its batch would lose that row, and a turn cut by the kill would
leave none. So each turn also costs two appends here: its start (its row as a cut turn would
have it) and its end (its row). An append is a copy into the segment's shared memory map, no
system call, no fsync: the map's pages are the file's in the kernel's page cache, so what a
killed process copied there survives it, as a ``write`` would have; only the machine's own
crash can lose the last of them, as it could before. The segment's blocks are allocated before
it is mapped (a full disk is an error then, never a SIGBUS on a copy); the unused tail reads
as NUL bytes, which ``recover`` stops at, and a segment closed is cut to what it holds.
Nothing here runs per chunk.

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
import mmap
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
MAPPED = 1 << 18  # bytes a segment's map holds at first (doubled while it is too small)


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
        self._files = self.segments()  # the segment files there, made since included
        self.seq = max(self._files, default=0)
        self._fd = -1
        self._map: mmap.mmap | None = None  # the current segment's, ``_at`` bytes written
        self._at = 0

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
            data = self._path(seq).read_bytes()
            end = data.find(b"\0")  # the map's unused tail (a segment a kill left open)
            for raw in (data if end < 0 else data[:end]).splitlines():
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
        self.close()
        self.seq += 1
        self._files.append(self.seq)
        try:
            self._fd = os.open(self._path(self.seq), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            _allocate(self._fd, 0, MAPPED)
            self._map = mmap.mmap(self._fd, MAPPED)
        except OSError as exc:
            self._failed(exc)
            return
        if self._open:
            self._append(b"".join(self._open.values()))

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
        mapped = self._map
        if mapped is None:
            return
        at = self._at
        end = at + len(line)
        if end > len(mapped):  # the map grows: its new blocks allocated first
            size = max(2 * len(mapped), end)
            try:
                _allocate(self._fd, len(mapped), size - len(mapped))
                mapped.resize(size)
            except OSError as exc:
                self._failed(exc)
                return
        mapped[at:end] = line
        self._at = end

    def _failed(self, exc: OSError) -> None:
        """A full disk: this segment written no more (the next seal tries a new one); the
        ledger's batches still go on."""
        log.warning("the usage journal %s could not be written: %s", self.directory, exc)
        self.close()

    def seal(self) -> int:
        """The current segment is closed (what the batch now taken was journalled in, and
        earlier); a new one opens. Returns the sealed segment's number."""
        sealed = self.seq
        self._start_segment()
        return sealed

    def committed(self, sealed: int) -> None:
        """The rows of every segment up to ``sealed`` are in the ledger: those files go."""
        files = self._files
        while files and files[0] <= sealed:
            try:
                self._path(files.pop(0)).unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """The current segment closed, cut to the lines it holds."""
        mapped, fd, at = self._map, self._fd, self._at
        self._map, self._fd, self._at = None, -1, 0
        if mapped is not None:
            mapped.close()
        if fd >= 0:
            try:
                if mapped is not None:
                    os.ftruncate(fd, at)
            except OSError:
                pass  # its tail of NUL bytes stays: ``recover`` stops at it
            os.close(fd)


def _allocate(fd: int, offset: int, length: int) -> None:
    """The file's blocks from ``offset`` allocated (OSError when the disk is full)."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, offset, length)
    else:  # (macOS) the file extended, its blocks allocated as they are written
        os.ftruncate(fd, offset + length)


def _write_private(path: pathlib.Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
