"""Model servers answering at their usual local ports: what doctor and the demo offer."""

from __future__ import annotations

import trio

from gateway.runner.backend import Backend, ProbeFailed

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
