"""Runners enrolled and revoked (issue 34, points 1 and 2), on trio's autojump clock: a real hub
on loopback, fake runners (tests/support/fake_runner.py) and the runner API driven by hand.

An enrollment token registers runners in its project and does nothing else; a revoked runner is
refused at once (401), its channels close within a second (virtual time: a revocation made by
another process is applied by the hub's check every ``REVOCATION_CHECK`` s) and its sessions move
to another runner."""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
import trio_websocket
from fake_runner import FakeRunner
from helpers import LogCapture, hub_command

from gateway.hub import Hub, open_hub
from gateway.hub.runnerapi import CHANNEL_PATH
from gateway.hub.store import open_store

ADMIN = "alpa_test_admin_credential"
OWNER, PROJECT = "acme", "chat"
BASE = f"/api/owners/{OWNER}/projects/{PROJECT}"
NEVER = 1000.0
GUARD = 5000.0  # s of virtual time: a hang guard, never a timing
MESSAGES = [{"role": "user", "content": "hi"}]


def hub_of(data: Path | None = None, **settings: Any) -> Hub:
    base: dict[str, Any] = {
        "runner_wait_timeout": NEVER,
        "reconnect_timeout": 0.0,
        "ping_interval": 0.0,  # the clock jumps: no ping may be judged against it
    }
    base.update(settings)
    return Hub(data, admin_token=ADMIN, **base)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def chat(url: str, key: str, session: str) -> httpx.Response:
    headers = {**bearer(key), "X-Chat-Session": session}
    payload = {"model": "fake-model", "messages": MESSAGES}
    async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
        return await http.post("/v1/chat/completions", json=payload, headers=headers)


@asynccontextmanager
async def fake_runner(url: str, credential: str, name: str) -> AsyncIterator[FakeRunner]:
    runner = FakeRunner(url, credential, owner=OWNER, project=PROJECT, name=name, redials=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        yield runner
        nursery.cancel_scope.cancel()


async def test_an_enrollment_token_registers_runners_of_its_project_and_nothing_else(
    autojump_clock: trio.testing.MockClock, logs: LogCapture
) -> None:
    async with open_hub(hub_of()) as (hub, url):
        first, token = await hub.runner_admin.enroll(f"{OWNER}/{PROJECT}", None, 2)
        assert token.startswith("alpe_")
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
            body = {"name": "box", "labels": ["linux"]}
            r = await http.post(f"{BASE}/runners", json=body, headers=bearer(token))
            assert r.status_code == 201 and r.headers["cache-control"] == "no-store"
            runner_token = r.json()["token"]
            poll = await http.post(
                f"{BASE}/runners/jobs", json={"capabilities": []}, headers=bearer(runner_token)
            )
            assert poll.status_code == 204
            # another project: refused, and no use is spent on it
            other = await http.post(
                "/api/owners/acme/projects/other/runners", json=body, headers=bearer(token)
            )
            assert other.status_code == 403
            assert "registers runners in acme/chat only" in other.json()["error"]["message"]
            # everywhere else it is no credential at all
            assert (await http.get("/api/hub/jobs", headers=bearer(token))).status_code == 403
            assert (await http.get("/api/hub/runners", headers=bearer(token))).status_code == 403
            assert (await http.get("/metrics", headers=bearer(token))).status_code == 403
            assert (await http.post("/api/hub/keys", json={"name": "x"}, headers=bearer(token))).status_code == 403  # fmt: skip
            chat_reply = await chat(url, token, "s")
            assert chat_reply.status_code == 401
            assert (await http.get("/v1/models", headers=bearer(token))).status_code == 401
            polled = await http.post(
                f"{BASE}/runners/jobs", json={"capabilities": []}, headers=bearer(token)
            )
            assert polled.status_code == 401
            # an API key or a runner token registers nothing
            for wrong in (key, runner_token):
                r = await http.post(f"{BASE}/runners", json=body, headers=bearer(wrong))
                assert r.status_code == 403 and "enrollment token" in r.text
            # the second use, then used up
            r = await http.post(f"{BASE}/runners", json=body, headers=bearer(token))
            assert r.status_code == 201
            spent = await http.post(f"{BASE}/runners", json=body, headers=bearer(token))
            assert spent.status_code == 401
            assert spent.json()["error"]["message"] == "this enrollment token is used up"
            # expired and revoked ones
            old, old_token = await hub.store.create_enrollment(
                f"{OWNER}/{PROJECT}", time.time() - 1, None
            )
            r = await http.post(f"{BASE}/runners", json=body, headers=bearer(old_token))
            assert r.status_code == 401 and "expired" in r.text
            admin = bearer(ADMIN)
            made = await http.post(
                "/api/hub/enrollments", json={"project": "acme/chat", "uses": 5}, headers=admin
            )
            assert made.status_code == 201 and made.headers["cache-control"] == "no-store"
            listed = (await http.get("/api/hub/enrollments", headers=admin)).json()
            used = {e["id"]: e["used"] for e in listed["enrollments"]}
            assert used == {first.id: 2, old.id: 0, made.json()["id"]: 0}
            assert all("token" not in e for e in listed["enrollments"])
            gone = await http.delete(f"/api/hub/enrollments/{made.json()['id']}", headers=admin)
            assert gone.status_code == 200
            r = await http.post(f"{BASE}/runners", json=body, headers=bearer(made.json()["token"]))
            assert r.status_code == 401 and "revoked" in r.text
            assert not [line for line in logs.lines if "admin credential" in line]
            # the admin credential still registers, with one warning naming the better way
            r = await http.post(f"{BASE}/runners", json=body, headers=admin)
            assert r.status_code == 201 and r.headers["cache-control"] == "no-store"
    warned = [line for line in logs.lines if "with the admin credential" in line]
    assert len(warned) == 1 and "hub runners enroll" in warned[0]
    assert not [line for line in logs.lines if token in line or runner_token in line]
    assert old.expires_at is not None


async def test_a_runner_revoked_on_the_admin_api_is_refused_and_its_session_moves(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(hub_of()) as (hub, url):
        _, token = await hub.runner_admin.enroll(f"{OWNER}/{PROJECT}", None, None)
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        async with (
            httpx.AsyncClient(base_url=url, timeout=GUARD) as http,
            fake_runner(url, token, "a") as a,
        ):
            with trio.fail_after(GUARD):
                assert (await chat(url, key, "s")).status_code == 200
                (job_id,) = a.claimed
                async with fake_runner(url, token, "b") as b:
                    listed = (await http.get("/api/hub/runners", headers=bearer(ADMIN))).json()
                    assert {r["name"] for r in listed["runners"]} == {"a", "b"}
                    revoked_at = trio.current_time()
                    r = await http.delete("/api/hub/runners/a", headers=bearer(ADMIN))
                    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
                    assert r.json() == {"id": a.runner_id, "name": "a", "revoked": True}
                    job = await hub.board.all_jobs.get(job_id)
                    assert job is not None and job.over  # ended before the answer
                    # its channel closed, its redial refused, its final report refused
                    await a.wait_until(
                        lambda: a.reports.get(job_id, [{}])[-1].get("status") == "completed"
                    )
                    closed_after = trio.current_time() - revoked_at
                    moved = await chat(url, key, "s")
                    assert moved.status_code == 200
                    (turn,) = b.turns.values()  # the session's next turn, on b
                    assert turn.job_id in b.claimed and turn.job_id != job_id
                    again = await http.delete("/api/hub/runners/a", headers=bearer(ADMIN))
                    listed = (await http.get("/api/hub/runners", headers=bearer(ADMIN))).json()
                    assert a.token is not None
                    await assert_refused(http, url, a.token, job_id)
    assert closed_after <= 1.0
    assert again.status_code == 404 and "revoked already" in again.text
    assert {r["name"] for r in listed["runners"]} == {"b"}
    assert job.reports[-1] == {
        "status": "completed",
        "conclusion": "failure",
        "logs": "runner revoked",
        "forced": True,
    }
    print(f"OBSERVED revoked runner's channel closed and redial refused after {closed_after} s")


async def assert_refused(http: httpx.AsyncClient, url: str, token: str, job_id: str) -> None:
    """A revoked runner's token: poll, claim, report and events 401, the channel refused."""
    auth = bearer(token)
    poll = await http.post(f"{BASE}/runners/jobs", json={"capabilities": []}, headers=auth)
    assert poll.status_code == 401
    claim = await http.post(
        f"{BASE}/runners/generate-jitconfig", json={"jobId": job_id, "name": "a"}, headers=auth
    )
    assert claim.status_code == 401
    report = await http.patch(
        f"{BASE}/runs/r/jobs/{job_id}", json={"status": "in_progress"}, headers=auth
    )
    assert report.status_code == 401
    authority = urllib.parse.urlsplit(url).netloc
    query = urllib.parse.urlencode({"jobId": job_id, "token": token})
    with pytest.raises(trio_websocket.HandshakeError):
        async with trio_websocket.open_websocket_url(f"ws://{authority}{CHANNEL_PATH}?{query}"):
            pass


async def test_a_runner_revoked_by_the_cli_is_cut_within_a_second(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "hub"
    async with open_hub(hub_of(data)) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        argv = ["runners", "enroll", "--project", f"{OWNER}/{PROJECT}", "--uses", "1"]
        assert await hub_command(autojump_clock, [*argv, "--data", str(data)]) == 0
        token = capsys.readouterr().out.strip()
        assert token.startswith("alpe_")
        async with fake_runner(url, token, "a") as a:
            with trio.fail_after(GUARD):
                assert (await chat(url, key, "s")).status_code == 200
                (job_id,) = a.claimed
                listing = ["runners", "list", "--data", str(data)]
                assert await hub_command(autojump_clock, listing) == 0
                before = capsys.readouterr().out
                revoke = ["runners", "revoke", "a", "--data", str(data)]
                assert await hub_command(autojump_clock, revoke) == 0
                revoked_at = trio.current_time()
                job = await hub.board.all_jobs.get(job_id)
                assert job is not None
                await job.completed.wait()
                await a.wait_until(
                    lambda: a.reports.get(job_id, [{}])[-1].get("status") == "completed"
                )
                cut_after = trio.current_time() - revoked_at
                assert await hub_command(autojump_clock, listing) == 0
                after = capsys.readouterr().out
                # its enrollment token was for one runner: the revoked one cannot come back
                async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                    again = await http.post(
                        f"{BASE}/runners", json={"name": "a"}, headers=bearer(token)
                    )
    assert cut_after <= 1.0
    assert again.status_code == 401
    (row,) = [line for line in before.splitlines() if line.startswith("a ")]
    assert "acme/chat" in row and "active" in row and row.split()[-2] == "1"  # one session
    (row,) = [line for line in after.splitlines() if line.startswith("a ")]
    assert row.endswith("revoked")
    print(f"OBSERVED runner revoked by the CLI: its channel closed after {cut_after} s")


async def test_a_runner_token_is_read_once_and_forgotten_when_another_process_revokes_it(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """Issue 39: a fleet's polls, heartbeats and reports each presented a runner token the hub
    looked up in its store. It is found once and kept; a revocation made by another process
    (the CLI on the same store) still refuses the token within a second."""
    data = tmp_path / "hub"
    async with open_hub(hub_of(data)) as (hub, url):
        _, token = await hub.runner_admin.enroll(f"{OWNER}/{PROJECT}", None, 1)
        asked: list[str] = []
        lookup = hub.store.registration_by_token

        async def counted(presented: str) -> Any:
            asked.append(presented)
            return await lookup(presented)

        hub.store.registration_by_token = counted  # type: ignore[method-assign]
        async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
            r = await http.post(f"{BASE}/runners", json={"name": "box"}, headers=bearer(token))
            runner_token = r.json()["token"]

            async def poll() -> int:
                reply = await http.post(
                    f"{BASE}/runners/jobs", json={"capabilities": []}, headers=bearer(runner_token)
                )
                return reply.status_code

            assert [await poll() for _ in range(20)] == [204] * 20
            assert asked.count(runner_token) == 1  # the store asked once, not 20 times
            revoke = ["runners", "revoke", "box", "--data", str(data)]
            assert await hub_command(autojump_clock, revoke) == 0
            await trio.sleep(1.0)  # virtual time: the bound the revocation is applied within
            assert await poll() == 401
            assert await hub.runner_admin.by_token(runner_token) is None  # not kept


async def test_the_revocation_check_walks_the_hubs_jobs_only_for_a_new_revocation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue 39: every ``REVOCATION_CHECK`` (0.5 s) the hub built the set of every runner it
    knew, a walk over every live job, to intersect it with the store's revocations. It now
    walks only when the store names a revocation it has not looked at yet."""
    from gateway.hub.runners import REVOCATION_CHECK, SEEN_EVERY

    walks = 0

    async with open_hub(hub_of()) as (hub, url):
        admin = hub.runner_admin
        known = admin.known

        def counted() -> set[str]:  # what it knows: a walk over every live job
            nonlocal walks
            walks += 1
            return known()

        admin.known = counted  # type: ignore[method-assign]
        _, token = await admin.enroll(f"{OWNER}/{PROJECT}", None, 1)
        async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
            r = await http.post(f"{BASE}/runners", json={"name": "gone"}, headers=bearer(token))
            runner_id = r.json()["id"]
        await trio.sleep(SEEN_EVERY)  # settled: nothing revoked, nothing walked
        before = walks
        await hub.store.revoke_runner(runner_id)  # by another process
        await trio.sleep(REVOCATION_CHECK * 40)  # 40 checks (20 s) after it
        assert walks - before == 1 and runner_id in admin.cut  # found, applied, and settled


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_the_store_keeps_enrollment_tokens_and_revocations(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    where = request.getfixturevalue("pg_url") if backend == "postgres" else tmp_path
    store = open_store(where)
    try:
        found, token = await store.create_enrollment("acme/chat", time.time() + 60, 2)
        other, _ = await store.create_enrollment("acme/other", None, None)
        assert (await store.enrollment_by_token(token)) == found
        assert await store.enrollment_by_token("alpe_wrong") is None
        assert await store.use_enrollment(found.id, time.time())
        assert await store.use_enrollment(found.id, time.time())
        assert not await store.use_enrollment(found.id, time.time())  # two uses, spent
        assert await store.use_enrollment(other.id, 1e18)  # no expiry
        fresh, _ = await store.create_enrollment("acme/chat", time.time() + 60, None)
        assert not await store.use_enrollment(fresh.id, time.time() + 120)  # expired by then
        spent = await store.enrollment_by_token(token)
        assert spent is not None and spent.used == 2 and spent.uses_left == 0
        assert spent.refusal(time.time()) == "this enrollment token is used up"
        assert await store.revoke_enrollment(other.id)
        assert not await store.revoke_enrollment(other.id)
        revoked = {e.id: e.revoked for e in await store.list_enrollments()}
        assert revoked == {found.id: False, other.id: True, fresh.id: False}
        runner, runner_token = await store.add_registration("acme", "chat", "a", [], found.id)
        await store.runners_seen([runner.id], 1234.5)
        (listed,) = await store.list_runners()
        assert (listed.name, listed.last_seen, listed.revoked_at) == ("a", 1234.5, None)
        assert await store.revoke_runner(runner.id)
        assert not await store.revoke_runner(runner.id)
        assert await store.registration_by_token(runner_token) is None
        assert await store.revoked_runners() == {runner.id}
        (listed,) = await store.list_runners()
        assert listed.revoked_at is not None
    finally:
        await store.close()


async def test_a_polled_path_is_routed_with_its_own_project_each_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The hub keeps the route each path with params resolved to (a project's runners poll one
    path): a path is still routed with its own owner and project, the first time, the next
    times and after more paths than it keeps (it begins again)."""
    async with open_hub(hub_of()) as (hub, url):
        tokens = {}
        async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
            for project in ("chat", "other"):
                _, enroll = await hub.runner_admin.enroll(f"{OWNER}/{project}", None, 1)
                r = await http.post(
                    f"/api/owners/{OWNER}/projects/{project}/runners",
                    json={"name": project, "labels": []},
                    headers=bearer(enroll),
                )
                assert r.status_code == 201
                tokens[project] = r.json()["token"]

            async def poll(project: str, token: str) -> httpx.Response:
                return await http.post(
                    f"/api/owners/{OWNER}/projects/{project}/runners/jobs",
                    json={"capabilities": []},
                    headers=bearer(token),
                )

            for n in range(300):  # past the paths kept, and again after
                for own, other in (("chat", "other"), ("other", "chat")):
                    if n % 100 == 0:
                        assert (await poll(own, tokens[own])).status_code == 204
                        wrong = await poll(other, tokens[own])
                        assert wrong.status_code == 403
                        assert f"registered to {OWNER}/{own}" in wrong.text
                elsewhere = await poll(f"p{n}", tokens["chat"])
                assert elsewhere.status_code == 403
                assert f"registered to {OWNER}/chat" in elsewhere.text
