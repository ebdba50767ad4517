"""The runner API (docs/protocol.md §1-§4): HTTP routes on the job board, the channel handshake."""

from __future__ import annotations

import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from gateway import logsafe
from gateway.apis.shapes import SSE_HEADERS
from gateway.hub.board import REPORT_MAX_BYTES, BoardError, Job
from gateway.hub.bounds import (
    MAX_CAPABILITIES,
    MAX_LABELS,
    MAX_NAME,
    too_long,
    too_many,
)
from gateway.hub.hub import Hub
from gateway.hub.routekit import (
    HTTPError,
    Request,
    bearer,
    json_object,
    string_list,
    wait_disconnect,
)
from gateway.hub.store import Enrollment, Registration
from gateway.wire.server import WebSocketRequest

log = logging.getLogger("gateway.hub")

CHANNEL_PATH = "/api/lives/chat/channel/ws"

_STATUS_OF_REFUSAL = {"not_found": 404, "conflict": 409, "forbidden": 403, "invalid": 400}
_encoder = msgspec.json.Encoder()
ENROLL_NEEDED = (
    "an enrollment token is required to register a runner (alpe_…, made by "
    "`alp-gateway hub runners enroll --project OWNER/PROJECT`)"
)
NO_STORE = [(b"cache-control", b"no-store")]  # a runner token is shown once, never cached


def _bounded(*passed: str | None) -> None:
    """HTTPError 413 naming the first bound of ``gateway.hub.bounds`` a value passed (nothing of
    the request is kept then)."""
    for found in passed:
        if found is not None:
            raise HTTPError(413, found, "too_large")


def refused(exc: BoardError) -> HTTPError:
    """The HTTP answer to a refusal of the job board."""
    return HTTPError(_STATUS_OF_REFUSAL[exc.kind], exc.message, exc.kind)


class RunnerApi:
    """The runner routes of one hub (``{base}/...`` and the channel WebSocket)."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.board = hub.board

    async def _runner(self, req: Request) -> Registration:
        """The registration of the runner token presented, in the route's project."""
        token = bearer(req.scope)
        runner = await self.hub.runner_admin.by_token(token) if token else None
        if runner is None:
            message = "a runner token is required" if token is None else "unknown runner token"
            raise HTTPError(401, message, "invalid_runner_token")
        self.board.seen(runner.id, runner)
        owner, project = req.params["owner"], req.params["project"]
        if (runner.owner, runner.project) != (owner, project):
            raise HTTPError(
                403, f"this runner is registered to {runner.owner}/{runner.project}", "forbidden"
            )
        return runner

    async def register(self, req: Request) -> None:
        """``POST {base}/runners``: a runner registered with a project's enrollment token (or,
        still, the admin credential: one warning line naming the better way); its token is
        answered once, never cached (``Cache-Control: no-store``)."""
        token = bearer(req.scope)
        if token is None:
            raise HTTPError(401, ENROLL_NEEDED)
        owner, project = req.params["owner"], req.params["project"]
        enrollment = None
        if not self.hub.keys.is_admin(token):
            enrollment = await self._enrollment(token, owner, project)
        obj = json_object(await req.body(self.hub.settings.max_body))
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            raise HTTPError(400, '"name" must be a non-empty string', "invalid_request")
        labels = string_list(obj, "labels", required=False)
        _bounded(too_long('"name"', name, MAX_NAME), too_many('"labels"', labels, MAX_LABELS))
        if enrollment is None:
            log.warning(
                "a runner registered in %s/%s with the admin credential: give runner hosts an "
                "enrollment token instead (`alp-gateway hub runners enroll --project "
                "OWNER/PROJECT`), which can register runners and nothing else",
                logsafe.safe(owner),
                logsafe.safe(project),
            )
        elif not await self.hub.store.use_enrollment(enrollment.id, time.time()):
            raise HTTPError(
                401, "this enrollment token is used up, expired or revoked", "invalid_credential"
            )
        registration, runner_token = await self.hub.store.add_registration(
            owner, project, name, labels, None if enrollment is None else enrollment.id
        )
        self.board.seen(
            registration.id, registration
        )  # a registration is the runner's first sign of life
        answer = {
            "id": registration.id,
            "name": registration.name,
            "token": runner_token,
            "registeredAt": registration.registered_at,
        }
        await req.resp.json(201, answer, NO_STORE)

    async def _enrollment(self, token: str, owner: str, project: str) -> Enrollment:
        """The enrollment token ``token`` is, valid now for ``owner/project``; else HTTPError
        saying what the credential is and what registers a runner."""
        store = self.hub.store
        found = await store.enrollment_by_token(token)
        if found is not None:
            refusal = found.refusal(time.time())
            if refusal is not None:
                raise HTTPError(401, refusal, "invalid_credential")
            if (found.owner, found.project) != (owner, project):
                raise HTTPError(
                    403,
                    f"this enrollment token registers runners in {found.owner}/{found.project} "
                    "only",
                    "forbidden",
                )
            return found
        if await store.registration_by_token(token) is not None:
            raise HTTPError(
                403,
                "a runner token was presented: a runner registers with an enrollment token "
                "(alpe_…, made by `alp-gateway hub runners enroll`)",
            )
        if await store.check_api_key(token) is not None:
            raise HTTPError(
                403,
                "an API key (alpk_…) was presented: a runner registers with an enrollment token "
                "(alpe_…, made by `alp-gateway hub runners enroll`)",
            )
        raise HTTPError(401, "unknown credential")

    async def poll(self, req: Request) -> None:
        runner = await self._runner(req)  # the credential before the body is read
        body = await req.body(self.hub.settings.max_body)
        obj = json_object(body)
        advertised = string_list(obj, "capabilities", required=True)
        _bounded(too_many('"capabilities"', advertised, MAX_CAPABILITIES))
        capabilities = set(advertised)
        stopping = obj.get("stopping") is True and not capabilities  # its last poll: it stops
        owner, project = req.params["owner"], req.params["project"]
        offered = self.board.offered(runner.id, owner, project, capabilities, stopping)
        jobs = [job.to_json() for job in offered]
        if not jobs:
            await req.resp.whole(204, b"")
            return
        await req.resp.json(200, {"jobs": jobs})

    async def claim(self, req: Request) -> None:
        runner = await self._runner(req)  # the credential before the body is read
        body = await req.body(self.hub.settings.max_body)
        obj = json_object(body)
        job_id, name = obj.get("jobId"), obj.get("name")
        if not isinstance(job_id, str) or not isinstance(name, str):
            raise HTTPError(400, '"jobId" and "name" must be strings', "invalid_request")
        _bounded(too_long('"name"', name, MAX_NAME), too_long('"jobId"', job_id, MAX_NAME))
        try:
            run_id = await self.board.claim(
                runner.id, req.params["owner"], req.params["project"], job_id, name
            )
        except BoardError as exc:
            raise refused(exc) from None
        await req.resp.json(200, {"runId": run_id})

    async def status(self, req: Request) -> None:
        job = await self._report(req, self.board.report_status)
        await req.resp.json(200, {"id": job.id, "runId": job.run_id, "status": job.status})

    async def progress(self, req: Request) -> None:
        await self._report(req, self._progress)
        await req.resp.json(200, {})

    async def _progress(self, job: Job, report: dict[str, Any]) -> None:
        self.board.report_progress(job, report)

    async def _report(
        self, req: Request, report: Callable[[Job, dict[str, Any]], Awaitable[None]]
    ) -> Job:
        """A report on the runner's own job (status or progress): the body (413 past
        ``REPORT_MAX_BYTES``) given to ``report``."""
        runner = await self._runner(req)  # the credential before the body is read
        body = await req.body(min(REPORT_MAX_BYTES, self.hub.settings.max_body))
        p = req.params
        try:
            job = await self.board.own_job(
                runner.id, p["owner"], p["project"], p["run_id"], p["job_id"]
            )
            await report(job, json_object(body))
        except BoardError as exc:
            raise refused(exc) from None
        return job

    async def events(self, req: Request) -> None:
        """``job_available`` events for the runner's project until it disconnects; a keepalive
        comment after each quiet interval, from the hub's one ticker (``hub.push_streams``)."""
        runner = await self._runner(req)
        resp = req.resp
        p = req.params
        streams = self.hub.push_streams
        with self.board.subscribe(p["owner"], p["project"], runner.id) as queued:
            await resp.start(200, list(SSE_HEADERS))
            with streams.kept(resp):
                async with trio.open_nursery() as nursery:

                    async def until_disconnect() -> None:
                        await wait_disconnect(req.receive)
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(until_disconnect)
                    async for job_id in queued:  # no timer: the ticker writes the keepalives
                        data = _encoder.encode({"jobId": job_id})
                        await resp.body(b"event: job_available\ndata: " + data + b"\n\n")
                        streams.wrote(resp)

    async def channel(self, req: WebSocketRequest) -> None:
        """The Chat Channel handshake (``?jobId=&token=``), then the channel until it closes.

        Refused (403, before the accept) unless the token's runner claimed that job and the job
        is not over.
        """
        query = urllib.parse.parse_qs(req.scope.get("query_string", b"").decode("latin-1"))
        job_id = (query.get("jobId") or [""])[0]
        token = (query.get("token") or [""])[0]
        runner = await self.hub.runner_admin.by_token(token) if token else None
        if runner is not None:
            self.board.seen(runner.id, runner)
        job = await self.board.channel_job(runner.id, job_id) if runner is not None else None
        if runner is None or job is None:
            await req.refuse(403, "no channel for this job and token", "forbidden")
            return
        ws = await req.accept()
        job.channel_opened = True
        ch = self.hub.channels.accept(job.id, runner.id, ws)
        held = ch.held = trio.Event()  # turns already waiting for it send after the hello
        try:
            await self.hub.coordination.channel_accepted(ch)  # a replica tells the others
            ch.held = None
            await ch.send(ch.hello)  # the first frame: the held ones go after it
        finally:
            ch.held = None
            held.set()
        await ch.serve()
