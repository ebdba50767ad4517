"""Anthropic's error shape, for both directions of the Messages translation: pure.

``MessagesError`` is a request refused (raised by ``messages.request``); ``error_body`` is the
``{"type": "error", "error": {...}}`` body both an HTTP error answer and a stream's ``event:
error`` carry; ``error_type_for_status`` names Anthropic's error ``type`` for an HTTP status.
"""

from __future__ import annotations

import msgspec

__all__ = ["MessagesError", "error_body", "error_type_for_status"]

_encode = msgspec.json.Encoder().encode


class MessagesError(Exception):
    """A request refused: answered with ``status`` and ``error_body(type, message)``."""

    def __init__(self, status: int, type_: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message

    def body(self) -> bytes:
        return error_body(self.type, self.message)


def error_body(type_: str, message: str) -> bytes:
    """``{"type": "error", "error": {"type", "message"}}`` as JSON bytes."""
    return _encode({"type": "error", "error": {"type": type_, "message": message}})


_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type_for_status(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status (``api_error`` for any other)."""
    return _TYPE_BY_STATUS.get(status, "api_error")
