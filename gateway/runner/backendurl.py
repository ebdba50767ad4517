"""A backend URL that lacks its ``/v1``, found and said in the same words by ``run`` and ``doctor``.

Ollama's ``http://127.0.0.1:11434``, vLLM's or the simulator's host given without ``/v1`` starts
fine (the server answers), lists no model and fails every turn with the backend's 404.
``missing_v1`` asks ``{url}/models`` and ``{url}/v1/models``: when the first answers 404 and the
second lists models, the URL surely wants its ``/v1``. The runner logs the answer in one WARNING
line at start; doctor shows it as a failed check.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from gateway.runner.backends import Backend, ProbeFailed


@dataclass(frozen=True)
class MissingV1:
    """What is wrong with the URL (``detail``), and the fix (``fix``)."""

    detail: str
    fix: str

    @property
    def line(self) -> str:
        """Both, in one line (the runner's warning)."""
        return f"{self.detail} ({self.fix})"


def where_configured(backend: Backend) -> str:
    """Where the user wrote the backend's URL: the flag or the config file's table."""
    if backend.name == "default":
        return "--backend / CHAT_LLM_BACKEND_URL"
    return f"[[backend]] {backend.name}"


async def missing_v1(backend: Backend) -> MissingV1 | None:
    """``MissingV1`` when ``{url}/models`` answers 404 and ``{url}/v1/models`` lists models (with
    the backend's key), else None. The caller bounds the time (a cancel scope)."""
    if backend.url.rstrip("/").endswith("/v1"):
        return None
    try:
        if (await backend.fetch("GET", "/models")).status != 404:
            return None
        answer = await backend.fetch("GET", "/v1/models")
        data = msgspec.json.decode(answer.body) if answer.ok else None
    except (ProbeFailed, msgspec.DecodeError):
        return None
    if not (isinstance(data, dict) and isinstance(data.get("data"), list)):
        return None
    v1 = f"{backend.url}/v1"
    return MissingV1(
        f"{backend.url}/models answered 404, but {v1}/models lists models: did you mean {v1}?",
        f"give the OpenAI-compatible base URL, {v1}, in {where_configured(backend)}",
    )
