"""Whether and where the runner's traces go, and what a turn span takes from a chunk: pure, no
OpenTelemetry module imported.

Tracing is off unless asked: ``--otlp-endpoint`` / ``ALP_GATEWAY_OTLP_ENDPOINT`` or the standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (``OTEL_SDK_DISABLED=true``
or ``OTEL_TRACES_EXPORTER=none`` turn it off again). When on, the runner imports
:mod:`gateway.runner.otel` (which imports this module, never the other way), which holds the
SDK-backed spans; while off, no OpenTelemetry module is imported and a turn does no tracing work
(the channel holds ``None``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import msgspec


def endpoint_from_env(env: Mapping[str, str], setting: str | None = None) -> str | None:
    """The OTLP/HTTP traces URL to export to, or None when tracing is off.

    ``setting`` (ours) wins; then ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (a full URL, used as
    given), then ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base: ``/v1/traces`` is appended, as the
    OpenTelemetry specification says). Ours is a base too, unless it already ends in the path."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    if setting:
        return _traces_url(setting)
    full = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if full:
        return full
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    return _traces_url(base) if base else None


def _traces_url(base: str) -> str:
    base = base.strip()
    if urlsplit(base).path.rstrip("/").endswith("/v1/traces"):
        return base
    return base.rstrip("/") + "/v1/traces"


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _LastChunk(msgspec.Struct):
    """What a turn span takes from a stream's last chunk (read only while tracing is on)."""

    id: str | None = None
    model: str | None = None
    usage: _Usage | None = None


_decode_last = msgspec.json.Decoder(_LastChunk).decode


def usage_attributes(payload: bytes | None) -> dict[str, Any]:
    """GenAI attributes from a chunk that carries ``usage`` (or a whole completion), else {}."""
    if not payload:
        return {}
    try:
        chunk = _decode_last(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return {}
    attributes: dict[str, Any] = {}
    if chunk.model:
        attributes["gen_ai.response.model"] = chunk.model
    if chunk.id:
        attributes["gen_ai.response.id"] = chunk.id
    if chunk.usage is not None:
        if chunk.usage.prompt_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = chunk.usage.prompt_tokens
        if chunk.usage.completion_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = chunk.usage.completion_tokens
    return attributes
