"""The hub's ASGI app and its launch: one router for every route, one error shape, our server."""

from __future__ import annotations

import logging
import pathlib
import re
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from gateway.hub.admin import AdminApi
from gateway.hub.http import (
    ASGIApp,
    ClientGone,
    HTTPError,
    Receive,
    Request,
    Response,
    Scope,
    Send,
    error_envelope,
)
from gateway.hub.hub import Hub
from gateway.hub.runnerapi import CHANNEL_PATH, RunnerApi
from gateway.hub.server import Keepalive, Server

log = logging.getLogger("gateway.hub")

Handler = Callable[[Request], Awaitable[None]]
_BASE = r"/api/owners/(?P<owner>[^/]+)/projects/(?P<project>[^/]+)/"


@dataclass(frozen=True, slots=True)
class Route:
    """One route: a method, a path pattern (named groups become ``Request.params``), a handler."""

    method: str
    pattern: re.Pattern[str]
    handler: Handler


def _route(method: str, path: str, handler: Handler) -> Route:
    return Route(method, re.compile("^" + path + "$"), handler)


class App:
    """The hub's ASGI app: HTTP routes through one table, the Chat Channel WebSocket, lifespan."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        runners = RunnerApi(hub)
        admin = AdminApi(hub)
        door = hub.frontdoor
        settings = hub.settings
        self.runners = runners
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
            _route("POST", "/v1/chat/completions", door.chat),
            _route("GET", "/v1/models", door.list_models),
            _route("GET", "/v1/models/(?P<model>.+)", door.retrieve_model),
        ]
        # checked before the route is looked up: without the credential, no 404 or 405 either
        self._guards: list[tuple[str, Callable[[Request], None]]] = [("/api/hub/", admin.check)]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            await self._websocket(scope, receive, send)
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    def _resolve(self, req: Request) -> Handler:
        """The handler of the request's route (its params filled in); HTTPError 404/405."""
        method = req.scope["method"]
        path = req.scope["path"]
        if len(path) > 1:
            path = path.rstrip("/") or path
        for prefix, guard in self._guards:
            if path.startswith(prefix):
                guard(req)
        allowed: list[str] = []
        for route in self.routes:
            m = route.pattern.match(path)
            if m is None:
                continue
            if route.method != method:
                allowed.append(route.method)
                continue
            req.params = {k: v for k, v in m.groupdict().items() if v is not None}
            return route.handler
        if allowed:
            allow = ", ".join(dict.fromkeys(allowed))
            raise HTTPError(
                405,
                f"Method {method} is not allowed on {path}; use {allow}",
                "method_not_allowed",
                headers=[(b"allow", allow.encode())],
            )
        raise HTTPError(404, f"Invalid URL ({method} {path})", "unknown_url")

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        resp = Response(send)
        req = Request(scope, receive, resp, {})
        try:
            handler = self._resolve(req)
            await handler(req)
        except HTTPError as err:
            if not resp.started:
                try:
                    await resp.error(err)
                except ClientGone:
                    pass
        except ClientGone:
            return
        except Exception:
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
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

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        if message.get("type") != "websocket.connect":
            return
        if scope["path"] != CHANNEL_PATH:
            body = error_envelope("not found", "invalid_request_error", "unknown_url")
            await send(
                {
                    "type": "websocket.http.response.start",
                    "status": 404,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "websocket.http.response.body", "body": body})
            return
        await self.runners.channel(scope, receive, send)


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
    app: ASGIApp | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``hub`` on ``host:port`` (0 = a free port) until cancelled; ``started`` gets the base URL.

    With ``certfile`` and ``keyfile`` (PEM) it serves HTTPS and WSS only; the URL is ``https://``.
    ``app``: what to serve instead of the hub's own ``App`` (a wrapper around it).
    """
    settings = hub.settings
    server = Server(
        app if app is not None else App(hub),
        keepalive=Keepalive(settings.ping_interval, settings.pong_timeout),
        counters=hub.counters,
        max_message=settings.max_body,
        ssl_context=_ssl_context(certfile, keyfile),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(hub.run)  # the stored sessions are back before any request
        base_url: str = await nursery.start(server.serve, host, port)
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
