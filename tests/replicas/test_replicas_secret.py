"""Replicas that trust only each other (issue 34 point 4), on a real PostgreSQL with each
replica's server on loopback: the internal routes take only requests signed with a team secret
the operator gives (nothing in the store gives one), within a short window and once; two
secrets are accepted at once, so it is rotated without downtime; ``hub doctor`` says when
replicas talk plain HTTP across hosts."""

from __future__ import annotations

import hashlib
import hmac
import io
import time
from pathlib import Path

import httpx
import pytest
from helpers import ADMIN, OWNER, PROJECT, TEAM_SECRET, runner_config, running
from test_replicas import _chat, replicas, until

from gateway.hub import doctor
from gateway.hub.replicas.remote import ROUTE
from gateway.hub.replicas.signing import sign
from gateway.hub.settings import HubSettings
from gateway.hub.store import token_hash
from gateway.sim import Simulator
from gateway.wire import protocol

NEW = "the-new-team-secret-0123456789abcdef-rotated"
WRONG = "not-the-team-secret-0123456789abcdef-at-all"


async def test_the_internal_routes_take_only_signed_requests_once(
    pg_url: str, sim: Simulator, tmp_path: Path
) -> None:
    async with replicas(pg_url, 2) as (a, b):
        key = await a.hub.store.create_api_key("alice", f"{OWNER}/{PROJECT}")
        async with running(runner_config(b.url, sim.url, tmp_path / "state")) as runner:
            assert runner.registration is not None
            runner_id = runner.registration.id
            await until(lambda: a.hub.board.alive(runner_id), a)
            first = await _chat(a.url, key, "s1")
            assert first.status_code == 200, first.text
            job_id = next(iter(a.hub.sessions.live.values())).job_id
            assert job_id is not None and b.hub.channels.local(job_id) is not None
            path = f"{ROUTE}{job_id}/frames"
            end = protocol.end_frame(job_id, "forged").encode()
            # what anyone who can read the store could make before: refused
            derived = hmac.new(
                token_hash(ADMIN).encode(), b"alp-gateway: the replicas' credential", hashlib.sha256
            ).hexdigest()
            refused: dict[str, int] = {}
            async with httpx.AsyncClient(base_url=b.url, timeout=30) as http:
                tries = {
                    "derived from the store": {"authorization": f"Bearer {derived}"},
                    "unsigned": {},
                    "another secret": dict(_signed(WRONG, path, end, time.time())),
                    "too old": dict(_signed(TEAM_SECRET, path, end, time.time() - 120)),
                    "from the future": dict(_signed(TEAM_SECRET, path, end, time.time() + 120)),
                    "another body": dict(_signed(TEAM_SECRET, path, b"{}", time.time())),
                }
                for what, headers in tries.items():
                    r = await http.post(path, content=end, headers=headers)
                    refused[what] = r.status_code
                # a signed request is taken once: the same bytes again are refused
                probe = f"{ROUTE}no-such-job/frames"
                signed = dict(_signed(TEAM_SECRET, probe, b"{}", time.time()))
                taken = await http.post(probe, content=b"{}", headers=signed)
                replayed = await http.post(probe, content=b"{}", headers=signed)
            # the channel and its session untouched: the next turn through a is served by b
            assert b.hub.channels.local(job_id) is not None
            again = await _chat(a.url, key, "s1")
    assert refused == dict.fromkeys(tries, 401), refused
    assert taken.status_code == 404  # past the check: no such job here
    assert replayed.status_code == 401 and "replayed" in replayed.text
    assert again.status_code == 200 and b'"error"' not in again.content


def _signed(secret: str, path: str, body: bytes, at: float) -> list[tuple[str, str]]:
    return [(k.decode(), v.decode()) for k, v in sign(secret, "POST", path, body, at)]


async def test_two_secrets_at_once_rotate_the_team_without_downtime(
    pg_url: str, sim: Simulator, tmp_path: Path
) -> None:
    """Mid-rotation: a signs with the new secret and still takes the old, b the other way round;
    a forwarded turn is served, and each replica takes what the other signs."""
    team = [(NEW, TEAM_SECRET), (TEAM_SECRET, NEW)]
    async with replicas(pg_url, 2, team=team) as (a, b):
        key = await a.hub.store.create_api_key("alice", f"{OWNER}/{PROJECT}")
        async with running(runner_config(b.url, sim.url, tmp_path / "state")) as runner:
            assert runner.registration is not None
            runner_id = runner.registration.id
            await until(lambda: a.hub.board.alive(runner_id), a)
            answers = [await _chat(a.url, key, "s1") for _ in range(2)]  # a → b, signed NEW
            job_id = next(iter(a.hub.sessions.live.values())).job_id
        probe = f"{ROUTE}no-such-job/frames"
        found = {}
        for name, replica in (("a", a), ("b", b)):
            async with httpx.AsyncClient(base_url=replica.url, timeout=30) as http:
                for secret_name, secret in (("new", NEW), ("old", TEAM_SECRET), ("wrong", WRONG)):
                    headers = dict(_signed(secret, probe, b"{}", time.time()))
                    r = await http.post(probe, content=b"{}", headers=headers)
                    found[name, secret_name] = r.status_code
    assert [r.status_code for r in answers] == [200, 200]
    assert job_id is not None and a.hub.counters.failovers == 0
    assert found == {
        ("a", "new"): 404,  # taken (no such job)
        ("a", "old"): 404,
        ("a", "wrong"): 401,
        ("b", "new"): 404,
        ("b", "old"): 404,
        ("b", "wrong"): 401,
    }


async def test_hub_doctor_says_when_replicas_talk_plain_http_across_hosts(pg_url: str) -> None:
    # two: ``replicas`` waits until each has read the other's heartbeat, so both rows are there
    async with replicas(pg_url, 2, advertise="http://203.0.113.9:8787"):
        out = io.StringIO()
        await doctor.check(HubSettings(store=pg_url), doctor.Report(out))
    lines = out.getvalue()
    assert "! transport: replica(s) r0, r1 advertise plain http:// to another host" in lines
    assert "! team secret: none given here" in lines
    assert not doctor._plain_across_hosts("http://127.0.0.1:8787")
    assert not doctor._plain_across_hosts("https://hub-b:8787")
    assert doctor._plain_across_hosts("http://hub-b:8787")


def test_the_team_secret_from_a_file_one_line_each_and_its_errors(tmp_path: Path) -> None:
    from gateway.hub.replicas.replica import team_secrets

    path = tmp_path / "team-secret"
    path.write_text(f"{NEW}\n{TEAM_SECRET}\n")
    assert team_secrets(HubSettings(team_secret_file=path)) == (NEW, TEAM_SECRET)
    path.write_text("short\n")
    for settings, said in (
        (HubSettings(team_secret_file=path), "32 characters or more"),
        (HubSettings(team_secret_file=tmp_path / "none"), "cannot read --team-secret-file"),
    ):
        with pytest.raises(ValueError, match=said) as refused:
            team_secrets(settings)
        assert "short" not in str(refused.value)  # the error never repeats a secret
