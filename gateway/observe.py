"""Logging for people and for log shippers: one line per event, text or JSON, nothing per chunk."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from bisect import bisect_left
from collections.abc import Callable
from typing import TextIO

import trio


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        text = f"{stamp}Z {record.levelname:<7} {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class _RedactFilter(logging.Filter):
    """Last line of defence: bearer tokens and ``token=`` query values never reach the output."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "token" in message.lower() or "bearer" in message.lower():
            record.msg = _TOKEN_QUERY.sub(r"\1[redacted]", _BEARER.sub(r"\1[redacted]", message))
            record.args = None
        return True


def setup_logging(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Route every log line to stderr (or ``stream``) in the chosen format; quiet the HTTP libraries."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    handler.addFilter(_RedactFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    for noisy in ("httpx", "httpcore", "hpack"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class Counters:
    """Named event counters that tasks can wait on (metrics read them; tests wait on them)."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self._changed = trio.Event()
        self._waiting = 0  # tasks waiting for a change: without any, a change wakes nobody

    def inc(self, name: str, by: int = 1) -> None:
        self.values[name] = self.values.get(name, 0) + by
        if self._waiting:  # (counted on every turn: no event made when nobody waits)
            self._changed.set()
            self._changed = trio.Event()

    def get(self, name: str) -> int:
        return self.values.get(name, 0)

    async def _change(self) -> None:
        self._waiting += 1
        try:
            await self._changed.wait()
        finally:
            self._waiting -= 1

    async def wait(self, name: str, at_least: int) -> None:
        """Return once counter ``name`` has reached ``at_least``."""
        while self.values.get(name, 0) < at_least:
            await self._change()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds, checked again whenever any counter changes."""
        while not predicate():
            await self._change()


LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class Histogram:
    """A fixed-bucket histogram (Prometheus semantics: ``counts[i]`` counts values ≤ ``buckets[i]``,
    not cumulative; the last slot counts values above every bound)."""

    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


_CREDENTIAL_FIELD = re.compile(
    r'("(?:api[_-]?key|token|authorization|password|secret|key)"\s*:\s*")[^"]*(")', re.IGNORECASE
)
_BEARER = re.compile(r"(?i)(bearer\s+)[^\s\"']+")
_TOKEN_QUERY = re.compile(r"(?i)([?&]token=)[^&\s\"']+")


class Redactor:
    """Makes text safe to show: known secrets, bearer tokens and credential fields masked, long
    text cut (``limit`` None: never cut). The one redactor: logs, frame logs and doctor use it."""

    def __init__(self, secrets: list[str | None], limit: int | None = 240) -> None:
        self.secrets = [s for s in secrets if s and len(s) >= 4]
        self.limit = limit

    def __call__(self, text: str | bytes) -> str:
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        for secret in self.secrets:
            text = text.replace(secret, "[redacted]")
        size = len(text)
        if self.limit is not None and size > self.limit:
            text = text[: self.limit] + f"…({size} chars)"
        text = _BEARER.sub(r"\1[redacted]", text)
        text = _TOKEN_QUERY.sub(r"\1[redacted]", text)
        return _CREDENTIAL_FIELD.sub(r"\1[redacted]\2", text)
