"""Files and directories the runner and the hub make are owner-only whatever the umask (issue 36
point 7): each command runs in a subprocess under ``umask 000``, where ``mkdir(parents=True)``
made every missing parent 0777 and ``write_text`` the ``replica-id`` file 0666."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import trio
from helpers import clean_env


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def _under_umask_000(*argv: str, **extra_env: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        ["sh", "-c", 'umask 000 && exec "$@"', "sh", *argv],
        env=clean_env(**extra_env),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


def _modes_below(top: Path, leaf: Path) -> dict[str, int]:
    """Each directory from ``top``'s child down to ``leaf``, with its mode."""
    found = {}
    here = leaf
    while here != top:
        found[str(here.relative_to(top))] = _mode(here)
        here = here.parent
    return found


async def test_the_replica_id_file_is_0600_under_umask_000(tmp_path: Path) -> None:
    """The id a replica of a team keeps in its data directory (made at its first start)."""
    data = tmp_path / "a" / "data"
    made = (
        "import pathlib, sys\n"
        "from gateway.hub.team.team import replica_id\n"
        "print(replica_id(None, pathlib.Path(sys.argv[1])))\n"
    )
    result = await _under_umask_000(sys.executable, "-c", made, str(data))
    assert result.returncode == 0, result.stderr
    kept = data / "replica-id"
    assert kept.read_text().strip() == result.stdout.decode().strip()
    assert _mode(kept) == 0o600
    assert _modes_below(tmp_path, data) == {"a": 0o700, "a/data": 0o700}
    assert os.stat(kept).st_uid == os.geteuid()
