"""A turn continued on another runner (issue 27, point 2): the answer so far read out of the
chunks the client got, the request that asks a backend to continue it, and the continuation's
chunks made the first part's own (one id, one role delta), so its client sees one answer.

Pure: bytes in, bytes out; read only after a fault, never per chunk of a turn that went well.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.apis.chunks import chunk_decoder


def answer_so_far(chunks: list[Any]) -> tuple[str, str] | None:
    """(the first chunk's ``id``, the text of the answer so far) from a streamed turn's chunks
    (or a whole completion), or None when it cannot be continued: a tool call had begun, it
    already finished, nothing readable came, or there is no text."""
    text: list[str] = []
    first_id = ""
    for raw in chunks:
        try:
            chunk = chunk_decoder.decode(raw)
            head = _head_decoder.decode(raw)
        except msgspec.DecodeError:
            return None
        if not first_id and isinstance(head.id, str):
            first_id = head.id
        for choice in chunk.choices or []:
            delta = choice.delta or choice.message
            if delta is None:
                continue
            if delta.tool_calls:
                return None
            if isinstance(delta.content, str):
                text.append(delta.content)
            if choice.finish_reason is not None:
                return None  # whole already: nothing to continue
    answer = "".join(text)
    return (first_id, answer) if answer else None


class _Head(msgspec.Struct):
    id: Any = None


_head_decoder = msgspec.json.Decoder(_Head)


def continuation_body(body: bytes, so_far: str) -> bytes:
    """The chat body that asks a backend to continue ``so_far``: the same request, its
    messages ending with the answer so far as an assistant message."""
    obj = msgspec.json.decode(body)
    messages = list(obj.get("messages") or [])
    messages.append({"role": "assistant", "content": so_far})
    obj["messages"] = messages
    return msgspec.json.encode(obj)


class Stitch:
    """A continuation's chunks as the first part's own: its ``id``, and no second role delta
    (a chunk that carried only the role is dropped)."""

    __slots__ = ("first_id",)

    def __init__(self, first_id: str) -> None:
        self.first_id = first_id

    def __call__(self, raw: Any) -> bytes | None:
        try:
            obj = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return bytes(raw)
        if not isinstance(obj, dict):
            return bytes(raw)
        if self.first_id and "id" in obj:
            obj["id"] = self.first_id
        choices = obj.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                delta = choice.get("delta") if isinstance(choice, dict) else None
                if isinstance(delta, dict) and "role" in delta:
                    del delta["role"]
                    if not any(v for v in delta.values()) and choice.get("finish_reason") is None:
                        if len(choices) == 1 and obj.get("usage") is None:
                            return None  # it said only who speaks: already said
        return msgspec.json.encode(obj)
