"""What a hub loads to start: a hub that signs nobody in does without the sign-in libraries
(httpx, PyJWT, rsa and the cryptography package PyJWT takes in), and no command line built
takes in the ``connect`` command's HTTP client. They cost a hub some 18 MB of its memory and a
tenth of a second of its start (54 against 37 MB idle, 470 against 355 ms to listening, on the
2-core machine on 7 Dec).

The start runs in a fresh interpreter, as ``alp-gateway hub`` starts: the command line built
(every command's arguments), the hub's command module, then a hub on SQLite in a scratch
directory served on loopback; what it imported is read from its ``sys.modules`` once it listens.
The libraries are installed here (the tests use them), so a module that imports one at its top
again fails this test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the sign-in libraries (gateway/hub/oidc.py) and what httpx's import brings when it is there
NOT_AT_START = ("httpx", "jwt", "rsa", "cryptography", "click", "rich", "pygments")

START = """
import json, sys
import trio
import gateway.cli
gateway.cli.build_parser()
import gateway.hub.cli
from gateway.hub import Hub
from gateway.hub.app import open_hub

async def main():
    async with open_hub(Hub(sys.argv[1])) as (_hub, url):
        assert url.startswith("http://127.0.0.1:")
        print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))

trio.run(main)
"""


def test_a_hub_that_signs_nobody_in_starts_without_the_sign_in_libraries(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", START, str(tmp_path / "data")],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert "gateway" in loaded and "trio" in loaded  # the start ran
    assert sorted(loaded & set(NOT_AT_START)) == []
