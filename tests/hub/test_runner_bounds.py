"""Everything a runner sends is bounded (issue 34 point 5), over loopback to a real hub on
trio's autojump clock: past a bound of ``gateway.hub.bounds`` the answer is 413 (or 400 for a
report) naming the bound, and nothing of the request is kept."""

from __future__ import annotations

from typing import Any

import httpx
import trio
import trio.testing
from fake_runner import FakeRunner
from helpers import LogCapture, register_runner

from gateway.hub import Hub, open_hub
from gateway.hub.bounds import (
    MAX_CAPABILITIES,
    MAX_LABELS,
    MAX_LOGS,
    MAX_MESSAGE,
    MAX_MODELS,
    MAX_NAME,
    MAX_REASON,
    MAX_TEXT,
)

ADMIN = "alpa_test_admin_credential"
OWNER, PROJECT = "acme", "chat"
BASE = f"/api/owners/{OWNER}/projects/{PROJECT}"
GUARD = 5000.0  # s of virtual time: a hang guard, never a timing
CAPS = ["chat-llm:v1"]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def refusal(reply: httpx.Response) -> str:
    message: str = reply.json()["error"]["message"]
    return message


async def test_a_registration_past_its_bounds_is_refused_and_not_kept(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        open_hub(Hub(admin_token=ADMIN)) as (hub, url),
        httpx.AsyncClient(base_url=url, timeout=GUARD) as http,
    ):
        cases: list[tuple[dict[str, Any], str]] = [
            ({"name": "n" * (MAX_NAME + 1)}, f'"name" is {MAX_NAME + 1} characters'),
            (
                {"name": "box", "labels": ["l"] * (MAX_LABELS + 1)},
                f'"labels" holds {MAX_LABELS + 1} items',
            ),
            (
                {"name": "box", "labels": ["l" * (MAX_TEXT + 1)]},
                f'an item of "labels" is {MAX_TEXT + 1} characters',
            ),
        ]
        for body, said in cases:
            r = await http.post(f"{BASE}/runners", json=body, headers=bearer(ADMIN))
            assert r.status_code == 413 and refusal(r).startswith(said), r.text
        assert await hub.store.list_runners() == []
        at_bound = {"name": "n" * MAX_NAME, "labels": ["l" * MAX_TEXT] * MAX_LABELS}
        r = await http.post(f"{BASE}/runners", json=at_bound, headers=bearer(ADMIN))
        assert r.status_code == 201


async def test_polls_and_claims_past_their_bounds_are_refused_and_not_kept(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        open_hub(Hub(admin_token=ADMIN)) as (hub, url),
        httpx.AsyncClient(base_url=url, timeout=GUARD) as http,
    ):
        runner = await register_runner(hub, OWNER, PROJECT, "box", [])
        auth = bearer(runner["token"])
        for caps, said in (
            (["c"] * (MAX_CAPABILITIES + 1), f'"capabilities" holds {MAX_CAPABILITIES + 1}'),
            (["c" * (MAX_TEXT + 1)], f'an item of "capabilities" is {MAX_TEXT + 1}'),
        ):
            r = await http.post(f"{BASE}/runners/jobs", json={"capabilities": caps}, headers=auth)
            assert r.status_code == 413 and refusal(r).startswith(said), r.text
        assert hub.board.runners[runner["id"]].capabilities is None  # nothing of them kept
        job = await hub.board.enqueue(OWNER, PROJECT, CAPS, {"jobType": "chat_llm"})
        claim = {"jobId": job.id, "name": "n" * (MAX_NAME + 1)}
        r = await http.post(f"{BASE}/runners/generate-jitconfig", json=claim, headers=auth)
        assert r.status_code == 413 and refusal(r).startswith(f'"name" is {MAX_NAME + 1}')
        assert job.claimed_by is None and (await hub.store.load_job(job.id)).runner_name is None  # type: ignore[union-attr]
        claim["name"] = "box"
        r = await http.post(f"{BASE}/runners/generate-jitconfig", json=claim, headers=auth)
        assert r.status_code == 200
        run = r.json()["runId"]
        reports: list[tuple[str, dict[str, Any], str]] = [
            (
                "progress",
                {"stage": "s" * (MAX_REASON + 1)},
                f'"stage" is {MAX_REASON + 1} characters',
            ),
            (
                "progress",
                {"stage": "s", "message": "m" * (MAX_MESSAGE + 1)},
                f'"message" is {MAX_MESSAGE + 1} characters',
            ),
            (
                "status",
                {"status": "completed", "conclusion": "success", "logs": "x" * (MAX_LOGS + 1)},
                f'"logs" is {MAX_LOGS + 1} characters',
            ),
            (
                "status",
                {
                    "status": "completed",
                    "conclusion": "success",
                    "completionReason": "r" * (MAX_REASON + 1),
                },
                f'"completionReason" is {MAX_REASON + 1} characters',
            ),
        ]
        for kind, body, said in reports:
            path = f"{BASE}/runs/{run}/jobs/{job.id}"
            if kind == "progress":
                r = await http.post(path + "/progress", json=body, headers=auth)
            else:
                r = await http.patch(path, json=body, headers=auth)
            assert r.status_code == 400 and refusal(r).startswith(said), r.text
        assert job.reports == [] and job.heartbeats == 0 and job.status != "completed"
        stored = await hub.store.load_job(job.id)
        assert stored is not None and stored.reports == []


async def test_a_models_list_past_its_bounds_is_refused_and_not_kept(
    autojump_clock: trio.testing.MockClock, logs: LogCapture
) -> None:
    names = tuple(f"m{i}" for i in range(MAX_MODELS + 1))
    async with open_hub(Hub(admin_token=ADMIN, ping_interval=0.0)) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        runner = FakeRunner(url, ADMIN, owner=OWNER, project=PROJECT, models=names)
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            with trio.fail_after(GUARD):
                async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                    listed = await http.get("/v1/models", headers=bearer(key))
                await runner.wait_until(lambda: runner.models_requests >= 1)
            nursery.cancel_scope.cancel()
    assert runner.models_requests >= 1
    assert listed.status_code in (200, 503) and "m1000" not in listed.text
    assert len(listed.content) < 10_000
    assert hub.catalog.of_runner(runner.runner_id or "") is None
    assert await hub.store.load_models(OWNER, PROJECT) == []
    warned = [line for line in logs.lines if "models answer" in line]
    assert warned and f"holds {MAX_MODELS + 1} items, over the {MAX_MODELS}" in warned[0]
