"""The persisted runner registrations, one per Server and project: an owner-only JSON file in the state directory.

A runner token is issued by one Server for one project and goes to no other Server: the file
keeps one registration per (Server, ``OWNER/PROJECT``), so running the same project against
another ``--server`` registers anew there and leaves the first one as it was. The file is
``{"version": 2, "registrations": [...]}``; the first form, ``{"registrations": {"OWNER/PROJECT":
{...}}}`` (one registration per project, each naming its Server), is read as it is and written
in the new form at the next save.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gateway.privatefs import make_private_dirs

STATE_FILE = "registration.json"
LOCK_FILE = "runner.lock"  # held (flock) by the one live runner of a state directory
FILE_VERSION = 2
_DEFAULT_PORTS = {"http": 80, "https": 443}


class StateError(RuntimeError):
    """The state directory or file cannot be used; the message is one line for the user."""


class WhichServer(StateError):
    """No Server was given and the project is registered on several: the message says so."""


@dataclass(frozen=True)
class SavedRegistration:
    """One runner registration as the Server answered it (docs/protocol.md §1)."""

    id: str
    name: str
    token: str
    server: str
    owner: str
    project: str
    registeredAt: str | None = None

    @property
    def key(self) -> str:
        return f"{self.owner}/{self.project}"

    def is_for(self, server: str, project: str) -> bool:
        """Whether this is the registration for ``project`` (``OWNER/PROJECT``) at ``server``."""
        return self.key == project and same_server(self.server, server)

    def __repr__(self) -> str:  # the token never reaches a log line through repr()
        return (
            f"Registration(id={self.id!r}, name={self.name!r}, server={self.server!r}, "
            f"project={self.key!r})"
        )


def same_server(a: str, b: str) -> bool:
    """Whether two Server URLs name the same Server: scheme and host in any case, the default
    port written or not, a trailing ``/`` or not."""

    def identity(url: str) -> tuple[str, str, int | None, str]:
        parts = urlsplit(url.strip())
        scheme = parts.scheme.lower()
        try:
            port = parts.port or _DEFAULT_PORTS.get(scheme)
        except ValueError:
            port = None
        return scheme, (parts.hostname or "").lower(), port, parts.path.rstrip("/")

    return identity(a) == identity(b)


def _check_private(path: Path, want: int) -> None:
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISREG(st.st_mode):
        raise StateError(f"{path} is not a regular file; move it away to register anew")
    if st.st_uid != os.geteuid():
        raise StateError(
            f"{path} belongs to uid {st.st_uid}, not to this runner (uid {os.geteuid()}); "
            "it holds the runner token: move it away to register anew"
        )
    if mode & 0o077:
        raise StateError(
            f"{path} is readable by others (mode {mode:o}); it holds the runner token: "
            f"run `chmod {want:o} {path}` and start again"
        )


def private_dir(state_dir: Path) -> Path:
    """The directory that holds the registration file: THE state-directory rule.

    The token file is ``registration.json``: a regular file owned by the runner's user, mode
    0600 (a file others may read or that another user owns is refused). It lives in a directory
    that only the runner's user may write, so nobody else can replace, rename or link it:

    * ``state_dir`` owned by the runner's user (systemd's ``StateDirectory=``, the image's own
      ``/var/lib/alp-gateway`` in a Docker named volume, a home directory): the file is there,
      and the directory is made 0700 whenever it is used (load or save), however it was
      created (a 0777 one too).
    * ``state_dir`` owned by someone else but writable by the runner (a Kubernetes ``emptyDir``:
      root, 0777; a bind mount the host made group- or world-writable; a sticky ``/tmp``):
      the runner never changes that directory; the file is in ``state_dir/uid-<UID>``, a
      subdirectory the runner creates, owns and keeps 0700. One that exists and belongs to
      another user, or is a symlink, is refused.
    * ``state_dir`` neither owned nor writable (a root-owned 0755 bind mount): refused, with
      the fix (``chown UID DIR``).

    ``state_dir`` not there yet is created (0700, owned by the runner) and is the first case.
    """
    try:
        st = os.stat(state_dir)
    except FileNotFoundError:
        return state_dir
    except OSError as exc:
        raise StateError(f"{state_dir}: {exc.strerror}") from None
    if st.st_uid == os.geteuid():
        return state_dir
    return state_dir / f"uid-{os.geteuid()}"


class StateStore:
    """Reads and writes registrations under ``state_dir`` by the rule of :func:`private_dir`
    (directory 0700 owned by the runner, file 0600)."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self._lock_fd = -1  # the lock file, open and locked while this runner runs

    def lock(self) -> None:
        """Take the state directory for this process, as long as it lives: one live runner per
        registration (a second one would serve as the first's runner id). An OS lock
        (``flock``) on ``LOCK_FILE``: the kernel lets go of it when the process ends, however
        it ends, so a killed runner leaves nothing to clean up. StateError when another live
        process holds it, naming it and ``--state-dir``."""
        where = self._make_dir()
        path = where / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise StateError(f"cannot open {path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = ""
            with contextlib.suppress(OSError, ValueError):
                holder = f" (pid {int(os.pread(fd, 32, 0).decode().strip())})"
            os.close(fd)
            raise StateError(
                f"another runner{holder} is running on the registration in {self.dir}: "
                "give this one its own --state-dir (a runner per backend set, each its own "
                "runner id), or stop that one first"
            ) from None
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    @property
    def private_dir(self) -> Path:
        """Where the file is (``state_dir`` itself or its ``uid-<UID>`` subdirectory)."""
        return private_dir(self.dir)

    @property
    def path(self) -> Path:
        return self.private_dir / STATE_FILE

    def _secure_dir(self, where: Path) -> None:
        """``where`` exists: make sure it is ours and 0700 (tightened when it is looser)."""
        st = os.lstat(where) if where != self.dir else os.stat(where)
        uid = os.geteuid()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            raise StateError(
                f"{where} is not a directory of this runner's user (uid {uid}); it would hold "
                "the runner token: move it away and start again"
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(where, 0o700)

    def _make_dir(self) -> Path:
        where = self.private_dir
        if where == self.dir:
            make_private_dirs(where)  # its missing parents 0700 too, whatever the umask
        else:
            try:
                where.mkdir(mode=0o700, exist_ok=True)
            except PermissionError:
                st = os.stat(self.dir)
                raise StateError(
                    f"cannot use the state directory {self.dir}: it belongs to uid {st.st_uid} "
                    f"(mode {stat.S_IMODE(st.st_mode):o}) and uid {os.geteuid()} may not write "
                    f"in it: `chown {os.geteuid()} {self.dir}`, or give another --state-dir"
                ) from None
        self._secure_dir(where)
        return where

    def _load_all(self) -> list[dict[str, Any]]:
        """The file's entries (either form), not yet checked one by one; [] when there is none."""
        path = self.path
        try:
            if path.parent.exists():
                self._secure_dir(path.parent)
            if not path.exists():
                return []
            _check_private(path, 0o600)
            data = json.loads(path.read_text())
            regs = data["registrations"]
            if isinstance(regs, dict):  # the first form: one per project, keyed by it
                regs = list(regs.values())
            if not isinstance(regs, list) or not all(isinstance(r, dict) for r in regs):
                raise TypeError
            return regs
        except (ValueError, KeyError, TypeError):
            raise StateError(
                f"{path} is not a registration file; move it away to register anew"
            ) from None
        except OSError as exc:
            raise StateError(f"{path}: {exc.strerror}") from None

    def projects(self) -> list[str]:
        """The projects (``OWNER/PROJECT``) with a saved registration, in the file's order; []
        when the file is missing or unreadable (read only: its directory's mode left as it is,
        for doctor to see)."""
        try:
            regs = json.loads(self.path.read_text())["registrations"]
        except (OSError, ValueError, KeyError, TypeError):
            return []
        found: list[str] = []
        for raw in regs.values() if isinstance(regs, dict) else regs:
            if isinstance(raw, dict) and raw.get("owner") and raw.get("project"):
                key = f"{raw['owner']}/{raw['project']}"
                if key not in found:
                    found.append(key)
        return found

    def registrations(self, project: str) -> list[SavedRegistration]:
        """Every saved registration of ``project`` (``OWNER/PROJECT``), whatever its Server."""
        found = []
        for raw in self._load_all():
            try:
                reg = SavedRegistration(**raw)
            except TypeError:
                raise StateError(f"{self.path}: an entry is damaged; register again") from None
            if reg.key == project:
                found.append(reg)
        return found

    def load(self, server: str, project: str) -> SavedRegistration | None:
        """The saved registration for ``project`` (``OWNER/PROJECT``) at ``server``, if any."""
        return next((r for r in self.registrations(project) if r.is_for(server, project)), None)

    def find(
        self, server: str, project: str, *, server_given: bool = True
    ) -> SavedRegistration | None:
        """The registration a runner for ``project`` uses: the one saved for ``server``; when
        no Server was given (``server`` is the default), else the project's only one, at the
        Server it names (registered once with ``--server``, run without it). ``StateError``
        when there are several and none is at ``server``: which one is not guessed."""
        regs = self.registrations(project)
        reg = next((r for r in regs if r.is_for(server, project)), None)
        if reg is not None or server_given or not regs:
            return reg
        if len(regs) == 1:
            return regs[0]
        raise WhichServer(
            f"{self.path} holds registrations for {project} on "
            f"{', '.join(r.server for r in regs)}: give --server to say which Server to serve"
        )

    def missing(self, server: str, project: str) -> str:
        """Says, in one line, that ``project`` has no registration at ``server`` (and where it
        has one: that token is not sent to ``server``)."""
        elsewhere = [
            r.server for r in self.registrations(project) if not same_server(r.server, server)
        ]
        held = (
            f" (registered on {', '.join(elsewhere)} only; a runner token goes only to the "
            "Server that issued it)"
            if elsewhere
            else ""
        )
        return f"no registration for {project} on {server}{held}"

    def save(self, reg: SavedRegistration) -> None:
        """Persist ``reg`` atomically, owner-only, in place of the one for the same Server and
        project (the others are kept)."""
        path = self.path
        try:
            self._make_dir()
            regs = [
                raw
                for raw in self._load_all()
                if not (
                    f"{raw.get('owner')}/{raw.get('project')}" == reg.key
                    and same_server(str(raw.get("server", "")), reg.server)
                )
            ]
            regs.append(asdict(reg))
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o600)
                json.dump({"version": FILE_VERSION, "registrations": regs}, f, indent=2)
                f.write("\n")
            os.replace(tmp, path)
        except OSError as exc:
            raise StateError(f"cannot write {path}: {exc.strerror}") from None
