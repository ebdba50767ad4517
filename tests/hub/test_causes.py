"""Answers that name their cause (issue 18, points 3-5), on trio's autojump clock: a real hub on
loopback, fake runners (tests/support/fake_runner.py) and runners driven by hand over the runner API.

"At once" is asserted on the virtual clock: a wait the hub should not make (runner_wait_timeout,
reconnect_timeout) is set so long that making it would show as that much virtual time."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
import trio.testing
from fake_runner import FakeRunner, Script, stream_chunks
from helpers import hub_command, register_runner

from gateway.hub import Hub, open_hub
from gateway.hub.board import RECENT_ENDED
from gateway.hub.settings import HubSettings
from gateway.hub.store import StoredSession
from gateway.wire import protocol

ADMIN = "alpa_test_admin_credential"
OWNER, PROJECT = "acme", "chat"
NEVER = 1000.0  # s: a wait the hub must not make (it would show as this much virtual time)
GUARD = 5000.0  # s of virtual time: a hang guard, never a timing
MESSAGES = [{"role": "user", "content": "hi"}]
CHAT_DEFINITION = {"jobType": "chat_llm", "needs": ["chat-llm:v1"]}


def hub_of(data: Path | None = None, **settings: Any) -> Hub:
    base: dict[str, Any] = {
        "runner_wait_timeout": NEVER,
        "reconnect_timeout": NEVER,
        "ping_interval": 0.0,  # the clock jumps: no ping may be judged against it
    }
    base.update(settings)
    return Hub(data, admin_token=ADMIN, **base)


def client(url: str, key: str, session: str | None = None) -> openai.AsyncOpenAI:
    headers = {"X-Chat-Session": session} if session else None
    return openai.AsyncOpenAI(
        base_url=url + "/v1", api_key=key, max_retries=0, timeout=GUARD, default_headers=headers
    )


async def chat(url: str, key: str, session: str | None = None, **body: Any) -> httpx.Response:
    """One non-streamed turn over plain HTTP (status, headers and body as they came)."""
    headers = {"Authorization": f"Bearer {key}"}
    if session:
        headers["X-Chat-Session"] = session
    payload = {"model": "fake-model", "messages": MESSAGES, **body}
    async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
        return await http.post("/v1/chat/completions", json=payload, headers=headers)


def error_of(reply: httpx.Response) -> dict[str, Any]:
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


class HandRunner:
    """A runner driven step by step over the runner API: poll with chosen capabilities, claim."""

    def __init__(
        self, registration: dict[str, Any], url: str, owner: str = OWNER, project: str = PROJECT
    ) -> None:
        self.id = registration["id"]
        self.base = f"{url}/api/owners/{owner}/projects/{project}"
        self.http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {registration['token']}"}, timeout=GUARD
        )

    @classmethod
    async def register(
        cls, hub: Hub, url: str, owner: str = OWNER, project: str = PROJECT
    ) -> HandRunner:
        registration = await register_runner(hub, owner, project, "by-hand", ["self-hosted"])
        return cls(registration, url, owner, project)

    async def poll(self, *capabilities: str) -> list[dict[str, Any]]:
        reply = await self.http.post(
            f"{self.base}/runners/jobs", json={"capabilities": list(capabilities)}
        )
        assert reply.status_code in (200, 204), reply.text
        jobs: list[dict[str, Any]] = reply.json()["jobs"] if reply.status_code == 200 else []
        return jobs

    async def claim(self, job_id: str) -> str:
        reply = await self.http.post(
            f"{self.base}/runners/generate-jitconfig", json={"jobId": job_id, "name": "by-hand"}
        )
        assert reply.status_code == 200, reply.text
        run_id: str = reply.json()["runId"]
        reply = await self.http.patch(
            f"{self.base}/runs/{run_id}/jobs/{job_id}", json={"status": "in_progress"}
        )
        assert reply.status_code == 200, reply.text
        return run_id


@asynccontextmanager
async def fake_runner(
    url: str, **kwargs: Any
) -> AsyncIterator[tuple[FakeRunner, trio.CancelScope]]:
    """A FakeRunner of acme/chat, and a scope that kills it (as SIGKILL would: no report)."""
    runner = FakeRunner(url, ADMIN, owner=OWNER, project=PROJECT, **kwargs)
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()

        async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await runner.run(task_status=task_status)

        await nursery.start(run)
        yield runner, scope
        nursery.cancel_scope.cancel()


def frontdoor_jobs(hub: Hub) -> list[Any]:
    return [j for j in hub.board.jobs.values() if j.origin == "frontdoor"]


# -- point 4: the causes -----------------------------------------------------------------


async def test_no_runner_for_the_project_is_answered_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(hub_of()) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        # a runner of another project, alive and capable: "no runner" all the same, unnamed
        stranger = await HandRunner.register(hub, url, "secret-owner", "secret-project")
        await stranger.poll("chat-llm:v1")
        with trio.fail_after(GUARD):
            started = trio.current_time()
            reply = await chat(url, key)
            elapsed = trio.current_time() - started
            models = await httpx.AsyncClient(base_url=url, timeout=GUARD).get(
                "/v1/models", headers={"Authorization": f"Bearer {key}"}
            )
    assert elapsed < NEVER  # no wait for runner_wait_timeout (nor models_wait)
    assert reply.status_code == 503 and models.status_code == 503
    assert error_of(reply) == {
        "message": "no runner is connected for project acme/chat: start one with "
        f"`alp-gateway run --server {url} --project acme/chat`",
        "type": "service_unavailable",
        "param": None,
        "code": "no_runner",
    }
    assert error_of(models)["code"] == "no_runner"
    assert "secret" not in reply.text and "secret" not in models.text
    assert not [
        j for j in await hub.board.all_jobs.values() if j.owner == OWNER
    ]  # no job was ever opened


async def test_runners_connected_none_advertising_is_answered_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(hub_of()) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        down = [await HandRunner.register(hub, url), await HandRunner.register(hub, url)]
        for runner in down:
            assert await runner.poll() == []  # backends down: nothing advertised
        with trio.fail_after(GUARD):
            started = trio.current_time()
            reply = await chat(url, key)
            elapsed = trio.current_time() - started
    assert elapsed < NEVER
    assert reply.status_code == 503
    assert error_of(reply) == {
        "message": "2 runner(s) connected, none advertises chat-llm:v1: their backends are "
        "down (see `alp-gateway doctor`)",
        "type": "service_unavailable",
        "param": None,
        "code": "no_capable_runner",
    }
    assert not [j for j in await hub.board.all_jobs.values() if j.owner == OWNER]


async def _busy_runner(hub: Hub, url: str) -> HandRunner:
    """A runner holding one session and advertising nothing: at its capacity."""
    runner = await HandRunner.register(hub, url)
    job = await hub.board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], dict(CHAT_DEFINITION))
    assert [j["id"] for j in await runner.poll("chat-llm:v1")] == [job.id]
    await runner.claim(job.id)
    assert await runner.poll() == []  # at --max-sessions: stops advertising
    return runner


async def test_every_runner_busy_waits_queue_wait_then_503_with_retry_after(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(hub_of(queue_wait=7.0)) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        await _busy_runner(hub, url)
        with trio.fail_after(GUARD):
            started = trio.current_time()
            reply = await chat(url, key)
            elapsed = trio.current_time() - started
    assert 7.0 <= elapsed < NEVER  # the bounded wait, not runner_wait_timeout
    assert reply.status_code == 503 and reply.headers["retry-after"] == "7"
    assert error_of(reply) == {
        "message": "every runner is busy (1 at capacity, none took this request within 7 s in "
        "the queue): position 1 of 1: retry in 7 s, or start another runner",
        "type": "service_unavailable",
        "param": None,
        "code": "queue_timeout",
    }
    assert frontdoor_jobs(hub) == []  # the waiting job was withdrawn
    assert (hub.counters.queued, hub.counters.queue_timeouts) == (1, 1)


async def test_every_runner_busy_the_turn_is_served_when_one_frees_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(hub_of(queue_wait=60.0)) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        await _busy_runner(hub, url)
        replies: list[httpx.Response] = []
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:

                async def turn() -> None:
                    replies.append(await chat(url, key))

                nursery.start_soon(turn)
                while not frontdoor_jobs(hub):  # the turn waits with its job queued
                    await hub.board.changes.wait()
                async with fake_runner(url) as (fake, _):  # a runner with a free slot comes
                    await fake.wait_until(lambda: bool(replies))
    (reply,) = replies
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "tok0tok1tok2"


async def test_unknown_model_is_404_naming_the_models_before_any_job(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(hub_of()) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        async with fake_runner(url, models=("fake-model", "fake-tools")) as (fake, _):
            async with client(url, key) as openai_client:
                with trio.fail_after(GUARD):
                    # the list is not known yet: the runner's list, asked as its channel opens,
                    # says it does not serve the model: 404 all the same
                    first = await chat(url, key, model="not-listed-yet")
                    listed = await openai_client.models.list()  # now it is known
                    claimed = list(fake.claimed)
                    with pytest.raises(openai.NotFoundError) as caught:
                        await openai_client.chat.completions.create(
                            model="gpt-nope", messages=MESSAGES
                        )
                    after_404 = list(fake.claimed)
                    again = await chat(url, key, model="fake-tools")
                    fake.models.append("fake-new")  # the runner came back with another model
                    renewed = await chat(url, key, model="fake-new")
    assert first.status_code == 404 and error_of(first)["code"] == "model_not_found"
    assert "'fake-model', 'fake-tools'" in error_of(first)["message"]
    assert [m.id for m in listed.data] == ["fake-model", "fake-tools"]
    assert caught.value.status_code == 404
    assert caught.value.body == {
        "message": "The model 'gpt-nope' does not exist; the models available are: "
        "'fake-model', 'fake-tools'",
        "type": "invalid_request_error",
        "param": None,
        "code": "model_not_found",
    }
    assert after_404 == claimed and again.status_code == 200  # the 404 opened no job
    assert renewed.status_code == 200  # a kept list is checked again before a model is refused


async def test_a_backend_refusing_the_request_is_a_4xx_not_a_retried_502(
    autojump_clock: trio.testing.MockClock,
) -> None:
    refusals = {
        "missing-model": Script(
            error_before='backend returned 404: {"error": {"message": "model missing-model '
            'not found"}}'
        ),
        "bad-request": Script(error_before="backend returned 400: max_tokens is too large"),
        "broken": Script(error_before="backend returned 500: boom"),
    }
    async with open_hub(hub_of()) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        async with fake_runner(url, scripts=refusals, models=tuple(refusals)):
            with trio.fail_after(GUARD):
                missing = await chat(url, key, model="missing-model")
                bad = await chat(url, key, model="bad-request")
                broken = await chat(url, key, model="broken")
    assert missing.status_code == 404 and error_of(missing)["code"] == "model_not_found"
    assert error_of(missing)["type"] == "invalid_request_error"
    assert bad.status_code == 400 and error_of(bad)["message"].startswith("backend returned 400")
    assert broken.status_code == 502 and error_of(broken)["type"] == "upstream_error"


# -- point 3: failover without waiting for the dead ---------------------------------------


async def test_a_dead_runners_session_moves_at_once_when_another_runner_is_free(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(hub_of()) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        async with fake_runner(url, name="a") as (a, kill_a):
            with trio.fail_after(GUARD):
                assert (await chat(url, key, "s")).status_code == 200
                (job_id,) = a.claimed
                job1 = await hub.board.all_jobs.get(job_id)
            async with fake_runner(url, name="b") as (b, _):
                with trio.fail_after(GUARD):
                    while hub.board.runners[str(b.runner_id)].capabilities is None:
                        await hub.board.changes.wait()  # b polled: it is free
                    channel = hub.channels.get(job1.id)
                    assert channel is not None
                    kill_a.cancel()  # gone without a word or a report, as after SIGKILL
                    await channel.closed.wait()
                    started = trio.current_time()
                    reply = await chat(url, key, "s")
                    elapsed = trio.current_time() - started
    assert reply.status_code == 200, reply.text
    assert elapsed < NEVER  # the reconnect window was not waited out
    assert hub.counters.failovers_immediate == 1 and hub.counters.redial_waits == 0
    assert hub.counters.failovers == 1
    job2 = await hub.board.all_jobs.get(hub.sessions.listing()[("k", "s")])
    assert job2.id != job1.id and b.claimed == [job2.id]
    assert job1.cancelled and job1.cancel_reason == "channel lost"  # a redial would be refused


async def test_with_no_other_runner_free_the_turn_waits_for_the_redial(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(hub_of(reconnect_timeout=5.0, runner_wait_timeout=20.0)) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        async with fake_runner(url) as (fake, kill):
            with trio.fail_after(GUARD):
                assert (await chat(url, key, "s")).status_code == 200
                (job_id,) = fake.claimed
                channel = hub.channels.get(job_id)
                assert channel is not None
                kill.cancel()
                await channel.closed.wait()
                started = trio.current_time()
                reply = await chat(url, key, "s")
                elapsed = trio.current_time() - started
    # the only runner (dead, but the hub cannot know yet) held the job: its redial was waited
    # for, then a new job no one took
    assert hub.counters.redial_waits == 1 and hub.counters.failovers_immediate == 0
    assert reply.status_code == 503 and error_of(reply)["code"] == "no_runner"
    assert 5.0 + 20.0 <= elapsed < NEVER


# -- point 5: memory and keys -------------------------------------------------------------


async def test_ended_jobs_leave_memory_and_are_read_from_the_store(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    data = tmp_path / "hub"
    async with open_hub(hub_of(data)) as (hub, url):
        runner = await HandRunner.register(hub, url)
        jobs = [
            await hub.board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], dict(CHAT_DEFINITION))
            for _ in range(RECENT_ENDED + 2)
        ]
        done = {"status": "completed", "conclusion": "success", "logs": "ok"}
        for job in jobs:
            run_id = await runner.claim(job.id)
            reply = await runner.http.patch(f"{runner.base}/runs/{run_id}/jobs/{job.id}", json=done)
            assert reply.status_code == 200
        live = await hub.board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], dict(CHAT_DEFINITION))
        assert list(hub.board.jobs) == [live.id]  # polls scan only what can still run
        assert len(hub.board.recent) == RECENT_ENDED
        oldest = await hub.board.all_jobs.get(jobs[0].id)  # read back from the store
        assert oldest is not jobs[0] and oldest.status == "completed"
        assert oldest.reports == [{"status": "in_progress"}, done]
        # a late report on an ended job is refused as before (409), counted, and not kept
        reply = await runner.http.patch(
            f"{runner.base}/runs/{oldest.run_id}/jobs/{oldest.id}", json=done
        )
        assert reply.status_code == 409 and hub.board.late_reports == 1
        admin = await runner.http.get(
            f"{url}/api/hub/jobs", headers={"Authorization": f"Bearer {ADMIN}"}
        )
        listed = {j["id"]: j for j in admin.json()["jobs"]}
        assert len(listed) == len(jobs) + 1 and listed[jobs[0].id]["status"] == "completed"
        assert len(listed[jobs[0].id]["reports"]) == 2
    again = Hub(data, admin_token=ADMIN)
    await again.board.load()  # as its start does
    assert list(again.board.jobs) == [live.id]  # a restart loads the live ones only
    assert (
        await again.board.all_jobs.get(jobs[-1].id)
    ).conclusion == "success" and await again.board.all_jobs.count() == len(jobs) + 1
    await again.store.close()
    await hub.store.close()


async def test_sessions_per_key_bounded_lru_idle_ended_else_429(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = trio.Event()
    async with open_hub(hub_of(max_sessions_per_key=2)) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        other_key = await hub.keys.create("other", f"{OWNER}/{PROJECT}")
        scripts = {"gated": Script(gate=gate)}
        async with fake_runner(url, scripts=scripts) as (fake, _):
            with trio.fail_after(GUARD):
                for session in ("s1", "s2", "s1"):  # s2 is now the least recently used
                    assert (await chat(url, key, session)).status_code == 200
                jobs = hub.sessions.listing()
                third = await chat(url, key, "s3")
                await fake.wait_until(lambda: bool(fake.ends))
                after_third = hub.sessions.listing()
                # both sessions busy with a turn: a third one cannot take a slot
                replies: list[httpx.Response] = []
                async with trio.open_nursery() as nursery:

                    async def turn(session: str) -> None:
                        replies.append(await chat(url, key, session, model="gated"))

                    for session in ("s1", "s3"):
                        nursery.start_soon(turn, session)
                    await fake.wait_until(
                        lambda: (
                            sum(t.body.get("model") == "gated" for t in fake.turns.values()) == 2
                        )
                    )
                    refused = await chat(url, key, "s4")
                    elsewhere = await chat(url, other_key, "s4")  # another key is not bounded
                    gate.set()
    assert third.status_code == 200
    assert fake.ends == [(jobs[("k", "s2")], "session ended: its API key opened too many")]
    assert set(after_third) == {("k", "s1"), ("k", "s3")}
    assert refused.status_code == 429
    assert error_of(refused) == {
        "message": "this API key already holds 2 chat sessions, each with a turn in flight: "
        "wait for one to finish, or reuse a session (X-Chat-Session)",
        "type": "rate_limit_error",
        "param": None,
        "code": "too_many_sessions",
    }
    assert elsewhere.status_code == 200
    assert [r.status_code for r in replies] == [200, 200]


async def test_a_key_revoked_by_another_process_ends_its_sessions_and_its_name_inherits_nothing(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "hub"
    async with open_hub(hub_of(data, key_check_interval=3.0)) as (hub, url):
        key = await hub.keys.create("alice", f"{OWNER}/{PROJECT}")
        async with fake_runner(url) as (fake, _):
            with trio.fail_after(GUARD):
                assert (await chat(url, key, "s")).status_code == 200
                (old_job,) = fake.claimed
                # `alp-gateway hub keys revoke alice` from another process on the same store
                argv = ["keys", "revoke", "alice", "--data", str(data)]
                assert await hub_command(autojump_clock, argv) == 0
                revoked_at = trio.current_time()
                await fake.wait_until(lambda: bool(fake.ends))
                noticed = trio.current_time() - revoked_at
                await (await hub.board.all_jobs.get(old_job)).completed.wait()
                refused = await chat(url, key, "s")
                new_key = await hub.keys.create("alice", f"{OWNER}/{PROJECT}")
                fresh = await chat(url, new_key, "s")
    assert fake.ends == [(old_job, "api key revoked")]
    assert noticed <= 3.0  # within key_check_interval
    assert (await hub.board.all_jobs.get(old_job)).cancelled and (
        await hub.board.all_jobs.get(old_job)
    ).cancel_reason == "api key revoked"
    assert refused.status_code == 401
    assert fresh.status_code == 200 and len(fake.claimed) == 2  # a new session, a new job
    assert hub.sessions.listing() == {("alice", "s"): fake.claimed[1]}
    assert [(s.key_name, s.job_id) for s in await hub.store.load_sessions()] == [
        ("alice", fake.claimed[1])
    ]
    assert "revoked API key 'alice'" in capsys.readouterr().out


async def test_a_key_revoked_in_the_hub_ends_its_sessions_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(hub_of(key_check_interval=NEVER)) as (hub, url):
        key = await hub.keys.create("bob", f"{OWNER}/{PROJECT}")
        async with fake_runner(url) as (fake, _):
            with trio.fail_after(GUARD):
                assert (await chat(url, key, "s")).status_code == 200
                revoked_at = trio.current_time()
                assert await hub.keys.revoke("bob")
                await fake.wait_until(lambda: bool(fake.ends))
                noticed = trio.current_time() - revoked_at
    assert fake.ends == [(fake.claimed[0], "api key revoked")] and noticed < NEVER
    assert hub.sessions.listing() == {}


async def test_a_stored_session_of_a_revoked_key_is_not_restored(tmp_path: Path) -> None:
    data = tmp_path / "hub"
    first = Hub(data, admin_token=ADMIN)
    key = await first.keys.create("carol", f"{OWNER}/{PROJECT}")
    api_key = await first.store.check_api_key(key)
    assert api_key is not None and api_key.id and api_key.id not in key
    job = await first.board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], origin="frontdoor")
    job.claimed_by, job.run_id = "runner-1", "run-1"
    await first.board.save(job)
    await first.store.save_session(StoredSession("carol", "s", OWNER, PROJECT, job.id, api_key.id))
    assert await first.keys.revoke("carol")
    await first.store.close()
    second = Hub(data, admin_token=ADMIN)
    async with open_hub(second):
        assert second.sessions.listing() == {}
        assert (
            await second.board.all_jobs.get(job.id)
        ).cancelled  # withdrawn: its runner's redial is refused
    await second.store.close()


# -- the settings on the command line ------------------------------------------------------


def test_hub_cli_flags_for_the_new_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import gateway.hub.cli as cli

    seen: list[HubSettings] = []

    def fake_serve(*args: Any) -> int:
        seen.append(args[-1])
        return 0

    monkeypatch.setattr(cli, "_serve", fake_serve)
    data = ["--data", str(tmp_path), "--listen", "127.0.0.1:0"]  # 8787 may be taken here
    assert cli.main([*data, "--capacity-wait", "2.5", "--max-sessions-per-key", "3"]) == 0
    assert cli.main(data) == 0
    assert cli.main([*data, "--queue-wait", "4", "--queue-length", "5"]) == 0
    assert (seen[0].queue_wait, seen[0].max_sessions_per_key) == (2.5, 3)
    assert (seen[1].queue_wait, seen[1].max_sessions_per_key) == (10.0, 16)
    assert (seen[1].queue_length, seen[2].queue_length, seen[2].queue_wait) == (64, 5, 4.0)
    assert cli.main([*data, "--capacity-wait", "-1"]) == 2
    assert cli.main([*data, "--max-sessions-per-key", "-2"]) == 2
    assert cli.main([*data, "--queue-length", "-1"]) == 2
    err = capsys.readouterr().err  # --capacity-wait is --queue-wait's old name
    assert "--queue-wait" in err and "--max-sessions-per-key" in err
    assert "--queue-length" in err


async def test_a_key_revoked_through_the_admin_api_ends_its_turns_in_flight_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue 36, point 4: a streamed turn and a non-streamed one of a key revoked through the
    admin API (as the status page does) end at once, their clients told in their API, their
    runner told to stop; the key check (``key_check_interval``) is not waited for."""
    async with open_hub(hub_of(key_check_interval=NEVER)) as (hub, url):
        key = await hub.keys.create("dave", f"{OWNER}/{PROJECT}")
        answering = {"turns": 0, "both": trio.Event()}

        async def four_then_silence(send: Any, turn: Any) -> None:
            """Four chunks (the non-streamed turn's gathered by the hub), then nothing until
            the turn is cancelled."""
            frames = protocol.TurnFrames(turn.job_id, turn.request_id)
            for chunk in stream_chunks({**turn.body, "stream": True}, Script(chunks=4)):
                await send(frames.chunk(json.dumps(chunk).encode()).decode())
            answering["turns"] += 1
            if answering["turns"] == 2:
                answering["both"].set()
            await trio.sleep_forever()

        endless = Script(play=four_then_silence)
        async with fake_runner(url, default=endless) as (fake, _):
            auth = {"Authorization": f"Bearer {key}"}
            admin = {"Authorization": f"Bearer {ADMIN}"}
            body = {"model": "fake-model", "messages": MESSAGES}
            ended: dict[str, float] = {}
            whole: list[httpx.Response] = []
            events: list[str] = []
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:

                async def streamed() -> None:
                    stream = {**body, "stream": True}
                    headers = {**auth, "X-Chat-Session": "a"}
                    async with http.stream(
                        "POST", "/v1/chat/completions", json=stream, headers=headers
                    ) as reply:
                        async for line in reply.aiter_lines():
                            if line.startswith("data: "):
                                events.append(line[6:])
                    ended["streamed"] = trio.current_time()

                async def whole_turn() -> None:
                    headers = {**auth, "X-Chat-Session": "b"}
                    whole.append(
                        await http.post("/v1/chat/completions", json=body, headers=headers)
                    )
                    ended["whole"] = trio.current_time()

                with trio.fail_after(GUARD):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(streamed)
                        nursery.start_soon(whole_turn)
                        await answering["both"].wait()  # both turns are answering
                        revoked = await http.delete("/api/hub/keys/dave", headers=admin)
                        assert revoked.status_code == 200, revoked.text
                        revoked_at = trio.current_time()
                    # its runner told to stop each: the turn cancelled, or its session ended
                    await fake.wait_until(
                        lambda: all(
                            t.cancelled.is_set() or (t.job_id, "api key revoked") in fake.ends
                            for t in fake.turns.values()
                        )
                    )
                    cancelled_by = trio.current_time() - revoked_at
                    after = await http.post("/v1/chat/completions", json=body, headers=auth)
    took = {name: at - revoked_at for name, at in ended.items()}
    print(f"ended {took} s after the revocation; runner told within {cancelled_by:.3f} s")
    assert max(took.values()) < 1.0 and cancelled_by < 1.0
    last = json.loads(events[-1])
    assert last["error"]["code"] == "api_key_revoked" and "[DONE]" not in events
    assert len(events) > 3  # it had streamed before the revocation
    assert whole[0].status_code == 401
    assert whole[0].json()["error"]["code"] == "api_key_revoked"
    assert after.status_code == 401


async def test_a_key_revoked_by_another_process_ends_its_turns_within_a_second(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue 36, point 4, across processes: a key revoked in the store by another replica or
    by the CLI (here the store written directly, as they write it) ends this hub's turn in
    flight within a second, its client told in its API; ``key_check_interval`` is not
    waited for."""
    async with open_hub(hub_of(key_check_interval=NEVER)) as (hub, url):
        key = await hub.keys.create("erin", f"{OWNER}/{PROJECT}")
        answering = trio.Event()

        async def four_then_silence(send: Any, turn: Any) -> None:
            frames = protocol.TurnFrames(turn.job_id, turn.request_id)
            for chunk in stream_chunks({**turn.body, "stream": True}, Script(chunks=4)):
                await send(frames.chunk(json.dumps(chunk).encode()).decode())
            answering.set()
            await trio.sleep_forever()

        async with fake_runner(url, default=Script(play=four_then_silence)):
            body = {"model": "fake-model", "messages": MESSAGES, "stream": True}
            headers = {"Authorization": f"Bearer {key}", "X-Chat-Session": "a"}
            events: list[str] = []
            revoked_at = float("inf")
            async with httpx.AsyncClient(base_url=url, timeout=GUARD) as http:
                with trio.fail_after(GUARD):
                    async with trio.open_nursery() as nursery:

                        async def revoke_elsewhere() -> None:
                            nonlocal revoked_at
                            await answering.wait()
                            assert await hub.store.revoke_api_key("erin")  # not through Keys
                            revoked_at = trio.current_time()

                        nursery.start_soon(revoke_elsewhere)
                        async with http.stream(
                            "POST", "/v1/chat/completions", json=body, headers=headers
                        ) as reply:
                            async for line in reply.aiter_lines():
                                if line.startswith("data: "):
                                    events.append(line[6:])
                    ended = trio.current_time()
    took = ended - revoked_at
    print(f"ended {took:.3f} s after another process revoked its key")
    assert took <= 1.0
    assert json.loads(events[-1])["error"]["code"] == "api_key_revoked" and len(events) > 3
