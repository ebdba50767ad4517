"""The one error type and shape every HTTP API of this project answers with (OpenAI's error
envelope), and the client-gone signal; pure, no I/O."""

from __future__ import annotations

import msgspec

Headers = list[tuple[bytes, bytes]]

_encoder = msgspec.json.Encoder()

_TYPE_BY_STATUS = {
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
}


class HTTPError(Exception):
    """A request refused or failed, answered as ``{"error": {"message", "type", "param", "code"}}``
    (OpenAI's error envelope: the hub's routes, the simulator's)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        *,
        type_: str | None = None,
        headers: Headers | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type_ or _TYPE_BY_STATUS.get(status, "invalid_request_error")
        self.headers = list(headers or [])
        if status == 401 and not any(k == b"www-authenticate" for k, _ in self.headers):
            self.headers.append((b"www-authenticate", b"Bearer"))

    def copy(self) -> HTTPError:
        """The same answer as a new exception (to raise it again elsewhere)."""
        return HTTPError(
            self.status, self.message, self.code, type_=self.type, headers=self.headers
        )

    def body(self) -> bytes:
        """The JSON error envelope."""
        return error_envelope(self.message, self.type, self.code)


def error_envelope(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` as JSON bytes (``param``: the request
    field at fault, null by default)."""
    error = {"message": message, "type": type_, "param": param, "code": code}
    return _encoder.encode({"error": error})


class ClientGone(Exception):
    """The HTTP client disconnected (or sending to it failed)."""
