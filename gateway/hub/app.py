"""The hub's routes and its launch: one router for every route, one error shape, our server."""

from __future__ import annotations

import logging
import math
import pathlib
import re
import resource
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from gateway.apis.dialects import anthropic_error_body
from gateway.hub.admin import PAGE_SESSION, AdminApi
from gateway.hub.hub import Hub
from gateway.hub.routekit import ClientGone, HTTPError, Request
from gateway.hub.runnerapi import CHANNEL_PATH, RunnerApi
from gateway.hub.statuspage import StatusPage
from gateway.hub.store import StoreUnavailable
from gateway.wire.protocol import CAPABILITY
from gateway.wire.server import ConnectionLimits, Keepalive, Server, WebSocketRequest
from gateway.wire.server import Handler as ServerHandler

log = logging.getLogger("gateway.hub")
# a channel quiet for PATIENCE ping intervals is pinged: a runner that pings its channel every
# interval (ours does, on a quiet channel) is never pinged back, nor wakes the hub's timer
PATIENCE = 1.5

Handler = Callable[[Request], Awaitable[None]]
_STORE_UNAVAILABLE = "the hub's store is unavailable: retry shortly"
_BASE = r"/api/owners/(?P<owner>[^/]+)/projects/(?P<project>[^/]+)/"
WARN_EVERY = 60.0  # s: at most one warning this often about a full budget
FILE_RESERVE = 64  # descriptors kept for the store, the journal, logs and the spare one


@dataclass
class Budget:
    """One kind of caller's connections in progress (runners', clients'), capped apart from the
    other kind's: past ``limit`` a 503 at once, one warning a minute."""

    kind: str
    limit: int
    open: int = 0
    refused: int = 0
    warned_at: float = -math.inf


@dataclass(frozen=True, slots=True)
class Route:
    """One route: a method, a path pattern (named groups become ``Request.params``), a handler."""

    method: str
    pattern: re.Pattern[str]
    handler: Handler


_MATCHED = 256  # (method, path) pairs memoised at most (then begun again)
_MATCHED_PATH = 512  # characters: a longer path is resolved each time, never memoised


def _route(method: str, path: str, handler: Handler) -> Route:
    return Route(method, re.compile("^" + path + "$"), handler)


class App:
    """The hub's handler: HTTP routes through one table, and the Chat Channel WebSocket."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        runners = RunnerApi(hub)
        admin = AdminApi(hub)
        page = StatusPage()
        door = hub.frontdoor
        settings = hub.settings
        self.runners = runners
        self.runner_budget = Budget("runners'", settings.max_runner_connections)
        self.client_budget = Budget("clients'", settings.max_client_connections)
        # (method, path) → the handler of the route that matched it and its params (memoised:
        # the routes are fixed, so a path resolves the same each time; a front-door turn tried
        # 18 patterns, a project's runners poll one path); bounded in count and length
        self._matched: dict[tuple[str, str], tuple[Handler, dict[str, str]]] = {}
        self.routes: list[Route] = [
            *(
                _route("POST", _BASE + re.escape(path), runners.register)
                for path in settings.register_paths
            ),
            _route("POST", _BASE + "runners/jobs", runners.poll),
            _route("POST", _BASE + "runners/generate-jitconfig", runners.claim),
            _route(
                "PATCH", _BASE + "runs/(?P<run_id>[^/]+)/jobs/(?P<job_id>[^/]+)", runners.status
            ),
            _route(
                "POST",
                _BASE + "runs/(?P<run_id>[^/]+)/jobs/(?P<job_id>[^/]+)/progress",
                runners.progress,
            ),
            *([_route("GET", _BASE + "runners/events", runners.events)] if settings.events else []),
            _route("GET", "/api/hub/jobs", admin.jobs),
            _route("GET", "/api/hub/sessions", admin.sessions),
            _route("GET", "/api/hub/counters", admin.counters),
            _route("GET", "/api/hub/replicas", admin.replicas),
            _route("GET", "/api/hub/runners", admin.runners),
            _route("POST", "/api/hub/runners/revoke", admin.revoke_runner),
            _route("DELETE", "/api/hub/runners/(?P<runner>[^/]+)", admin.revoke_runner),
            _route("GET", "/api/hub/enrollments", admin.enrollments),
            _route("POST", "/api/hub/enrollments", admin.create_enrollment),
            _route("DELETE", "/api/hub/enrollments/(?P<id>[^/]+)", admin.revoke_enrollment),
            _route("GET", "/api/hub/turns", admin.turns),
            _route("GET", "/api/hub/usage", admin.usage),
            _route("GET", "/api/hub/keys", admin.keys),
            _route("POST", "/api/hub/keys", admin.create_key),
            _route("POST", "/api/hub/keys/revoke", admin.revoke_key),
            _route("DELETE", "/api/hub/keys/(?P<name>[^/]+)", admin.revoke_key),
            _route("GET", "/api/hub/people", admin.people),
            _route("PUT", "/api/hub/people/(?P<sub>[^/]+)/projects", admin.set_person_projects),
            _route("POST", "/api/hub/keys/(?P<name>[^/]+)/budget", admin.key_budget),
            _route("GET", "/api/hub/prices", admin.prices),
            _route("POST", "/api/hub/prices", admin.set_price),
            _route("DELETE", "/api/hub/prices/(?P<model>[^/]+)", admin.unset_price),
            _route("GET", "/metrics", admin.metrics),
            # people's sign-in (issue 34): 404 on a hub without --oidc-issuer
            _route("GET", "/auth/login", hub.people.login),
            _route("GET", "/auth/callback", hub.people.callback),
            _route("GET", "/auth/me", hub.people.me),
            _route("POST", "/auth/logout", hub.people.logout),
            _route("GET", "/", page.index),
            _route("GET", "/page/(?P<name>[a-z.]+)", page.asset),
            _route("POST", "/v1/chat/completions", door.chat),
            _route("POST", "/v1/messages", door.messages),
            _route("POST", "/v1/messages/count_tokens", door.count_tokens),
            _route("POST", "/v1/responses", door.responses),
            _route("POST", "/v1/embeddings", door.embeddings),
            _route("POST", "/v1/completions", door.not_served),
            _route("GET", "/healthz", self.healthz),
            _route("GET", "/readyz", self.healthz),
            _route("GET", "/livez", self.livez),
            _route("GET", "/v1/models", door.list_models),
            _route("GET", "/v1/models/(?P<model>.+)", door.retrieve_model),
        ]
        # the admin API's routes a signed-in member may use too (their own keys and usage)
        self._member_routes: set[Handler] = {
            admin.keys,
            admin.create_key,
            admin.revoke_key,
            admin.usage,
        }
        # checked before the route is looked up: without the credential, no 404 or 405 either
        self._guards: list[tuple[str, Callable[[Request], None]]] = [
            ("/api/hub/", admin.check),
            ("/metrics", admin.check),
        ]
        # the routes other replicas reach this one's channels by (a hub alone has none)
        guards, routes = hub.coordination.routes()
        self._guards += guards
        self.routes += [_route(method, path, handler) for method, path, handler in routes]

    async def livez(self, req: Request) -> None:
        """``GET /livez`` (no key): 200 while the process serves, runners or not: for a liveness
        probe and a balancer's check (runners must reach a hub that has none yet)."""
        await req.resp.json(200, {"status": "ok"})

    async def healthz(self, req: Request) -> None:
        """``GET /readyz`` and ``GET /healthz`` (no key): 200 with the connected runners and the
        models they list; 503 saying why when no runner can serve a chat turn (a readiness probe:
        not a reason to restart the hub)."""
        board = self.hub.board
        live = [state for rid, state in board.runners.items() if board.up(rid)]
        capable = [s for s in live if s.capabilities is None or CAPABILITY in s.capabilities]
        models: dict[str, None] = {}
        for owner, project in {(s.owner, s.project) for s in live}:
            models.update(dict.fromkeys(self.hub.catalog.live_lists(owner, project)[0]))
        found = {"runners": len(live), "capable": len(capable), "models": len(models)}
        if not live:
            await req.resp.json(
                503, {"status": "unavailable", "reason": "no runner is connected", **found}
            )
        elif not capable:
            reason = (
                f"{len(live)} runner(s) connected, none advertises {CAPABILITY}: their "
                "backends are down (see `alp-gateway doctor` on the runner's machine)"
            )
            await req.resp.json(503, {"status": "unavailable", "reason": reason, **found})
        else:
            await req.resp.json(200, {"status": "ok", **found})

    def _resolve(self, req: Request) -> Handler:
        """The handler of the request's route (its params filled in); HTTPError 404/405."""
        method = req.scope["method"]
        path = req.scope["path"]
        if len(path) > 1:
            path = path.rstrip("/") or path
        for prefix, guard in self._guards:
            if path.startswith(prefix):
                guard(req)
        matched = self._matched.get((method, path))
        if matched is not None:  # found before: no pattern tried
            req.params = dict(matched[1])
            return matched[0]
        allowed: list[str] = []
        for route in self.routes:
            m = route.pattern.match(path)
            if m is None:
                continue
            if route.method != method:
                allowed.append(route.method)
                continue
            req.params = {k: v for k, v in m.groupdict().items() if v is not None}
            if len(path) <= _MATCHED_PATH:
                if len(self._matched) >= _MATCHED:  # paths of many jobs: begun again
                    self._matched.clear()
                self._matched[method, path] = (route.handler, dict(req.params))
            return route.handler
        if allowed:
            allow = ", ".join(dict.fromkeys(allowed))
            raise HTTPError(
                405,
                f"Method {method} is not allowed on {path}; use {allow}",
                "method_not_allowed",
                headers=[(b"allow", allow.encode())],
            )
        message = f"Invalid URL ({method} {path})"
        if not path.startswith("/v1/") and any(
            route.method == method and route.pattern.match("/v1" + path) for route in self.routes
        ):  # a client given the hub's root as its base URL
            message += (
                f": did you mean {method} /v1{path}? (a client's base URL is the hub's address "
                "with /v1)"
            )
        raise HTTPError(404, message, "unknown_url")

    def _budget_of(self, path: str) -> Budget | None:
        """The budget a request's connection counts in: a runner's (the runner API), a client's
        (the front door), or none (the admin API, the status page, /healthz, a replica's relay)."""
        if path.startswith("/v1/"):
            return self.client_budget
        if path.startswith("/api/owners/"):
            return self.runner_budget
        return None

    def _over(self, budget: Budget) -> HTTPError:
        """The answer past a budget, counted, said once a minute."""
        budget.refused += 1
        self.hub.counters.connections_refused += 1
        now = trio.current_time()
        if now - budget.warned_at >= WARN_EVERY:
            budget.warned_at = now
            log.warning(
                "%d %s connections in progress (their budget): refusing more with 503 "
                "(refused so far: %d)",
                budget.open,
                budget.kind,
                budget.refused,
            )
        return HTTPError(
            503,
            f"the hub serves {budget.limit} {budget.kind} connections at once; retry shortly",
            "too_many_connections",
            headers=[(b"retry-after", b"1")],
        )

    async def http(self, req: Request) -> None:
        """One HTTP request within its kind's budget (past it, 503 in the caller's shape)."""
        path = req.scope["path"]
        budget = self._budget_of(path)
        if budget is None:
            await self._http(req)
            return
        if budget.open >= budget.limit:
            err = self._over(budget)
            try:
                if path.startswith("/v1/messages"):
                    await req.resp.whole(err.status, anthropic_error_body(err), err.headers)
                else:
                    await req.resp.error(err)
            except ClientGone:
                pass
            return
        budget.open += 1
        try:
            await self._http(req)
        finally:
            budget.open -= 1

    async def _http(self, req: Request) -> None:
        """One HTTP request through its route; every failure answered in the error shape."""
        resp = req.resp
        scope = req.scope
        try:
            handler = self._resolve(req)
            try:
                if PAGE_SESSION in scope:  # a person's page session, not the admin credential
                    await self.hub.people.authorize(req, handler, handler in self._member_routes)
                await handler(req)
            except StoreUnavailable as exc:  # the database went away or is locked: try later
                # the store says so once in the log (not once per request that needed it)
                log.debug("%s %.200r: %s", scope.get("method"), scope.get("path"), exc)
                raise HTTPError(
                    503, _STORE_UNAVAILABLE, "store_unavailable", headers=[(b"retry-after", b"1")]
                ) from None
        except HTTPError as err:
            if not resp.started and not resp.gone:
                try:
                    await resp.error(err)
                except ClientGone:
                    pass
        except ClientGone:
            return
        except Exception:
            log.exception("unexpected error on %s %.200r", scope.get("method"), scope.get("path"))
            try:
                if not resp.started:
                    await resp.error(HTTPError(500, "internal error in the hub", "internal_error"))
                elif not resp.finished:
                    await resp.body(b"", more=False)
            except ClientGone:
                pass
        else:
            if resp.started and not resp.finished and not resp.gone:
                try:
                    await resp.body(b"", more=False)
                except ClientGone:
                    pass

    async def websocket(self, req: WebSocketRequest) -> None:
        """The Chat Channel handshake; any other WebSocket path is a 404."""
        if req.scope["path"] != CHANNEL_PATH:
            await req.refuse(404, "not found", "unknown_url")
            return
        budget = self.runner_budget
        if budget.open >= budget.limit:
            err = self._over(budget)
            await req.refuse(err.status, err.message, "too_many_connections")
            return
        budget.open += 1
        try:
            await self.runners.channel(req)
        finally:
            budget.open -= 1


def raise_file_limit() -> tuple[int, int]:
    """The process's soft file limit raised to its hard limit (where it can be): (soft, hard)
    after. Each connection holds a descriptor; systemd's and many shells' soft 1,024 would cap
    a hub at about a thousand sessions."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft, hard


def _ssl_context(
    certfile: str | pathlib.Path | None, keyfile: str | pathlib.Path | None
) -> ssl.SSLContext | None:
    """The server's TLS context for a PEM certificate (chain) and key; None for plain HTTP."""
    if (certfile is None) != (keyfile is None):
        raise ValueError("TLS needs both a certificate and its key")
    if certfile is None or keyfile is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile=str(certfile), keyfile=str(keyfile))
    context.set_alpn_protocols(["http/1.1"])
    return context


async def serve_hub(
    hub: Hub,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    certfile: str | pathlib.Path | None = None,
    keyfile: str | pathlib.Path | None = None,
    app: ServerHandler | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``hub`` on ``host:port`` (0 = a free port) until cancelled; ``started`` gets the base URL.

    With ``certfile`` and ``keyfile`` (PEM) it serves HTTPS and WSS only; the URL is ``https://``.
    ``app``: what to serve instead of the hub's own ``App`` (a wrapper around it).
    """
    settings = hub.settings
    soft, _hard = raise_file_limit()
    holds = max(1, min(settings.max_connections, soft - FILE_RESERVE))
    log.info(
        "file limit %d: up to %d connections (runners' budget %d, clients' %d)",
        soft,
        holds,
        settings.max_runner_connections,
        settings.max_client_connections,
    )
    server = Server(
        app if app is not None else App(hub),
        keepalive=Keepalive(settings.ping_interval, settings.pong_timeout, patience=PATIENCE),
        counters=hub.counters,
        limits=ConnectionLimits(
            head_timeout=settings.head_timeout,
            keepalive_timeout=settings.keepalive_timeout,
            body_timeout=settings.body_timeout,
            max_connections=holds,
            max_message=settings.max_body,
        ),
        ssl_context=_ssl_context(certfile, keyfile),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(hub.run)  # the stored sessions are back before any request
        base_url: str = await nursery.start(server.serve, host, port)
        hub.coordination.advertise(base_url)
        task_status.started(base_url)


@asynccontextmanager
async def open_hub(hub: Hub | None = None, **serve_kwargs: Any) -> AsyncIterator[tuple[Hub, str]]:
    """Serve a hub (a fresh in-memory one by default) for the body of the block; yields (hub, base_url)."""
    if hub is None:
        hub = Hub()
    async with trio.open_nursery() as nursery:
        base_url: str = await nursery.start(partial(serve_hub, hub, **serve_kwargs))
        try:
            yield hub, base_url
        finally:
            nursery.cancel_scope.cancel()
