"""What every hub route shares beyond the request and response: the JSON body helpers, the
disconnect wait (the request and response are ``gateway.wire.http``'s, the error type ``gateway.wire.errors``')."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from gateway.wire.errors import ClientGone, Headers, HTTPError, error_envelope
from gateway.wire.http import (
    JSON_HEADER,
    Message,
    Request,
    Response,
    Scope,
    bearer,
    header,
)

Receive = Callable[[], Awaitable[Message]]

__all__ = [
    "JSON_HEADER",
    "ClientGone",
    "HTTPError",
    "Headers",
    "Message",
    "Receive",
    "Request",
    "Response",
    "Scope",
    "bearer",
    "error_envelope",
    "header",
    "json_object",
    "string_list",
    "wait_disconnect",
]


def json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; HTTPError 400 otherwise."""
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):  # nested too deep is not JSON we take
        raise HTTPError(400, "request body is not JSON", "invalid_json") from None
    if not isinstance(obj, dict):
        raise HTTPError(400, "request body must be a JSON object", "invalid_request")
    return obj


def string_list(obj: dict[str, Any], key: str, *, required: bool) -> list[str]:
    """``obj[key]`` as a list of strings (``[]`` when absent and not required); HTTPError 400."""
    value = obj.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise HTTPError(400, f'"{key}" must be a list of strings', "invalid_request")
    return value


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client of this HTTP request has disconnected."""
    while (await receive())["type"] != "http.disconnect":
        pass
