"""The ``hub runners`` commands: enrollment tokens made, listed and revoked; runners listed and
revoked, on the hub's store (a running hub applies a revocation within ``REVOCATION_CHECK`` s).
What they print that a runner or an admin chose is escaped as the logs are."""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import trio

from gateway import logsafe
from gateway.config import parse_duration
from gateway.hub.runners import pick
from gateway.hub.store import Enrollment, Store

Table = Callable[[Sequence[str], Sequence[Sequence[str]], int], list[str]]


def add_runners_commands(parser: Any, sub: Any, positive: Callable[[str], int]) -> None:
    """``hub runners ...``: enrollment tokens (made, listed, revoked) and runners (listed,
    revoked); ``parser`` is the hub's (``gateway.hub.cli``), ``positive`` its type of a count."""
    runners = parser.command(sub, "runners", help="enroll, list and revoke runners")
    runners_sub = runners.add_subparsers(
        dest="runners_command",
        metavar="{enroll,enrollments,unenroll,list,revoke}",
        parser_class=type(parser),
        required=True,
    )
    enroll = runners.command(
        runners_sub,
        "enroll",
        help="make an enrollment token (printed once) that registers runners in one project "
        "and does nothing else; give it to a runner host as AGENTICS_USER_TOKEN",
    )
    enroll.add_argument("--project", required=True, help="OWNER/PROJECT its runners serve")
    enroll.add_argument(
        "--expires", metavar="DURATION", help="valid for 30m, 24h, 7d... (default: until revoked)"
    )
    enroll.add_argument(
        "--uses", type=positive, metavar="N", help="registrations it may make (default: any)"
    )
    runners.command(runners_sub, "enrollments", help="list enrollment tokens")
    unenroll = runners.command(
        runners_sub,
        "unenroll",
        help="revoke an enrollment token (the runners it registered stay: revoke them apart)",
    )
    unenroll.add_argument("id", help="the token's id (`hub runners enrollments`)")
    runners.command(
        runners_sub, "list", help="list runners: name, project, last seen, models, sessions"
    )
    revoke = runners.command(
        runners_sub,
        "revoke",
        help="revoke a runner: refused from now on, its channels closed and its sessions moved "
        "(a running hub applies it within a second)",
    )
    revoke.add_argument("runner", metavar="NAME|ID")


def runners_command(args: argparse.Namespace, store: Store, table: Table) -> int:
    """``hub runners ...`` on the hub's ``store`` (closed after); ValueError (one line) on a
    mistake; ``table`` lays out the lists."""
    expires: float | None = None
    if getattr(args, "expires", None) is not None:
        try:
            expires = parse_duration(args.expires)
        except ValueError as exc:
            raise ValueError(f"--expires {args.expires!r} is {exc}") from None
    return trio.run(_runners_in, args, store, expires, table)


async def _runners_in(
    args: argparse.Namespace, store: Store, expires: float | None, table: Table
) -> int:
    try:
        command = args.runners_command
        if command == "enroll":
            if expires is not None and expires <= 0:
                raise ValueError("--expires must be a positive duration")
            expires_at = None if expires is None else time.time() + expires
            found, token = await store.create_enrollment(args.project, expires_at, args.uses)
            print(
                f"enrollment token {found.id} registers runners in "
                f"{logsafe.safe(args.project)} ({_enrollment_bounds(found)}); it is shown only "
                "now: give it to a runner host as AGENTICS_USER_TOKEN",
                file=sys.stderr,
            )
            print(token)
            return 0
        if command == "enrollments":
            found_all = await store.list_enrollments()
            if not found_all:
                print("no enrollment tokens", file=sys.stderr)
                return 0
            now = time.time()
            rows = [
                (
                    e.id,
                    f"{e.owner}/{e.project}",
                    e.created_at,
                    _enrollment_bounds(e),
                    str(e.used),
                    _enrollment_status(e, now),
                )
                for e in found_all
            ]
            header = ("ID", "PROJECT", "CREATED", "BOUNDS", "USED", "STATUS")
            print("\n".join(table(header, rows, len(header))))
            return 0
        if command == "unenroll":
            if await store.revoke_enrollment(args.id):
                print(f"revoked enrollment token {logsafe.safe(args.id)}")
                return 0
            raise ValueError(f"no active enrollment token has the id {args.id!r}")
        if command == "list":
            listed = await store.list_runners()
            if not listed:
                print("no runners", file=sys.stderr)
                return 0
            runner_rows = [
                (
                    r.name,
                    r.id,
                    f"{r.owner}/{r.project}",
                    "-" if r.last_seen is None else _ago(time.time() - r.last_seen),
                    "-" if r.models is None else ", ".join(r.models),
                    str(r.sessions),
                    "revoked" if r.revoked_at is not None else "active",
                )
                for r in listed
            ]
            runner_header = ("NAME", "ID", "PROJECT", "LAST SEEN", "MODELS", "SESSIONS", "STATUS")
            print("\n".join(table(runner_header, runner_rows, 5)))
            return 0
        runner = pick(await store.list_runners(), args.runner)  # RunnerNotFound: a ValueError
        await store.revoke_runner(runner.id)
        print(
            f"revoked runner {logsafe.safe(runner.name)!r} ({runner.id}); a running hub refuses "
            "it at once and closes its channels within a second"
        )
        return 0
    finally:
        await store.close()


def _enrollment_bounds(found: Enrollment) -> str:
    """``until 2026-12-07 17:00 UTC, 2 uses left`` (only the bounds set), or ``no bounds``."""
    parts = []
    if found.expires_at is not None:
        until = datetime.datetime.fromtimestamp(found.expires_at, datetime.UTC)
        parts.append(f"until {until:%Y-%m-%d %H:%M UTC}")
    if found.uses_left is not None:
        parts.append(f"{found.uses_left} use(s) left")
    return ", ".join(parts) or "no bounds"


def _enrollment_status(found: Enrollment, now: float) -> str:
    """active, revoked, expired or used up."""
    refusal = found.refusal(now)
    return "active" if refusal is None else refusal.rsplit(" ", 1)[-1].replace("up", "used up")


def _ago(seconds: float) -> str:
    """``12 s ago``, ``3 min ago``, ``5 h ago``."""
    if seconds < 120:
        return f"{max(0, round(seconds))} s ago"
    if seconds < 7200:
        return f"{round(seconds / 60)} min ago"
    return f"{round(seconds / 3600)} h ago"
