"""HTTP/1.1 requests as their bytes arrive, sans-IO: httptools (llhttp, in C) parses, heads come out in order.

The server core's connection (``gateway.wire.httpconn``) reads its socket and feeds what
arrived here, once per read. Each request's head is queued in ``heads`` once it is whole (its
method, target, version, headers lower-cased, and the headers the core itself reads noted as
they are parsed, so none is searched for after); its body's pieces gather in ``body`` until
the request is whole, then it holds them joined. Requests pipelined behind one are parsed
ahead and queued. Where llhttp stops is kept: an error (``broken``: a malformed head or chunk,
Content-Length with Transfer-Encoding, ...) after the requests before it, or an upgrade it took
(the request is ``switched``; the bytes after its head are ``rest``, the new protocol's).
An absolute-form target is read as its path and authority (``origin_form``).
"""

from __future__ import annotations

from collections import deque

import httptools

# the headers the core reads, noted as they are parsed
_NOTED = frozenset((b"host", b"content-length", b"transfer-encoding", b"upgrade", b"expect"))


class RequestHead:
    """One request as it is parsed: its head, then its body once it is whole."""

    __slots__ = (
        "url",
        "headers",
        "method",
        "version",
        "keep_alive",
        "head_done",
        "complete",
        "upgrade",
        "switched",
        "hosts",
        "length",
        "chunked",
        "coding",
        "expect",
        "body",
    )

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.method = b""
        self.version = ""  # "1.1", "1.0"...
        self.keep_alive = False  # llhttp's: the version and Connection header allow another
        self.head_done = False
        self.complete = False  # its body too
        self.upgrade: bytes | None = None  # its Upgrade header
        self.switched = False  # llhttp stopped after it: an upgrade (or CONNECT) it took
        self.hosts = 0  # Host headers
        self.length: bytes | None = None  # its Content-Length header
        self.chunked = False  # it has a Transfer-Encoding
        self.coding: bytes | None = None  # its one Transfer-Encoding's value (None: several)
        self.expect = False  # Expect: 100-continue
        self.body: bytes | None = None  # once complete: its body

    def head_size(self) -> int:
        """The head's size as a bound counts it: the target and every field."""
        return len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)


class RequestParser:
    """The requests of one connection as its bytes are fed; httptools calls the ``on_*``
    methods as it parses."""

    def __init__(self) -> None:
        self.heads: deque[RequestHead] = deque()  # heads whole, not taken yet
        self.current: RequestHead | None = None  # the request being parsed
        self.body: list[bytes] = []  # the pieces of its body so far
        self.on_body = self.body.append  # httptools' callback: no Python frame per piece
        self.broken: httptools.HttpParserError | None = None  # where llhttp stopped, failing
        self.rest = b""  # after an upgrade: the bytes that came after its head
        self.stopped = False  # llhttp stopped: an upgrade, or an error (``broken``)
        # llhttp's parser holds this one (its callbacks) and this one holds it: ``close``
        # breaks the pair, else only the cyclic garbage collector frees them (a hub's full
        # collections are rare: a connection's last read, a refused body's first 64 KiB
        # included, stayed in memory until one)
        self._parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)

    def feed(self, data: bytes) -> None:
        """Parse what was read (after an upgrade, it is kept in ``rest``)."""
        parser = self._parser
        if parser is None:  # closed: the connection has ended
            return
        if self.stopped:
            if self.broken is None:
                self.rest += data
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            assert self.current is not None
            self.current.switched = self.stopped = True
            self.rest = data[exc.args[0] :]
        except httptools.HttpParserError as exc:
            self.broken = exc
            self.stopped = True

    def close(self) -> None:
        """The connection has ended: llhttp's parser let go (the pair then goes with the
        connection); what is fed after is dropped."""
        self._parser = None

    def take_rest(self) -> bytes:
        """After an upgrade: the bytes that came after its head (the new protocol's)."""
        rest, self.rest = self.rest, b""
        return rest

    @property
    def head_begun(self) -> bool:
        """A request's head is being parsed (not whole yet)."""
        current = self.current
        return current is not None and not current.head_done

    # -- httptools' callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.current = RequestHead()

    def on_url(self, url: bytes) -> None:
        current = self.current
        assert current is not None
        current.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        current = self.current
        assert current is not None
        name = name.lower()
        current.headers.append((name, value))
        if name in _NOTED:
            if name == b"host":
                current.hosts += 1
            elif name == b"content-length":
                current.length = value
            elif name == b"transfer-encoding":
                current.coding = None if current.chunked else value
                current.chunked = True
            elif name == b"upgrade":
                current.upgrade = value
            else:
                current.expect = value.lower() == b"100-continue"

    def on_headers_complete(self) -> None:
        current = self.current
        parser = self._parser
        assert current is not None and parser is not None
        current.method = parser.get_method()
        current.version = parser.get_http_version()
        current.keep_alive = parser.should_keep_alive()
        current.head_done = True
        self.heads.append(current)

    def on_message_complete(self) -> None:
        current = self.current
        assert current is not None
        current.complete = True
        body = self.body
        current.body = b"".join(body)
        body.clear()


def origin_form(target: bytes) -> tuple[bytes, bytes | None]:
    """A request target in origin form (path and query) and the authority an absolute-form one
    named (RFC 9112 §3.2.2: ``http://host:port/path?query``), or None."""
    if target[:1] == b"/":
        return target, None
    scheme, sep, rest = target.partition(b"://")
    if not sep or not scheme.isalpha():
        return target, None  # authority-form, asterisk-form: as they are
    end = min((i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0), default=len(rest))
    authority = rest[:end].rpartition(b"@")[2]  # userinfo dropped (RFC 9110 §4.2.4)
    path = rest[end:]
    return (path if path[:1] == b"/" else b"/" + path), authority
