"""The ALP REST client (docs/protocol.md §1–§4): register, poll, claim, status, progress, report, events.

Every request has a deadline sized for it (``Deadlines``): the answer to a poll, a claim, a
status, a heartbeat or a report must come within the time the runner gives a silent path on the
channel (its ping timeout), a registration gets longer, and the push-events stream may stay
silent for a ping interval and a ping timeout (the Server sends keepalive comments on it). A
request that meets its deadline, or a stream that stays silent past it, means the path to the
Server may be dead: every kept-alive connection is dropped then (a new pool; the old one is
closed once its requests are done), so the next request dials afresh instead of waiting on a
connection a NAT or a frozen path has killed.
"""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar
from urllib.parse import urlsplit

import httpx
import msgspec
import trio

from gateway.runner.state import SavedRegistration
from gateway.wire.protocol import CAPABILITY
from gateway.wire.sse import SSESplitter

log = logging.getLogger("gateway.alp")

CHAT_JOB_TYPE = "chat_llm"
KEEPALIVE_EXPIRY = 25.0  # s kept idle: past the 10 s polls, within the hub's 30 s keepalive


class ServerUnavailable(Exception):
    """The Server could not be reached, timed out or answered 5xx: worth retrying later."""


class ServerSilent(ServerUnavailable):
    """No answer within the request's deadline: the path may be dead (kept-alive connections
    were dropped, so the next request dials afresh)."""


class TokenRefused(Exception):
    """The Server refused the runner token (401/403)."""


class RegistrationRefused(Exception):
    """Registration refused: only a user credential registers a runner."""


class EventsUnavailable(Exception):
    """The Server has no push route (``GET …/runners/events`` answered 404/405)."""


class MalformedReply(ServerUnavailable):
    """The Server answered 2xx with a body that does not fit the contract; the message names the
    request and the field. Retried like an outage (a Server mid-deploy, a proxy's page)."""


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


# -- what the Server answers (docs/protocol.md §1-§3), decoded into types ------------------
#
# Each reply is decoded once, into the Struct below, by ``_decode``: a reply that does not fit
# is one ``MalformedReply`` naming the request and the field (msgspec's path, ``$.jobs[0].id``),
# never a KeyError or a traceback. Fields the runner does not read are ignored, so a Server
# that sends more stays compatible. msgspec's messages name types and paths, never values: a
# registration reply's token cannot reach an error message.

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class RegistrationReply(msgspec.Struct):
    """``POST {base}/runners`` answered 2xx (§1): the runner's id, name and token."""

    id: NonEmpty
    token: NonEmpty
    name: str | None = None  # the Server's name for the runner; else the one asked for
    registeredAt: str | None = None


class AgentDefinition(msgspec.Struct):
    """What the runner reads of a job's ``agentDefinition`` (§2, §4, §6).

    ``traceparent`` and the two time limits are left as any JSON value: the contract says one
    that is not valid is ignored (§6) or logged and means no limit (§2), never that the job is
    refused; ``gateway.runner.session.ChatJob`` reads them."""

    jobType: str | None = None
    needs: list[str] | None = None
    traceparent: Any = None
    idleTimeoutMinutes: Any = None
    maxTimeoutMinutes: Any = None
    channelUrl: str | None = None


class OfferedJob(msgspec.Struct):
    """One job a poll offers (§2): a Chat Job or someone else's."""

    id: NonEmpty
    needs: list[str] | None = None
    agentDefinition: AgentDefinition | None = None
    channelUrl: str | None = None

    @property
    def definition(self) -> AgentDefinition:
        return self.agentDefinition or _NO_DEFINITION

    @property
    def is_chat_job(self) -> bool:
        """A Kind B job: ``agentDefinition.jobType == "chat_llm"`` or ``chat-llm:v1`` in its needs."""
        definition = self.definition
        if definition.jobType == CHAT_JOB_TYPE:
            return True
        return any(CAPABILITY in (needs or ()) for needs in (self.needs, definition.needs))

    @property
    def channel_url(self) -> str | None:
        """The job's own channel URL (§4, §6: on the job or in its definition), when it is ws(s)."""
        for url in (self.channelUrl, self.definition.channelUrl):
            if url is not None and url.startswith(("ws://", "wss://")):
                return url
        return None


_NO_DEFINITION = AgentDefinition()


class JobsReply(msgspec.Struct):
    """``POST {base}/runners/jobs`` answered 200 (§2). Each job is decoded on its own (``OfferedJob``):
    one the runner cannot read is skipped, not the whole offer."""

    jobs: list[msgspec.Raw] | None = None


class ClaimReply(msgspec.Struct):
    """``POST {base}/runners/generate-jitconfig`` answered 2xx (§3): the job is ours."""

    runId: NonEmpty


class JobAvailable(msgspec.Struct):
    """One ``job_available`` event's data (§2); only a hint to poll now."""

    jobId: str | None = None


T = TypeVar("T")


def _at(exc: msgspec.ValidationError, where: str) -> str:
    """msgspec's message for a value decoded at ``where`` of the whole reply, with that path."""
    text = str(exc)
    if " - at `$" in text:
        return text.replace(" - at `$", f" - at `{where}", 1)
    return f"{text} - at `{where}`"


def _decode(content: bytes, kind: type[T], what: str) -> T:
    """``content`` as ``kind``; ``MalformedReply`` naming ``what`` and the field when it is not."""
    try:
        return msgspec.json.decode(content, type=kind)
    except msgspec.ValidationError as exc:
        raise MalformedReply(f"{what}: malformed reply: {exc}") from None
    except msgspec.DecodeError:
        raise MalformedReply(f"{what}: malformed reply: not JSON") from None


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


class SpeaksTls(ServerUnavailable):
    """Plain HTTP sent to a Server that speaks HTTPS at that port (it answered 400 saying so, or
    closed the connection without a word, as a TLS port does): ``https`` is the URL to try."""

    def __init__(self, message: str, https: str) -> None:
        super().__init__(message)
        self.https = https


# OpenSSL's verify codes of a certificate that does not name the host dialled (in its SAN)
HOST_MISMATCH = (62, 64)  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH


def _check_certificate(exc: BaseException, url: str, ca_file: Path | None = None) -> None:
    root = _root_cause(exc)
    if isinstance(root, ssl.SSLCertVerificationError):
        if root.verify_code in HOST_MISMATCH:
            host = urlsplit(url).hostname
            raise CertificateRefused(
                f"{url}: the Server's certificate does not name {host} in its subjectAltName "
                f"({root.verify_message}): a certificate needs the host name or IP address it "
                "is reached at in its SAN (its CN alone is not read); make one with a SAN "
                '(packaging/DEPLOY.md, "TLS with your own CA")'
            ) from None
        if ca_file is not None:
            raise CertificateRefused(
                f"{url}: the Server's certificate was refused ({root.verify_message}) though "
                f"--ca-file {ca_file} was given: it is not signed by the CA in that file"
            ) from None
        raise CertificateRefused(
            f"{url}: the Server's certificate was refused ({root.verify_message}); "
            "if it is signed by a private CA, give it with --ca-file"
        ) from None
    if isinstance(root, ssl.SSLError) and root.reason == "WRONG_VERSION_NUMBER":
        plain = "http://" + url.split("://", 1)[-1]
        raise CertificateRefused(
            f"{url}: the Server does not speak TLS: use {plain} (http://, not https://)"
        ) from None


@dataclass(frozen=True)
class Deadlines:
    """How long each exchange with the Server may take before its path counts as dead."""

    request: float = 20.0  # poll, claim, status, progress, report: a live Server answers at once
    register: float = 30.0  # once per runner, and a person may be waiting
    events: float = 60.0  # the push stream's longest silence: the Server sends keepalives on it

    @classmethod
    def of(cls, ping_interval: float, ping_timeout: float | None) -> Deadlines:
        """From the channel's dead-path settings: a request gets the ping timeout, the events
        stream a ping interval and a ping timeout of silence (pings off: the defaults)."""
        if ping_interval <= 0:
            return cls()
        timeout = ping_timeout or ping_interval
        return cls(
            request=timeout, register=max(cls.register, timeout), events=ping_interval + timeout
        )


class _ClientPool:
    """One HTTP client (its kept-alive connections) and the requests in flight on it."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.busy = 0
        self.retired = False  # replaced: closed once its last request is done


class AlpClient:
    """Talks to one ALP Server for one project; every call is one HTTP request."""

    def __init__(
        self,
        server: str,
        owner: str,
        project: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        ca_file: Path | None = None,
        timeout: float | None = None,
        connect_timeout: float = 10.0,
        deadlines: Deadlines | None = None,
    ) -> None:
        self.server = server
        self.ca_file = ca_file  # the private CA in ssl_context, named in its refusal
        self.owner = owner
        self.project = project
        self.base = f"{server}/api/owners/{owner}/projects/{project}"
        self.token: str | None = None
        self._said: set[str] = set()  # the skipped jobs already warned about
        deadlines = deadlines or Deadlines()
        if timeout is not None:  # one deadline for every request (doctor's probes)
            deadlines = Deadlines(timeout, timeout, deadlines.events)
        self.deadlines = deadlines
        self._ssl_context = ssl_context
        self._connect_timeout = connect_timeout
        self._pool = _ClientPool(self._client())
        self.pools_dropped = 0  # times every kept-alive connection was dropped (a dead path)

    def _https(self) -> str:
        return "https://" + self.server.split("://", 1)[1]

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            verify=self._ssl_context if self._ssl_context is not None else True,
            timeout=httpx.Timeout(self.deadlines.request, connect=self._connect_timeout),
            headers={"user-agent": "alp-gateway"},
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY),  # httpx's 5 s: one a poll
        )

    async def aclose(self) -> None:
        self._pool.retired = True
        await self._pool.client.aclose()

    async def drop_connections(self) -> None:
        """The path to the Server may be dead: every kept-alive connection goes (a new pool for
        the next request; the old one is closed once its requests in flight are done)."""
        old, self._pool = self._pool, _ClientPool(self._client())
        old.retired = True
        self.pools_dropped += 1
        if not old.busy:
            with trio.CancelScope(shield=True):
                await old.client.aclose()

    async def _done(self, pool: _ClientPool) -> None:
        """A request on ``pool`` is done: a retired pool is closed after its last one."""
        pool.busy -= 1
        if pool.retired and not pool.busy:
            with trio.CancelScope(shield=True):
                await pool.client.aclose()

    def _auth(self, token: str | None = None) -> dict[str, str]:
        token = token or self.token
        return {"authorization": f"Bearer {token}"} if token else {}

    async def _request(
        self,
        method: str,
        path: str,
        *,
        token: str | None = None,
        json: Any = None,
        deadline: float | None = None,
    ) -> httpx.Response:
        url = f"{self.base}/{path}"
        pool = self._pool
        pool.busy += 1
        try:
            timeout = httpx.Timeout(
                deadline or self.deadlines.request, connect=self._connect_timeout
            )
            resp = await pool.client.request(
                method, url, json=json, headers=self._auth(token), timeout=timeout
            )
        except httpx.TimeoutException as exc:
            if pool is self._pool:
                await self.drop_connections()
            raise ServerSilent(f"{method} {url}: {describe_error(exc, url)}") from None
        except httpx.HTTPError as exc:
            _check_certificate(exc, self.server, self.ca_file)
            said = f"{method} {url}: {describe_error(exc, url)}"
            if isinstance(exc, httpx.RemoteProtocolError) and url.startswith("http://"):
                raise SpeaksTls(said, self._https()) from None  # perhaps: tried once
            raise ServerUnavailable(said) from None
        finally:
            await self._done(pool)
        if (
            resp.status_code == 400
            and url.startswith("http://")
            and b"speaks HTTPS" in resp.content
        ):
            raise SpeaksTls(f"{method} {url}: this port speaks HTTPS", self._https())
        if resp.status_code >= 500:
            raise ServerUnavailable(f"{method} {url}: Server answered {resp.status_code}")
        return resp

    async def register(self, user_token: str, name: str, labels: list[str]) -> SavedRegistration:
        """``POST {base}/runners``, falling back to ``{base}/runners/register`` on 404/405."""
        body = {"name": name, "labels": labels}
        deadline = self.deadlines.register
        resp = await self._request(
            "POST", "runners", token=user_token, json=body, deadline=deadline
        )
        tried = [f"{self.base}/runners"]
        if resp.status_code in (404, 405):
            resp = await self._request(
                "POST", "runners/register", token=user_token, json=body, deadline=deadline
            )
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
        reply = _decode(resp.content, RegistrationReply, f"POST {tried[-1]}")
        return SavedRegistration(
            id=reply.id,
            name=reply.name or name,
            token=reply.token,
            server=self.server,
            owner=self.owner,
            project=self.project,
            registeredAt=reply.registeredAt,
        )

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

    async def poll(self, capabilities: list[str], *, stopping: bool = False) -> list[OfferedJob]:
        """``POST {base}/runners/jobs``: the offered jobs (never claims). A job the runner cannot
        read is left out, said once in a warning (it may be another kind of runner's).
        ``stopping``: the last poll of a clean stop, said as ``"stopping": true`` (an ALP Server
        reads the capabilities only; the hub forgets the runner at once, docs/protocol.md §2)."""
        body: dict[str, Any] = {"capabilities": capabilities}
        if stopping:
            body["stopping"] = True
        resp = await self._request("POST", "runners/jobs", json=body)
        if resp.status_code in (204, 404):
            return []
        if resp.status_code in (401, 403):
            raise TokenRefused(f"the Server refused the runner token on poll ({resp.status_code})")
        if not resp.is_success:
            raise Refused(f"poll: Server answered {resp.status_code}", resp.status_code)
        if resp.content.strip() in (b"", b"null"):  # nothing offered (§2)
            return []
        what = f"POST {self.base}/runners/jobs"
        jobs = []
        for n, raw in enumerate(_decode(resp.content, JobsReply, what).jobs or ()):
            try:
                jobs.append(msgspec.json.decode(raw, type=OfferedJob))
            except msgspec.ValidationError as exc:
                self._skipped(f"{what}: a job skipped: {_at(exc, f'$.jobs[{n}]')}")
        return jobs

    def _skipped(self, message: str) -> None:
        """A job left out: a warning the first time, debug after (it is offered on every poll)."""
        if message in self._said:
            log.debug("%s", message)
            return
        if len(self._said) >= 256:
            self._said.clear()
        self._said.add(message)
        log.warning("%s", message)

    async def claim(self, job_id: str, name: str) -> str | None:
        """``POST {base}/runners/generate-jitconfig``: the runId, or None when another runner has it."""
        resp = await self._request(
            "POST", "runners/generate-jitconfig", json={"jobId": job_id, "name": name}
        )
        if not resp.is_success:
            return None
        what = f"POST {self.base}/runners/generate-jitconfig"
        return _decode(resp.content, ClaimReply, what).runId

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
        # the Server sends a keepalive comment while it has no event: a read that waits longer
        # than the silence allowed means the stream's path is dead
        timeout = httpx.Timeout(self.deadlines.events, connect=self._connect_timeout)
        headers = {**self._auth(), "accept": "text/event-stream"}
        pool = self._pool
        pool.busy += 1
        try:
            async with pool.client.stream("GET", url, headers=headers, timeout=timeout) as resp:
                if resp.status_code in (404, 405):
                    raise EventsUnavailable(f"{url}: {resp.status_code}")
                if resp.status_code in (401, 403):
                    raise TokenRefused(
                        f"the Server refused the runner token on events ({resp.status_code})"
                    )
                if not resp.is_success:
                    raise ServerUnavailable(f"GET {url}: Server answered {resp.status_code}")
                yield _job_ids(resp, url)
        except (httpx.TimeoutException, ServerSilent) as exc:
            if pool is self._pool:
                await self.drop_connections()
            if isinstance(exc, ServerSilent):
                raise
            raise ServerSilent(f"GET {url}: {describe_error(exc, url)}") from None
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"GET {url}: {describe_error(exc, url)}") from None
        finally:
            await self._done(pool)


async def _job_ids(resp: httpx.Response, url: str) -> AsyncIterator[str]:
    """The jobIds in an open events stream ("" for an event without one)."""
    splitter = SSESplitter()
    try:
        async for raw in resp.aiter_raw():
            for payload in splitter.feed(raw):
                try:  # any event means "poll now": one that cannot be read as well
                    job_id = msgspec.json.decode(payload, type=JobAvailable).jobId
                except msgspec.DecodeError:
                    job_id = None
                yield job_id or ""
    except httpx.TimeoutException as exc:
        raise ServerSilent(f"GET {url}: silent for too long ({describe_error(exc, url)})") from None
    except httpx.HTTPError as exc:
        raise ServerUnavailable(f"GET {url}: {describe_error(exc, url)}") from None
