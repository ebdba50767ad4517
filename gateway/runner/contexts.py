"""Where a backend says a model's context length (issue 37, point 3), read from its answers:
pure, no I/O.

A ``/models`` entry's ``max_model_len`` (vLLM) or ``context_length``; llama.cpp's ``GET /props``
(``default_generation_settings.n_ctx``: a slot's context); Ollama's ``POST /api/show``
(``parameters``' ``num_ctx``, else ``model_info``'s ``*.context_length`` capped at the context
Ollama runs a model with when no ``num_ctx`` is set) or, for a loaded model, ``GET /api/ps``.
``Backend.learn_contexts`` asks them.
"""

from __future__ import annotations

import re

import msgspec

_CONTEXT_FIELDS = ("max_model_len", "context_length")
OLLAMA_DEFAULT_CONTEXT = 4096  # Ollama's num_ctx when neither the model nor the server sets one
MAX_CONTEXT_ASKS = 32  # models whose context is asked one by one (Ollama), per model listing
_NUM_CTX = re.compile(r"(?m)^\s*num_ctx\s+(\d+)\s*$")


def _context_value(value: object) -> int | None:
    """A context length as a backend says it: a positive whole number, else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 31:
        return value
    return None


def listed_contexts(items: list[dict[str, object]]) -> dict[str, int]:
    found: dict[str, int] = {}
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            continue
        for name in _CONTEXT_FIELDS:
            value = _context_value(item.get(name))
            if value is not None:
                found[str(item["id"])] = value
                break
    return found


def llamacpp_context(body: bytes) -> int | None:
    """``n_ctx`` from llama.cpp's ``/props`` answer (a slot's context), else None."""
    try:
        props = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(props, dict):
        return None
    settings = props.get("default_generation_settings")
    if isinstance(settings, dict) and _context_value(settings.get("n_ctx")) is not None:
        return _context_value(settings.get("n_ctx"))
    return _context_value(props.get("n_ctx"))


def ollama_context(body: bytes) -> int | None:
    """The context Ollama runs a model with, from its ``/api/show`` answer: the model's
    ``num_ctx`` parameter, else its trained ``*.context_length`` capped at Ollama's default."""
    try:
        shown = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(shown, dict):
        return None
    parameters = shown.get("parameters")
    if isinstance(parameters, str):
        found = _NUM_CTX.search(parameters)
        if found is not None:
            return _context_value(int(found.group(1)))
    info = shown.get("model_info")
    if isinstance(info, dict):
        for name, value in info.items():
            if isinstance(name, str) and name.endswith(".context_length"):
                trained = _context_value(value)
                if trained is not None:
                    return min(trained, OLLAMA_DEFAULT_CONTEXT)
    return None


def ollama_loaded(body: bytes) -> dict[str, int]:
    """The context of each model Ollama has loaded now (``/api/ps``: ``context_length``)."""
    try:
        ps = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return {}
    found: dict[str, int] = {}
    models = ps.get("models") if isinstance(ps, dict) else None
    for item in models if isinstance(models, list) else []:
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            value = _context_value(item.get("context_length"))
            if value is not None:
                found[item["name"]] = value
    return found
