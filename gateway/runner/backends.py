"""The backend pool: the local OpenAI-compatible model servers a turn can be forwarded to.

A ``Backend`` is one model server: its URL and key, the models it serves (declared in
the config or discovered from ``GET /models``), whether it is up, and a bounded FIFO of
turns waiting for one of its ``max_concurrency`` slots. The ``BackendPool`` routes each
turn: the model named by the frame, else by the body, else the default; aliases mapped
to local names; the allowlist applied; then the least-loaded up backend serving it.
``BackendPool.run`` keeps model lists fresh and probes health in the background.

Every request to a backend, turns, health checks, model listing and doctor's, goes through
its one ``http1.Client``: the same kept-alive connections, the same proxy (``NO_PROXY``
ranges included) and the same TLS context, so a probe reaches the backend as a turn does.
"""

from __future__ import annotations

import logging
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import msgspec
import trio

from gateway.config import ConfigError
from gateway.wire import http1, protocol

if TYPE_CHECKING:
    from gateway.config import BackendSpec, Config

log = logging.getLogger("gateway.backends")

PROBE_TIMEOUT = 10.0  # a health check's or a model list's whole exchange
ANSWER_LIMIT = 16 * 1024 * 1024  # the largest answer to a probe read (a long model list)
KEEPALIVE_CONNECTIONS = (
    64  # idle backend connections kept per backend (O(1) each, whatever the number)
)


class BackendError(Exception):
    """A turn could not be served by the backend; the message is safe for a frame (no key)."""


class BackendUnreachable(BackendError):
    """The connection to the backend failed: nothing was sent, so another backend may try."""


class BackendBusy(BackendError):
    """Every slot of the backend is taken and its wait-queue is full."""


class BackendIdle(BackendError):
    """The backend sent nothing for longer than the idle timeout."""


class ProbeFailed(Exception):
    """A health check, model listing or doctor's request got no usable answer.

    ``reason`` says why in a few words (no key in it); ``status`` is the HTTP status when the
    backend answered one that does not do."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass(frozen=True)
class Answer:
    """A whole answer to ``Backend.fetch``: its status and its body."""

    status: int
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


class _ModelList(msgspec.Struct):
    data: list[dict[str, object]] = []


class _OllamaTags(msgspec.Struct):
    models: list[dict[str, object]] = []


_ListT = TypeVar("_ListT", _ModelList, _OllamaTags)


def _ids(items: list[dict[str, object]], field: str) -> list[str]:
    return [str(item[field]) for item in items if isinstance(item, dict) and item.get(field)]


def _broke(exc: http1.ExchangeFailed) -> str:
    """What went wrong with a request that reached the backend, for an error frame."""
    if isinstance(exc, http1.ProtocolError):
        return str(exc)
    return f"stream broke: {exc}"


@contextmanager
def _in_time(seconds: float) -> Iterator[None]:
    """A probe's deadline: ``ProbeFailed("did not answer in time")`` when it passes."""
    try:
        with trio.fail_after(seconds):
            yield
    except trio.TooSlowError:
        raise ProbeFailed("did not answer in time") from None


def _model_list(answer: Answer, kind: type[_ListT]) -> _ListT:
    """A model list's answer decoded; ``ProbeFailed`` for another status or another shape."""
    if not answer.ok:
        raise ProbeFailed(f"answered {answer.status}", answer.status)
    try:
        return msgspec.json.decode(answer.body, type=kind)
    except msgspec.ValidationError as exc:
        raise ProbeFailed(f"sent a model list of another shape ({exc})") from None
    except msgspec.DecodeError as exc:
        raise ProbeFailed(f"sent a model list that is not JSON ({type(exc).__name__})") from None


class Backend:
    """One OpenAI-compatible backend at ``url`` (its base, including ``/v1``).

    The counters ``in_flight``, ``waited_seconds_total``, ``waits_total``, ``busy_total`` and
    ``turns_total`` are plain attributes for the metrics to read; ``waiting`` is the queue's length.
    """

    def __init__(
        self,
        url: str,
        key: str | None = None,
        *,
        name: str = "default",
        models: Sequence[str] = (),
        max_concurrency: int | None = None,
        queue: int = 16,
        connect_timeout: float = 10.0,
        idle_timeout: float = 600.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.declared_models: tuple[str, ...] = tuple(models)
        self.discovered_models: tuple[str, ...] | None = None  # None: never listed
        self.max_concurrency = max_concurrency
        self.queue_limit = queue
        self.idle_timeout = idle_timeout
        self.key = key or None  # masked in what the runner relays of this backend's errors
        # Every request (turns on the hot path; probes): keep-alive, bounded idle reuse.
        try:
            self.http = http1.Client(
                self.url,
                ssl_context=ssl_context,
                connect_timeout=connect_timeout,
                max_idle=KEEPALIVE_CONNECTIONS,
            )
        except ValueError as exc:  # an unusable URL, or a proxy this client cannot speak
            raise ConfigError(f"backend {name} ({self.url}): {exc}") from None
        self._turn_target = self.http.target("/chat/completions")
        self._turn_headers = [(b"accept", b"text/event-stream"), *self._common_headers(True)]
        # the head of every turn's request, built once (a traceparent gets its own per turn)
        self._turn_head = self.http.prepare(b"POST", self._turn_target, self._turn_headers)
        # health: optimistic until a probe says otherwise
        self.up = True
        self.down_reason: str | None = None
        self.discovery_error: str | None = None
        self._probe_now = trio.Event()
        # concurrency
        self.in_flight = 0
        self.waited_seconds_total = 0.0
        self.waits_total = 0
        self.busy_total = 0
        self.turns_total = 0
        self._waiters: deque[trio.Event] = deque()
        self._changed = trio.Event()

    @classmethod
    def from_spec(
        cls,
        spec: BackendSpec,
        *,
        connect_timeout: float = 10.0,
        idle_timeout: float = 600.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> Backend:
        return cls(
            spec.url,
            spec.key,
            name=spec.name,
            models=spec.models,
            max_concurrency=spec.max_concurrency,
            queue=spec.queue,
            connect_timeout=connect_timeout,
            idle_timeout=idle_timeout,
            ssl_context=ssl_context,
        )

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, {self.url!r})"

    @property
    def models(self) -> tuple[str, ...]:
        """The models it serves: declared in the config, else as last discovered."""
        return self.declared_models or self.discovered_models or ()

    @property
    def knows_models(self) -> bool:
        return bool(self.models)

    def _common_headers(self, body: bool) -> list[tuple[bytes, bytes]]:
        """Every request's headers but ``accept``: the body's type when there is one, the key."""
        headers = [(b"content-type", b"application/json")] if body else []
        if self.key:
            headers.append((b"authorization", f"Bearer {self.key}".encode()))
        return headers

    def mark(self, reason: str | None, models: Sequence[str] | None = None) -> None:
        """Record a check made elsewhere (doctor): down for ``reason`` (None: up), models as listed."""
        self.up, self.down_reason = reason is None, reason
        if models is not None:
            self.discovered_models = tuple(models)

    async def aclose(self) -> None:
        self.http.close()

    # -- HTTP ----------------------------------------------------------------------------

    @asynccontextmanager
    async def stream(
        self, body: bytes, traceparent: str | None = None
    ) -> AsyncIterator[http1.Response]:
        """POST one chat-completions body (as it is) and yield the response once its head is in.

        ``traceparent`` (tracing on): the turn span's W3C header, sent with this request only.

        The exchange runs under one idle deadline, ``response.idle``: the reader moves it
        forward as bytes arrive (never an overall deadline); when it passes, the block ends
        with ``BackendIdle``. The connection is closed (the generation abandoned) when the
        block exits before the response was read to its end, cancellation included; else it
        is kept for the next turn."""
        idle = trio.CancelScope(deadline=trio.current_time() + self.idle_timeout)
        response: http1.Response | None = None
        head = self._turn_head
        if traceparent is not None:
            headers = [*self._turn_headers, (b"traceparent", traceparent.encode())]
            head = self.http.prepare(b"POST", self._turn_target, headers)
        try:
            with idle:
                try:
                    response = await self.http.send(head, body)
                except http1.ConnectFailed as exc:
                    raise BackendUnreachable(f"backend {self.url} unreachable: {exc}") from None
                except http1.ExchangeFailed as exc:
                    raise BackendError(f"backend {self.url} {_broke(exc)}") from None
                response.idle = idle
                response.idle_timeout = self.idle_timeout
                yield response
        finally:
            if response is not None:
                if response.reusable:
                    self.http.release(response)
                else:
                    response.close()
        if idle.cancelled_caught:
            raise BackendIdle(f"backend {self.url} sent nothing for too long (idle timeout)")

    async def fetch(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        *,
        under_base: bool = True,
    ) -> Answer:
        """One request beside the turns (a probe, a model list, doctor's), on the turns' client.

        ``path`` is under the base URL (``under_base=False``: under the origin); the key goes
        with it. An answer of any status is an ``Answer``; no whole answer (unreachable,
        broken, over ``ANSWER_LIMIT``) is ``ProbeFailed``. The caller bounds the time (a cancel
        scope; a connect is bounded by ``connect_timeout``). A connection read to its end is
        kept for the next request."""
        headers = [(b"accept", b"application/json"), *self._common_headers(bool(body))]
        target = self.http.target(path, under_base=under_base)
        response: http1.Response | None = None
        try:
            response = await self.http.request(method.encode(), target, headers, body)
            data = await response.read_body(ANSWER_LIMIT)
        except http1.ConnectFailed as exc:
            raise ProbeFailed(f"unreachable ({exc})") from None
        except http1.ExchangeFailed as exc:
            raise ProbeFailed(_broke(exc)) from None
        finally:
            if response is not None:
                self.http.release(response)  # kept if read to its end, else closed
        if not response.complete:
            raise ProbeFailed(f"sent an answer over {ANSWER_LIMIT} bytes")
        return Answer(response.status, data)

    async def list_models(self) -> list[str]:
        """Model ids from ``GET {url}/models`` (Ollama's ``/api/tags`` where that is missing);
        ``ProbeFailed`` when there is no list (``status`` set when it answered another status)."""
        with _in_time(PROBE_TIMEOUT):
            answer = await self.fetch("GET", "/models")
            if answer.status == 404 and self.url.endswith("/v1"):
                origin_path = f"{self.http.base_path[:-3]}/api/tags"
                tags = await self.fetch("GET", origin_path, under_base=False)
                return _ids(_model_list(tags, _OllamaTags).models, "name")
        return _ids(_model_list(answer, _ModelList).data, "id")

    async def check(self) -> str | None:
        """Probe ``GET {url}/models``: None when the backend answers, else why it is down.

        A 404/405 still counts as up (the server lives, it just has no model list).
        """
        try:
            with _in_time(PROBE_TIMEOUT):
                answer = await self.fetch("GET", "/models")
        except ProbeFailed as exc:
            return exc.reason
        if answer.ok or answer.status in (404, 405):
            return None
        if answer.status in (401, 403):
            return f"answered {answer.status}: its key was refused"
        return f"answered {answer.status}"

    # -- concurrency ---------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Turns waiting in the queue for a slot."""
        return len(self._waiters)

    @property
    def has_free_slot(self) -> bool:
        return self.max_concurrency is None or (
            self.in_flight < self.max_concurrency and not self._waiters
        )

    @property
    def queue_has_room(self) -> bool:
        return len(self._waiters) < self.queue_limit

    def _touch(self) -> None:
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    async def wait_until(self, predicate: Callable[[Backend], bool]) -> None:
        """Wait until ``predicate(self)`` holds; rechecked whenever a slot, the queue or health changes."""
        while not predicate(self):
            await self._changed.wait()

    def busy_text(self) -> str:
        return f"backend {self.name} is busy ({self.in_flight} in flight, {self.waiting} waiting)"

    async def acquire(self, job_id: str, request_id: str) -> None:
        """Take a slot, waiting in FIFO order when all are taken; ``BackendBusy`` when the queue is full."""
        if self.has_free_slot:
            self.in_flight += 1
            self._touch()
            return
        if not self.queue_has_room:
            self.busy_total += 1
            raise BackendBusy(self.busy_text())
        event = trio.Event()
        self._waiters.append(event)
        self.waits_total += 1
        log.info(
            "job %s request %s: waiting for backend %s (%d in flight, %d waiting)",
            job_id,
            request_id,
            self.name,
            self.in_flight,
            self.waiting,
        )
        start = trio.current_time()
        self._touch()
        try:
            await event.wait()
        except BaseException:
            if event.is_set():  # the slot was handed over as we were cancelled: pass it on
                self.release()
            else:
                self._waiters.remove(event)
            raise
        finally:
            self.waited_seconds_total += trio.current_time() - start
            self._touch()

    def release(self) -> None:
        """Give a slot back; it passes straight to the first waiting turn, if any."""
        if self._waiters:
            self._waiters.popleft().set()
        else:
            self.in_flight -= 1
        self._touch()


@dataclass(frozen=True)
class Route:
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

    # -- routing -------------------------------------------------------------------------

    def _candidates(self, model: str | None) -> list[Backend]:
        if model is None:
            return []
        return [b for b in self.backends if model in b.models]

    async def route(self, frame_model: str | None, body: bytes) -> Route:
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
        return Route(requested, local, body, tuple(candidates))

    def _unknown_text(self, requested: str | None) -> str:
        available = self.servable()
        listing = (
            f"available: {', '.join(available)}" if available else "no model is available right now"
        )
        if requested is None:
            return f"the turn names no model and this runner has no default (--model); {listing}"
        return f"model {requested!r} is not available on this runner; {listing}"

    def _choose(self, route: Route, exclude: Sequence[Backend]) -> Backend:
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
        self, route: Route, job_id: str, request_id: str, exclude: Sequence[Backend] = ()
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
        route: Route,
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


LOCAL_SERVERS: tuple[tuple[str, str], ...] = (
    ("Ollama", "http://127.0.0.1:11434/v1"),
    ("vLLM", "http://127.0.0.1:8000/v1"),
    ("LM Studio", "http://127.0.0.1:1234/v1"),
    ("llama.cpp", "http://127.0.0.1:8080/v1"),
    ("LiteLLM", "http://127.0.0.1:4000/v1"),
    ("alp-gateway sim", "http://127.0.0.1:8789/v1"),  # gateway.sim.cli.DEFAULT_LISTEN
)


async def discover_local(probe_timeout: float = 0.5) -> list[tuple[str, str, list[str]]]:
    """Model servers answering at their usual local ports: (kind, base URL, model ids)."""
    found: list[tuple[str, str, list[str]]] = []

    async def probe(kind: str, url: str) -> None:
        backend = Backend(url, connect_timeout=probe_timeout, idle_timeout=probe_timeout)
        try:
            models = await backend.list_models()
        except ProbeFailed:
            return
        finally:
            await backend.aclose()
        if models:
            found.append((kind, url, models))

    async with trio.open_nursery() as nursery:
        for kind, url in LOCAL_SERVERS:
            nursery.start_soon(probe, kind, url)
    order = [url for _, url in LOCAL_SERVERS]
    return sorted(found, key=lambda item: order.index(item[1]))
