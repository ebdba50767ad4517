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
flight), and once the batch is written ``committed`` deletes the sealed segments but the last,
which is zeroed and kept to be the next segment's file (no file made, allocated, mapped or
deleted a batch). Each line begins with the number of the segment it was written in, and
``recover`` reads a file's lines of its own number only: a machine's crash that kept a reused
file's rename but not its zeroes leaves its earlier lines, never read twice. The batch's
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


class _Segment:
    """One segment file, open and mapped: ``at`` bytes of lines, NUL bytes after them."""

    __slots__ = ("seq", "fd", "map", "at", "tag")

    def __init__(self, seq: int, fd: int, mapped: mmap.mmap) -> None:
        self.seq, self.fd, self.map, self.at = seq, fd, mapped, 0
        self.tag = b"%d " % seq  # each line's first word: the segment it was written in

    def close(self, cut: bool) -> None:
        """Let the file go, ``cut`` to its lines (else its NUL tail stays, blocks and all)."""
        self.map.close()
        try:
            if cut:
                os.ftruncate(self.fd, self.at)
        except OSError:
            pass  # its tail of NUL bytes stays: ``recover`` stops at it
        os.close(self.fd)


class Journal:
    """The journal of one hub's data directory (``id``: which hub, where several share a
    database: the batch writer's mark is kept per journal).

    A segment whose batch is in is not deleted but kept as the next segment's file (``_spare``):
    its lines zeroed first, still under its own number (which the ledger's mark already
    covers: a kill then leaves nothing to read twice), then renamed to the next number at the
    next seal; so a batch costs no file made, allocated, mapped or deleted."""

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
        self._current: _Segment | None = None  # where lines go (None: nowhere)
        self._sealed: _Segment | None = None  # the last sealed, kept open for its reuse
        self._spare: _Segment | None = None  # a committed one, zeroed, for the next seal

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
            mine = b"%d" % seq
            for raw in (data if end < 0 else data[:end]).splitlines():
                if raw[:1] != b"[":  # (a line of an older hub has no segment number)
                    tag, _, raw = raw.partition(b" ")
                    if tag != mine:  # the file's earlier use, its zeroes lost with the machine
                        continue
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
        """A new segment (the spare renamed, or a new file), beginning with the starts of
        the turns in flight."""
        self.seq += 1
        path = self._path(self.seq)
        spare, self._spare = self._spare, None
        try:
            if spare is not None:
                os.rename(self._path(spare.seq), path)
                self._files.remove(spare.seq)
                spare.seq, spare.tag = self.seq, b"%d " % self.seq
                self._current = spare
            else:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    _allocate(fd, 0, MAPPED)
                    self._current = _Segment(self.seq, fd, mmap.mmap(fd, MAPPED))
                except OSError:
                    os.close(fd)
                    raise
        except OSError as exc:
            if spare is not None:
                spare.close(cut=True)
            self._failed(exc)
            return
        finally:
            self._files.append(self.seq)
        if self._open:
            tag = self._current.tag
            self._append(b"".join([b"%b%b" % (tag, line) for line in self._open.values()]))

    def started(self, turn: str, record: UsageRecord, at: float) -> None:
        """A turn began (``record``: its row were it cut now)."""
        line = _encode(_Line(turn, False, at, record)) + b"\n"
        self._open[turn] = line
        if self._current is not None:
            self._append(self._current.tag + line)

    def ended(self, turn: str, record: UsageRecord, at: float) -> None:
        """A turn ended: its row."""
        self._open.pop(turn, None)
        if self._current is not None:
            self._append(b"%b%b\n" % (self._current.tag, _encode(_Line(turn, True, at, record))))

    def _append(self, data: bytes) -> None:
        """Lines (each with its segment's tag) copied into the current segment's map."""
        segment = self._current
        if segment is None:
            return
        mapped = segment.map
        at = segment.at
        end = at + len(data)
        if end > len(mapped):  # the map grows: its new blocks allocated first
            size = max(2 * len(mapped), end)
            try:
                _allocate(segment.fd, len(mapped), size - len(mapped))
                mapped.resize(size)
            except OSError as exc:
                self._failed(exc)
                return
        mapped[at:end] = data
        segment.at = end

    def _failed(self, exc: OSError) -> None:
        """A full disk: this segment written no more (the next seal tries a new one); the
        ledger's batches still go on."""
        log.warning("the usage journal %s could not be written: %s", self.directory, exc)
        current, self._current = self._current, None
        if current is not None:
            current.close(cut=True)

    def seal(self) -> int:
        """The current segment is closed (what the batch now taken was journalled in, and
        earlier); a new one opens. Returns the sealed segment's number. The last sealed is
        kept open for its reuse; one sealed before it whose batch is not in yet (the store is
        behind: they may pile up) is let go, cut to its lines."""
        sealed = self.seq
        if self._sealed is not None:
            self._sealed.close(cut=True)
        self._sealed, self._current = self._current, None
        self._start_segment()
        return sealed

    def committed(self, sealed: int) -> None:
        """The rows of every segment up to ``sealed`` are in the ledger: those files go, but
        for one kept (zeroed) as the next segment's."""
        files = self._files
        kept = self._sealed
        while files and files[0] <= sealed:
            seq = files.pop(0)
            if kept is not None and kept.seq == seq and self._spare is None:
                kept.map[: kept.at] = bytes(kept.at)  # a kill from here: its number is done
                kept.at = 0
                self._sealed, self._spare = None, kept
                files.insert(0, seq)  # still there, under its number, till the next seal
                break
            if kept is not None and kept.seq == seq:
                self._sealed = None
                kept.close(cut=True)
            try:
                self._path(seq).unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Every segment let go: the current one cut to its lines, a spare deleted."""
        current, sealed, spare = self._current, self._sealed, self._spare
        self._current = self._sealed = self._spare = None
        for segment in (current, sealed):
            if segment is not None:
                segment.close(cut=True)
        if spare is not None:
            spare.close(cut=True)
            self._files.remove(spare.seq)
            try:
                self._path(spare.seq).unlink()
            except FileNotFoundError:
                pass


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
