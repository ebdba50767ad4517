"""The output items of a Responses answer as a stream builds them: pure.

A ``TextItem`` is a ``message`` (its ``output_text`` part) or a ``reasoning`` item (its
``reasoning_text`` part); a ``CallItem`` is a ``function_call`` or ``custom_tool_call`` grown
from one chat tool call. Each keeps its pieces and renders itself as an item at any status.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.apis.responses.tools import ToolName

__all__ = ["CallItem", "TextItem"]

_encoder = msgspec.json.Encoder()


class TextItem:
    """An output item with one text part: a ``message`` (output_text) or ``reasoning``."""

    __slots__ = ("kind", "item_id", "output_index", "pieces", "delta_head")

    def __init__(self, kind: str, item_id: str, output_index: int) -> None:
        self.kind = kind  # "message" or "reasoning"
        self.item_id = item_id
        self.output_index = output_index
        self.pieces: list[str] = []
        # the bytes of a delta event after its sequence number, up to its delta
        self.delta_head = (
            b',"item_id":'
            + _encoder.encode(item_id)
            + b',"output_index":'
            + str(output_index).encode()
            + b',"content_index":0,"delta":'
        )

    @property
    def part_type(self) -> str:
        return "output_text" if self.kind == "message" else "reasoning_text"

    def part(self, text: str) -> dict[str, Any]:
        if self.kind == "message":
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "reasoning_text", "text": text}

    def item(self, status: str, text: str | None) -> dict[str, Any]:
        content: list[dict[str, Any]] = [] if text is None else [self.part(text)]
        if self.kind == "message":
            return {
                "id": self.item_id,
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": content,
            }
        return {
            "id": self.item_id,
            "type": "reasoning",
            "status": status,
            "summary": [],
            "content": content,
        }


class CallItem:
    """A ``function_call`` (or ``custom_tool_call``) item, from one chat tool call index."""

    __slots__ = (
        "item_id",
        "output_index",
        "call_id",
        "wanted_id",
        "chat_name",
        "pieces",
        "added",
        "tool",
    )

    def __init__(self) -> None:
        self.item_id = ""
        self.output_index = -1
        self.call_id: str | None = None
        self.wanted_id: str | None = None  # the backend's id for the call
        self.chat_name = ""
        self.pieces: list[str] = []
        self.added = False
        self.tool: ToolName | None = None

    @property
    def custom(self) -> bool:
        return self.tool is not None and self.tool.kind == "custom"

    def arguments(self) -> str:
        return "".join(self.pieces)

    def custom_input(self) -> str:
        arguments = self.arguments()
        try:
            decoded = msgspec.json.decode(arguments)
        except (msgspec.DecodeError, RecursionError):
            return arguments
        if isinstance(decoded, dict) and isinstance(decoded.get("input"), str):
            return str(decoded["input"])
        return arguments

    def item(self, status: str, done: bool) -> dict[str, Any]:
        name = self.tool.name if self.tool is not None else self.chat_name
        if self.custom:
            return {
                "id": self.item_id,
                "type": "custom_tool_call",
                "status": status,
                "call_id": self.call_id,
                "name": name,
                "input": self.custom_input() if done else "",
            }
        item = {
            "id": self.item_id,
            "type": "function_call",
            "status": status,
            "call_id": self.call_id,
            "name": name,
            "arguments": self.arguments() if done else "",
        }
        if self.tool is not None and self.tool.namespace is not None:
            item["namespace"] = self.tool.namespace
        return item
