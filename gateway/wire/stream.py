"""A backend's answer as its bytes arrive, sans-IO (in the style of h11): no socket, no clock.

``ResponseParser`` reads one HTTP/1.1 response (httptools): its head, its body's pieces, its
end. ``EventStream`` reads a streamed chat-completions body over it: bytes in; out come the
``data:`` payloads of the events completed (each checked, JSON and UTF-8, and never decoded),
``done`` once ``[DONE]`` came, ``ended`` once the HTTP message did, or a typed error
(``ProtocolError``, ``ConnectionLost``, ``BadPayload``). Whoever holds the socket reads it and
feeds what arrived, once per read: ``gateway.wire.http1`` for a response's head and for bodies
read whole, the runner's relay for a stream.
"""

from __future__ import annotations

import httptools
import msgspec

from gateway.wire.sse import SSESplitter
from gateway.wire.wsframes import is_utf8

DONE = b"[DONE]"
_validate_json = msgspec.json.Decoder(msgspec.Raw).decode


class ExchangeFailed(Exception):
    """An HTTP exchange with a backend failed before its answer was whole (no connection, an
    answer that is not HTTP/1.1, a connection lost): not an error status, which is an answer.
    The message is safe for a frame (no header, no key)."""


class ProtocolError(ExchangeFailed):
    """The answer is not HTTP/1.1 as it must be."""


class ConnectionLost(ExchangeFailed):
    """The connection broke or was closed before the answer was complete."""


class BadPayload(Exception):
    """An event's payload cannot go into a frame unchanged (not JSON, or not UTF-8); the message
    says which, and is safe for a frame."""


def lost(exc: BaseException) -> ConnectionLost:
    """The error a failed read (``OSError``, ``ssl.SSLError``) becomes: the one wording of it."""
    return ConnectionLost(f"connection broke ({type(exc).__name__})")


def _malformed(exc: Exception) -> ProtocolError:
    return ProtocolError(f"sent a malformed HTTP response ({exc})")


class _AfterWhole(Exception):
    """Raised in llhttp's callback when a message begins after the whole one: it stops there
    (``ResponseParser.stopped``)."""


class ResponseParser:
    """One HTTP/1.1 response as its bytes are fed; httptools' callbacks fill it in.

    ``body`` holds the body's pieces parsed and not taken yet (already de-chunked; it stays
    the same list, emptied in place); ``complete`` once the whole message was read;
    ``started`` once any byte of it came.
    """

    __slots__ = (
        "status",
        "headers",
        "body",
        "on_body",
        "head_done",
        "complete",
        "started",
        "_sized",
        "_keep_alive",
        "_parser",
    )

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        # httptools' body callback: the list's own append, no Python frame per piece
        self.on_body = self.body.append
        self.head_done = False
        self.complete = False
        self.started = False
        self._sized = False  # the body has a length or is chunked (else: until the close)
        self._keep_alive = False
        # llhttp's parser holds this one (its callbacks) and this one holds it: let go once
        # the message is whole (``on_message_complete``), else every response of a runner's
        # turns was cyclic garbage, freed only by the collector (most of its collections' work)
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)

    # httptools' callbacks
    def on_message_begin(self) -> None:
        if self.complete:  # bytes after the whole message, in its last read: parsed no further
            raise _AfterWhole

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None  # (called by it)
        status = parser.get_status_code()
        if status < 200:  # an informational answer: the real one follows
            self.headers = []
            return
        self.status = status
        self.head_done = True
        for name, value in self.headers:
            if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value):
                self._sized = True
        if status in (204, 304):
            self._sized = True

    def on_message_complete(self) -> None:
        parser = self._parser
        if self.head_done and parser is not None:
            self.complete = True
            self._keep_alive = parser.should_keep_alive()
            self._parser = None  # whole: nothing more is parsed (``feed`` drops what follows)

    # what the reader asks
    def header(self, name: bytes) -> bytes | None:
        """The first value of the header ``name`` (lower case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def keep_alive(self) -> bool:
        """The whole message was read and the connection may carry the next one."""
        return self.complete and self._keep_alive

    def feed(self, data: bytes) -> None:
        """Parse the bytes that arrived; ``b""``: the peer closed its side."""
        if not data:
            self.end_of_stream()
            return
        self.started = True
        if self.complete:  # bytes after the whole message: not a connection to keep
            self._keep_alive = False
            return
        parser = self._parser
        assert parser is not None  # (let go only once complete)
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.stopped(exc)

    def stopped(self, exc: httptools.HttpParserError) -> None:
        """llhttp stopped: once the message is whole, at whatever came after it in the same
        read (a message ``on_message_begin`` stops, or bytes after ``Connection: close``) the
        answer stands and the connection is not kept; before, ``ProtocolError``."""
        if not self.complete:
            raise _malformed(exc) from None
        self._keep_alive = False

    def end_of_stream(self) -> None:
        """The peer closed its side: the end of a body that runs until the close, else a loss."""
        if self.head_done and not self._sized:
            self.complete = True
        elif not self.complete:
            raise ConnectionLost("closed the connection mid-response" if self.head_done else "")

    def take_body(self) -> bytes:
        """The body's pieces parsed so far, joined; they are taken."""
        body = self.body
        data = b"".join(body)
        del body[:]
        return data


class EventStream:
    """A streamed chat-completions body (``text/event-stream``), read over the
    ``ResponseParser`` that read its head: one ``feed`` per read.

    The payloads given out are those of whole events, in order, each checked (JSON, UTF-8) and
    never re-encoded; after ``[DONE]`` (``done``) nothing more is given out.
    """

    __slots__ = ("done", "ended", "_http", "_parse", "_splitter", "_split")

    def __init__(self, http: ResponseParser) -> None:
        self.done = False  # [DONE] came
        self.ended = http.complete  # the HTTP message ended (with [DONE] or without)
        self._http = http
        parser = http._parser  # (None once the message is whole: nothing more is parsed)
        self._parse = parser.feed_data if parser is not None else http.feed
        self._splitter = SSESplitter()
        self._split = self._splitter.feed

    def feed(self, data: bytes | None) -> list[bytes]:
        """The payloads of the events completed by ``data`` (the bytes one read got; ``b""``:
        the peer closed the connection; None: nothing new, for the body bytes that came with
        the head). ``ProtocolError``, ``ConnectionLost`` or ``BadPayload`` when the answer is
        broken: the stream is over then."""
        http = self._http
        if data:
            if http.complete:  # bytes after the whole message: not a connection to keep
                http.feed(data)
            else:
                try:
                    self._parse(data)
                except httptools.HttpParserError as exc:
                    http.stopped(exc)
        elif data is not None:
            http.end_of_stream()
        pieces = http.body
        if not pieces:  # a chunk's head, or the body's end
            if http.complete:
                self.ended = True
            return []
        split = self._split
        payloads = split(pieces[0])
        if len(pieces) > 1:  # several chunks of a chunked body in one read
            for piece in pieces[1:]:
                payloads += split(piece)
        del pieces[:]
        if DONE in payloads:
            del payloads[payloads.index(DONE) :]
            self.done = True
        for payload in payloads:  # payload_problem, inlined: this runs per chunk
            try:
                _validate_json(payload)
            except msgspec.DecodeError:
                raise BadPayload("sent a malformed SSE event") from None
            if not payload.isascii() and not is_utf8(payload):
                raise BadPayload("sent an SSE event that is not UTF-8")
        if http.complete:
            self.ended = True
        return payloads

    def finish(self) -> list[bytes]:
        """Once the message ended without ``[DONE]``: the payload of a last event that had no
        blank line after it, checked (``BadPayload``)."""
        rest = [p for p in self._splitter.flush() if p != DONE]
        for payload in rest:
            problem = payload_problem(payload)
            if problem is not None:
                raise BadPayload(f"sent an SSE event that is {problem}")
        return rest


def payload_problem(payload: bytes) -> str | None:
    """Why a payload cannot go into a frame unchanged, or None when it can."""
    try:
        _validate_json(payload)
    except msgspec.DecodeError:
        return "malformed (not JSON)"
    return None if is_utf8(payload) else "not UTF-8"
