"""Incremental Server-Sent Events splitter over bytes: pure, no I/O.

Feed it whatever the socket gave; it returns the ``data:`` payloads of every
event completed so far, as bytes, without decoding them. Multi-line data is
joined with ``\\n`` as the SSE spec says; comments and other fields are skipped.
"""

from __future__ import annotations

_DATA = b"data:"


class SSESplitter:
    """Splits an SSE byte stream into event data payloads as events complete."""

    __slots__ = ("_buf", "_data")

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        """Return the data payloads of the events that ``chunk`` completes."""
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
            if buf.endswith(b"\r"):  # a CRLF may be split across reads: keep the CR
                buf = buf[:-1]
                keep_cr = True
            else:
                keep_cr = False
            buf = buf.replace(b"\r", b"\n")
        else:
            keep_cr = False
        out: list[bytes] = []
        start = 0
        end = len(buf)
        while start < end:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if not line:
                if self._data:
                    data = self._data
                    out.append(data[0] if len(data) == 1 else b"\n".join(data))
                    self._data = []
                continue
            if line.startswith(_DATA):
                value = line[5:]
                if value[:1] == b" ":
                    value = value[1:]
                self._data.append(value)
            # comments (":...") and other fields (event:, id:, retry:) are skipped
        rest = buf[start:]
        self._buf = rest + b"\r" if keep_cr else rest
        return out

    def pending(self) -> bool:
        """True when bytes of an unfinished event are held (the stream ended mid-event)."""
        return bool(self._buf.strip()) or bool(self._data)

    def flush(self) -> list[bytes]:
        """At end of stream: the payload of a last event that had no blank line after it."""
        out = self.feed(b"\n\n") if self._buf or self._data else []
        return out
