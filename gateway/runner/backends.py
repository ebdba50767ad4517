"""The backend pool: the local OpenAI-compatible model servers a turn can be forwarded to.

The ``BackendPool`` routes each turn: the model named by the frame, else by the body, else the
default; aliases mapped to local names; the allowlist applied; then the least-loaded up backend
serving it (``gateway.runner.backend.Backend``: one server each). ``BackendPool.run`` keeps
model lists fresh and probes health in the background.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from gateway.runner.backend import Backend, BackendBusy, BackendError, ProbeFailed
from gateway.wire import protocol

if TYPE_CHECKING:
    from gateway.config import Config

log = logging.getLogger("gateway.backends")


@dataclass(frozen=True)
class TurnRoute:
    """Where one turn goes: the caller's model name, the local one, the body to send, the candidates."""

    requested: str | None
    model: str | None
    body: bytes
    candidates: tuple[Backend, ...]


class BackendPool:
    """Routes turns to backends, answers which models can be served, and watches health."""

    def __init__(
        self,
        backends: list[Backend],
        default_model: str | None = None,
        cache_ttl: float = 30.0,
        *,
        aliases: Mapping[str, str] | None = None,
        allowed_models: Iterable[str] = (),
        health_interval: float = 30.0,
        models_refresh: float = 300.0,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.backends = backends
        self.default_model = default_model
        self.cache_ttl = cache_ttl
        self.aliases = dict(aliases or {})
        self.allowed_models = tuple(allowed_models)
        self._allowed = frozenset(self.allowed_models)
        self.health_interval = health_interval
        self.models_refresh = models_refresh
        self.on_change = on_change
        self._refresh_done: trio.Event | None = None
        self._refreshed_at: float | None = None

    @classmethod
    def from_config(
        cls,
        config: Config,
        *,
        ssl_context: ssl.SSLContext | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> BackendPool:
        backends = [
            Backend.from_spec(
                spec,
                connect_timeout=config.connect_timeout,
                idle_timeout=config.idle_timeout,
                ssl_context=ssl_context,
            )
            for spec in config.backends
        ]
        return cls(
            backends,
            config.model,
            cache_ttl=config.models_cache,
            aliases=config.aliases,
            allowed_models=config.allowed_models,
            health_interval=config.health_interval,
            models_refresh=config.models_refresh,
            on_change=on_change,
        )

    @property
    def available(self) -> bool:
        """At least one backend is configured."""
        return bool(self.backends)

    @property
    def any_up(self) -> bool:
        """At least one backend is up now (what the chat-llm:v1 capability needs)."""
        return any(b.up for b in self.backends)

    async def aclose(self) -> None:
        for backend in self.backends:
            await backend.aclose()

    # -- models ------------------------------------------------------------------------

    def allowed(self, requested: str | None, local: str | None) -> bool:
        """The allowlist (empty = everything) names the caller's model or its local name."""
        return not self._allowed or requested in self._allowed or local in self._allowed

    def servable(self) -> list[str]:
        """Models servable now: those of up backends, allowlist applied, plus aliases onto them."""
        local: list[str] = []
        for backend in self.backends:
            if backend.up:
                local.extend(m for m in backend.models if m not in local)
        served = set(local)
        found = [m for m in local if self.allowed(m, m)]
        found.extend(
            alias
            for alias, target in self.aliases.items()
            if target in served and alias not in found and self.allowed(alias, target)
        )
        return found

    def contexts(self, models: Sequence[str]) -> dict[str, int]:
        """The context length of each of ``models`` (servable names: aliases too) that its up
        backends say, the smallest where several serve it (a turn may go to any)."""
        local: dict[str, int] = {}  # 0: a backend serves it without saying (not known)
        for backend in self.backends:
            if not backend.up:
                continue
            for model in backend.models:
                context = backend.contexts.get(model, 0)
                local[model] = min(context, local.get(model, context))
        found = {}
        for model in models:
            context = local.get(self.aliases.get(model, model), 0)
            if context:
                found[model] = context
        return found

    async def models(self) -> list[str]:
        """Answer ``chat.models.request``: lists older than ``cache_ttl`` are refreshed first."""
        now = trio.current_time()
        if self._refreshed_at is None or now - self._refreshed_at >= self.cache_ttl:
            await self.refresh_models()
        return self.servable()

    async def refresh_models(self) -> None:
        """List the models of every backend without declared ones; concurrent calls share one pass."""
        if self._refresh_done is not None:
            await self._refresh_done.wait()
            return
        done = self._refresh_done = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                for backend in self.backends:
                    if not backend.declared_models:
                        nursery.start_soon(self._discover, backend)
                    else:
                        nursery.start_soon(backend.learn_contexts, backend.declared_models)
        finally:
            self._refreshed_at = trio.current_time()
            self._refresh_done = None
            done.set()

    async def _discover(self, backend: Backend) -> None:
        try:
            models = await backend.list_models()
        except ProbeFailed as exc:
            reason = exc.reason
            if reason != backend.discovery_error:
                log.warning(
                    "backend %s (%s) cannot list its models: %s", backend.name, backend.url, reason
                )
            backend.discovery_error = reason
            return
        if backend.discovery_error is not None:
            log.info("backend %s lists its models again", backend.name)
        backend.discovery_error = None
        if tuple(models) != backend.discovered_models:
            log.info("backend %s serves %s", backend.name, ", ".join(models) or "no models")
        backend.discovered_models = tuple(models)
        await backend.learn_contexts(models)

    # -- routing -------------------------------------------------------------------------

    def _candidates(self, model: str | None) -> list[Backend]:
        if model is None:
            return []
        return [b for b in self.backends if model in b.models]

    async def route(self, frame_model: str | None, body: bytes) -> TurnRoute:
        """Resolve one turn's model and the backends that can serve it; ``BackendError`` if none.

        The model is the frame's, else the body's, else the default; an alias is replaced
        by its local name, which the body carries from here on (rewritten once per turn).
        """
        if not self.backends:
            raise BackendError("no backend is configured on this runner")
        in_body = protocol.body_model(body)
        requested = frame_model or in_body or self.default_model
        if requested is None:  # no model named and no default: the one model served, if just one
            if self._refreshed_at is None:
                await self.refresh_models()
            servable = self.servable()
            if len(servable) == 1:
                requested = servable[0]
        local = self.aliases.get(requested, requested) if requested is not None else None
        if not self.allowed(requested, local):
            what = (
                f"model {requested!r} is" if requested is not None else "a turn without a model is"
            )
            raise BackendError(
                f"{what} not allowed on this runner; allowed: {', '.join(self.allowed_models)}"
            )
        if self._refreshed_at is None:
            await self.refresh_models()
        candidates = self._candidates(local)
        if not candidates and local is not None and any(b.knows_models for b in self.backends):
            await self.refresh_models()  # a model pulled since the last pass is found at once
            candidates = self._candidates(local)
        if not candidates:
            if len(self.backends) == 1 and not any(b.knows_models for b in self.backends):
                candidates = list(self.backends)  # nothing to check against: forward, as ever
            else:
                raise BackendError(self._unknown_text(requested))
        if local is not None and local != in_body:
            body = protocol.with_model(body, local)
        return TurnRoute(requested, local, body, tuple(candidates))

    def _unknown_text(self, requested: str | None) -> str:
        available = self.servable()
        listing = (
            f"available: {', '.join(available)}" if available else "no model is available right now"
        )
        if requested is None:
            return f"the turn names no model and this runner has no default (--model); {listing}"
        return f"model {requested!r} is not available on this runner; {listing}"

    def _choose(self, route: TurnRoute, exclude: Sequence[Backend]) -> Backend:
        candidates = route.candidates
        if len(candidates) == 1 and not exclude:  # one backend serves the model: the usual case
            only = candidates[0]
            if only.has_free_slot or only.queue_has_room:
                return only
        skip = set(exclude)
        pool = [b for b in route.candidates if b not in skip]
        if not pool:
            raise BackendError(f"no other backend serves {route.requested or 'this turn'}")
        up = [b for b in pool if b.up] or pool  # all down: try anyway, it may be back
        free = [b for b in up if b.has_free_slot]
        if free:
            return min(free, key=lambda b: b.in_flight)
        room = [b for b in up if b.queue_has_room]
        if room:
            return min(room, key=lambda b: (b.waiting, b.in_flight))
        for backend in up:
            backend.busy_total += 1
        raise BackendBusy("; ".join(b.busy_text() for b in up))

    def turn(
        self, route: TurnRoute, job_id: str, request_id: str, exclude: Sequence[Backend] = ()
    ) -> _Slot:
        """Hold a slot on the chosen backend for the length of the block (waiting in its queue):
        ``async with pool.turn(...) as backend``."""
        return _Slot(self, route, job_id, request_id, exclude)

    # -- health --------------------------------------------------------------------------

    def suspect(self, backend: Backend) -> None:
        """A turn failed to connect: probe that backend now (``run`` does it)."""
        backend._probe_now.set()

    async def probe(self, backend: Backend) -> bool:
        """Probe one backend, log an up/down transition, and rediscover its models when it is back."""
        reason = await backend.check()
        was_up = backend.up
        backend.up = reason is None
        backend.down_reason = reason
        backend._touch()
        if was_up and reason is not None:
            log.warning("backend %s (%s) is down: %s", backend.name, backend.url, reason)
            self._notify()
        elif not was_up and reason is None:
            log.info("backend %s (%s) is up again", backend.name, backend.url)
            if not backend.declared_models:
                await self._discover(backend)
            self._notify()
        return backend.up

    def _notify(self) -> None:
        if self.on_change is not None:
            self.on_change()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Discover models and probe every backend now (then ``started``), refresh the models
        every ``models_refresh`` s and probe each backend every ``health_interval`` s (and at
        once after a failed connect); until cancelled."""
        await self.refresh_models()
        async with trio.open_nursery() as first:
            for backend in self.backends:
                first.start_soon(self.probe, backend)
        task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._refresh_loop)
            for backend in self.backends:
                nursery.start_soon(self._health_loop, backend)

    async def _refresh_loop(self) -> None:
        while True:
            await trio.sleep(self.models_refresh)
            await self.refresh_models()

    async def _health_loop(self, backend: Backend) -> None:
        while True:
            with trio.move_on_after(self.health_interval):
                await backend._probe_now.wait()
            backend._probe_now = trio.Event()
            await self.probe(backend)


class _Slot:
    """``BackendPool.turn``: a plain class rather than a generator-based context manager, as it
    runs at the start of every turn."""

    __slots__ = ("pool", "route", "job_id", "request_id", "exclude", "backend")

    def __init__(
        self,
        pool: BackendPool,
        route: TurnRoute,
        job_id: str,
        request_id: str,
        exclude: Sequence[Backend],
    ) -> None:
        self.pool = pool
        self.route = route
        self.job_id = job_id
        self.request_id = request_id
        self.exclude = exclude
        self.backend: Backend | None = None

    async def __aenter__(self) -> Backend:
        backend = self.pool._choose(self.route, self.exclude)
        await backend.acquire(self.job_id, self.request_id)
        backend.turns_total += 1
        self.backend = backend
        return backend

    async def __aexit__(self, *exc_info: object) -> None:
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.release()
