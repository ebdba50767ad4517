"""The backend pool: the local OpenAI-compatible model servers a turn can be forwarded to."""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import msgspec
import trio

log = logging.getLogger("gateway.backends")


class BackendError(Exception):
    """A turn could not be served by the backend; the message is safe for a frame (no key)."""


class _ModelList(msgspec.Struct):
    data: list[dict[str, object]] = []


class _OllamaTags(msgspec.Struct):
    models: list[dict[str, object]] = []


def _ids(items: list[dict[str, object]], field: str) -> list[str]:
    return [str(item[field]) for item in items if isinstance(item, dict) and item.get(field)]


class Backend:
    """One OpenAI-compatible backend at ``url`` (its base, including ``/v1``)."""

    def __init__(
        self,
        url: str,
        key: str | None = None,
        *,
        name: str = "default",
        connect_timeout: float = 10.0,
        idle_timeout: float = 600.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.completions_url = f"{self.url}/chat/completions"
        self._headers = {"accept": "text/event-stream", "content-type": "application/json"}
        if key:
            self._headers["authorization"] = f"Bearer {key}"
        # Per-read idle timeout, never an overall deadline: long generations are normal.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect_timeout, read=idle_timeout, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            verify=ssl_context if ssl_context is not None else True,
        )

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, {self.url!r})"

    async def aclose(self) -> None:
        await self.client.aclose()

    @asynccontextmanager
    async def stream(self, body: bytes) -> AsyncIterator[httpx.Response]:
        """POST one chat-completions body; the response is closed (and the generation
        abandoned) when the block exits, including by cancellation."""
        request = self.client.build_request(
            "POST", self.completions_url, content=body, headers=self._headers
        )
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TimeoutException:
            raise BackendError(f"backend {self.url} did not answer in time") from None
        except httpx.HTTPError as exc:
            raise BackendError(f"backend {self.url} unreachable: {type(exc).__name__}") from None
        try:
            yield response
        finally:
            with trio.CancelScope(shield=True):
                await response.aclose()

    async def list_models(self) -> list[str]:
        """Model ids from ``GET {url}/models`` (Ollama's ``/api/tags`` where that is missing)."""
        headers = {k: v for k, v in self._headers.items() if k == "authorization"}
        resp = await self.client.get(f"{self.url}/models", headers=headers, timeout=10.0)
        if resp.status_code == 404 and self.url.endswith("/v1"):
            tags = await self.client.get(f"{self.url[:-3]}/api/tags", timeout=10.0)
            tags.raise_for_status()
            return _ids(msgspec.json.decode(tags.content, type=_OllamaTags).models, "name")
        resp.raise_for_status()
        return _ids(msgspec.json.decode(resp.content, type=_ModelList).data, "id")


class BackendPool:
    """Routes turns to backends and answers which models can be served, briefly cached."""

    def __init__(self, backends: list[Backend], default_model: str | None, cache_ttl: float = 30.0):
        self.backends = backends
        self.default_model = default_model
        self.cache_ttl = cache_ttl
        self._models: list[str] | None = None
        self._models_at = -1e9
        self._lock = trio.Lock()

    @property
    def available(self) -> bool:
        return bool(self.backends)

    def route(self, model: str | None) -> Backend:
        if not self.backends:
            raise BackendError("no backend is configured on this runner")
        return self.backends[0]

    async def models(self) -> list[str]:
        """Ids the backends can serve now; an empty list (and one log line) when they cannot say."""
        async with self._lock:
            now = trio.current_time()
            if self._models is not None and now - self._models_at < self.cache_ttl:
                return self._models
            found: list[str] = []
            for backend in self.backends:
                try:
                    for model in await backend.list_models():
                        if model not in found:
                            found.append(model)
                except (httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                    log.warning("backend %s cannot list its models: %s", backend.url, type(exc).__name__)
            self._models, self._models_at = found, now
            return found

    async def aclose(self) -> None:
        for backend in self.backends:
            await backend.aclose()


LOCAL_SERVERS: tuple[tuple[str, str], ...] = (
    ("Ollama", "http://127.0.0.1:11434/v1"),
    ("vLLM", "http://127.0.0.1:8000/v1"),
    ("LM Studio", "http://127.0.0.1:1234/v1"),
    ("llama.cpp", "http://127.0.0.1:8080/v1"),
    ("LiteLLM", "http://127.0.0.1:4000/v1"),
)


async def discover_local(probe_timeout: float = 0.5) -> list[tuple[str, str, list[str]]]:
    """Model servers answering at their usual local ports: (kind, base URL, model ids)."""
    found: list[tuple[str, str, list[str]]] = []

    async def probe(kind: str, url: str) -> None:
        backend = Backend(url, connect_timeout=probe_timeout, idle_timeout=probe_timeout)
        try:
            models = await backend.list_models()
        except (httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError):
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
