"""Owner-only directories and files (0700, 0600), made so whatever the process's umask.

``Path.mkdir(parents=True)`` gives every parent it makes ``0777 & ~umask`` (0777 under
``umask 000``), and ``Path.write_text`` a file ``0666 & ~umask``: where a secret, a token or
an identity lives, that is everyone's. Both here set the mode themselves.
"""

from __future__ import annotations

import os
from pathlib import Path


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and each of its missing parents, every one made 0700 (owner-only)
    whatever the umask; directories that exist already are left as they are."""
    missing: list[Path] = []
    here = path
    while not os.path.lexists(here):
        missing.append(here)
        if here.parent == here:
            break
        here = here.parent
    for where in reversed(missing):
        try:
            os.mkdir(where, 0o700)
        except FileExistsError:  # made meanwhile (another process)
            continue
        os.chmod(where, 0o700)  # the umask may have taken bits away from the owner too


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path``, the file owner-only (0600) whatever the umask, replaced if it
    exists (never followed through a symlink)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)
