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
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise StateError(
            f"{path} is readable by others (mode {mode:o}); it holds the runner token: "
            f"run `chmod {want:o} {path}` and start again"
        )


class StateStore:
    """Reads and writes registrations under ``state_dir`` (directory 0700, file 0600)."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.path = state_dir / STATE_FILE

    def _load_all(self) -> dict[str, dict[str, str]]:
        if not self.path.exists():
            return {}
        _check_private(self.path, 0o600)
        try:
            data = json.loads(self.path.read_text())
            regs = data["registrations"]
            if not isinstance(regs, dict):
                raise TypeError
            return regs
        except (ValueError, KeyError, TypeError):
            raise StateError(
                f"{self.path} is not a registration file; move it away to register anew"
            ) from None
        except OSError as exc:
            raise StateError(f"{self.path}: {exc.strerror}") from None

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
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.dir, 0o700)
            regs = self._load_all()
            regs[reg.key] = asdict(reg)
            tmp = self.path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o600)
                json.dump({"registrations": regs}, f, indent=2)
                f.write("\n")
            os.replace(tmp, self.path)
        except OSError as exc:
            raise StateError(f"cannot write {self.path}: {exc.strerror}") from None
