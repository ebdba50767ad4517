"""``alp-gateway hub doctor``: check a hub's store (reachable, its schema migrated and not newer
than this code), and on PostgreSQL the replicas it knows (each one's heartbeat, version, and
whether its address answers from here, whether they talk plain HTTP across hosts, whether a
team secret is given), with a fix for each failure.

Opening the store applies the migrations this code knows, as a starting hub does; nothing else
is written. One line a check, no password ever (URLs are said redacted)."""

from __future__ import annotations

import ipaddress
import sys
from typing import TextIO
from urllib.parse import urlsplit

import httpx
import trio

from gateway import __version__
from gateway.hub.replicas.replica import EXPIRY, team_secrets
from gateway.hub.replicas.store.base import ReplicaRow
from gateway.hub.replicas.store.shared import shared
from gateway.hub.settings import HubSettings
from gateway.hub.store import StoreError, StoreMissing, open_store
from gateway.hub.store.dburl import is_url, redact
from gateway.hub.store.schema import LATEST

OK, FAIL, WARN = "✓", "✗", "!"
PROBE_TIMEOUT = 3.0  # s for a replica's /healthz to answer


class Report:
    """The checks' lines, and whether one failed."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.failed = False

    def add(self, mark: str, what: str, detail: str, fix: str = "") -> None:
        self.failed |= mark == FAIL
        line = f"{mark} {what}: {detail}"
        print(line + (f"\n    fix: {fix}" if fix else ""), file=self.out)


async def check(settings: HubSettings, report: Report) -> None:
    """Every check in turn (those that need the store only when it opened)."""
    place = settings.store or settings.data
    where = redact(place) if isinstance(place, str) and is_url(place) else str(place)
    try:
        store = open_store(place, create=False, pool_size=1)
    except StoreMissing as exc:
        report.add(FAIL, "store", str(exc), "give the --store (or --data) of the hub you run")
        return
    except (StoreError, OSError) as exc:
        report.add(FAIL, "store", str(exc), "start the database, or fix the URL's host and user")
        return
    try:
        kind = "PostgreSQL" if settings.store else "SQLite"
        report.add(OK, "store", f"{kind} at {where} reachable")
        report.add(OK, "migrations", f"schema at version {LATEST}, this alp-gateway's")
        team = shared(store, "doctor")
        if team is None:
            report.add(OK, "replicas", "none: a SQLite hub serves alone (--store for a team)")
            return
        try:
            rows = await team.replicas()
        except StoreError as exc:
            report.add(FAIL, "replicas", str(exc), "check the database, then run this again")
            return
        live = [r for r in rows if not r.stopped and r.heartbeat_age < EXPIRY]
        report.add(
            OK if live else WARN,
            "replicas",
            f"{len(live)} up of {len(rows)} known"
            + ("" if live else " (start `alp-gateway hub --store ...`)"),
        )
        _secret(settings, report)
        plain = [r for r in live if _plain_across_hosts(r.url)]
        if plain:
            report.add(
                WARN,
                "transport",
                f"replica(s) {', '.join(r.id for r in plain)} advertise plain http:// to another "
                "host: their forwarded turns (prompts and answers) cross the network unencrypted",
                "serve each replica with --tls-cert/--tls-key and advertise https://, or keep "
                "the replicas on one private network",
            )
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT, trust_env=False) as client:
            for row in rows:
                await _replica(client, row, row in live, report)
    finally:
        await store.close()


def _plain_across_hosts(url: str) -> bool:
    """Whether a replica's advertised URL is plain HTTP to a host other than this machine's
    loopback."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        return False
    host = parts.hostname or ""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a host name: another machine, or a container's


def _secret(settings: HubSettings, report: Report) -> None:
    """Whether this machine's settings give the team secret (the replicas' own are not
    readable from here: each must be given the same)."""
    try:
        found = (
            team_secrets(settings) if (settings.team_secret or settings.team_secret_file) else ()
        )
    except ValueError as exc:
        report.add(FAIL, "team secret", str(exc), "fix the file, or the setting")
        return
    if not found:
        report.add(
            WARN,
            "team secret",
            "none given here (--team-secret-file, ALP_GATEWAY_HUB_TEAM_SECRET): a replica "
            "without it cannot reach the others' channels",
            "give every replica the same secret (`openssl rand -hex 32` in a 0600 file)",
        )
        return
    rotating = " and one more accepted (rotating)" if len(found) > 1 else ""
    report.add(OK, "team secret", f"given{rotating}: the replicas sign their internal requests")


async def _replica(client: httpx.AsyncClient, row: ReplicaRow, live: bool, report: Report) -> None:
    what = f"replica {row.id}"
    if not live:
        state = "stopped" if row.stopped else f"silent for {row.heartbeat_age:.0f} s"
        report.add(OK, what, f"{row.url} {state} (version {row.version})")
        return
    skew = "" if row.version == __version__ else f", this alp-gateway is {__version__}"
    try:
        response = await client.get(f"{row.url}/healthz")
    except httpx.HTTPError as exc:
        report.add(
            FAIL,
            what,
            f"heartbeat {row.heartbeat_age:.1f} s ago, but {row.url} does not answer from "
            f"here ({type(exc).__name__})",
            "the other replicas reach it there too: set its --advertise to an address they "
            "can reach",
        )
        return
    runners = ""
    if response.headers.get("content-type", "").startswith("application/json"):
        runners = f", {response.json().get('runners', 0)} runner(s) seen"
    report.add(
        WARN if skew else OK,
        what,
        f"{row.url} up (heartbeat {row.heartbeat_age:.1f} s ago, version {row.version}{skew}; "
        f"/healthz {response.status_code}{runners})",
    )


def main(settings: HubSettings, out: TextIO = sys.stdout) -> int:
    """Run the checks; 0 when none failed, else 1."""
    report = Report(out)
    trio.run(check, settings, report)
    return 1 if report.failed else 0
