"""An answer cut by a fault, continued as one answer: the answer so far read out of the chunks
its client got, the chat body that asks for the rest, and the continuation's chunks made the
first part's own. Pure: bytes in, bytes out, no I/O.

Both sides of the channel use it (docs/protocol.md §6): the runner continues on another backend
(``gateway.runner.forward``, its payloads read per read), the hub on another runner
(``gateway.hub.serving``, its chunks one by one). Read only after a fault, never per chunk of a
turn that went well: ``Stitch`` runs per chunk, but only on a continuation.

Where the two sides differ, a parameter says so (their defaults are the runner's):

- ``answer_so_far(text_only=True)``, the runner: only an answer of text is continued, one
  choice and no reasoning (a payload of another shape is not continued either). The hub passes
  ``text_only=False``: it continues an answer that reasoned or had more than one choice, with
  the text of its choices, and reads a whole ``chat.completion``'s ``message`` too.
- ``continuation_body(extend=True)``, the runner: the text is appended to an assistant message
  the body already ends with (the one a continued turn ends with, or a client's prefill). The
  hub passes ``extend=False``: the text is an assistant message of its own, after it.

Alike on both sides: a tool call begun (``tool_calls`` or ``function_call``) or a payload that
is no JSON chunk is never continued; ``SoFar.finished`` says whether the answer had finished
(the runner then answers whole, the hub keeps what its client has). ``Stitch`` gives each
continuation chunk the first part's ``id`` (when it had one) and takes the role out of every
delta; a chunk that then says nothing (no delta value, no finish, no usage) is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.apis.chunks import Chunk


class _Identified(Chunk):
    id: Any = None  # only a continuation reads it: the chunk schema the translations use has none


_decoder = msgspec.json.Decoder(_Identified)
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
_EMPTY: tuple[Any, ...] = (None, "", [], {})


@dataclass(frozen=True)
class SoFar:
    """What a cut answer said: its chunks' ``id`` (None: none), its text, and whether it had
    finished."""

    id: str | None
    text: str
    finished: bool


def answer_so_far(payloads: Iterable[Any], *, text_only: bool = True) -> SoFar | None:
    """The answer in ``payloads`` (chunks' JSON: bytes, ``msgspec.Raw`` or a memoryview), or
    None when it cannot be continued: a tool call begun, a payload that is no chunk, and with
    ``text_only`` a second choice, reasoning or a content that is not text."""
    chunk_id: str | None = None
    parts: list[str] = []
    finished = False
    for payload in payloads:
        try:
            chunk = _decoder.decode(payload)
        except msgspec.DecodeError:
            return None
        if chunk_id is None and isinstance(chunk.id, str):
            chunk_id = chunk.id
        for choice in chunk.choices or ():
            if text_only and choice.index != 0:
                return None
            if choice.finish_reason is not None:
                finished = True
            delta = choice.delta or choice.message
            if delta is None:
                continue
            if delta.tool_calls or delta.function_call:
                return None
            if text_only and (delta.reasoning_content or delta.reasoning):
                return None
            if isinstance(delta.content, str):
                parts.append(delta.content)
            elif text_only and delta.content is not None:
                return None
    return SoFar(chunk_id, "".join(parts), finished)


def continuation_body(body: bytes, text: str, *, extend: bool = True) -> bytes | None:
    """``body`` (a chat-completions request) asking for the rest of an answer that so far says
    ``text``: its messages end with that text as the assistant's (with ``extend``, appended to
    an assistant message they already end with). None when ``body`` has no list of messages, or
    the assistant message to extend has a content that is not text."""
    try:
        obj = _decode(body)
    except msgspec.DecodeError:
        return None
    messages = obj.get("messages") if isinstance(obj, dict) else None
    if not isinstance(messages, list):
        return None
    last = messages[-1] if messages else None
    if extend and isinstance(last, dict) and last.get("role") == "assistant":
        before = last.get("content")
        if not isinstance(before, str):
            return None
        messages[-1] = {**last, "content": before + text}
    else:
        messages.append({"role": "assistant", "content": text})
    return _encode(obj)


class Stitch:
    """A continuation's chunks made the cut answer's: the first part's ``id`` (when it had one),
    no role delta, and a chunk that then says nothing dropped. ``stitch(chunk)`` for one chunk
    (None: dropped), ``stitch.payloads(list)`` for a read's."""

    __slots__ = ("id",)

    def __init__(self, chunk_id: str | None) -> None:
        self.id = chunk_id

    def __call__(self, raw: Any) -> bytes | None:
        try:
            obj = _decode(raw)
        except msgspec.DecodeError:
            return bytes(raw)
        if not isinstance(obj, dict):
            return bytes(raw)
        if self.id and "id" in obj:
            obj["id"] = self.id
        if _said_nothing(obj):
            return None
        return _encode(obj)

    def payloads(self, payloads: list[bytes]) -> list[bytes]:
        """A read's payloads, each stitched (those dropped left out)."""
        out = []
        for payload in payloads:
            stitched = self(payload)
            if stitched is not None:
                out.append(stitched)
        return out


def _said_nothing(chunk: dict[str, Any]) -> bool:
    """Take the role out of each delta; True when the chunk then says nothing at all."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    empty = True
    for choice in choices:
        if not isinstance(choice, dict):
            return False
        delta = choice.get("delta")
        if isinstance(delta, dict):
            delta.pop("role", None)
            if any(v not in _EMPTY for v in delta.values()):
                empty = False
        if choice.get("finish_reason") is not None:
            empty = False
    return empty and chunk.get("usage") is None
