"""One backend: a local OpenAI-compatible model server, its HTTP client, slots and health.

A ``Backend`` is one model server: its URL and key, the models it serves (declared in the
config or discovered from ``GET /models``), whether it is up, what kind of server it is (as its
model list and its URL tell: how it continues an answer, docs/protocol.md §6), and a bounded
FIFO of turns waiting for one of its ``max_concurrency`` slots.

Every request to a backend, turns, health checks, model listing and doctor's, goes through
its one ``http1.Client``: the same kept-alive connections, the same proxy (``NO_PROXY``
ranges included) and the same TLS context, so a probe reaches the backend as a turn does.
"""

from __future__ import annotations

import logging
import ssl
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit

import msgspec
import trio

from gateway.config import ConfigError
from gateway.runner.contexts import (
    MAX_CONTEXT_ASKS,
    listed_contexts,
    llamacpp_context,
    ollama_context,
    ollama_loaded,
)
from gateway.wire import http1, protocol

if TYPE_CHECKING:
    from gateway.config import BackendSpec

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


class BackendLost(BackendError):
    """The connection to the backend broke after the request was sent, before an answer."""


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


# What kind of model server a backend is, as its model list says (each entry's ``owned_by``), or
# as its URL's host does; a kind tells how it continues a trailing assistant message (§6).
_OWNED_BY = {
    "vllm": "vllm",
    "llamacpp": "llama.cpp",
    "organization_owner": "lmstudio",
    "library": "ollama",
    "ollama": "ollama",
    "sim": "sim",
}
_HOSTS = {"api.openai.com": "openai"}
CANNOT_CONTINUE = frozenset({"openai"})  # answers a trailing assistant message with a new one
_VLLM_CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def _host_kind(url: str) -> str | None:
    host = urlsplit(url).hostname or ""
    if host.endswith(".openai.azure.com"):
        return "openai"
    return _HOSTS.get(host)


def _listed_kind(items: list[dict[str, object]]) -> str | None:
    for item in items:
        owner = item.get("owned_by") if isinstance(item, dict) else None
        if isinstance(owner, str) and owner in _OWNED_BY:
            return _OWNED_BY[owner]
    return None


def _kind_in(body: bytes) -> str | None:
    """The kind a model list's body says (None: it does not, or it is no model list)."""
    try:
        return _listed_kind(msgspec.json.decode(body, type=_ModelList).data)
    except msgspec.DecodeError:
        return None


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
        # model -> its context length (tokens) as the backend said it (``learn_contexts``)
        self.contexts: dict[str, int] = {}
        self._listed_ctx: dict[str, int] = {}  # as its last model list's entries said them
        self.max_concurrency = max_concurrency
        self.queue_limit = queue
        self.idle_timeout = idle_timeout
        self.key = key or None  # masked in what the runner relays of this backend's errors
        # vllm, llama.cpp, ollama, lmstudio, sim, openai; None: not known (yet)
        self.kind: str | None = _host_kind(self.url)
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
        self._watchers = 0  # tasks in ``wait_until``

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

    def stream(self, body: bytes, traceparent: str | None = None) -> BackendExchange:
        """POST one chat-completions body (as it is) and yield the response once its head is in:
        ``async with backend.stream(body) as response``.

        ``traceparent`` (tracing on): the turn span's W3C header, sent with this request only.

        The exchange runs under one idle deadline, ``response.idle``: the reader moves it
        forward as bytes arrive (never an overall deadline); when it passes, the block ends
        with ``BackendIdle``. The connection is closed (the generation abandoned) when the
        block exits before the response was read to its end, cancellation included; else it
        is kept for the next turn."""
        head = self._turn_head
        if traceparent is not None:
            headers = [*self._turn_headers, (b"traceparent", traceparent.encode())]
            head = self.http.prepare(b"POST", self._turn_target, headers)
        return BackendExchange(self, head, body)

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
        response: http1.ClientResponse | None = None
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
                models = _ids(_model_list(tags, _OllamaTags).models, "name")
                self._listed_ctx = {}
                self._learn_kind("ollama")
                return models
        data = _model_list(answer, _ModelList).data
        self._learn_kind(_listed_kind(data))
        self._listed_ctx = listed_contexts(data)
        return _ids(data, "id")

    async def learn_contexts(self, models: Sequence[str]) -> None:
        """Each model's context length, where the backend says it (``contexts``): its model
        list's entries, llama.cpp's ``/props``, Ollama's ``/api/ps`` and ``/api/show``. What
        cannot be learnt is left out (no context known: nothing is refused for it)."""
        found = dict(self._listed_ctx)
        origin = self.http.base_path[:-3] if self.url.endswith("/v1") else self.http.base_path
        try:
            with _in_time(PROBE_TIMEOUT):
                if self.kind == "llama.cpp" and models:
                    answer = await self.fetch("GET", f"{origin}/props", under_base=False)
                    n_ctx = llamacpp_context(answer.body) if answer.ok else None
                    if n_ctx is not None:
                        found.update(dict.fromkeys(models, n_ctx))
                elif self.kind == "ollama" and models:
                    answer = await self.fetch("GET", f"{origin}/api/ps", under_base=False)
                    loaded = ollama_loaded(answer.body) if answer.ok else {}
                    for model in list(models)[:MAX_CONTEXT_ASKS]:
                        if model in loaded:
                            found[model] = loaded[model]
                            continue
                        body = msgspec.json.encode({"model": model})
                        answer = await self.fetch(
                            "POST", f"{origin}/api/show", body, under_base=False
                        )
                        context = ollama_context(answer.body) if answer.ok else None
                        if context is not None:
                            found[model] = context
        except ProbeFailed as exc:
            log.info(
                "backend %s: its models' context lengths not learnt: %s", self.name, exc.reason
            )
        if found != self.contexts:
            log.info(
                "backend %s: context lengths %s",
                self.name,
                ", ".join(f"{m} {n}" for m, n in found.items()) or "not said",
            )
        self.contexts = found

    def _learn_kind(self, kind: str | None) -> None:
        if kind is not None and kind != self.kind and _host_kind(self.url) is None:
            log.info("backend %s (%s) is %s", self.name, self.url, kind)
            self.kind = kind

    def continuation(self, body: bytes) -> bytes | None:
        """``body``, whose messages end with the answer so far, as this backend is asked to
        continue it (docs/protocol.md §6): vLLM with ``continue_final_message`` and no
        generation prompt; llama.cpp, Ollama, LM Studio, the simulator and a server of a kind
        not known continue a trailing assistant message as it is; None for a kind known not to
        continue one. Once per turn."""
        if self.kind in CANNOT_CONTINUE:
            return None
        if self.kind == "vllm":
            return protocol.with_fields(body, _VLLM_CONTINUE, "continue_final_message")
        return body

    async def check(self) -> str | None:
        """Probe ``GET {url}/models``: None when the backend answers, else why it is down.

        A 404/405 still counts as up (the server lives, it just has no model list).
        """
        try:
            with _in_time(PROBE_TIMEOUT):
                answer = await self.fetch("GET", "/models")
        except ProbeFailed as exc:
            return exc.reason
        if answer.ok:
            self._learn_kind(_kind_in(answer.body))
            return None
        if answer.status in (404, 405):
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
        if self._watchers:  # (twice a turn: no event made when nobody waits)
            changed, self._changed = self._changed, trio.Event()
            changed.set()

    async def wait_until(self, predicate: Callable[[Backend], bool]) -> None:
        """Wait until ``predicate(self)`` holds; rechecked whenever a slot, the queue or health changes."""
        while not predicate(self):
            self._watchers += 1
            try:
                await self._changed.wait()
            finally:
                self._watchers -= 1

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


class BackendExchange:
    """``Backend.stream``'s block: a plain class rather than a generator-based context manager,
    as it runs on every turn. Entered, the request is sent under the idle deadline and the
    response's head read; exited, the connection is kept or closed, and a deadline that
    passed is ``BackendIdle``."""

    __slots__ = ("backend", "head", "body", "idle", "response")

    def __init__(self, backend: Backend, head: bytes, body: bytes) -> None:
        self.backend = backend
        self.head = head
        self.body = body
        self.idle = trio.CancelScope(deadline=trio.current_time() + backend.idle_timeout)
        self.response: http1.ClientResponse | None = None

    def _idle_error(self) -> BackendIdle:
        return BackendIdle(f"backend {self.backend.url} sent nothing for too long (idle timeout)")

    async def __aenter__(self) -> http1.ClientResponse:
        backend = self.backend
        idle = self.idle
        idle.__enter__()
        try:
            try:
                response = await backend.http.send(self.head, self.body)
            except http1.ConnectFailed as exc:
                raise BackendUnreachable(f"backend {backend.url} unreachable: {exc}") from None
            except http1.ConnectionLost as exc:
                raise BackendLost(f"backend {backend.url} {_broke(exc)}") from None
            except http1.ExchangeFailed as exc:
                raise BackendError(f"backend {backend.url} {_broke(exc)}") from None
        except BaseException as exc:
            if idle.__exit__(type(exc), exc, exc.__traceback__):
                raise self._idle_error() from None  # the deadline passed: swallowed by its scope
            raise
        response.idle = idle
        response.idle_timeout = backend.idle_timeout
        self.response = response
        return response

    async def __aexit__(
        self,
        etype: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        idle = self.idle
        try:
            idle.__exit__(etype, exc, tb)
        finally:
            response = self.response
            if response is not None:
                if response.reusable:
                    self.backend.http.release(response)
                else:
                    response.close()
        if idle.cancelled_caught:
            raise self._idle_error() from None
        return False
