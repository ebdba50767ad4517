"""``hub backup`` and ``hub restore`` (issue 36 point 6): a whole copy of a running hub's SQLite
store, taken under load, restored.

A hub serves turns of several clients through a real runner to the simulator, on loopback,
while API keys are made; ``alp-gateway hub backup`` runs as another process meanwhile. What the
store held (committed) just before the backup started is read by a connection of the test's
own; the restored store has every one of those keys and usage rows. ``hub restore`` is refused,
one line, while the hub runs on the data directory, and done once it has stopped."""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path
from typing import Any

import httpx
import trio
from helpers import ADMIN, EXE, OWNER, PROJECT, clean_env, runner_config, running

from gateway.hub import Hub, open_hub
from gateway.hub.store import open_store
from gateway.sim import Simulator

LIMIT = 60.0  # s: no step of this real-time test may take longer
CLIENTS = 4
PROMPT = [{"role": "user", "content": "one two three four"}]


def committed(data: Path) -> tuple[set[str], dict[int, tuple[Any, ...]]]:
    """The API keys and usage rows committed in ``data``'s store, as a reader sees them."""
    db = sqlite3.connect(data / "hub.sqlite3")
    try:
        keys = {row[0] for row in db.execute("SELECT name FROM api_keys")}
        rows = {row[0]: row for row in db.execute("SELECT * FROM usage_turns")}
    finally:
        db.close()
    return keys, rows


async def hub_cli(*argv: str) -> tuple[int, str, str]:
    done = await trio.run_process(
        [EXE, "hub", *argv], env=clean_env(), capture_stdout=True, capture_stderr=True, check=False
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def test_a_backup_taken_under_load_restores_every_key_and_usage_row_before_it(
    sim: Simulator, tmp_path: Path
) -> None:
    data = tmp_path / "hub"
    copy = tmp_path / "backups" / "hub-backup.sqlite3"
    served = trio.Event()  # a few turns' rows are in the store
    turns = 0
    made_keys = 0
    with trio.fail_after(LIMIT):
        async with open_hub(Hub(data, admin_token=ADMIN, runner_wait_timeout=LIMIT)) as (hub, url):
            key = await hub.keys.create("alice", f"{OWNER}/{PROJECT}")
            async with running(runner_config(url, sim.url, tmp_path / "state")):
                async with trio.open_nursery() as load:

                    async def client(n: int) -> None:
                        nonlocal turns
                        async with httpx.AsyncClient(base_url=url, timeout=LIMIT) as http:
                            while True:
                                resp = await http.post(
                                    "/v1/chat/completions",
                                    headers={
                                        "Authorization": f"Bearer {key}",
                                        "X-Chat-Session": f"c{n}",
                                    },
                                    json={
                                        "model": "sim-model",
                                        "messages": PROMPT,
                                        "sim": {"chunks": 3},
                                    },
                                )
                                assert resp.status_code == 200, resp.text
                                turns += 1
                                if turns >= 3 * CLIENTS:
                                    served.set()

                    async def keys() -> None:
                        nonlocal made_keys
                        while True:
                            await hub.keys.create(f"k{made_keys}", f"{OWNER}/{PROJECT}")
                            made_keys += 1
                            await trio.lowlevel.checkpoint()

                    for n in range(CLIENTS):
                        load.start_soon(client, n)
                    load.start_soon(keys)
                    await served.wait()
                    await hub.store.flush_usage()
                    before_keys, before_rows = committed(data)
                    turns_at_backup = turns
                    code, out, err = await hub_cli("--data", str(data), "backup", str(copy))
                    assert code == 0, err
                    turns_during = turns - turns_at_backup
                    # a hub runs on the data directory: not overwritten
                    code, out2, refused = await hub_cli("--data", str(data), "restore", str(copy))
                    load.cancel_scope.cancel()
            await hub.store.flush_usage()
            after_keys, after_rows = committed(data)
        await hub.store.close()  # the hub has stopped (as its command does at its end)
        # the hub has stopped: restored
        code_restore, restored_out, restored_err = await hub_cli(
            "--data", str(data), "restore", str(copy)
        )
    print(
        f"backup under load: {len(before_keys)} keys and {len(before_rows)} usage rows before it, "
        f"{turns_during} turns served while it ran; {len(after_rows)} rows at the hub's stop"
    )
    assert code == 2 and "a hub is running" in refused and "\n" not in refused.strip(), refused
    assert "Traceback" not in refused and out2 == ""
    assert "backed up" in out and str(copy) in out
    assert stat.S_IMODE(copy.stat().st_mode) == 0o600
    assert sorted(os.listdir(copy.parent)) == [copy.name]  # one file: no partial, no log
    assert code_restore == 0, restored_err
    assert "restored" in restored_out
    assert len(before_rows) >= 3 * CLIENTS and len(before_keys) >= 2
    assert len(after_rows) > len(before_rows)  # the load went on after the backup
    keys_back, rows_back = committed(data)
    assert before_keys <= keys_back, before_keys - keys_back
    missing = {i for i in before_rows if rows_back.get(i) != before_rows[i]}
    assert not missing, sorted(missing)
    assert keys_back <= after_keys and rows_back.keys() <= after_rows.keys()
    # the store replaced is kept, whole: every row the hub wrote up to its stop
    kept = sqlite3.connect(data / "hub.sqlite3.replaced")
    try:
        assert kept.execute("SELECT COUNT(*) FROM usage_turns").fetchone()[0] == len(after_rows)
    finally:
        kept.close()
    # a hub opens the restored store
    store = open_store(data, create=False)
    try:
        assert len(await store.usage_rows()) == len(rows_back)
    finally:
        await store.close()
