"""What every hub route shares: the one error type and shape, body reader, bearer, answers."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

log = logging.getLogger("gateway.hub")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON_HEADER = (b"content-type", b"application/json")
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
    (OpenAI's error envelope, on every route of the hub)."""

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


def error_envelope(message: str, type_: str, code: str | None) -> bytes:
    """``{"error": {"message", "type", "param": null, "code"}}`` as JSON bytes."""
    error = {"message": message, "type": type_, "param": None, "code": code}
    return _encoder.encode({"error": error})


class ClientGone(Exception):
    """The HTTP client disconnected (or sending to it failed)."""


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case), or None."""
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value)
    return None


def bearer(scope: Scope) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header; None without one (or another scheme)."""
    raw = header(scope, b"authorization")
    if raw is None:
        return None
    scheme, _, token = raw.decode("latin-1").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body; HTTPError 413 past ``limit`` bytes, ClientGone on a disconnect."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise _too_large(limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"request body exceeds {limit} bytes", "request_too_large")


def json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; HTTPError 400 otherwise."""
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError:
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


class Response:
    """One HTTP response on its way out, remembering how far it got."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.finished = False
        self.gone = False

    async def _emit(self, message: Message) -> None:
        if self.gone:
            raise ClientGone()
        try:
            await self._send(message)
        except Exception as exc:  # the server raises on a send after the client went away
            self.gone = True
            log.debug("send to the HTTP client failed: %r", exc)
            raise ClientGone() from exc

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        await self._emit({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, more: bool = True) -> None:
        if not more:
            self.finished = True
        await self._emit({"type": "http.response.body", "body": data, "more_body": more})

    async def whole(self, status: int, data: bytes, headers: Headers | None = None) -> None:
        """A complete response: ``data`` (JSON unless ``headers`` say otherwise) in one body."""
        if status == 204:
            await self.start(status, list(headers or []))
        else:
            head = [JSON_HEADER, (b"content-length", str(len(data)).encode())]
            await self.start(status, head + list(headers or []))
        await self.body(b"" if status == 204 else data, more=False)

    async def json(self, status: int, obj: Any, headers: Headers | None = None) -> None:
        await self.whole(status, _encoder.encode(obj), headers)

    async def error(self, err: HTTPError) -> None:
        await self.whole(err.status, err.body(), err.headers)


class Request:
    """One HTTP request as a route handler sees it: the ASGI scope and receive, the response on
    its way out, and the values the route's path captured."""

    __slots__ = ("params", "receive", "resp", "scope")

    def __init__(
        self, scope: Scope, receive: Receive, resp: Response, params: dict[str, str]
    ) -> None:
        self.scope = scope
        self.receive = receive
        self.resp = resp
        self.params = params

    async def body(self, limit: int) -> bytes:
        return await read_body(self.scope, self.receive, limit)
