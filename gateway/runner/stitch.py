"""An answer cut by a backend's fault, read out of its relayed chunks, and the continuation's
chunks stitched onto it; pure: msgspec, no I/O.

Read only after a fault, never per chunk on the normal path: ``answer_so_far`` reads the payloads
a turn relayed (kept by reference) and says whether the answer can be continued (text only: no
tool call begun, one choice, no reasoning), ``continuation_body`` asks for the rest (the answer so
far as a final assistant message, or appended to the one a continued turn already ends with) and
``Stitch`` makes the continuation's chunks the first part's own: its ``id``, and no second role
delta (a chunk left with nothing to say is dropped), so the Server sees one answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec


class _Delta(msgspec.Struct):
    content: Any = None
    tool_calls: Any = None
    function_call: Any = None
    reasoning_content: Any = None
    reasoning: Any = None


class _Choice(msgspec.Struct):
    index: Any = 0
    delta: _Delta | None = None
    finish_reason: Any = None


class _Chunk(msgspec.Struct):
    id: Any = None
    choices: list[_Choice] | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


@dataclass(frozen=True)
class SoFar:
    """What a cut answer said: its chunks' ``id``, its text, and whether it had finished."""

    id: str | None
    text: str
    finished: bool


def answer_so_far(relayed: list[list[bytes]]) -> SoFar | None:
    """The answer in ``relayed`` (each read's payloads), or None when it cannot be continued:
    a tool call begun, a second choice, reasoning, or a payload of another shape."""
    chunk_id: str | None = None
    parts: list[str] = []
    finished = False
    for payloads in relayed:
        for payload in payloads:
            try:
                chunk = _chunk_decoder.decode(payload)
            except msgspec.DecodeError:
                return None
            if chunk_id is None and isinstance(chunk.id, str):
                chunk_id = chunk.id
            for choice in chunk.choices or ():
                if choice.index != 0:
                    return None
                if choice.finish_reason is not None:
                    finished = True
                delta = choice.delta
                if delta is None:
                    continue
                if delta.tool_calls or delta.function_call:
                    return None
                if delta.reasoning_content or delta.reasoning:
                    return None
                if isinstance(delta.content, str):
                    parts.append(delta.content)
                elif delta.content is not None:
                    return None
    return SoFar(chunk_id, "".join(parts), finished)


def continuation_body(body: bytes, text: str) -> bytes | None:
    """``body`` asking for the rest of an answer that so far says ``text``: its messages end
    with that assistant message (appended to the one already there, when the turn was itself a
    continuation). None when ``body`` has no list of messages."""
    try:
        obj = _decode(body)
    except msgspec.DecodeError:
        return None
    messages = obj.get("messages") if isinstance(obj, dict) else None
    if not isinstance(messages, list):
        return None
    last = messages[-1] if messages else None
    if isinstance(last, dict) and last.get("role") == "assistant":
        before = last.get("content")
        if not isinstance(before, str):
            return None
        messages[-1] = {**last, "content": before + text}
    else:
        messages.append({"role": "assistant", "content": text})
    return _encode(obj)


class Stitch:
    """A continuation's payloads made the cut answer's: the first part's ``id``, no role delta
    (a chunk then empty, with no finish and no usage, is dropped). Per chunk, but only on the
    continuation of a turn whose backend failed."""

    __slots__ = ("id",)

    def __init__(self, chunk_id: str | None) -> None:
        self.id = chunk_id

    def __call__(self, payloads: list[bytes]) -> list[bytes]:
        out = []
        for payload in payloads:
            try:
                obj = _decode(payload)
            except msgspec.DecodeError:
                out.append(payload)
                continue
            if not isinstance(obj, dict):
                out.append(payload)
                continue
            if self.id is not None and "id" in obj:
                obj["id"] = self.id
            if _drop_role(obj):
                continue
            out.append(_encode(obj))
        return out


def _drop_role(chunk: dict[str, Any]) -> bool:
    """Remove the role from each delta; True when the chunk then says nothing at all."""
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
            if any(v not in (None, "", [], {}) for v in delta.values()):
                empty = False
        if choice.get("finish_reason") is not None:
            empty = False
    return empty and chunk.get("usage") is None
