"""The admin routes: every job with its reports, the front door's sessions, the counters."""

from __future__ import annotations

from gateway.hub.http import HTTPError, Request, bearer
from gateway.hub.hub import Hub


class AdminApi:
    """``GET /api/hub/jobs``, ``GET /api/hub/sessions`` and ``GET /api/hub/counters``."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    def check(self, req: Request) -> None:
        """HTTPError 401/403 unless the admin credential was presented."""
        token = bearer(req.scope)
        if token is None:
            raise HTTPError(401, "the admin credential is required")
        if not self.hub.is_admin_token(token):
            raise HTTPError(403, "only the admin credential may use /api/hub/")

    async def jobs(self, req: Request) -> None:
        """Every job with its reports: live ones from memory, ended ones from the store."""
        jobs = [job.admin_json() for job in self.hub.jobs.values()]
        await req.resp.json(200, {"jobs": jobs})

    async def sessions(self, req: Request) -> None:
        found = self.hub.frontdoor.sessions.listing()
        sessions = [{"key": key, "session": sid, "jobId": job} for (key, sid), job in found.items()]
        await req.resp.json(200, {"sessions": sessions})

    async def counters(self, req: Request) -> None:
        """Pings sent, pong timeouts, channels declared dead, failovers (since the hub started)."""
        await req.resp.json(200, self.hub.counters.as_json())
