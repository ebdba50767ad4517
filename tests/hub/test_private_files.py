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
from helpers import ADMIN, EXE, OWNER, PROJECT, clean_env

from gateway.hub import Hub, open_hub


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


async def test_a_state_dir_s_missing_parents_are_0700_under_umask_000(tmp_path: Path) -> None:
    state = tmp_path / "a" / "b" / "state"
    async with open_hub(Hub(admin_token=ADMIN)) as (_hub, url):
        result = await _under_umask_000(
            EXE,
            "register",
            "--server",
            url,
            "--project",
            f"{OWNER}/{PROJECT}",
            "--state-dir",
            str(state),
            AGENTICS_USER_TOKEN=ADMIN,
        )
    assert result.returncode == 0, result.stderr
    dirs = _modes_below(tmp_path, state)
    assert dirs == {"a": 0o700, "a/b": 0o700, "a/b/state": 0o700}, dirs
    assert _mode(state / "registration.json") == 0o600


async def test_a_data_dir_s_missing_parents_are_0700_under_umask_000(tmp_path: Path) -> None:
    data = tmp_path / "a" / "b" / "data"
    result = await _under_umask_000(
        EXE, "hub", "--data", str(data), "keys", "create", "k", "--create"
    )
    assert result.returncode == 0, result.stderr
    dirs = _modes_below(tmp_path, data)
    assert dirs == {"a": 0o700, "a/b": 0o700, "a/b/data": 0o700}, dirs
    files = {p.name: _mode(p) for p in data.iterdir() if p.is_file()}
    assert files and all(mode == 0o600 for mode in files.values()), files


async def test_the_replica_id_file_is_0600_under_umask_000(tmp_path: Path) -> None:
    """The id a replica of a team keeps in its data directory (made at its first start)."""
    data = tmp_path / "a" / "data"
    made = (
        "import pathlib, sys\n"
        "from gateway.hub.replicas.replica import replica_id\n"
        "print(replica_id(None, pathlib.Path(sys.argv[1])))\n"
    )
    result = await _under_umask_000(sys.executable, "-c", made, str(data))
    assert result.returncode == 0, result.stderr
    kept = data / "replica-id"
    assert kept.read_text().strip() == result.stdout.decode().strip()
    assert _mode(kept) == 0o600
    assert _modes_below(tmp_path, data) == {"a": 0o700, "a/data": 0o700}
    assert os.stat(kept).st_uid == os.geteuid()
