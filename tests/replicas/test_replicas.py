"""Several hubs as replicas of one team on a real PostgreSQL (``tests/pgserver.py``), each with its
own server on loopback (here in one process; ``test_replicas_killed.py`` runs them as processes):
a turn whose session's channel another replica holds is forwarded there, its bytes the runner's
own; a job is claimed once however many replicas its claims reach; API-key limits are exact
across replicas; every replica shows the whole team, and its own ``/metrics`` says which it is."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio
from helpers import (
    ADMIN,
    CHAT_DEFINITION,
    OWNER,
    PROJECT,
    TEAM_SECRET,
    register_runner,
    runner_config,
    running,
)
from prometheus_client.parser import text_string_to_metric_families

from gateway import __version__
from gateway.hub import Hub, doctor, open_hub
from gateway.hub.channel import ServerChannel
from gateway.hub.replicas.remote import RemoteChannel
from gateway.hub.settings import HubSettings
from gateway.hub.store import KeyLimits, open_store
from gateway.hub.store.schema import LATEST
from gateway.sim import Simulator

BASE = f"/api/owners/{OWNER}/projects/{PROJECT}"
GUARD = 60.0  # s: how long ``until`` waits before it calls a state never reached (a hang guard)


@dataclass
class Replica:
    hub: Hub
    url: str
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)  # cancelled: it stops

    def stop(self) -> None:
        """This replica stops serving (as a clean stop does: it retires from the team)."""
        self.scope.cancel()


async def until(check: Callable[[], bool], *among: Replica, within: float = GUARD) -> None:
    """Until ``check()`` holds, looked at again on every change of the replicas' boards (a
    runner seen, a job or a channel changed, a replica up or down). ``within``: a hang guard,
    not a timing (replicas on a loaded 2-core machine took over 10 s to see each other up)."""
    with trio.fail_after(within):
        while True:
            # each board's next change taken before looking: one made between the look and the
            # waiters' start (the nursery's tasks start after a checkpoint) is not missed
            events = [replica.hub.board.changes.event for replica in among]
            if check():
                return
            async with trio.open_nursery() as nursery:
                for event in events:

                    async def changed(e: trio.Event = event) -> None:
                        await e.wait()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(changed)


@asynccontextmanager
async def replicas(
    pg_url: str,
    count: int,
    *,
    team: Sequence[tuple[str, ...]] | None = None,
    **settings: Any,
) -> AsyncIterator[list[Replica]]:
    """``count`` hubs on the database ``pg_url``, each served on a port of its own, each
    knowing every other up; ``team``: each one's team secrets (else ``TEAM_SECRET`` for all)."""
    async with trio.open_nursery() as nursery:
        started: list[Replica] = []
        for n in range(count):
            secrets = team[n] if team is not None else (TEAM_SECRET,)
            hub = Hub(
                admin_token=ADMIN,
                settings=HubSettings(
                    store=pg_url, replica_id=f"r{n}", team_secret=secrets, **settings
                ),
            )
            scope = trio.CancelScope()
            started.append(Replica(hub, await nursery.start(_serve, hub, scope), scope))

        def all_up() -> bool:
            return all(
                sum(p.up for p in r.hub.team.peers.values()) == count - 1  # type: ignore[union-attr]
                for r in started
            )

        await until(all_up, *started)
        try:
            yield started
        finally:
            nursery.cancel_scope.cancel()


async def _serve(
    hub: Hub, scope: trio.CancelScope, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    with scope:
        async with open_hub(hub) as (_hub, url):
            task_status.started(url)
            await trio.sleep_forever()


def _body(content: str = "hi", **more: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "stream": True,
        "stream_options": {"include_usage": True},  # nothing kept from the client
        "messages": [{"role": "user", "content": content}],
        **more,
    }


async def _chat(url: str, key: str, session: str, **more: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(
            f"{url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}", "X-Chat-Session": session},
            json=_body(**more),
        )


class _Recording:
    """A sink in front of another: each chunk payload it gets noted, as it came."""

    def __init__(self, sink: Any, into: list[bytes]) -> None:
        self._sink = sink
        self._into = into

    def chunk(self, chunk: msgspec.Raw, frame: bytes) -> None:
        self._into.append(bytes(chunk))
        self._sink.chunk(chunk, frame)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)


def _record_reads(ch: ServerChannel) -> list[bytes]:
    """Every chunk payload the runner sends on ``ch`` for a request opened from now on, as the
    channel's reader read it, in order."""
    payloads: list[bytes] = []
    open_request = ch.open
    ch.open = lambda rid, sink: open_request(rid, _Recording(sink, payloads))  # type: ignore[method-assign]
    return payloads


def _events(body: bytes) -> list[bytes]:
    return [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]


async def test_a_forwarded_turn_is_the_runners_bytes_as_a_direct_one_is(
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
            assert job_id is not None
            held = b.hub.channels.local(job_id)
            assert held is not None and a.hub.channels.local(job_id) is None  # b holds it
            assert isinstance(a.hub.channels.get(job_id), RemoteChannel)
            sent = _record_reads(held)
            forwarded = await _chat(a.url, key, "s1", sim={"chunks": 30})  # through b
            from_runner = list(sent)
            sent.clear()
            direct = await _chat(b.url, key, "s1", sim={"chunks": 30})  # b's own
            assert forwarded.status_code == direct.status_code == 200
            assert len(from_runner) == len(sent) > 30  # 30 chunks and the usage chunk at least
            # byte for byte the runner's chunks, then the end: forwarded as direct
            assert _events(forwarded.content) == [*from_runner, b"[DONE]"]
            assert _events(direct.content) == [*sent, b"[DONE]"]
            assert forwarded.headers["content-type"] == direct.headers["content-type"]
            # one session, one job, one runner, whichever replica the turns reached
            assert {s.job_id for s in b.hub.sessions.live.values()} == {job_id}
            assert a.hub.counters.failovers == b.hub.counters.failovers == 0
            # usage from both replicas in the one ledger, seen from either
            await a.hub.store.flush_usage()  # a writes behind (0.1 s); b flushes as it reads
            rows = await b.hub.store.usage_rows()
            assert len(rows) == 3 and {r["job_id"] for r in rows} == {job_id}


async def test_a_job_made_on_one_replica_is_pushed_to_a_runner_on_another(
    pg_url: str, sim: Simulator, tmp_path: Path
) -> None:
    """Issue 28 point 2: ``runners/events`` pushes reach runners on every replica. The runner
    holds its events stream on b and polls once an hour, so only b's push of the job a made
    for a new session (a's board change, notified through the store) can have it claimed."""
    async with replicas(pg_url, 2) as (a, b):
        key = await a.hub.store.create_api_key("alice", f"{OWNER}/{PROJECT}")
        config = runner_config(b.url, sim.url, tmp_path / "state", poll_interval=3600.0)
        async with running(config) as runner:
            assert runner.registration is not None
            runner_id = runner.registration.id
            await until(lambda: a.hub.board.alive(runner_id), a)
            answer = await _chat(a.url, key, "pushed")
            assert answer.status_code == 200, answer.text
            assert _events(answer.content)[-1] == b"[DONE]" and b'"error"' not in answer.content
            (session,) = a.hub.sessions.live.values()
            job = b.hub.board.jobs[session.job_id]
            assert job.claimed_by == runner_id  # claimed through b, after b pushed it
            assert b.hub.channels.local(session.job_id) is not None


async def test_a_job_is_claimed_once_whatever_replica_each_claim_reaches(pg_url: str) -> None:
    async with replicas(pg_url, 2) as (a, b):
        runners = [
            await register_runner(a.hub, OWNER, PROJECT, f"runner-{n}", ["self-hosted"])
            for n in range(12)
        ]
        job = await a.hub.board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], dict(CHAT_DEFINITION))
        await until(lambda: job.id in b.hub.board.jobs, b)  # b offers it too
        answers: list[tuple[str, int, dict[str, Any]]] = []

        async def claim(runner: dict[str, Any], replica: Replica) -> None:
            async with httpx.AsyncClient(timeout=10) as client:
                got = await client.post(
                    f"{replica.url}{BASE}/runners/generate-jitconfig",
                    headers={"Authorization": f"Bearer {runner['token']}"},
                    json={"jobId": job.id, "name": runner["name"]},
                )
            answers.append((runner["id"], got.status_code, got.json()))

        async with trio.open_nursery() as nursery:
            for n, runner in enumerate(runners):
                nursery.start_soon(claim, runner, (a, b)[n % 2])
        won = [(rid, body) for rid, status, body in answers if status == 200]
        assert len(won) == 1, answers
        assert sorted(status for _, status, _ in answers) == [200] + [409] * 11
        winner, body = won[0]
        stored = await b.hub.store.load_job(job.id)
        assert stored is not None and stored.claimed_by == winner
        assert stored.run_id == body["runId"]
        # both replicas' boards say the same
        await until(lambda: b.hub.board.jobs[job.id].claimed_by == winner, b)
        assert a.hub.board.jobs[job.id].claimed_by == winner


async def _stream_statuses(
    replicas_urls: list[str], key: str, sim: dict[str, Any], decided: int
) -> list[int]:
    """One streamed request to each URL at once (sessions of their own); their statuses once
    ``decided`` of them have their answer's head (the others still streaming are then left)."""
    statuses: list[int] = []
    done = trio.Event()

    async def one(n: int, url: str) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            headers = {"Authorization": f"Bearer {key}", "X-Chat-Session": f"s{n}"}
            async with client.stream(
                "POST", f"{url}/v1/chat/completions", headers=headers, json=_body(sim=sim)
            ) as response:
                statuses.append(response.status_code)
                if len(statuses) == decided:
                    done.set()
                await done.wait()

    async with trio.open_nursery() as nursery:
        for n, url in enumerate(replicas_urls):
            nursery.start_soon(one, n, url)
        await done.wait()
        nursery.cancel_scope.cancel()
    return statuses


async def test_limits_are_exact_across_replicas(
    pg_url: str, sim: Simulator, tmp_path: Path
) -> None:
    async with replicas(pg_url, 2) as (a, b):
        project = f"{OWNER}/{PROJECT}"
        rpm = await a.hub.store.create_api_key("rpm3", project, KeyLimits(rpm=3))
        streams = await a.hub.store.create_api_key("streams3", project, KeyLimits(max_streams=3))
        async with running(
            runner_config(b.url, sim.url, tmp_path / "state", max_sessions=16)
        ) as runner:
            assert runner.registration is not None
            runner_id = runner.registration.id
            await until(lambda: a.hub.board.alive(runner_id), a)
            split = [a.url, b.url, a.url, b.url, a.url]
            # requests a minute: 3 of 5 at once pass, on either replica
            statuses = await _stream_statuses(split, rpm, {"chunks": 2}, 5)
            assert sorted(statuses) == [200, 200, 200, 429, 429], statuses
            # turns in flight: 3 of 5 long ones at once stream, 2 are refused
            statuses = await _stream_statuses(split, streams, {"chunks": 400, "interval": 0.05}, 5)
            assert sorted(statuses) == [200, 200, 200, 429, 429], statuses
        refusal = await _chat(b.url, rpm, "late")
        assert refusal.status_code == 429
        assert "limited to 3 requests per minute (rpm)" in refusal.json()["error"]["message"]


async def test_every_replica_shows_the_whole_team(
    pg_url: str, sim: Simulator, tmp_path: Path
) -> None:
    async with replicas(pg_url, 2) as (a, b):
        key = await a.hub.store.create_api_key("alice", f"{OWNER}/{PROJECT}")
        async with running(runner_config(b.url, sim.url, tmp_path / "state")) as runner:
            assert runner.registration is not None
            runner_id = runner.registration.id
            await until(lambda: a.hub.board.alive(runner_id), a)
            assert (await _chat(a.url, key, "team")).status_code == 200
            admin = {"Authorization": f"Bearer {ADMIN}"}
            async with httpx.AsyncClient(timeout=10, headers=admin) as client:
                team = (await client.get(f"{a.url}/api/hub/replicas")).json()
                listed = (await client.get(f"{a.url}/api/hub/runners")).json()["runners"]
                sessions = (await client.get(f"{a.url}/api/hub/sessions")).json()["sessions"]
            assert sorted(r["id"] for r in team["replicas"]) == ["r0", "r1"]
            assert all(r["up"] for r in team["replicas"])
            held = {r["id"]: (r["channels"], r["runners"]) for r in team["replicas"]}
            assert held == {"r0": (0, []), "r1": (1, [runner_id])}  # the runner dialled b
            assert [r["connected"] for r in listed if r["id"] == runner_id] == [True]
            assert [(s["key"], s["session"]) for s in sessions] == [("alice", "team")]
            assert sessions[0]["runnerId"] == runner_id
            print(json.dumps(team))


async def _metrics(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A replica's ``/metrics``: each sample name's (labels, value) pairs."""
    async with httpx.AsyncClient(timeout=10) as client:
        got = await client.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert got.status_code == 200, got.text
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(got.text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def _total(found: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for got, v in found.get(name, []) if labels.items() <= got.items())


async def test_each_replicas_metrics_are_its_own_and_name_it(
    pg_url: str, sim: Simulator, tmp_path: Path
) -> None:
    """Issue 28 point 2: ``/metrics`` per replica. Each replica's scrape names it in
    ``alp_hub_replica_info`` (its id, address, version) and counts its own: the turn that came
    in at a (served by the runner whose channel b holds) is a's turn, the channel b's."""
    async with replicas(pg_url, 2) as (a, b):
        key = await a.hub.store.create_api_key("alice", f"{OWNER}/{PROJECT}")
        async with running(runner_config(b.url, sim.url, tmp_path / "state")) as runner:
            assert runner.registration is not None
            runner_id = runner.registration.id
            await until(lambda: a.hub.board.alive(runner_id), a)
            assert (await _chat(a.url, key, "counted")).status_code == 200
            at_a, at_b = await _metrics(a.url), await _metrics(b.url)
    for found, replica, own in ((at_a, "r0", a), (at_b, "r1", b)):
        assert found["alp_hub_replica_info"] == [
            ({"replica": replica, "url": own.url.rstrip("/"), "version": __version__}, 1.0)
        ]
    assert _total(at_a, "alp_hub_turns_total", key="alice", outcome="ok") == 1
    assert _total(at_b, "alp_hub_turns_total", key="alice") == 0  # a's turn, not b's
    assert _total(at_a, "alp_hub_tokens_total", key="alice") > 0
    assert _total(at_b, "alp_hub_tokens_total", key="alice") == 0
    assert _total(at_a, "alp_hub_channels_open") == 0  # the channel is b's
    assert _total(at_b, "alp_hub_channels_open") == 1


async def test_hub_doctor_checks_the_store_and_sees_every_replica(
    pg_url: str, tmp_path: Path
) -> None:
    """``alp-gateway hub doctor`` (issue 28 point 5): the store reachable and migrated, each
    replica up with its address answering from here; one stopped is said stopped; a SQLite
    hub has no team; a database that cannot be reached fails with a fix and no password."""
    async with replicas(pg_url, 2):
        out = io.StringIO()
        report = doctor.Report(out)
        await doctor.check(HubSettings(store=pg_url, team_secret=(TEAM_SECRET,)), report)
        lines = out.getvalue().splitlines()
    assert not report.failed, lines
    assert lines[0].startswith("✓ store: PostgreSQL at postgresql://") and "***" in lines[0]
    assert lines[1] == f"✓ migrations: schema at version {LATEST}, this alp-gateway's"
    assert lines[2] == "✓ replicas: 2 up of 2 known"
    assert lines[3] == "✓ team secret: given: the replicas sign their internal requests"
    assert sorted(line.split(":")[0] for line in lines[4:]) == ["✓ replica r0", "✓ replica r1"]
    assert all("/healthz 503" in line for line in lines[4:])  # no runner: up, answering
    out = io.StringIO()
    await doctor.check(HubSettings(store=pg_url), doctor.Report(out))
    assert out.getvalue().count(" stopped (version ") == 2  # they retired when they stopped
    sqlite = io.StringIO()
    alone = open_store(tmp_path / "one")
    await alone.create_api_key("alone", f"{OWNER}/{PROJECT}")
    await alone.close()
    await doctor.check(HubSettings(data=tmp_path / "one"), doctor.Report(sqlite))
    assert "✓ replicas: none: a SQLite hub serves alone" in sqlite.getvalue()
    gone = io.StringIO()
    down = doctor.Report(gone)
    secret = pg_url.split(":")[2].split("@")[0]
    await doctor.check(HubSettings(store=pg_url.rsplit("/", 1)[0] + "/nosuchdb"), down)
    assert down.failed and gone.getvalue().startswith("✗ store: ")
    assert "fix: " in gone.getvalue() and secret not in gone.getvalue()
