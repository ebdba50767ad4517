"""A throwaway PostgreSQL server for tests: Debian's ``initdb`` and ``pg_ctl`` in a temporary
directory, on a free loopback port, with a password (so every test goes through one), stopped by
``pg_ctl`` (its PID killed if that fails) and deleted at the end; a fresh database per test.

As root the server runs as the ``postgres`` user (``runuser -u postgres``: PostgreSQL refuses
root), otherwise as the current user. Where PostgreSQL is not installed the tests that need it
skip with the reason, except in CI (``CI=true``), where they fail: ``.ci/run`` installs it."""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pathlib
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile

import psycopg
import pytest

PG_MAJOR = "15"  # Debian 12's; another installed version is taken when 15 is not
USER = "postgres"  # the database superuser the tests connect as
_names = itertools.count(1)


def bin_dir() -> pathlib.Path | None:
    """The directory of ``initdb`` and ``pg_ctl``: ``$ALP_TEST_PG_BIN``, else Debian's."""
    given = os.environ.get("ALP_TEST_PG_BIN")
    if given:
        return pathlib.Path(given)
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    preferred = [f for f in found if f"/{PG_MAJOR}/" in f]
    chosen = (preferred or found)[-1:] if found else []
    return pathlib.Path(chosen[0]).parent if chosen else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PgServer:
    """One server in its own temporary directory: ``start``, ``stop``, ``database``."""

    def __init__(self, bin_path: pathlib.Path) -> None:
        self.bin = bin_path
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="alp-pg-"))
        self.data = self.root / "data"
        self.password = secrets.token_urlsafe(12)
        self.port = 0
        self._as: list[str] = []
        if os.geteuid() == 0:  # PostgreSQL will not run as root
            self._as = ["runuser", "-u", USER, "--"]
            account = pwd.getpwnam(USER)
            os.chown(self.root, account.pw_uid, account.pw_gid)
        pwfile = self.root / "pw"
        pwfile.write_text(self.password + "\n")
        if self._as:
            os.chown(pwfile, pwd.getpwnam(USER).pw_uid, -1)
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            USER,
            f"--pwfile={pwfile}",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
            "--no-sync",
        )
        pwfile.unlink()

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            [*self._as, str(self.bin / tool), *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            log = self.root / "log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr.strip()} {tail}")

    def start(self) -> None:
        """Start the server (on the port it had, the first time on a free one)."""
        for _ in range(5):
            self.port = self.port or _free_port()
            try:
                self._run(
                    "pg_ctl",
                    "-D",
                    str(self.data),
                    "-l",
                    str(self.root / "log"),
                    "-w",
                    "-t",
                    "60",
                    "-o",
                    f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
                    " -c fsync=off -c synchronous_commit=off -c full_page_writes=off",
                    "start",
                )
                return
            except RuntimeError:
                if "could not bind" not in (self.root / "log").read_text():
                    raise
                self.port = 0  # taken meanwhile: another free one
        raise RuntimeError("no free port for PostgreSQL")

    def stop(self) -> None:
        """Stop the server now (``pg_ctl stop -m fast``: its sessions are ended)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def url(self, dbname: str = "postgres", *, password: str | None = None) -> str:
        secret = self.password if password is None else password
        return f"postgresql://{USER}:{secret}@127.0.0.1:{self.port}/{dbname}"

    def database(self) -> str:
        """A new empty database; its URL."""
        name = f"t{os.getpid()}_{next(_names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop(self, url: str) -> None:
        """Drop the database of ``url`` (its sessions ended first)."""
        name = url.rsplit("/", 1)[1]
        with (
            contextlib.suppress(psycopg.OperationalError),
            psycopg.connect(self.url(), autocommit=True) as conn,
        ):
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def destroy(self) -> None:
        """Stop the server (by its PID if ``pg_ctl`` cannot) and delete its directory."""
        pidfile = self.data / "postmaster.pid"
        try:
            if pidfile.exists():
                self.stop()
        except (RuntimeError, subprocess.TimeoutExpired):
            with contextlib.suppress(OSError, ValueError, IndexError):
                os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


def start_or_skip() -> PgServer:
    """A started server, or the test skipped (failed in CI) with the reason there is none."""
    path = bin_dir()
    reason = None
    if path is None or not (path / "initdb").exists():
        reason = "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb)"
    elif os.geteuid() == 0:
        try:
            pwd.getpwnam(USER)
        except KeyError:
            reason = f"running as root and there is no {USER!r} user to run PostgreSQL as"
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}: CI must run the PostgreSQL tests (.ci/run installs it)")
        pytest.skip(f"{reason}: the PostgreSQL store tests need it (apt-get install postgresql)")
    assert path is not None
    server = PgServer(path)
    try:
        server.start()
    except BaseException:
        server.destroy()
        raise
    return server
