"""The schema of an OpenAI ``chat.completion.chunk`` (or a whole ``chat.completion``), written
once: only the fields read of it, every one optional, as the translations, the continuation
(``gateway.apis.continuation``, runner and hub) and the demo read it. Pure."""

from __future__ import annotations

from typing import Any

import msgspec


class Function(msgspec.Struct):
    name: Any = None
    arguments: Any = None


class ToolCallDelta(msgspec.Struct):
    index: Any = None
    id: Any = None
    function: Function | None = None


class Delta(msgspec.Struct):
    content: Any = None
    reasoning_content: Any = None
    reasoning: Any = None
    refusal: Any = None
    tool_calls: list[ToolCallDelta] | None = None
    function_call: Any = None  # the tool call of before tool_calls (a continuation refuses one)


class Choice(msgspec.Struct):
    index: Any = 0
    delta: Delta | None = None
    message: Delta | None = None  # a whole chat.completion's choice
    finish_reason: Any = None
    stop_reason: Any = None  # vLLM: the stop string that ended the turn (an int: a stop token)


class Details(msgspec.Struct):
    cached_tokens: Any = None
    reasoning_tokens: Any = None


class Usage(msgspec.Struct):
    prompt_tokens: Any = None
    completion_tokens: Any = None
    total_tokens: Any = None
    prompt_tokens_details: Details | None = None
    completion_tokens_details: Details | None = None


class Chunk(msgspec.Struct):
    choices: list[Choice] | None = None
    usage: Usage | None = None
    error: Any = None


chunk_decoder = msgspec.json.Decoder(Chunk)


# -- what the hub reads of a chunk without decoding it (a byte search), and its usage -----------


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


class _WithUsage(msgspec.Struct):
    usage: Usage | None = None


_usage_decoder = msgspec.json.Decoder(_WithUsage)


MAX_TOKENS = (1 << 31) - 1  # a usage number past this is no count of one turn's tokens


def _count(n: Any) -> bool:
    return n.__class__ is int and 0 <= n <= MAX_TOKENS


def read_usage(raw: bytes | memoryview | msgspec.Raw) -> tuple[int | None, int | None] | None:
    """(prompt tokens, completion tokens) of a chunk or completion that carries ``usage`` (each
    None where it is absent), or None without one, or when a number it gives is no count of
    tokens (not a whole number from 0 to ``MAX_TOKENS``: a runner's say is not believed in
    either then, and the turn is charged as one without usage)."""
    try:
        usage = _usage_decoder.decode(raw).usage
    except msgspec.DecodeError:
        return None
    if usage is None:
        return None
    prompt, completion = usage.prompt_tokens, usage.completion_tokens
    if (prompt is not None and not _count(prompt)) or (
        completion is not None and not _count(completion)
    ):
        return None
    return prompt, completion
