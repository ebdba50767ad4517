"""``hub backup`` and ``hub restore``: a whole copy of a SQLite hub store, taken while the hub runs.

A copy of ``hub.sqlite3`` by ``cp`` misses what is still in its write-ahead log (``-wal``) and
may catch a page mid-write; SQLite's online backup API (``sqlite3.Connection.backup``) copies
the store as one read transaction sees it, the log's committed pages included, while the hub
goes on writing (a reader never blocks a writer in WAL mode). The copy is one self-contained
file (its journal mode set back to DELETE), owner-only, put in place by a rename: a backup cut
short leaves no half file under the name.

Every open SQLite store holds a shared ``flock`` on ``DATA/hub.lock`` (``lock_shared``, taken by
``SqliteStore``); a restore takes it exclusively, so it refuses to overwrite the store of a hub
that runs (or of a ``hub keys`` command at work), and a hub cannot open the store while it is
being restored. The store a restore replaces is kept beside it, whole (``hub.sqlite3.replaced``).
No trio: blocking calls for the command line.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import sqlite3
from typing import Any

from gateway.hub.settings import HubSettings
from gateway.hub.store.base import StoreError
from gateway.hub.store.schema import LATEST, too_new
from gateway.privatefs import make_private_dirs

FILENAME = "hub.sqlite3"  # as gateway.hub.store.sqlite names it
LOCK_FILE = "hub.lock"
REPLACED = FILENAME + ".replaced"
BUSY_TIMEOUT = 10.0  # s: a hub's write in progress is waited for this long
COMMANDS = ("backup", "restore")  # the ``hub`` subcommands here


class InUse(StoreError):
    """The store is open in another process (a hub serving it): not restored."""


def lock_shared(data_dir: pathlib.Path) -> int:
    """A shared lock on ``data_dir``'s store, held while the returned descriptor is open:
    any number of hubs and ``hub`` commands together, never during a restore (StoreError)."""
    fd = _open_lock(data_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StoreError(
            f"the hub store in {data_dir} is being restored (`hub restore`): start once it is done"
        ) from None
    return fd


def _open_lock(data_dir: pathlib.Path) -> int:
    path = data_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise StoreError(f"cannot open {path}: {exc.strerror}") from None
    os.fchmod(fd, 0o600)
    return fd


def _schema_version(db: sqlite3.Connection, where: str) -> int:
    try:
        row = db.execute("SELECT MAX(version) FROM schema_version").fetchone()
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{where} is not a hub store: {exc}") from None
    return int(row[0] or 0)


def _copy(source: sqlite3.Connection, target: pathlib.Path) -> None:
    """``source`` as one read transaction sees it into ``target`` (made owner-only, then put
    in place by a rename), one file with no log beside it."""
    make_private_dirs(target.parent)
    partial = target.with_name(f".{target.name}.partial")
    with contextlib.suppress(FileNotFoundError):
        partial.unlink()
    os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    try:
        copy = sqlite3.connect(partial, isolation_level=None)
        try:
            source.backup(copy)  # all pages in one step: one consistent snapshot
            copy.execute("PRAGMA journal_mode=DELETE")  # one file, whatever the source's mode
            check = copy.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise StoreError(f"the copy of the hub store failed its check: {check}")
        finally:
            copy.close()
        fd = os.open(partial, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        raise


def _counts(db: sqlite3.Connection) -> tuple[int, int]:
    keys = db.execute("SELECT COUNT(*) FROM api_keys").fetchone()[0]
    rows = db.execute("SELECT COUNT(*) FROM usage_turns").fetchone()[0]
    return int(keys), int(rows)


def backup(data_dir: pathlib.Path, target: pathlib.Path) -> str:
    """Copy the store of ``data_dir`` (a hub may be serving it) to ``target``; the one line
    that says what was copied. StoreError when there is no store or it cannot be read."""
    path = data_dir / FILENAME
    if not path.exists():
        raise StoreError(f"no hub in {data_dir} (no {FILENAME})")
    if target.resolve() == path.resolve():
        raise StoreError(f"{target} is the store itself: give the backup another name")
    try:
        source = sqlite3.connect(path, timeout=BUSY_TIMEOUT)  # read only (a WAL reader)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open {path}: {exc}") from None
    try:
        version = _schema_version(source, str(path))
        keys, rows = _counts(source)
        _copy(source, target)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot back up {path}: {exc}") from None
    finally:
        source.close()
    return (
        f"backed up {path} to {target} (schema version {version}, {keys} API key(s), "
        f"{rows} usage row(s))"
    )


def restore(data_dir: pathlib.Path, source: pathlib.Path) -> str:
    """Put the backup ``source`` in place of ``data_dir``'s store; the one line that says so.
    InUse when a hub (or a ``hub`` command) has the store open; StoreError when ``source`` is
    not a hub store, or one newer than this alp-gateway knows."""
    if not source.is_file():
        raise StoreError(f"no backup at {source}")
    try:
        backup_db = sqlite3.connect(f"{source.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open {source}: {exc}") from None
    try:
        version = _schema_version(backup_db, str(source))
        if version > LATEST:
            raise StoreError(too_new(str(source), version))
        check = backup_db.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise StoreError(f"{source} failed its check: {check}")
        keys, rows = _counts(backup_db)
        make_private_dirs(data_dir)
        fd = _open_lock(data_dir)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise InUse(
                    f"a hub is running on {data_dir} (or a `hub` command has its store open): "
                    "stop it, then restore"
                ) from None
            path = data_dir / FILENAME
            kept = ""
            if path.exists():  # the store replaced, kept whole (its log folded in)
                current = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT)
                try:
                    _copy(current, data_dir / REPLACED)
                finally:
                    current.close()
                kept = f"; the store it replaced is kept as {data_dir / REPLACED}"
            _copy(backup_db, path.with_name(FILENAME + ".restoring"))
            for log in ("-wal", "-shm", "-journal"):  # the replaced store's, not the backup's
                with contextlib.suppress(FileNotFoundError):
                    (data_dir / (FILENAME + log)).unlink()
            os.replace(path.with_name(FILENAME + ".restoring"), path)
        finally:
            os.close(fd)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot restore {source}: {exc}") from None
    finally:
        backup_db.close()
    return (
        f"restored {source} into {data_dir / FILENAME} (schema version {version}, {keys} API "
        f"key(s), {rows} usage row(s)){kept}"
    )


# -- the command line (``gateway.hub.cli`` adds these and hands them here) ------------------------


def add_commands(parser: Any, sub: Any) -> None:
    """``hub backup FILE`` and ``hub restore FILE`` on the ``hub`` parser (``cliparse.Parser.command``)."""
    backup_cmd = parser.command(
        sub,
        "backup",
        help="copy the hub's SQLite store (--data) to FILE, whole, while the hub runs (a "
        "PostgreSQL store: pg_dump)",
    )
    backup_cmd.add_argument("file", metavar="FILE", type=pathlib.Path)
    restore_cmd = parser.command(
        sub,
        "restore",
        help="put the backup FILE in place of the hub's SQLite store (--data); refused while a "
        "hub runs on it; the store it replaces is kept as hub.sqlite3.replaced",
    )
    restore_cmd.add_argument("file", metavar="FILE", type=pathlib.Path)


def command(name: str, settings: HubSettings, file: pathlib.Path) -> str:
    """Run ``hub backup FILE`` or ``hub restore FILE``: the one line it prints; StoreError
    (one line) when it cannot."""
    if settings.store:
        raise StoreError(
            f"`hub {name}` works on a SQLite store (--data); a PostgreSQL store is backed up "
            "with pg_dump and restored with pg_restore (packaging/DEPLOY.md)"
        )
    if name == "backup":
        return backup(settings.data, file)
    return restore(settings.data, file)
