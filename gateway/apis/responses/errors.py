"""The Responses translation's refusals, in OpenAI's error shape: pure.

``ResponsesError`` is a Responses request the hub refuses (its status, message, ``code`` and
``param``; the front door wraps it in its HTTP error); ``invalid`` and ``unsupported`` build the
two kinds the request and tools translations raise.
"""

from __future__ import annotations

__all__ = ["ResponsesError", "invalid", "unsupported"]


class ResponsesError(Exception):
    """A Responses request we refuse, in OpenAI's error shape (the hub's HTTPError wraps it)."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def invalid(param: str, why: str) -> ResponsesError:
    """400 ``invalid_request``: ``param`` is not what it should be (``why``)."""
    return ResponsesError(400, f"Invalid '{param}': {why}", "invalid_request", param)


def unsupported(param: str, message: str) -> ResponsesError:
    """400 ``unsupported_parameter``: ``param`` asks what the hub cannot do."""
    return ResponsesError(400, message, "unsupported_parameter", param)
