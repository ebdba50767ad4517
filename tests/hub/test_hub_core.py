"""Tests of the hub core: the runner API, the Chat Channel, auth, persistence and the hub CLI."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import stat
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
import trio_websocket
from faultproxy import LOST, RESET, Delay, FaultProxy, Hold, fault_proxy
from helpers import inbox, register_runner, send

from gateway.config import default_hub_data
from gateway.hub import Hub, ServerChannel, open_hub
from gateway.hub.app import _ssl_context
from gateway.hub.channel import CLOSE_OFFLINE, CLOSE_REPLACED
from gateway.hub.cli import main
from gateway.wire import protocol

ADMIN = "alpa_test-admin-token"
OWNER, PROJECT = "acme", "chat"
BASE = f"/api/owners/{OWNER}/projects/{PROJECT}"
CAPS = [protocol.CAPABILITY]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def served() -> AsyncIterator[tuple[Hub, httpx.AsyncClient]]:
    async with open_hub(Hub(admin_token=ADMIN)) as (hub, base_url):
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
            yield hub, client


@pytest.fixture
async def proxied() -> AsyncIterator[tuple[Hub, FaultProxy, httpx.AsyncClient]]:
    """A hub behind a fault-injecting proxy, and an HTTP client talking to the proxy."""
    async with open_hub(Hub(admin_token=ADMIN)) as (hub, base_url), fault_proxy(base_url) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
            yield hub, proxy, client


def ws_url(client: httpx.AsyncClient, job_id: str, token: str) -> str:
    base = str(client.base_url).rstrip("/").replace("http://", "ws://")
    return f"{base}/api/lives/chat/channel/ws?jobId={job_id}&token={token}"


async def message(ws: trio_websocket.WebSocketConnection) -> str | bytes:
    """The next message the hub sends on a channel but those it sends every channel as it opens:
    its hello (docs/protocol.md §6) and the models request (asked, not answered here)."""
    while True:
        found = await ws.get_message()
        if isinstance(found, bytes) or (
            protocol.MODELS_REQUEST not in found and protocol.HELLO not in found
        ):
            return found


async def claim(client: httpx.AsyncClient, token: str, job_id: str) -> str:
    r = await client.post(
        f"{BASE}/runners/generate-jitconfig",
        json={"jobId": job_id, "name": "box"},
        headers=bearer(token),
    )
    assert r.status_code == 200, r.text
    return r.json()["runId"]


async def claimed_job(hub: Hub, client: httpx.AsyncClient) -> tuple[dict[str, Any], str, str]:
    """A registered runner (its record), a job it claimed, and the run id."""
    runner = await register_runner(hub, OWNER, PROJECT, "box", [])
    job = await hub.board.enqueue(OWNER, PROJECT, CAPS, {"jobType": "chat_llm"})
    run_id = await claim(client, runner["token"], job.id)
    return runner, job.id, run_id


# -- registration --------------------------------------------------------------


@pytest.mark.parametrize("path", ["runners", "runners/register"])
async def test_register_both_paths(served: tuple[Hub, httpx.AsyncClient], path: str) -> None:
    hub, client = served
    r = await client.post(
        f"{BASE}/{path}", json={"name": "box", "labels": ["linux"]}, headers=bearer(ADMIN)
    )
    assert r.status_code in (200, 201)
    body = r.json()
    assert set(body) == {"id", "name", "token", "registeredAt"}
    assert body["name"] == "box"
    assert body["token"].startswith("alpr_")
    runner = await hub.store.registration_by_token(body["token"])
    assert runner is not None and runner.labels == ("linux",)
    assert (runner.owner, runner.project) == (OWNER, PROJECT)


async def test_register_paths_configurable() -> None:
    async with open_hub(Hub(admin_token=ADMIN, register_paths=("runners/register",))) as (_, url):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post(f"{BASE}/runners", json={"name": "b"}, headers=bearer(ADMIN))
            assert r.status_code == 404
            r = await client.post(
                f"{BASE}/runners/register", json={"name": "b"}, headers=bearer(ADMIN)
            )
            assert r.status_code in (200, 201)


async def test_register_credentials(served: tuple[Hub, httpx.AsyncClient]) -> None:
    hub, client = served
    url = f"{BASE}/runners"
    body = {"name": "box", "labels": []}
    assert (await client.post(url, json=body)).status_code == 401
    assert (await client.post(url, json=body, headers=bearer("alpa_wrong"))).status_code == 401
    runner = await register_runner(hub, OWNER, PROJECT, "box", [])
    r = await client.post(url, json=body, headers=bearer(runner["token"]))
    assert r.status_code == 403
    assert "a runner registers with an enrollment token" in r.json()["error"]["message"]
    key = await hub.keys.create("k")
    assert (await client.post(url, json=body, headers=bearer(key))).status_code == 403
    assert (await client.post(url, content=b"not json", headers=bearer(ADMIN))).status_code == 400
    assert (await client.post(url, json={"labels": []}, headers=bearer(ADMIN))).status_code == 400
    assert (await client.get(url, headers=bearer(ADMIN))).status_code == 405


# -- polling and claiming --------------------------------------------------------


async def test_poll_matches_capabilities(served: tuple[Hub, httpx.AsyncClient]) -> None:
    hub, client = served
    token = (await register_runner(hub, OWNER, PROJECT, "box", []))["token"]
    url = f"{BASE}/runners/jobs"
    r = await client.post(url, json={"capabilities": CAPS}, headers=bearer(token))
    assert r.status_code == 204 and r.content == b""

    chat = await hub.board.enqueue(OWNER, PROJECT, CAPS, {"jobType": "chat_llm"})
    await hub.board.enqueue(OWNER, PROJECT, [*CAPS, "gpu"])
    anyone = await hub.board.enqueue(OWNER, PROJECT, [])
    await hub.board.enqueue(OWNER, "elsewhere", CAPS)

    for _ in range(2):  # polling never claims
        r = await client.post(url, json={"capabilities": CAPS}, headers=bearer(token))
        assert r.status_code == 200
        jobs = r.json()["jobs"]
        assert [j["id"] for j in jobs] == [chat.id, anyone.id]
    assert jobs[0] == {
        "id": chat.id,
        "runId": None,
        "needs": CAPS,
        "agentDefinition": {"jobType": "chat_llm"},
    }
    assert all(job.claimed_by is None for job in await hub.board.all_jobs.values())
    assert hub.board.last_seen[(await hub.store.registration_by_token(token)).id] > 0  # type: ignore[union-attr]


async def test_poll_auth(served: tuple[Hub, httpx.AsyncClient]) -> None:
    hub, client = served
    url = f"{BASE}/runners/jobs"
    body = {"capabilities": CAPS}
    assert (await client.post(url, json=body)).status_code == 401
    assert (await client.post(url, json=body, headers=bearer("alpr_nope"))).status_code == 401
    assert (await client.post(url, json=body, headers=bearer(ADMIN))).status_code == 401
    foreign = (await register_runner(hub, OWNER, "other", "box", []))["token"]
    assert (await client.post(url, json=body, headers=bearer(foreign))).status_code == 403
    token = (await register_runner(hub, OWNER, PROJECT, "box", []))["token"]
    assert (await client.post(url, content=b"{", headers=bearer(token))).status_code == 400
    assert (
        await client.post(url, json={"capabilities": "x"}, headers=bearer(token))
    ).status_code == 400


async def test_claim_once(served: tuple[Hub, httpx.AsyncClient]) -> None:
    hub, client = served
    first = await register_runner(hub, OWNER, PROJECT, "one", [])
    second = await register_runner(hub, OWNER, PROJECT, "two", [])
    job = await hub.board.enqueue(OWNER, PROJECT, CAPS)
    url = f"{BASE}/runners/generate-jitconfig"
    run_id = await claim(client, first["token"], job.id)
    assert job.claimed.is_set() and job.claimed_by == first["id"] and job.run_id == run_id
    r = await client.post(
        url, json={"jobId": job.id, "name": "two"}, headers=bearer(second["token"])
    )
    assert r.status_code == 409
    r = await client.post(
        url, json={"jobId": "nope", "name": "two"}, headers=bearer(second["token"])
    )
    assert r.status_code == 404
    r = await client.post(url, json={"jobId": job.id}, headers=bearer(second["token"]))
    assert r.status_code == 400
    r = await client.post(
        f"{BASE}/runners/jobs", json={"capabilities": CAPS}, headers=bearer(second["token"])
    )
    assert r.status_code == 204  # a claimed job is no longer offered


async def test_status_and_progress(served: tuple[Hub, httpx.AsyncClient]) -> None:
    hub, client = served
    runner, job_id, run_id = await claimed_job(hub, client)
    job = await hub.board.all_jobs.get(job_id)
    token = runner["token"]
    other = (await register_runner(hub, OWNER, PROJECT, "other", []))["token"]
    url = f"{BASE}/runs/{run_id}/jobs/{job_id}"

    r = await client.patch(url, json={"status": "in_progress"}, headers=bearer(other))
    assert r.status_code == 403
    r = await client.patch(
        f"{BASE}/runs/wrong/jobs/{job_id}", json={"status": "in_progress"}, headers=bearer(token)
    )
    assert r.status_code == 404
    r = await client.patch(url, json={"status": "in_progress"}, headers=bearer(token))
    assert r.status_code == 200 and job.status == "in_progress"

    progress = {"stage": "chat_llm_active", "message": None}
    r = await client.post(f"{url}/progress", json=progress, headers=bearer(token))
    assert r.status_code == 200 and job.last_progress == progress
    r = await client.post(f"{url}/progress", json=progress, headers=bearer(other))
    assert r.status_code == 403
    r = await client.patch(url, json={"status": "bogus"}, headers=bearer(token))
    assert r.status_code == 400

    done = {
        "status": "completed",
        "conclusion": "success",
        "logs": "bye",
        "completionReason": "success",
    }
    r = await client.patch(url, json=done, headers=bearer(token))
    assert r.status_code == 200
    assert job.completed.is_set() and job.status == "completed" and job.conclusion == "success"
    r = await client.patch(url, json=done, headers=bearer(token))
    assert r.status_code == 409
    # the refused report and the late one are not kept; the late ones are counted
    assert job.reports == [{"status": "in_progress"}, done]
    assert hub.board.late_reports == 1
    r = await client.post(f"{url}/progress", json=progress, headers=bearer(token))
    assert r.status_code == 409 and hub.board.late_reports == 2


# -- events (SSE) ------------------------------------------------------------------


async def test_events_deliver_job_available(served: tuple[Hub, httpx.AsyncClient]) -> None:
    hub, client = served
    token = (await register_runner(hub, OWNER, PROJECT, "box", []))["token"]
    with trio.fail_after(10):
        async with client.stream("GET", f"{BASE}/runners/events", headers=bearer(token)) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            await hub.board.enqueue(OWNER, "elsewhere", CAPS)  # another project's subscribers only
            job = await hub.board.enqueue(OWNER, PROJECT, CAPS)
            buf = ""
            async for text in r.aiter_text():
                buf += text
                if "\n\n" in buf:
                    break
            event, _, _ = buf.partition("\n\n")
            assert (
                event
                == f"event: job_available\ndata: {json.dumps({'jobId': job.id}, separators=(',', ':'))}"
            )


async def test_events_keepalive_and_auth() -> None:
    async with open_hub(Hub(admin_token=ADMIN, keepalive_interval=0.05)) as (hub, url):
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.get(f"{BASE}/runners/events")).status_code == 401
            token = (await register_runner(hub, OWNER, PROJECT, "box", []))["token"]
            with trio.fail_after(10):
                async with client.stream(
                    "GET", f"{BASE}/runners/events", headers=bearer(token)
                ) as r:
                    async for text in r.aiter_text():
                        assert text.startswith(": keepalive\n\n")
                        break


async def test_events_disabled() -> None:
    async with open_hub(Hub(admin_token=ADMIN, events=False)) as (hub, url):
        token = (await register_runner(hub, OWNER, PROJECT, "box", []))["token"]
        async with httpx.AsyncClient(base_url=url) as client:
            assert (
                await client.get(f"{BASE}/runners/events", headers=bearer(token))
            ).status_code == 404


# -- the Chat Channel ----------------------------------------------------------------


async def test_channel_handshake_rejections(served: tuple[Hub, httpx.AsyncClient]) -> None:
    hub, client = served
    runner, job_id, run_id = await claimed_job(hub, client)
    other = (await register_runner(hub, OWNER, PROJECT, "other", []))["token"]
    unclaimed = await hub.board.enqueue(OWNER, PROJECT, CAPS)
    for jid, token in [
        (job_id, "alpr_wrong"),
        (job_id, other),
        (job_id, ADMIN),
        (unclaimed.id, runner["token"]),
        ("nope", runner["token"]),
    ]:
        with pytest.raises(trio_websocket.ConnectionRejected) as info:
            async with trio_websocket.open_websocket_url(ws_url(client, jid, token)):
                pass
        assert info.value.status_code == 403
    # a completed job accepts no channel either
    done = {
        "status": "completed",
        "conclusion": "success",
        "logs": "",
        "completionReason": "success",
    }
    r = await client.patch(
        f"{BASE}/runs/{run_id}/jobs/{job_id}", json=done, headers=bearer(runner["token"])
    )
    assert r.status_code == 200
    with pytest.raises(trio_websocket.ConnectionRejected):
        async with trio_websocket.open_websocket_url(ws_url(client, job_id, runner["token"])):
            pass


class Recording:
    """A sink that keeps what the channel's reader hands it (``gateway.hub.channel.Sink``)."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.replies: list[Any] = []
        self.flushes = 0
        self.gone = trio.Event()

    def chunk(self, chunk: Any, frame: bytes) -> None:
        self.chunks.append(bytes(chunk))

    def flush(self) -> None:
        self.flushes += 1

    def reply(self, frame: Any) -> None:
        self.replies.append(frame)

    def lost(self) -> bool:
        self.gone.set()
        return False

    def resume_count(self) -> int:
        return len(self.chunks)

    def resumed(self) -> None:
        pass


async def test_channel_routing_send_and_close(served: tuple[Hub, httpx.AsyncClient]) -> None:
    hub, client = served
    runner, job_id, _ = await claimed_job(hub, client)
    with trio.fail_after(10):
        async with trio_websocket.open_websocket_url(ws_url(client, job_id, runner["token"])) as ws:
            ch = await hub.channels.wait(job_id, 5)
            assert isinstance(ch, ServerChannel) and ch is hub.channels.get(job_id)
            assert hub.channels.runners() == {runner["id"]} and hub.channels.all() == [ch]
            hello = json.loads(await ws.get_message())  # first on every channel: the extensions
            assert hello == {
                "type": protocol.HELLO,
                "jobId": job_id,
                "extensions": ["resume", "continue", "embeddings", "liveness"],
            }
            asked = json.loads(await ws.get_message())  # then its runner's models
            assert asked["type"] == protocol.MODELS_REQUEST and asked["jobId"] == job_id
            unrouted = inbox(ch)
            sink = Recording()
            ch.open("r1", sink)
            frames = protocol.TurnFrames(job_id, "r1")
            chunk = frames.chunk(b'{"id":"c"}').decode()
            stray = protocol.done_frame(job_id, "r2")
            await ws.send_message(b"\x00binary is ignored")
            await ws.send_message("not json at all")
            await ws.send_message(stray)
            await ws.send_message(chunk)
            await ws.send_message(chunk)
            await ws.send_message(protocol.end_frame(job_id, "bye"))
            assert [(await unrouted.recv())[0] for _ in range(3)] == [
                "not json at all",
                stray,
                protocol.end_frame(job_id, "bye"),
            ]
            assert sink.chunks == [b'{"id":"c"}'] * 2 and sink.flushes >= 1 and not sink.replies
            assert ch.runner_ended and ch.undecodable == 1
            await ws.send_message(frames.done.decode())  # the end of r1: it is routed no more
            await ws.send_message(chunk)
            assert (await unrouted.recv())[0] == chunk
            assert [type(r).__name__ for r in sink.replies] == ["DoneFrame"] and not ch.routes("r1")

            await send(ch, {"type": protocol.MODELS_REQUEST, "jobId": job_id, "requestId": "m"})
            assert json.loads(await ws.get_message()) == {
                "type": protocol.MODELS_REQUEST,
                "jobId": job_id,
                "requestId": "m",
            }
            await send(ch, "raw text")
            assert await ws.get_message() == "raw text"
            await send(ch, b"\x01\x02")
            assert await ws.get_message() == b"\x01\x02"
            await hub.channels.end_job(job_id, "idle")
            assert json.loads(await ws.get_message()) == {
                "type": "chat.end",
                "jobId": job_id,
                "reason": "idle",
            }

            open_one = Recording()
            ch.open("r3", open_one)
            await ch.close(1011)
            with pytest.raises(trio_websocket.ConnectionClosed) as info:
                await ws.get_message()
            assert info.value.reason.code == 1011
            assert (
                ch.closed.is_set()
                and hub.channels.get(job_id) is None
                and not hub.channels.runners()
            )
            assert open_one.gone.is_set()  # its request was lost with the channel
            assert not await ch.send(b"dropped quietly")
            late = Recording()
            ch.open("late", late)
            assert late.gone.is_set()  # a request opened on a closed channel is lost at once


async def test_channel_runner_disconnect(served: tuple[Hub, httpx.AsyncClient]) -> None:
    hub, client = served
    runner, job_id, _ = await claimed_job(hub, client)
    with trio.fail_after(10):
        async with trio_websocket.open_websocket_url(ws_url(client, job_id, runner["token"])) as ws:
            ch = await hub.channels.wait(job_id)
            assert ch is not None
            sink = Recording()
            ch.open("r1", sink)
            await ws.aclose()
            await ch.closed.wait()
            assert sink.gone.is_set()
        assert await hub.channels.wait(job_id, 0.01) is None


async def test_channel_replaced_on_reconnect(served: tuple[Hub, httpx.AsyncClient]) -> None:
    hub, client = served
    runner, job_id, _ = await claimed_job(hub, client)
    url = ws_url(client, job_id, runner["token"])
    with trio.fail_after(10):
        async with trio_websocket.open_websocket_url(url) as ws1:
            first = await hub.channels.wait(job_id)
            assert first is not None
            async with trio_websocket.open_websocket_url(url) as ws2:
                await first.closed.wait()
                second = hub.channels.get(job_id)
                assert second is not None and second is not first
                with pytest.raises(trio_websocket.ConnectionClosed) as info:
                    await message(ws1)
                assert info.value.reason.code == CLOSE_REPLACED
                unrouted = inbox(second)
                await send(second, "still here")
                assert await message(ws2) == "still here"
                await ws2.send_message("hello")
                assert (await unrouted.recv())[0] == "hello"


async def test_channel_message_limit() -> None:
    async with open_hub(Hub(admin_token=ADMIN, max_body=1024)) as (hub, url):
        async with httpx.AsyncClient(base_url=url) as client:
            runner, job_id, _ = await claimed_job(hub, client)
            with trio.fail_after(10):
                async with trio_websocket.open_websocket_url(
                    ws_url(client, job_id, runner["token"])
                ) as ws:
                    ch = await hub.channels.wait(job_id)
                    assert ch is not None
                    await ws.send_message("x" * 2048)
                    with pytest.raises(trio_websocket.ConnectionClosed) as info:
                        await message(ws)
                    assert info.value.reason.code == 1009
                    await ch.closed.wait()


async def test_cancel_job(served: tuple[Hub, httpx.AsyncClient]) -> None:
    hub, client = served
    runner = await register_runner(hub, OWNER, PROJECT, "box", [])
    queued = await hub.board.enqueue(OWNER, PROJECT, CAPS)
    await hub.channels.cancel_job(queued.id, "no runner")
    assert queued.id not in await hub.board.all_jobs.ids() and queued.cancelled
    r = await client.post(
        f"{BASE}/runners/jobs", json={"capabilities": CAPS}, headers=bearer(runner["token"])
    )
    assert r.status_code == 204
    r = await client.post(
        f"{BASE}/runners/generate-jitconfig",
        json={"jobId": queued.id, "name": "b"},
        headers=bearer(runner["token"]),
    )
    assert r.status_code == 404

    job = await hub.board.enqueue(OWNER, PROJECT, CAPS)
    await claim(client, runner["token"], job.id)
    with trio.fail_after(10):
        async with trio_websocket.open_websocket_url(ws_url(client, job.id, runner["token"])) as ws:
            await hub.channels.wait(job.id)
            await hub.channels.cancel_job(job.id, "gone")
            assert json.loads(await message(ws)) == {
                "type": "chat.end",
                "jobId": job.id,
                "reason": "gone",
            }
            assert job.cancelled


# -- faults, dispatch ------------------------------------------------------------------


async def test_fault_injection(proxied: tuple[Hub, FaultProxy, httpx.AsyncClient]) -> None:
    hub, proxy, client = proxied
    token = (await register_runner(hub, OWNER, PROJECT, "box", []))["token"]
    proxy.faults["poll"] = [503, 500]
    url = f"{BASE}/runners/jobs"
    for expected in (503, 500, 204):
        r = await client.post(url, json={"capabilities": CAPS}, headers=bearer(token))
        assert r.status_code == expected
        if expected != 204:
            assert r.json() == {"error": "injected"}
    proxy.faults["register"].append(502)
    r = await client.post(f"{BASE}/runners", json={"name": "b"}, headers=bearer(ADMIN))
    assert r.status_code == 502
    runner, job_id, _ = await claimed_job(hub, client)
    proxy.faults["channel"] = [500]
    with pytest.raises(trio_websocket.ConnectionRejected) as info:
        async with trio_websocket.open_websocket_url(ws_url(client, job_id, runner["token"])):
            pass
    assert info.value.status_code == 500
    async with trio_websocket.open_websocket_url(ws_url(client, job_id, runner["token"])):
        assert await hub.channels.wait(job_id, 5) is not None


async def test_dispatch_unknown(served: tuple[Hub, httpx.AsyncClient]) -> None:
    _, client = served
    r = await client.get("/nowhere")
    assert r.status_code == 404
    assert r.json() == {
        "error": {
            "message": "Invalid URL (GET /nowhere)",
            "type": "invalid_request_error",
            "param": None,
            "code": "unknown_url",
        }
    }
    assert (await client.post(f"{BASE}/runners/unknown")).status_code == 404
    # a client given the hub's root as its base URL (without /v1) is told where the API is
    r = await client.post("/chat/completions", json={})
    assert r.status_code == 404 and r.json()["error"]["message"] == (
        "Invalid URL (POST /chat/completions): did you mean POST /v1/chat/completions? "
        "(a client's base URL is the hub's address with /v1)"
    )
    r = await client.get("/models")
    assert "did you mean GET /v1/models?" in r.json()["error"]["message"]
    r = await client.delete(f"{BASE}/runners/jobs")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = await client.post(f"{BASE}/runners/jobs", json={"capabilities": CAPS})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["message"] == "a runner token is required"


# -- offline detection -----------------------------------------------------------------


async def test_offline_runner_jobs_force_completed() -> None:
    async with open_hub(Hub(admin_token=ADMIN, offline_after=0.5)) as (hub, url):
        async with httpx.AsyncClient(base_url=url) as client:
            runner, job_id, run_id = await claimed_job(hub, client)
            job = await hub.board.all_jobs.get(job_id)
            assert await hub.check_offline() == []  # just seen: alive
            with trio.fail_after(10):
                async with trio_websocket.open_websocket_url(
                    ws_url(client, job_id, runner["token"])
                ) as ws:
                    await job.completed.wait()
                    with pytest.raises(trio_websocket.ConnectionClosed) as info:
                        await message(ws)
                    assert info.value.reason.code == CLOSE_OFFLINE
            assert job.conclusion == "failure"
            assert job.reports[-1] == {
                "status": "completed",
                "conclusion": "failure",
                "logs": "runner offline",
                "forced": True,
            }
            done = {
                "status": "completed",
                "conclusion": "success",
                "logs": "",
                "completionReason": "success",
            }
            r = await client.patch(
                f"{BASE}/runs/{run_id}/jobs/{job_id}", json=done, headers=bearer(runner["token"])
            )
            assert r.status_code == 409


# -- persistence and auth storage ----------------------------------------------------------


async def test_persistence_across_restart(tmp_path: pathlib.Path) -> None:
    data = tmp_path / "hub"
    first = Hub(data)
    assert first.admin_token.startswith("alpa_") and first.admin_token_created
    assert stat.S_IMODE((data / "admin-token").stat().st_mode) == 0o600
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    async with open_hub(first) as (_, url):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post(
                f"{BASE}/runners", json={"name": "box"}, headers=bearer(first.admin_token)
            )
            token = r.json()["token"]
    key = await first.keys.create("alice", "acme/chat")
    await first.store.close()

    second = Hub(data)
    assert second.admin_token == first.admin_token and not second.admin_token_created
    found = await second.store.check_api_key(key)
    assert found is not None and (found.name, found.owner, found.project) == (
        "alice",
        "acme",
        "chat",
    )
    async with open_hub(second) as (_, url):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post(
                f"{BASE}/runners/jobs", json={"capabilities": CAPS}, headers=bearer(token)
            )
            assert r.status_code == 204
    raw = (data / "hub.sqlite3").read_bytes()
    assert token.encode() not in raw and key.encode() not in raw


async def test_api_keys() -> None:
    hub = Hub()
    key = await hub.keys.create("bob")
    assert key.startswith("alpk_")
    found = await hub.store.check_api_key(key)
    assert found is not None and (found.owner, found.project) == ("local", "chat")
    assert await hub.store.check_api_key(key + "x") is None
    with pytest.raises(ValueError):
        await hub.keys.create("bob")
    with pytest.raises(ValueError):
        await hub.keys.create("carol", "no-slash")
    assert [k["name"] for k in await hub.keys.listing()] == ["bob"]
    assert await hub.keys.revoke("bob") and not await hub.keys.revoke("bob")
    assert await hub.store.check_api_key(key) is None
    assert (await hub.keys.listing())[0]["revoked"] is True


# -- the hub CLI ---------------------------------------------------------------------------


def test_cli_keys(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = str(tmp_path / "state")
    assert main(["keys", "create", "alice", "--data", data, "--create"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("alpk_")
    assert main(["keys", "create", "bob", "--project", "acme/chat", "--data", data]) == 0
    capsys.readouterr()
    assert main(["keys", "list", "--data", data]) == 0
    out = capsys.readouterr().out
    assert "alice" in out and "local/chat" in out and "acme/chat" in out and key not in out
    assert main(["keys", "revoke", "alice", "--data", data]) == 0
    said = capsys.readouterr().out  # when a running hub honours it, with the value
    assert said.startswith("revoked API key 'alice'") and "within key_check_interval (5 s)" in said
    assert main(["keys", "revoke", "alice", "--data", data]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "alice" in err
    monkeypatch.setenv("ALP_GATEWAY_HUB_KEY_CHECK_INTERVAL", "30")  # as the hub was started
    assert main(["keys", "update", "bob", "--rpm", "5", "--data", data]) == 0
    assert "a running hub applies them within key_check_interval (30 s)" in capsys.readouterr().out
    assert trio.run(Hub(tmp_path / "state").store.check_api_key, key) is None
    assert main(["keys", "create", "x", "--project", "bad", "--data", data]) == 2
    assert main(["--listen", "nonsense", "--data", data]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_cli_keys_refuse_a_data_directory_with_no_hub(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped --data made a new empty store and a key the running hub rejects."""
    hub = Hub(tmp_path / "hub")  # the hub that runs
    trio.run(hub.store.close)
    wrong = tmp_path / "hbu"
    for command in (["create", "alice"], ["list"], ["update", "alice", "--rpm", "1"]):
        assert main(["keys", *command, "--data", str(wrong)]) == 2
        err = capsys.readouterr().err
        assert f"no hub in {wrong} (no hub.sqlite3): give the --data of the hub you run" in err
        assert err.count("\n") == 1
        assert ("`keys create --create` to start a new hub store" in err) == (
            command[0] == "create"
        )
    assert not wrong.exists()
    assert main(["usage", "--data", str(wrong)]) == 2
    assert main(["keys", "create", "alice", "--data", str(tmp_path / "hub")]) == 0
    assert capsys.readouterr().out.startswith("alpk_")
    assert main(["keys", "create", "bob", "--data", str(wrong), "--create"]) == 0
    assert (wrong / "hub.sqlite3").exists()


def test_cli_hub_on_a_port_in_use_creates_nothing(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        data = tmp_path / "hub"
        assert main(["--listen", f"127.0.0.1:{port}", "--data", str(data)]) == 2
    out, err = capsys.readouterr()
    assert (
        err
        == f"alp-gateway hub: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    )
    assert "admin token" not in out and not data.exists()


def test_cli_default_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("ALP_GATEWAY_STATE_DIR", str(tmp_path / "s"))
    assert default_hub_data(os.environ) == tmp_path / "s" / "hub"
    monkeypatch.delenv("ALP_GATEWAY_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "x"))
    assert default_hub_data(os.environ) == tmp_path / "x" / "alp-gateway" / "hub"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = tmp_path / "home" / ".local" / "state" / "alp-gateway" / "hub"
    assert default_hub_data(os.environ) == home


# -- fault kinds, hits, admin routes, re-offered claims, pausing a channel ---------------------


async def _raw_poll(url: str, token: str) -> bytes:
    """A poll over a bare socket: every byte the hub sends back (b"" if it closed)."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    body = json.dumps({"capabilities": CAPS}).encode()
    request = (
        f"POST {BASE}/runners/jobs HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body
    stream = await trio.open_tcp_stream(host, int(port))
    received = b""
    async with stream:
        await stream.send_all(request)
        with trio.fail_after(10):
            try:
                while data := await stream.receive_some():
                    received += data
            except trio.BrokenResourceError:  # ECONNRESET
                pass
    return received


async def test_fault_kinds(proxied: tuple[Hub, FaultProxy, httpx.AsyncClient]) -> None:
    hub, proxy, client = proxied
    token = (await register_runner(hub, OWNER, PROJECT, "box", []))["token"]
    url = f"{BASE}/runners/jobs"
    body = {"capabilities": CAPS}
    proxy.faults["poll"] = [RESET]
    assert await _raw_poll(proxy.url, token) == b""  # not one byte of an answer
    proxy.faults["poll"] = [Hold(30.0), Hold(30.0), Delay(0.2), Delay(0)]
    for _ in range(2):  # held until the client gives up: a timeout, not an answer
        with pytest.raises(httpx.ReadTimeout):
            await client.post(url, json=body, headers=bearer(token), timeout=0.5)
    start = trio.current_time()
    r = await client.post(url, json=body, headers=bearer(token))
    assert r.status_code == 204 and trio.current_time() - start >= 0.2  # late, but answered
    assert (await client.post(url, json=body, headers=bearer(token))).status_code == 204
    assert [h.fault for h in proxy.hits] == [RESET, Hold(30.0), Hold(30.0), Delay(0.2), Delay(0)]
    assert await proxy.wait_hits("poll", 5) == proxy.hits and proxy.hit_counts["poll"] == 5

    # LOST: the claim takes effect, the answer never comes
    job = await hub.board.enqueue(OWNER, PROJECT, CAPS)
    proxy.faults["claim"] = [LOST]
    with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):  # reset, no answer
        await client.post(
            f"{BASE}/runners/generate-jitconfig",
            json={"jobId": job.id, "name": "box"},
            headers=bearer(token),
        )
    assert job.claimed_by is not None and job.run_id is not None


async def test_channel_faults(proxied: tuple[Hub, FaultProxy, httpx.AsyncClient]) -> None:
    hub, proxy, client = proxied
    runner, job_id, _ = await claimed_job(hub, client)
    url = ws_url(client, job_id, runner["token"])
    proxy.faults["channel"] = [RESET, Delay(0.1)]
    with pytest.raises(trio_websocket.HandshakeError) as reset:
        async with trio_websocket.open_websocket_url(url, connect_timeout=1):
            pass
    assert not isinstance(reset.value, trio_websocket.ConnectionRejected)  # no answer at all
    with trio.fail_after(10):
        async with trio_websocket.open_websocket_url(url):  # late, but accepted
            assert await hub.channels.wait(job_id, 5) is not None
    assert [h.fault for h in proxy.hits if h.route == "channel"] == [RESET, Delay(0.1)]


async def test_admin_routes(served: tuple[Hub, httpx.AsyncClient]) -> None:
    hub, client = served
    runner, job_id, run_id = await claimed_job(hub, client)
    assert (await client.get("/api/hub/jobs")).status_code == 401
    assert (await client.get("/api/hub/jobs", headers=bearer(runner["token"]))).status_code == 403
    assert (await client.get("/api/hub/nope", headers=bearer(ADMIN))).status_code == 404
    assert (await client.post("/api/hub/jobs", headers=bearer(ADMIN))).status_code == 405
    r = await client.get("/api/hub/jobs", headers=bearer(ADMIN))
    assert r.status_code == 200
    [job] = r.json()["jobs"]
    assert job["id"] == job_id and job["runId"] == run_id and job["claimedBy"] == runner["id"]
    assert job["status"] == "queued" and job["reports"] == [] and not job["finalReported"]
    r = await client.get("/api/hub/sessions", headers=bearer(ADMIN))
    assert r.status_code == 200 and r.json() == {"sessions": []}


async def test_unstarted_claim_is_reoffered_to_its_runner_only() -> None:
    async with open_hub(Hub(admin_token=ADMIN, reoffer_after=3600)) as (hub, url):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            runner, job_id, run_id = await claimed_job(hub, client)
            other = await register_runner(hub, OWNER, PROJECT, "other", [])
            poll = f"{BASE}/runners/jobs"

            async def offered(token: str) -> list[str]:
                r = await client.post(poll, json={"capabilities": CAPS}, headers=bearer(token))
                return [j["id"] for j in r.json()["jobs"]] if r.status_code == 200 else []

            assert await offered(runner["token"]) == []  # just claimed
            hub.settings.reoffer_after = 0.0  # as if reoffer_after had passed (no clock race)
            assert await offered(runner["token"]) == [job_id]
            assert await offered(other["token"]) == []
            assert await claim(client, runner["token"], job_id) == run_id  # idempotent
            r = await client.post(
                f"{BASE}/runners/generate-jitconfig",
                json={"jobId": job_id, "name": "other"},
                headers=bearer(other["token"]),
            )
            assert r.status_code == 409
            async with trio_websocket.open_websocket_url(ws_url(client, job_id, runner["token"])):
                assert await hub.channels.wait(job_id, 5) is not None
                assert await offered(runner["token"]) == []  # started: never again
                r = await client.post(
                    f"{BASE}/runners/generate-jitconfig",
                    json={"jobId": job_id, "name": "box"},
                    headers=bearer(runner["token"]),
                )
                assert r.status_code == 409


async def test_paused_channel_reads_nothing_until_resumed(
    proxied: tuple[Hub, FaultProxy, httpx.AsyncClient],
) -> None:
    # the Server stops reading the channel (the proxy in front of it does): TCP pushes back
    hub, proxy, client = proxied
    runner, job_id, _ = await claimed_job(hub, client)
    total, pad = 300, "x" * 65536  # ~20 MB: far more than the socket buffers hold
    sent = 0

    async def sender(ws: trio_websocket.WebSocketConnection) -> None:
        nonlocal sent
        for i in range(total):
            await ws.send_message(f"{i:06d}{pad}")
            sent += 1

    with trio.fail_after(30):
        async with (
            trio_websocket.open_websocket_url(ws_url(client, job_id, runner["token"])) as ws,
            trio.open_nursery() as nursery,
        ):
            ch = await hub.channels.wait(job_id, 5)
            assert ch is not None
            unrouted = inbox(ch)
            proxy.pause_channels()
            nursery.start_soon(sender, ws)
            last = -1
            while sent != last:  # a measurement: until the runner side's sends block
                last = sent
                await trio.sleep(0.25)
            await trio.sleep(0.5)
            assert 0 < sent == last < total  # TCP pushed back
            await send(ch, "the Server can still send")
            assert await message(ws) == "the Server can still send"
            proxy.resume_channels()
            for i in range(total):
                assert (await unrouted.recv())[0] == f"{i:06d}{pad}"


async def test_jobs_and_reports_survive_a_restart(tmp_path: pathlib.Path) -> None:
    data = tmp_path / "hub"
    first = Hub(data)
    done = {
        "status": "completed",
        "conclusion": "success",
        "logs": "",
        "completionReason": "success",
    }
    async with open_hub(first) as (_, url):
        async with httpx.AsyncClient(base_url=url) as client:
            runner, job_id, run_id = await claimed_job(first, client)
            status = f"{BASE}/runs/{run_id}/jobs/{job_id}"
            r = await client.patch(
                status, json={"status": "in_progress"}, headers=bearer(runner["token"])
            )
            assert r.status_code == 200
            _, finished_id, finished_run = await claimed_job(first, client)
    queued = await first.board.enqueue(OWNER, PROJECT, CAPS, {"jobType": "chat_llm"})
    withdrawn = await first.board.enqueue(OWNER, PROJECT, CAPS)
    await first.channels.cancel_job(withdrawn.id)
    await first.store.close()

    second = Hub(data, offline_after=60)
    assert set(await second.board.all_jobs.ids()) == {job_id, finished_id, queued.id}
    job = await second.board.all_jobs.get(job_id)
    assert (job.status, job.run_id, job.claimed_by) == ("in_progress", run_id, runner["id"])
    assert job.claimed.is_set() and not job.completed.is_set()
    assert job.reports == [{"status": "in_progress"}]
    assert (await second.board.all_jobs.get(queued.id)).agent_definition == {"jobType": "chat_llm"}
    async with open_hub(second) as (_, url):
        assert await second.check_offline() == []  # reloaded jobs get offline_after to show up
        async with httpx.AsyncClient(base_url=url) as client:
            with trio.fail_after(10):  # the runner's redial of the same job is accepted
                async with trio_websocket.open_websocket_url(
                    ws_url(client, job_id, runner["token"])
                ):
                    assert await second.channels.wait(job_id, 5) is not None
            status = f"{BASE}/runs/{run_id}/jobs/{job_id}"
            r = await client.patch(status, json=done, headers=bearer(runner["token"]))
            assert r.status_code == 200
            r = await client.post(
                f"{BASE}/runners/jobs", json={"capabilities": CAPS}, headers=bearer(runner["token"])
            )
            assert [j["id"] for j in r.json()["jobs"]] == [queued.id]
    await second.store.close()

    third = Hub(data)
    job = await third.board.all_jobs.get(job_id)
    assert job.status == "completed" and job.conclusion == "success" and job.final_reported
    assert job.completed.is_set()
    assert [r["status"] for r in job.reports] == ["in_progress", "completed"]
    assert (await third.board.all_jobs.get(finished_id)).run_id == finished_run
    await third.store.close()


def test_tls_needs_cert_and_key(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = str(tmp_path / "state")
    assert main(["--data", data, "--tls-cert", str(tmp_path / "c.pem")]) == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    (tmp_path / "c.pem").write_text("not a certificate")
    assert (
        main(
            [
                "--data",
                data,
                "--tls-cert",
                str(tmp_path / "c.pem"),
                "--tls-key",
                str(tmp_path / "c.pem"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot use --tls-cert" in err
    with pytest.raises(ValueError):
        _ssl_context("c.pem", None)
