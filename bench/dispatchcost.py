"""``python -m bench.dispatchcost``: a new session's dispatch CPU as the fleet grows (issue 39,
point 1), in one process without sockets: the hub's board, channels, sessions and dispatcher
over a store in memory, R runners of one project on push streams and S jobs they hold; each new
session's turn waits, its job is opened and offered, the runner woken claims it, its channel is
accepted, the turn gets it. Prints the process CPU a new session took (the mean of ``--new``).

``--hub-path`` runs another checkout's hub parts (``before`` and ``after`` side by side): each
point runs in its own process (``python bench/dispatchcost.py R S N``) with ``PYTHONPATH`` at
that checkout; this file imports nothing of ``bench``, so another checkout's parts run it too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


async def _point(runners: int, jobs: int, new: int) -> float:
    import trio
    import trio.testing

    from gateway.apis.dialects import CHAT
    from gateway.hub.board import Changes, JobBoard
    from gateway.hub.channel import Channels
    from gateway.hub.counters import HubCounters
    from gateway.hub.dispatcher import Dispatcher
    from gateway.hub.job import Job
    from gateway.hub.sessions import Sessions
    from gateway.hub.settings import HubSettings
    from gateway.hub.store import ApiKey, KeyLimits, open_store
    from gateway.hub.turn import Turn
    from gateway.wire.protocol import CAPABILITY

    class Response:  # nobody reads it: no turn here is streamed to a client
        started = finished = gone = False
        backlog = 0

    class Conn:  # a client that never leaves
        async def wait_disconnect(self) -> None:
            await trio.sleep_forever()

    changes, settings, store = Changes(), HubSettings(max_sessions_per_key=10**6), open_store(None)
    board = JobBoard(store, settings, changes)
    channels = Channels(board, changes, HubCounters())

    async def end_job(job_id: str, reason: str) -> None:
        await channels.end_job(job_id, reason)

    sessions = Sessions(
        store,
        idle_timeout=lambda: settings.session_idle_timeout,
        max_per_key=lambda: settings.max_sessions_per_key,
        key_check_interval=lambda: settings.key_check_interval,
        job_over=lambda job_id: False,
        end_job=end_job,
    )
    dispatcher = Dispatcher(settings, board, channels, sessions, HubCounters())
    for i in range(runners):
        board.seen(f"r{i}")
        board.polled(f"r{i}", "o", "p", {CAPABILITY})
    for i in range(jobs):  # the fleet's open sessions
        held = Job(f"j{i}", "o", "p", [CAPABILITY], {}, claimed_by=f"r{i % runners}")
        held.status = "in_progress"
        board.add(held)
    await store.create_api_key("k", "o/p", KeyLimits())
    found = await store.key_limits("k")
    assert found is not None
    key = ApiKey("k", "o", "p", found[0])
    spent = 0.0
    with contextlib.ExitStack() as stack:
        streams = {
            f"r{i}": stack.enter_context(board.subscribe("o", "p", f"r{i}")) for i in range(runners)
        }
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dispatcher.run)
            for n in range(new):
                session, _ = await sessions.enter(key, f"s{n}")
                turn = Turn(
                    "t",
                    session.key[0],
                    session.key_name,
                    session.key[1],
                    b'{"messages":[{"role":"user","content":"hi"}]}',
                    CHAT,
                    Response(),  # type: ignore[arg-type]
                    model=None,
                    stream=False,
                    bound=1,
                    max_answer=1,
                    now=trio.current_time(),
                )
                got: list[object] = []

                async def wait(
                    session: object = session, turn: Turn = turn, got: list = got
                ) -> None:
                    got.append(await dispatcher.channel_for(session, turn, Conn()))  # type: ignore[arg-type]

                started = time.process_time()
                nursery.start_soon(wait)
                await trio.testing.wait_all_tasks_blocked()
                spent += time.process_time() - started
                # the runner woken (the bench's own walk: not counted)
                woken = [r for r, s in streams.items() if s.statistics().current_buffer_used]
                runner_id = woken[0]
                job_id = streams[runner_id].receive_nowait()
                started = time.process_time()
                await board.claim(runner_id, "o", "p", job_id, "box")
                await trio.testing.wait_all_tasks_blocked()
                channels.accept(job_id, runner_id, None)
                await trio.testing.wait_all_tasks_blocked()
                spent += time.process_time() - started
                assert got and got[0] is not None, "the turn got no channel"
            nursery.cancel_scope.cancel()
    return spent / new


def _run_point(runners: int, jobs: int, new: int) -> None:
    import trio
    import trio.testing

    clock = trio.testing.MockClock(autojump_threshold=0)
    cpu = trio.run(_point, runners, jobs, new, clock=clock)
    print(f"{cpu * 1e3:.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dispatchcost", description=__doc__)
    p.add_argument("--sizes", default="10/100,100/1000,1000/5000", help="runners/jobs,...")
    p.add_argument("--new", type=int, default=200, help="new sessions a point")
    p.add_argument("--hub-path", action="append", help="a checkout whose hub runs (repeatable)")
    args = p.parse_args(argv)
    paths = args.hub_path or [str(HERE.parent)]
    print("| hub | runners | held jobs | a new session's dispatch: CPU ms |")
    print("|---|---|---|---|")
    for size in args.sizes.split(","):
        runners, jobs = (int(x) for x in size.split("/"))
        for path in paths:
            env = dict(os.environ, PYTHONPATH=path)
            cmd = [sys.executable, str(HERE / "dispatchcost.py"), str(runners), str(jobs)]
            out = subprocess.run(
                [*cmd, str(args.new)], env=env, cwd=path, capture_output=True, text=True
            )
            found = out.stdout.strip() or out.stderr.strip().splitlines()[-1]
            print(f"| {path} | {runners:,} | {jobs:,} | {found} |", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1].isdigit():
        _run_point(*(int(x) for x in sys.argv[1:]))
    else:
        sys.exit(main())
