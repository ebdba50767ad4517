"""One front-door turn as the hub accounts for it: who asked, which runner served, the tokens,
the times and how it ended. Pure: the serving path fills it in, the usage book keeps it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

# how a turn ended
OK = "ok"  # the runner finished it
ERROR = "error"  # the runner (its backend) reported an error
LOST = "lost"  # the channel was lost mid-answer
CLIENT_GONE = "client_gone"  # the client left before the end
REFUSED = "refused"  # answered with an error before any runner served it (no runner, 404, 429...)
OUTCOMES = (OK, ERROR, LOST, CLIENT_GONE, REFUSED)


@dataclass(eq=False, slots=True)
class TurnRecord:
    """One turn, filled in as it goes (times on the trio clock, seconds)."""

    key_id: str  # the API key's id (not the key)
    key_name: str
    session: str  # the session id the client named ("default" without one)
    api: str  # "chat", "messages" or "responses"
    model: str | None  # the model asked of the runner (None: the runner's default)
    stream: bool
    started: float
    runner_id: str | None = None  # the runner whose channel served it
    job_id: str | None = None
    first_token: float | None = None  # when the first chunk went to the client
    ended: float | None = None
    outcome: str | None = None
    prompt_tokens: int | None = None  # from the backend's usage, when it sent one
    completion_tokens: int | None = None
    chunks: int = 0  # chunks sent to the client so far (a streamed turn's pace, live)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.started

    @property
    def duration(self) -> float | None:
        return None if self.ended is None else self.ended - self.started

    def take_usage(self, raw: bytes | memoryview | msgspec.Raw) -> None:
        """The tokens of a chunk (or a whole completion) that carries ``usage``."""
        try:
            found = _usage_decoder.decode(raw)
        except msgspec.DecodeError:
            return
        usage = found.usage
        if usage is None:
            return
        if isinstance(usage.prompt_tokens, int):
            self.prompt_tokens = usage.prompt_tokens
        if isinstance(usage.completion_tokens, int):
            self.completion_tokens = usage.completion_tokens

    @property
    def tokens(self) -> int:
        """Prompt and completion tokens together (0 where the backend told none)."""
        return (self.prompt_tokens or 0) + (self.completion_tokens or 0)


class _Usage(msgspec.Struct):
    prompt_tokens: Any = None
    completion_tokens: Any = None


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None


_usage_decoder = msgspec.json.Decoder(_WithUsage)


def has_usage(raw: bytes | memoryview | msgspec.Raw) -> bool:
    """Whether a chunk carries a ``usage`` object (a byte search, no decode: the backends' JSON
    writes it ``"usage":{`` or ``"usage": {``; ``"usage":null`` is none)."""
    data = bytes(raw) if not isinstance(raw, bytes) else raw
    return b'"usage":{' in data or b'"usage": {' in data


def is_usage_only(raw: bytes | memoryview | msgspec.Raw) -> bool:
    """A chunk with ``choices`` empty: the extra usage chunk ``include_usage`` asks for (the
    chunk, or the whole frame that carries it: a byte search, no decode)."""
    data = bytes(raw) if not isinstance(raw, bytes) else raw
    return b'"choices":[]' in data or b'"choices": []' in data


_CHOICES = b'"choices":'


def choices_mark(data: bytes) -> tuple[bytes, int] | None:
    """Where a chunk (or the frame that carries it) opens a non-empty ``choices``: the bytes
    from its key to the first choice's ``{`` and their offset, or None (no ``choices``, an empty
    one, or laid out otherwise).

    A backend writes every chunk of a stream with the same head (id, object, created, model...),
    so the next chunk of the turn that has these bytes at this offset is not a usage-only chunk:
    one ``startswith`` per chunk instead of ``is_usage_only``'s search of the whole frame. (A
    string cannot hold ``"choices":`` unescaped, so the first one found is a key: the chunk's
    own, the envelope and the head before it have none.)"""
    at = data.find(_CHOICES)
    if at < 0:
        return None
    end = at + len(_CHOICES)
    while data[end : end + 1] == b" ":
        end += 1
    if not data.startswith(b"[{", end):
        return None
    return data[at : end + 2], at
