"""Incremental Server-Sent Events splitter over bytes: pure, no I/O.

Feed it whatever the socket gave; it returns the ``data:`` payloads of every
event completed so far, as bytes, without decoding them. Multi-line data is
joined with ``\\n`` as the SSE spec says; comments and other fields are skipped.

The common read, whole events of one ``data: `` line each, costs no per-line work:
it is cut at event boundaries (a blank line) in one C-level split, and each event's
payload is sliced out as it is. Anything else (comments, other fields, several data
lines, an event begun in an earlier read) goes through the line-by-line parser,
which gives the same results.
"""

from __future__ import annotations

_DATA = b"data:"


class SSESplitter:
    """Splits an SSE byte stream into event data payloads as events complete."""

    __slots__ = ("_buf", "_data")

    def __init__(self) -> None:
        self._buf = b""  # an unfinished line
        self._data: list[bytes] = []  # data lines of the event in progress

    def feed(self, chunk: bytes) -> list[bytes]:
        """Return the data payloads of the events that ``chunk`` completes."""
        if self._buf or self._data:
            return self._feed_rest(chunk)
        end = chunk.find(b"\n")
        if end == len(chunk) - 2 and chunk[-1] == 10 and chunk[:6] == b"data: ":
            if b"\r" not in chunk:  # the usual read: one whole event of one "data: " line
                return [chunk[6:end]]
        if chunk.endswith(b"\n\n") and b"\r" not in chunk:
            # whole events only, each one "data: " line
            events = chunk.split(b"\n\n")  # several: one C-level split
            del events[-1]
            out = [e[6:] for e in events if e[:6] == b"data: " and b"\n" not in e]
            if len(out) == len(events):
                return out
            out = []  # something else among them: the line parser, event by event
            pos = 0
            end = len(chunk)
            while pos < end:
                pos = self._lines(chunk, pos, out, stop_at_event=True)
            return out
        return self._feed_rest(chunk)

    def _feed_rest(self, chunk: bytes) -> list[bytes]:
        """``feed`` for everything but whole events of one data line each."""
        buf = self._buf + chunk if self._buf else chunk
        keep_cr = False
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
            if buf.endswith(b"\r"):  # a CRLF may be split across reads: keep the CR
                buf = buf[:-1]
                keep_cr = True
            buf = buf.replace(b"\r", b"\n")
        out: list[bytes] = []
        if self._buf or self._data or b"\n\n" not in buf:
            # an event (or line) begun in an earlier read: the line parser finishes it
            start = self._lines(buf, 0, out, stop_at_event=True)
        else:
            start = 0
        last = buf.rfind(b"\n\n", start)  # the end of the last complete event
        if last >= 0:
            for event in buf[start:last].split(b"\n\n"):
                if event.startswith(_DATA) and b"\n" not in event:
                    out.append(event[6:] if event[5:6] == b" " else event[5:])
                elif event:
                    self._lines(event + b"\n\n", 0, out)
            start = last + 2
        if start < len(buf):
            start = self._lines(buf, start, out)
        rest = buf[start:]
        self._buf = rest + b"\r" if keep_cr else rest
        return out

    def _lines(self, buf: bytes, start: int, out: list[bytes], stop_at_event: bool = False) -> int:
        """Parse the complete lines of ``buf`` from ``start``; the offset of the first unparsed byte.

        With ``stop_at_event``, stop right after the first event dispatched (or ignored).
        """
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
                if stop_at_event:
                    break
                continue
            if line.startswith(_DATA):
                value = line[5:]
                if value[:1] == b" ":
                    value = value[1:]
                self._data.append(value)
            # comments (":...") and other fields (event:, id:, retry:) are skipped
        return start

    def pending(self) -> bool:
        """True when bytes of an unfinished event are held (the stream ended mid-event)."""
        return bool(self._buf.strip()) or bool(self._data)

    def flush(self) -> list[bytes]:
        """At end of stream: the payload of a last event that had no blank line after it."""
        out = self.feed(b"\n\n") if self._buf or self._data else []
        return out
