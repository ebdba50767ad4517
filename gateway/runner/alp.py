"""The ALP REST client (docs/protocol.md §1–§4): register, poll, claim, status, progress, report, events."""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec

from gateway.state import Registration
from gateway.wire.protocol import CAPABILITY
from gateway.wire.sse import SSESplitter

log = logging.getLogger("gateway.alp")

CHAT_JOB_TYPE = "chat_llm"


class ServerUnavailable(Exception):
    """The Server could not be reached, timed out or answered 5xx: worth retrying later."""


class TokenRefused(Exception):
    """The Server refused the runner token (401/403)."""


class RegistrationRefused(Exception):
    """Registration refused: only a user credential registers a runner."""


class EventsUnavailable(Exception):
    """The Server has no push route (``GET …/runners/events`` answered 404/405)."""


class Refused(Exception):
    """A non-retryable 4xx answer; the message names the path and status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def make_ssl_context(ca_file: Path | None) -> ssl.SSLContext:
    """Certificates are verified; ``ca_file`` adds a private CA (a self-hosted hub)."""
    ctx = ssl.create_default_context()
    if ca_file is not None:
        ctx.load_verify_locations(cafile=str(ca_file))
    return ctx


def is_chat_job(job: Any) -> bool:
    """A Kind B job: ``agentDefinition.jobType == "chat_llm"`` or ``chat-llm:v1`` in its needs."""
    if not isinstance(job, dict) or not isinstance(job.get("id"), str):
        return False
    definition = job.get("agentDefinition")
    if not isinstance(definition, dict):
        definition = {}
    if definition.get("jobType") == CHAT_JOB_TYPE:
        return True
    for needs in (job.get("needs"), definition.get("needs")):
        if isinstance(needs, list) and CAPABILITY in needs:
            return True
    return False


_jobs_decoder = msgspec.json.Decoder()


def _root_cause(exc: BaseException) -> BaseException:
    seen = 0
    while seen < 8:
        if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]  # trio's "all attempts to connect … failed" holds the reason
        elif (exc.__cause__ or exc.__context__) is not None:
            exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        else:
            break
        seen += 1
    return exc


def _host_port(url: str) -> str:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme in ("https", "wss") else 80)
    return f"{parts.hostname}:{port}"


def describe_error(exc: BaseException, url: str | None = None) -> str:
    """One clean reason for a failed request to ``url``: under trio httpx's own message is
    often empty or doubled, and the cause (a refused connection, a name that does not resolve,
    TLS spoken to a plain-HTTP port) is a few levels down."""
    root = _root_cause(exc)
    if url is not None:
        where = _host_port(url)
        if isinstance(root, ConnectionRefusedError):
            return f"connection refused by {where}: nothing listens there"
        if isinstance(root, socket.gaierror):
            host = urlsplit(url).hostname
            return f"cannot resolve the host name {host!r} ({root.strerror})"
        if isinstance(root, ssl.SSLError) and root.reason == "WRONG_VERSION_NUMBER":
            return f"{where} does not speak TLS: use http:// instead of https://"
    text = str(exc)
    if root is not exc and str(root) and str(root) not in text:
        text = f"{text}: {root}" if text else str(root)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class CertificateRefused(ServerUnavailable):
    """TLS with the Server cannot work: its certificate failed verification, or it does not
    speak TLS at all (an https:// URL for a plain-HTTP Server). Retried like any outage once
    running, but registration stops at once: retrying will not help."""


def _check_certificate(exc: BaseException, url: str) -> None:
    root = _root_cause(exc)
    if isinstance(root, ssl.SSLCertVerificationError):
        raise CertificateRefused(
            f"{url}: the Server's certificate was refused ({root.verify_message}); "
            "if it is signed by a private CA, give it with --ca-file"
        ) from None
    if isinstance(root, ssl.SSLError) and root.reason == "WRONG_VERSION_NUMBER":
        plain = "http://" + url.split("://", 1)[-1]
        raise CertificateRefused(
            f"{url}: the Server does not speak TLS: use {plain} (http://, not https://)"
        ) from None


class AlpClient:
    """Talks to one ALP Server for one project; every call is one HTTP request."""

    def __init__(
        self,
        server: str,
        owner: str,
        project: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        timeout: float = 30.0,
        connect_timeout: float = 10.0,
    ) -> None:
        self.server = server
        self.owner = owner
        self.project = project
        self.base = f"{server}/api/owners/{owner}/projects/{project}"
        self.token: str | None = None
        self._client = httpx.AsyncClient(
            verify=ssl_context if ssl_context is not None else True,
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            headers={"user-agent": "alp-gateway"},
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    def _auth(self, token: str | None = None) -> dict[str, str]:
        token = token or self.token
        return {"authorization": f"Bearer {token}"} if token else {}

    async def _request(
        self, method: str, path: str, *, token: str | None = None, json: Any = None
    ) -> httpx.Response:
        url = f"{self.base}/{path}"
        try:
            resp = await self._client.request(method, url, json=json, headers=self._auth(token))
        except httpx.HTTPError as exc:
            _check_certificate(exc, self.server)
            raise ServerUnavailable(f"{method} {url}: {describe_error(exc, url)}") from None
        if resp.status_code >= 500:
            raise ServerUnavailable(f"{method} {url}: Server answered {resp.status_code}")
        return resp

    async def register(self, user_token: str, name: str, labels: list[str]) -> Registration:
        """``POST {base}/runners``, falling back to ``{base}/runners/register`` on 404/405."""
        body = {"name": name, "labels": labels}
        resp = await self._request("POST", "runners", token=user_token, json=body)
        tried = [f"{self.base}/runners"]
        if resp.status_code in (404, 405):
            resp = await self._request("POST", "runners/register", token=user_token, json=body)
            tried.append(f"{self.base}/runners/register")
        if resp.status_code in (401, 403):
            raise RegistrationRefused(self._refused_because(resp.status_code, user_token))
        if resp.status_code in (404, 405):
            raise Refused(self._not_found(resp.status_code, tried), resp.status_code)
        if not resp.is_success:
            raise Refused(
                f"registration failed: POST {tried[-1]} answered {resp.status_code}",
                resp.status_code,
            )
        try:
            data = resp.json()
            return Registration(
                id=str(data["id"]),
                name=str(data.get("name") or name),
                token=str(data["token"]),
                server=self.server,
                owner=self.owner,
                project=self.project,
                registeredAt=data.get("registeredAt"),
            )
        except (ValueError, KeyError, TypeError):
            raise Refused("registration reply lacks id/token", resp.status_code) from None

    def _refused_because(self, status: int, user_token: str) -> str:
        """Why a user credential was refused, in words that point the right way."""
        owner_project = f"{self.owner}/{self.project}"
        if user_token.startswith("alpr_"):  # the runner tokens this Server family hands out
            return (
                f"the Server refused registration ({status}): the credential given is a runner "
                "token (alpr_…); registering needs a user credential (--user-token or "
                "AGENTICS_USER_TOKEN)"
            )
        if status == 403:
            return (
                f"the Server refused registration (403): the user credential is known but may "
                f"not register runners in {owner_project}; check --project and the user's rights"
            )
        return (
            f"the Server refused registration (401): it does not accept the user credential "
            f"(--user-token or AGENTICS_USER_TOKEN) for {self.server}; check that it is this "
            "Server's and that it is not expired or revoked"
        )

    def _not_found(self, status: int, tried: list[str]) -> str:
        parts = urlsplit(self.server)
        root = f"{parts.scheme}://{parts.netloc}"
        if parts.path.strip("/"):
            hint = (
                f"--server {self.server} has a path ({parts.path}): give the Server's root, "
                f"--server {root} (without /v1 or /api)"
            )
        else:
            hint = (
                f"is {self.server} an ALP Server (not a model server or a proxy), and does the "
                f"project {self.owner}/{self.project} exist there?"
            )
        return f"registration failed: {' and '.join(f'POST {u}' for u in tried)} answered {status}: {hint}"

    async def poll(self, capabilities: list[str]) -> list[dict[str, Any]]:
        """``POST {base}/runners/jobs``: the offered jobs (never claims)."""
        resp = await self._request("POST", "runners/jobs", json={"capabilities": capabilities})
        if resp.status_code in (204, 404):
            return []
        if resp.status_code in (401, 403):
            raise TokenRefused(f"the Server refused the runner token on poll ({resp.status_code})")
        if not resp.is_success:
            raise Refused(f"poll: Server answered {resp.status_code}", resp.status_code)
        if not resp.content.strip():
            return []
        try:
            data = _jobs_decoder.decode(resp.content)
        except msgspec.DecodeError:
            raise ServerUnavailable("poll: the Server's answer is not JSON") from None
        if data is None:
            return []
        jobs = data.get("jobs") if isinstance(data, dict) else None
        return [j for j in jobs if isinstance(j, dict)] if isinstance(jobs, list) else []

    async def claim(self, job_id: str, name: str) -> str | None:
        """``POST {base}/runners/generate-jitconfig``: the runId, or None when another runner has it."""
        resp = await self._request(
            "POST", "runners/generate-jitconfig", json={"jobId": job_id, "name": name}
        )
        if not resp.is_success:
            return None
        try:
            run_id = resp.json().get("runId")
        except (ValueError, AttributeError):
            return None
        return str(run_id) if run_id else None

    async def set_status(self, run_id: str, job_id: str, body: dict[str, Any]) -> None:
        resp = await self._request("PATCH", f"runs/{run_id}/jobs/{job_id}", json=body)
        if not resp.is_success:
            raise Refused(f"job status: Server answered {resp.status_code}", resp.status_code)

    async def progress(self, run_id: str, job_id: str, stage: str) -> None:
        resp = await self._request(
            "POST", f"runs/{run_id}/jobs/{job_id}/progress", json={"stage": stage, "message": None}
        )
        if not resp.is_success:
            raise Refused(f"progress: Server answered {resp.status_code}", resp.status_code)

    async def report(self, run_id: str, job_id: str, conclusion: str, logs: str) -> None:
        """The one final report of a job (docs/protocol.md §3)."""
        await self.set_status(
            run_id,
            job_id,
            {
                "status": "completed",
                "conclusion": conclusion,
                "logs": logs,
                "completionReason": conclusion,
            },
        )

    @asynccontextmanager
    async def events(self) -> AsyncIterator[AsyncIterator[str]]:
        """``GET {base}/runners/events``, open for the length of the block: it gives an iterator of
        the jobId of every ``job_available`` event. The stream is closed when the block exits,
        however it exits (a cancelled consumer included), never left to the garbage collector."""
        url = f"{self.base}/runners/events"
        timeout = httpx.Timeout(10.0, read=60.0)  # the Server sends a keepalive every 15 s
        headers = {**self._auth(), "accept": "text/event-stream"}
        try:
            async with self._client.stream("GET", url, headers=headers, timeout=timeout) as resp:
                if resp.status_code in (404, 405):
                    raise EventsUnavailable(f"{url}: {resp.status_code}")
                if resp.status_code in (401, 403):
                    raise TokenRefused(
                        f"the Server refused the runner token on events ({resp.status_code})"
                    )
                if not resp.is_success:
                    raise ServerUnavailable(f"GET {url}: Server answered {resp.status_code}")
                yield _job_ids(resp, url)
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"GET {url}: {describe_error(exc, url)}") from None


async def _job_ids(resp: httpx.Response, url: str) -> AsyncIterator[str]:
    """The jobIds in an open events stream ("" for an event without one)."""
    splitter = SSESplitter()
    try:
        async for raw in resp.aiter_raw():
            for payload in splitter.feed(raw):
                try:
                    job_id = msgspec.json.decode(payload).get("jobId")
                except (msgspec.DecodeError, AttributeError):
                    job_id = None
                yield job_id if isinstance(job_id, str) else ""
    except httpx.HTTPError as exc:
        raise ServerUnavailable(f"GET {url}: {describe_error(exc, url)}") from None
