"""The ALP REST client against a Server that answers wrong: each malformed reply is one clear
error naming the request and the field (never a traceback), and fields nobody reads are ignored.

The Server is a tiny loopback HTTP/1.1 server answering canned replies by path
(``CannedServer``): the hub always answers right, so it cannot stand in here."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import trio
from helpers import OWNER, PROJECT, LogCapture, runner_config, running

from gateway.observe import Counters
from gateway.runner.alp import AlpClient, MalformedReply
from gateway.runner.supervisor import Runner, RunnerExit

CHAT = {"jobType": "chat_llm"}
SECRET = "alpr_the_runner_token_4242"
GOOD_REGISTRATION = json.dumps({"id": "r1", "name": "box", "token": SECRET}).encode()


class CannedServer:
    """Answers ``POST/GET/PATCH {base}/{path}`` with ``replies[path]`` (status, body), else 404;
    counts the requests per path (``counters``: tests wait on them)."""

    def __init__(self, replies: dict[str, tuple[int, bytes]]) -> None:
        self.replies = replies
        self.counters = Counters()
        self.url = ""
        self.base = f"/api/owners/{OWNER}/projects/{PROJECT}/"

    async def handle(self, stream: trio.SocketStream) -> None:
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            while len(body) < length:
                body += await stream.receive_some(65536)
            path = lines[0].split(" ")[1].split("?")[0].removeprefix(self.base)
            status, reply = self.replies.get(path, (404, b""))
            await stream.send_all(
                b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (status, len(reply), reply)
            )
            self.counters.inc(path)
        except trio.BrokenResourceError:
            pass
        finally:
            await stream.aclose()


@asynccontextmanager
async def canned(replies: dict[str, tuple[int, bytes]]) -> AsyncIterator[CannedServer]:
    server = CannedServer(replies)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
        server.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        yield server
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def client(server: CannedServer) -> AsyncIterator[AlpClient]:
    alp = AlpClient(server.url, OWNER, PROJECT)
    alp.token = SECRET
    try:
        yield alp
    finally:
        await alp.aclose()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"jobs": {"id": "j1"}}', "Expected `array | null`, got `object` - at `$.jobs`"),
        (b'[{"id": "j1"}]', "Expected `object`, got `array`"),
        (b"<html>a proxy's page</html>", "not JSON"),
    ],
)
async def test_a_malformed_poll_reply_names_the_request_and_the_field(
    body: bytes, field: str
) -> None:
    async with canned({"runners/jobs": (200, body)}) as server, client(server) as alp:
        with pytest.raises(MalformedReply) as info:
            await alp.poll(["chat-llm:v1"])
    message = str(info.value)
    assert message.startswith(f"POST {alp.base}/runners/jobs: malformed reply: "), message
    assert field in message and "\n" not in message


@pytest.mark.parametrize("body", [b"", b"null", b" null\n", b"{}", b'{"jobs": null}'])
async def test_nothing_offered(body: bytes) -> None:
    async with canned({"runners/jobs": (200, body)}) as server, client(server) as alp:
        assert await alp.poll(["chat-llm:v1"]) == []


async def test_a_job_that_cannot_be_read_is_skipped_once_said_and_the_rest_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    jobs = [
        {"id": 7, "agentDefinition": CHAT},  # a number for an id
        {"id": "j2", "needs": ["chat-llm:v1"], "later": {"fields": [1]}, "runId": None},
        {"id": "j3", "agentDefinition": {"jobType": "dispatch_worker", "needs": "docker"}},
        {"id": "j4", "agentDefinition": {**CHAT, "traceparent": 5, "idleTimeoutMinutes": "x"}},
    ]
    reply = json.dumps({"jobs": jobs, "next": "ignored"}).encode()
    async with canned({"runners/jobs": (200, reply)}) as server, client(server) as alp:
        first = await alp.poll(["chat-llm:v1"])
        again = await alp.poll(["chat-llm:v1"])
    assert [j.id for j in first] == [j.id for j in again] == ["j2", "j4"]
    assert [j.is_chat_job for j in first] == [True, True]
    warned = [r.message for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2, warned  # each once, though offered twice
    assert "Expected `str`, got `int` - at `$.jobs[0].id`" in warned[0]
    assert "Expected `array | null`, got `str` - at `$.jobs[2].agentDefinition.needs`" in warned[1]


async def test_a_claim_reply_without_a_run_id_is_an_error_not_a_lost_race() -> None:
    replies = {"runners/generate-jitconfig": (200, b'{"run": "r1"}')}
    async with canned(replies) as server, client(server) as alp:
        with pytest.raises(MalformedReply, match="missing required field `runId`") as info:
            await alp.claim("j1", "box")
        assert str(info.value).startswith(f"POST {alp.base}/runners/generate-jitconfig: ")
        replies["runners/generate-jitconfig"] = (200, b'{"runId": "", "more": 1}')
        with pytest.raises(MalformedReply, match="length >= 1 - at `\\$.runId`"):
            await alp.claim("j1", "box")
        replies["runners/generate-jitconfig"] = (200, b'{"runId": "r1", "more": 1}')
        assert await alp.claim("j1", "box") == "r1"
        replies["runners/generate-jitconfig"] = (409, b'{"runId": "r1"}')
        assert await alp.claim("j1", "box") is None  # another runner has it


async def test_registration_reads_what_it_needs_and_ignores_the_rest() -> None:
    reply = {"id": "r1", "token": SECRET, "registeredAt": "2026-01-01T00:00:00Z", "new": [1]}
    async with canned({"runners": (201, json.dumps(reply).encode())}) as server:
        async with client(server) as alp:
            registration = await alp.register("user", "asked-name", [])
    assert (registration.id, registration.name, registration.token) == ("r1", "asked-name", SECRET)
    assert registration.registeredAt == "2026-01-01T00:00:00Z"


@pytest.mark.parametrize(
    ("reply", "field"),
    [
        ({"id": "r1"}, "missing required field `token`"),
        ({"id": 5, "token": SECRET}, "Expected `str`, got `int` - at `$.id`"),
        ({"id": "r1", "token": SECRET, "name": ["x"]}, "at `$.name`"),
    ],
)
async def test_a_malformed_registration_reply_stops_register_with_one_line(
    reply: dict[str, object], field: str, tmp_path: Path, logs: LogCapture
) -> None:
    async with canned({"runners": (200, json.dumps(reply).encode())}) as server:
        runner = Runner(runner_config(server.url, None, tmp_path))
        with pytest.raises(RunnerExit) as info:
            await runner.register(wait_for_server=False)
    message = str(info.value)
    assert info.value.code == 2 and field in message and "\n" not in message
    assert message.startswith(f"POST {server.url}/api/owners/{OWNER}/projects/{PROJECT}/runners")
    assert SECRET not in message and not any(SECRET in line for line in logs.lines)


async def test_a_running_runner_reports_a_malformed_poll_in_its_health_not_a_traceback(
    tmp_path: Path, logs: LogCapture
) -> None:
    replies = {"runners": (201, GOOD_REGISTRATION), "runners/jobs": (200, b'{"jobs": 1}')}
    async with canned(replies) as server:
        config = runner_config(server.url, None, tmp_path, poll_interval=0.05)
        async with running(config) as runner:
            with trio.fail_after(10):
                await runner.counters.wait("poll_errors", 2)  # retried, with backoff
            error = runner.status().last_poll_error
            assert error is not None
            assert error.startswith(f"POST {server.url}/api/owners/{OWNER}/projects/{PROJECT}/")
            assert "- at `$.jobs`" in error
            # a claim answered 2xx without a runId: said, skipped, asked again once; no session
            job = {"id": "j1", "agentDefinition": CHAT}
            replies["runners/jobs"] = (200, json.dumps({"jobs": [job]}).encode())
            replies["runners/generate-jitconfig"] = (200, b"{}")
            polls = server.counters.get("runners/jobs")
            with trio.fail_after(10):
                await server.counters.wait("runners/generate-jitconfig", 2)
                await server.counters.wait("runners/jobs", polls + 2)  # it polls on after it
            assert runner.status().last_poll_error is None and not runner.sessions
    claim = [line for line in logs.lines if "claim of job j1 failed" in line]
    assert claim and "missing required field `runId`" in claim[0]
    assert not any("Traceback" in line for line in logs.lines)
