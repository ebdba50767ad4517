"""The persisted runner registration: an owner-only JSON file in the state directory."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_FILE = "registration.json"


class StateError(RuntimeError):
    """The state directory or file cannot be used; the message is one line for the user."""


@dataclass(frozen=True)
class Registration:
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

    def __repr__(self) -> str:  # the token never reaches a log line through repr()
        return (
            f"Registration(id={self.id!r}, name={self.name!r}, server={self.server!r}, "
            f"project={self.key!r})"
        )


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
            where.mkdir(parents=True, exist_ok=True, mode=0o700)
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

    def _load_all(self) -> dict[str, dict[str, str]]:
        path = self.path
        try:
            if path.parent.exists():
                self._secure_dir(path.parent)
            if not path.exists():
                return {}
            _check_private(path, 0o600)
            data = json.loads(path.read_text())
            regs = data["registrations"]
            if not isinstance(regs, dict):
                raise TypeError
            return regs
        except (ValueError, KeyError, TypeError):
            raise StateError(
                f"{path} is not a registration file; move it away to register anew"
            ) from None
        except OSError as exc:
            raise StateError(f"{path}: {exc.strerror}") from None

    def load(self, project: str) -> Registration | None:
        """The saved registration for ``project`` (``OWNER/PROJECT``), if any."""
        raw = self._load_all().get(project)
        if raw is None:
            return None
        try:
            return Registration(**raw)
        except TypeError:
            raise StateError(
                f"{self.path}: the entry for {project} is damaged; register again"
            ) from None

    def save(self, reg: Registration) -> None:
        """Persist ``reg`` atomically, owner-only."""
        path = self.path
        try:
            self._make_dir()
            regs = self._load_all()
            regs[reg.key] = asdict(reg)
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o600)
                json.dump({"registrations": regs}, f, indent=2)
                f.write("\n")
            os.replace(tmp, path)
        except OSError as exc:
            raise StateError(f"cannot write {path}: {exc.strerror}") from None
