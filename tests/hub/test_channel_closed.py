"""A Chat Channel that closes with requests still queued on it (issue 36, point 3), over real
sockets: a real hub on loopback, a runner the test drives over the runner API and a raw
WebSocket that stops reading after its models answer, and a second runner (``FakeRunner``).

20 turns of 0.9 MiB bodies of one session wait on the channel that does not read; when it closes,
each waiting turn is served again on the other runner or answered 502 ``channel_lost``: never a
500, never a traceback (a send on a closed channel is an outcome, not an exception). Requests
queued for such a channel are bounded (``channel_backlog``): past it, 503 ``runner_busy`` at once,
while the channel is still open.
"""

from __future__ import annotations

import json
import logging
import socket
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from fake_runner import FakeRunner
from rawclient import TEXT, RawConn, upgrade_head, ws_frame
from test_causes import ADMIN, OWNER, PROJECT, chat, hub_of

from gateway.hub import Hub, open_hub
from gateway.hub.runnerapi import CHANNEL_PATH

BASE = f"/api/owners/{OWNER}/projects/{PROJECT}"
MiB = 1 << 20
BODY = 900 << 10  # a turn's content: its request frame under FakeRunner's 1 MiB message bound
TURNS = 20
GUARD = 60.0  # s: a hang guard, never a timing


class StuckRunner:
    """A registered runner that claims one job, dials its channel, answers the models request,
    then never reads again."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.token = ""
        self.http = httpx.AsyncClient(base_url=url, timeout=GUARD)

    async def rest(self, method: str, path: str, body: Any, token: str = "") -> httpx.Response:
        auth = {"Authorization": f"Bearer {token or self.token}"}
        return await self.http.request(method, path, json=body, headers=auth)

    async def register(self) -> None:
        reply = await self.rest("POST", f"{BASE}/runners", {"name": "stuck"}, token=ADMIN)
        assert reply.status_code in (200, 201), reply.text
        self.token = reply.json()["token"]
        await self.poll()

    async def poll(self) -> list[dict[str, Any]]:
        reply = await self.rest("POST", f"{BASE}/runners/jobs", {"capabilities": ["chat-llm:v1"]})
        assert reply.status_code in (200, 204), reply.text
        return reply.json()["jobs"] if reply.status_code == 200 else []  # type: ignore[no-any-return]

    async def claim(self, hub: Hub) -> str:
        """The next job offered, claimed (waits on the board for one to be queued)."""
        while True:
            change = hub.board.changes.event  # taken before the poll: one during it is not missed
            if jobs := await self.poll():
                break
            await change.wait()
        job_id: str = jobs[0]["id"]
        reply = await self.rest(
            "POST", f"{BASE}/runners/generate-jitconfig", {"jobId": job_id, "name": "stuck"}
        )
        assert reply.status_code == 200, reply.text
        return job_id

    async def dial(self, job_id: str) -> RawConn:
        """The job's channel, with a small receive window; its models request answered."""
        parts = urllib.parse.urlsplit(self.url)
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect((parts.hostname, parts.port))
        conn = RawConn(trio.SocketStream(sock))
        query = urllib.parse.urlencode({"jobId": job_id, "token": self.token})
        await conn.send(upgrade_head(f"{CHANNEL_PATH}?{query}"))
        resp = await conn.head()
        assert resp is not None and resp.status == 101, resp
        while (got := await conn.frame()) is not None:
            frame = json.loads(got[2])
            if frame.get("type") == "chat.models.request":
                answer = {**frame, "type": "chat.models.response", "models": ["fake-model"]}
                await conn.send(ws_frame(TEXT, json.dumps(answer).encode()))
                return conn
        raise AssertionError("the channel closed before its models request")


class Replies:
    """The clients' answers as they come (waited on, never slept for)."""

    def __init__(self) -> None:
        self.got: list[httpx.Response] = []
        self.changed = trio.Event()

    async def turn(self, url: str, key: str) -> None:
        body = [{"role": "user", "content": "x" * BODY}]
        self.got.append(await chat(url, key, "s", messages=body))
        self.changed.set()
        self.changed = trio.Event()

    async def until(self, n: int) -> None:
        while len(self.got) < n:
            await self.changed.wait()


class Records(logging.Handler):
    """Every log record of the test, kept whole (its level, its exception)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def logs() -> Iterator[Records]:
    handler = Records()
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(old)


def no_traceback(logs: Records) -> None:
    bad = [r for r in logs.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [(r.getMessage(), r.exc_info) for r in bad]


async def queued_on_a_stuck_channel(
    hub: Hub, url: str, key: str, replies: Replies, nursery: trio.Nursery, stuck: StuckRunner
) -> tuple[str, RawConn]:
    """The session's first turn on the stuck runner's channel, then the others after it."""
    await stuck.register()
    nursery.start_soon(replies.turn, url, key)
    job_id = await stuck.claim(hub)
    conn = await stuck.dial(job_id)
    for _ in range(TURNS - 1):
        nursery.start_soon(replies.turn, url, key)
    return job_id, conn


async def test_a_closed_channel_with_turns_queued_ends_each_cleanly(logs: Records) -> None:
    async with open_hub(hub_of(channel_backlog=64 * MiB)) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        replies = Replies()
        stuck = StuckRunner(url)
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                job_id, conn = await queued_on_a_stuck_channel(
                    hub, url, key, replies, nursery, stuck
                )
                ch = hub.channels.local(job_id)
                assert ch is not None
                while ch.requests < TURNS:  # every turn is in its send (or waits to be)
                    await trio.testing.wait_all_tasks_blocked()
                await trio.testing.wait_all_tasks_blocked()
                queued = ch.backlog
                other = FakeRunner(url, ADMIN, owner=OWNER, project=PROJECT, name="other")
                nursery.start_soon(other.run)
                await conn.aclose()  # the stuck runner's channel goes, 20 requests on it
                await replies.until(TURNS)
                nursery.cancel_scope.cancel()
        await stuck.http.aclose()
    statuses = sorted(r.status_code for r in replies.got)
    print(f"queued {queued / MiB:.1f} MiB unsent; statuses {statuses}")
    assert queued > 8 * MiB  # the requests did wait on the channel that does not read
    for reply in replies.got:
        assert reply.status_code in (200, 502), reply.text
        if reply.status_code == 502:
            assert reply.json()["error"]["code"] == "channel_lost", reply.text
    assert any(r.status_code == 200 for r in replies.got)  # served again on the other runner
    no_traceback(logs)


async def test_requests_past_the_channel_backlog_get_runner_busy_at_once(
    logs: Records,
) -> None:
    bound = 4 * MiB
    async with open_hub(hub_of(channel_backlog=bound)) as (hub, url):
        key = await hub.keys.create("k", f"{OWNER}/{PROJECT}")
        replies = Replies()
        stuck = StuckRunner(url)
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                job_id, conn = await queued_on_a_stuck_channel(
                    hub, url, key, replies, nursery, stuck
                )
                ch = hub.channels.local(job_id)
                assert ch is not None
                # every turn either waits on the channel or was refused, the channel still open
                while ch.requests + len(replies.got) < TURNS:
                    await trio.testing.wait_all_tasks_blocked()
                refused = list(replies.got)
                queued = ch.backlog
                assert not ch.closed.is_set()
                other = FakeRunner(url, ADMIN, owner=OWNER, project=PROJECT, name="other")
                nursery.start_soon(other.run)
                await conn.aclose()
                await replies.until(TURNS)
                nursery.cancel_scope.cancel()
        await stuck.http.aclose()
    print(f"{len(refused)} of {TURNS} refused at once; {queued / MiB:.1f} MiB unsent at most")
    assert len(refused) >= TURNS // 2
    for reply in refused:
        error = reply.json()["error"]
        assert reply.status_code == 503 and error["code"] == "runner_busy", reply.text
        assert reply.headers["retry-after"] == "1"
    assert queued <= bound + BODY + 4096  # the bound, and at most the one request that passed it
    rest = replies.got[len(refused) :]
    assert all(r.status_code in (200, 502) for r in rest), [r.text for r in rest]
    no_traceback(logs)
