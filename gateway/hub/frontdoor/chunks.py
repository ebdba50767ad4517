"""The schema of an OpenAI ``chat.completion.chunk`` (or a whole ``chat.completion``) as the
front door's translations read it: only the fields they use, every one optional. Pure."""

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
