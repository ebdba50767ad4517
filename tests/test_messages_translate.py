"""The Anthropic Messages translation (gateway.hub.frontdoor.messages), no sockets: requests to
chat bodies, chat chunks to SSE events and whole messages, read back by the ``anthropic`` SDK's
own parsers (a MockTransport hands it our bytes; no network)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2
import msgspec
import pytest
from anthropic.types import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.hub.frontdoor.messages import (
    MessagesError,
    MessagesStream,
    count_tokens,
    error_body,
    error_type_for_status,
    fold,
    new_message_id,
    to_chat,
    translate,
)

# -- helpers ---------------------------------------------------------------------------------


class FakeAnthropic:
    """A real ``anthropic.Anthropic`` client whose transport answers with given bytes."""

    def __init__(self) -> None:
        self.status = 200
        self.content_type = "application/json"
        self.body = b""
        self.sent: list[bytes] = []
        transport = httpx2.MockTransport(self._handle)
        self.client = anthropic.Anthropic(
            api_key="test",
            base_url="http://hub.test",
            http_client=httpx2.Client(transport=transport),
            max_retries=0,
        )

    def _handle(self, request: httpx2.Request) -> httpx2.Response:
        self.sent.append(request.read())
        return httpx2.Response(
            self.status, headers={"content-type": self.content_type}, content=self.body
        )

    def stream(self, sse: bytes) -> Message:
        self.status, self.content_type, self.body = 200, "text/event-stream", sse
        with self.client.messages.stream(
            model="m", max_tokens=100, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            return stream.get_final_message()

    def create(self, body: bytes, status: int = 200) -> Message:
        self.status, self.content_type, self.body = status, "application/json", body
        return self.client.messages.create(
            model="m", max_tokens=100, messages=[{"role": "user", "content": "hi"}]
        )


_SDK = FakeAnthropic()


def chat(body: dict[str, Any]) -> dict[str, Any]:
    """to_chat of a Messages body (a dict), its chat body decoded."""
    out, _stream, _model = to_chat(json.dumps(body).encode())
    decoded: dict[str, Any] = json.loads(out)
    return decoded


def base(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    body.update(fields)
    return body


def refused(body: bytes | dict[str, Any]) -> MessagesError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(MessagesError) as info:
        to_chat(raw)
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    return info.value


def sse_events(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """Our SSE bytes as (event, data) pairs, each event checked well-formed."""
    assert data.endswith(b"\n\n") or not data
    events = []
    for raw in data.split(b"\n\n")[:-1]:
        lines = raw.split(b"\n")
        assert len(lines) == 2, raw
        assert lines[0].startswith(b"event: ") and lines[1].startswith(b"data: "), raw
        name = lines[0][7:].decode()
        payload = json.loads(lines[1][6:])
        assert payload["type"] == name
        events.append((name, payload))
    return events


def check_block_order(events: list[tuple[str, dict[str, Any]]]) -> None:
    """As Anthropic streams: message_start first, indices 0, 1, 2..., one block open at a time,
    every block closed, then message_delta and message_stop."""
    names = [name for name, _ in events]
    assert names[0] == "message_start"
    assert names[-2:] == ["message_delta", "message_stop"]
    open_index: int | None = None
    started = 0
    for name, payload in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None
            assert payload["index"] == started
            open_index = started
            started += 1
        elif name == "content_block_delta":
            assert payload["index"] == open_index
        elif name == "content_block_stop":
            assert payload["index"] == open_index
            open_index = None
        else:
            assert name == "ping", name
    assert open_index is None


def run_stream(chunks: list[bytes], **kwargs: Any) -> bytes:
    stream = MessagesStream("m", kwargs.pop("message_id", "msg_test"), **kwargs)
    return b"".join(stream.chunk(c) for c in chunks) + stream.done()


def text_of(message: Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def tools_of(message: Message) -> list[tuple[str, str, Any]]:
    return [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"]


def enc(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


# -- errors ------------------------------------------------------------------------------------


def test_error_body_shape() -> None:
    assert json.loads(error_body("not_found_error", "no such model")) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "no such model"},
    }


@pytest.mark.parametrize(
    ("status", "type_"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (503, "overloaded_error"),
        (529, "overloaded_error"),
        (500, "api_error"),
        (502, "api_error"),
    ],
)
def test_error_type_for_status(status: int, type_: str) -> None:
    assert error_type_for_status(status) == type_


@pytest.mark.parametrize(
    ("status", "exc"),
    [
        (400, anthropic.BadRequestError),
        (401, anthropic.AuthenticationError),
        (404, anthropic.NotFoundError),
        (429, anthropic.RateLimitError),
        (529, anthropic.InternalServerError),
    ],
)
def test_error_body_read_by_the_sdk(status: int, exc: type[Exception]) -> None:
    body = error_body(error_type_for_status(status), "why it failed")
    with pytest.raises(exc) as info:
        _SDK.create(body, status=status)
    assert isinstance(info.value, anthropic.APIStatusError)
    assert info.value.body == json.loads(body)
    assert "why it failed" in str(info.value)


def test_messages_error_carries_its_answer() -> None:
    err = MessagesError(404, "not_found_error", "model 'x' not found")
    assert (err.status, err.type, err.message) == (404, "not_found_error", "model 'x' not found")
    assert json.loads(err.body())["error"]["type"] == "not_found_error"


# -- request: what is refused -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "names"),
    [
        (b"", "empty"),
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b'{"a": "\xff"}', "not valid JSON"),
        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
    ],
)
def test_refuses_what_is_not_a_json_object(body: bytes, names: str) -> None:
    assert names in refused(body).message


def test_refuses_deep_nesting_inside_an_object() -> None:
    deep = b'{"max_tokens": 5, "messages": [], "metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert "nested too deeply" in refused(deep).message


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"max_tokens": None}, "max_tokens: Field required"),
        ({"messages": None}, "messages: Field required"),
        ({"max_tokens": "64"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"messages": "hi"}, "messages: Input should be an array"),
        ({"messages": ["hi"]}, "messages.0"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "system", "content": [{"type": "image"}]}]},
            "messages.0.content.0: Input should be a text block",
        ),
        ({"messages": [{"role": "system", "content": 5}]}, "messages.0.content: Input should"),
        ({"messages": [{"role": "user"}]}, "messages.0.content: Field required"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": [5]}]}, "messages.0.content.0"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages.0.content.0.type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages.0.content.0.text",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]},
                ]
            },
            "messages.1.content.0.id",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}
                ]
            },
            "only allowed in assistant messages",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
            "messages.0.content.0.tool_use_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}],
                    }
                ]
            },
            "messages.0.content.0.source.type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}],
                    }
                ]
            },
            "messages.0.content.0.source.media_type",
        ),
        ({"model": 5}, "model: Input should be a string"),
        ({"system": 5}, "system"),
        ({"system": [{"type": "text"}]}, "system.0"),
        ({"stream": "yes"}, "stream"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": []}, "top_p"),
        ({"top_k": 2.5}, "top_k"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"stop_sequences": ["a", 1]}, "stop_sequences"),
        ({"tools": {"name": "f"}}, "tools: Input should be an array"),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"tools": [{"input_schema": {}}]}, "tools.0.name"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ],
)
def test_refuses_invalid_fields_naming_them(change: dict[str, Any], field: str) -> None:
    body = base()
    for key, value in change.items():
        if value is None:
            del body[key]
        else:
            body[key] = value
    assert field in refused(body).message


# -- request: what is translated -----------------------------------------------------------------


def test_minimal_request() -> None:
    out, stream, model = to_chat(json.dumps(base()).encode())
    assert (stream, model) == (False, "m")
    assert json.loads(out) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 64,
        "stream": False,
    }


def test_model_absent_is_none_and_left_out() -> None:
    body = base()
    del body["model"]
    out, _stream, model = to_chat(json.dumps(body).encode())
    assert model is None
    assert "model" not in json.loads(out)


def test_stream_asks_for_usage() -> None:
    out, stream, _model = to_chat(json.dumps(base(stream=True)).encode())
    assert stream is True
    body = json.loads(out)
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_system_string_and_blocks() -> None:
    assert chat(base(system="be brief"))["messages"][0] == {"role": "system", "content": "be brief"}
    blocks = [
        {"type": "text", "text": "one", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "two"},
    ]
    assert chat(base(system=blocks))["messages"][0] == {"role": "system", "content": "one\ntwo"}
    assert chat(base(system=""))["messages"] == [{"role": "user", "content": "hi"}]


def test_text_blocks_become_a_string() -> None:
    content = [
        {"type": "text", "text": "first", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "second"},
    ]
    messages = chat(base(messages=[{"role": "user", "content": content}]))["messages"]
    assert messages == [{"role": "user", "content": "first\nsecond"}]


def test_images_become_image_url_parts() -> None:
    content = [
        {"type": "text", "text": "what is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
    ]
    messages = chat(base(messages=[{"role": "user", "content": content}]))["messages"]
    assert messages == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
            ],
        }
    ]


def test_tool_use_becomes_tool_calls() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"c": "P"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}},
            ],
        },
    ]
    assistant = chat(base(messages=messages))["messages"][1]
    assert assistant == {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "toolu_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"c":"P"}'},
            },
            {
                "id": "toolu_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    }


def test_tool_use_only_has_null_content() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
        },
    ]
    assert chat(base(messages=messages))["messages"][1]["content"] is None


def test_tool_results_come_first_as_tool_messages() -> None:
    messages = [
        {"role": "user", "content": "weather and time?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "here you go"},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "noon"}, {"type": "text", "text": "UTC"}],
                    "cache_control": {"type": "ephemeral"},
                },
            ],
        },
    ]
    out = chat(base(messages=messages))["messages"]
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "tool", "user"]
    assert out[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert out[3] == {"role": "tool", "tool_call_id": "toolu_2", "content": "noon\nUTC"}
    assert out[4] == {"role": "user", "content": "here you go"}


def test_tool_result_only_adds_no_user_message() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
    ]
    out = chat(base(messages=messages))["messages"]
    assert out[-1] == {"role": "tool", "tool_call_id": "t", "content": ""}


def test_tool_result_error_is_marked() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": True}
            ],
        },
    ]
    assert chat(base(messages=messages))["messages"][-1]["content"] == "Error: boom"


def test_tool_result_images_follow_in_a_user_message() -> None:
    image = {"type": "image", "source": {"type": "url", "url": "https://x.test/s.png"}}
    messages = [
        {"role": "user", "content": "screenshot"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t",
                    "content": [{"type": "text", "text": "taken"}, image],
                }
            ],
        },
    ]
    out = chat(base(messages=messages))["messages"]
    assert out[-2] == {"role": "tool", "tool_call_id": "t", "content": "taken"}
    assert out[-1] == {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "https://x.test/s.png"}}],
    }


def test_system_messages_in_the_conversation_stay_in_place() -> None:
    """Claude Code (2.1.x) sends its environment context as a ``system`` message after the
    first user turn, text blocks with ``cache_control``: a chat system message in its place."""
    context = [{"type": "text", "text": "# Environment", "cache_control": {"type": "ephemeral"}}]
    messages = [
        {"role": "system", "content": "first"},
        {"role": "user", "content": "say hi"},
        {"role": "system", "content": context},
        {"role": "system", "content": "more"},
        {"role": "system", "content": []},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
    ]
    out = chat(base(system="top", messages=messages))["messages"]
    assert out == [
        {"role": "system", "content": "top\nfirst"},
        {"role": "user", "content": "say hi"},
        {"role": "system", "content": "# Environment\nmore"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
    ]
    body = base(messages=[{"role": "user", "content": "a"}, {"role": "system", "content": "b" * 8}])
    assert count_tokens(json.dumps(body).encode()) == 3  # ceil(9 / 4): system text counts


def test_consecutive_turns_of_a_role_are_merged() -> None:
    image = {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}}
    messages = [
        {"role": "user", "content": "one"},
        {"role": "user", "content": [{"type": "text", "text": "two"}]},
        {"role": "assistant", "content": "thinking aloud"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]},
        {"role": "user", "content": "then"},
        {"role": "user", "content": [image]},
    ]
    out = chat(base(messages=messages))["messages"]
    assert out == [
        {"role": "user", "content": "one\ntwo"},
        {
            "role": "assistant",
            "content": "thinking aloud",
            "tool_calls": [
                {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "t", "content": "r"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "then"},
                {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}},
            ],
        },
    ]


def test_documents_with_text_are_text() -> None:
    content = [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}},
        {
            "type": "document",
            "source": {"type": "base64", "media_type": "application/pdf", "data": "JVB"},
        },
        {"type": "text", "text": "summarize"},
    ]
    out = chat(base(messages=[{"role": "user", "content": content}]))["messages"]
    assert out == [{"role": "user", "content": "doc\nsummarize"}]


def test_tools_and_server_tools() -> None:
    tools = [
        {
            "name": "get_weather",
            "description": "Weather of a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
            "cache_control": {"type": "ephemeral"},
        },
        {"type": "custom", "name": "noop", "input_schema": {"type": "object"}},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        {"type": "bash_20250124", "name": "bash"},
        {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
    ]
    out = chat(base(tools=tools))
    assert out["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        },
        {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
    ]


def test_deferred_tools_are_left_out() -> None:
    """Claude Code 2.1.x sends a ``DeferredToolPlaceholder`` with ``defer_loading: true``."""
    placeholder = {
        "name": "DeferredToolPlaceholder",
        "description": "Reserved placeholder that keeps deferred tool loading active",
        "input_schema": {"type": "object", "properties": {}},
        "defer_loading": True,
    }
    out = chat(base(tools=[TOOL, placeholder, {**TOOL, "name": "g", "defer_loading": False}]))
    assert [t["function"]["name"] for t in out["tools"]] == ["f", "g"]
    only = chat(base(tools=[placeholder], tool_choice={"type": "auto"}))
    assert "tools" not in only and "tool_choice" not in only


def test_only_server_tools_send_no_tools_nor_choice() -> None:
    out = chat(
        base(
            tools=[{"type": "web_search_20250305", "name": "web_search"}],
            tool_choice={"type": "any"},
        )
    )
    assert "tools" not in out and "tool_choice" not in out


TOOL = {"name": "f", "input_schema": {"type": "object"}}


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any"}, "required", None),
        ({"type": "none"}, "none", None),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}, None),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
        ({"type": "any", "disable_parallel_tool_use": False}, "required", None),
        ({"type": "tool", "name": "f", "disable_parallel_tool_use": True}, None, False),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: Any, parallel: bool | None) -> None:
    out = chat(base(tools=[TOOL], tool_choice=choice))
    if expected is not None:
        assert out["tool_choice"] == expected
    assert out.get("parallel_tool_calls") == parallel


def test_sampling_fields() -> None:
    out = chat(
        base(max_tokens=7, stop_sequences=["END", "###"], temperature=0.2, top_p=0.9, top_k=40)
    )
    assert (out["max_tokens"], out["stop"]) == (7, ["END", "###"])
    assert (out["temperature"], out["top_p"], out["top_k"]) == (0.2, 0.9, 40)
    assert "stop" not in chat(base(stop_sequences=[]))


def test_ignored_fields_are_never_an_error() -> None:
    out = chat(
        base(
            thinking={"type": "enabled", "budget_tokens": 1024},
            metadata={"user_id": "u1"},
            service_tier="auto",
            container="c1",
            mcp_servers=[{"type": "url", "url": "https://x"}],
            cache_control={"type": "ephemeral"},
            something_new={"x": 1},
        )
    )
    assert set(out) == {"model", "messages", "max_tokens", "stream"}


def test_a_request_the_sdk_builds_is_translated() -> None:
    """The body a real anthropic client sends for a tool round trip passes to_chat."""
    _SDK.sent.clear()
    message = json.loads(fold([b'{"choices":[{"delta":{"content":"ok"}}]}'], "m", "msg_1"))
    _SDK.status, _SDK.content_type, _SDK.body = 200, "application/json", enc(message)
    _SDK.client.messages.create(
        model="m",
        max_tokens=50,
        system=[{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_9", "name": "w", "input": {"c": 1}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]},
        ],
        tools=[{"name": "w", "input_schema": {"type": "object"}}],
        tool_choice={"type": "auto"},
        metadata={"user_id": "u"},
        stop_sequences=["END"],
        thinking={"type": "enabled", "budget_tokens": 1024},
        cache_control={"type": "ephemeral"},
    )
    out, stream, model = to_chat(_SDK.sent[-1])
    body = json.loads(out)
    assert (stream, model) == (False, "m")
    assert body["stop"] == ["END"] and "thinking" not in body
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "tool"]
    assert body["messages"][2]["tool_calls"][0]["function"] == {"name": "w", "arguments": '{"c":1}'}


# -- count_tokens ------------------------------------------------------------------------------


def test_count_tokens_is_chars_over_four() -> None:
    body = {"model": "m", "system": "x" * 8, "messages": [{"role": "user", "content": "y" * 12}]}
    assert count_tokens(json.dumps(body).encode()) == 5


def test_count_tokens_counts_tools_blocks_and_images() -> None:
    plain = {"messages": [{"role": "user", "content": "hello"}]}
    richer = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hello"},
                    {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}},
                ],
            },
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}],
            },
        ],
        "tools": [{"name": "f", "description": "does f", "input_schema": {"type": "object"}}],
    }
    small = count_tokens(json.dumps(plain).encode())
    big = count_tokens(json.dumps(richer).encode())
    assert small == 2
    assert big > small + 1600


def test_count_tokens_needs_no_max_tokens_but_checks_messages() -> None:
    assert count_tokens(b'{"model": "m", "messages": []}') == 0
    with pytest.raises(MessagesError) as info:
        count_tokens(b'{"model": "m"}')
    assert info.value.status == 400 and "messages" in info.value.message
    with pytest.raises(MessagesError):
        count_tokens(b"nope")


def test_translate_gives_the_estimate_with_the_body() -> None:
    body = json.dumps(base(system="s" * 40)).encode()
    request = translate(body)
    assert request.input_tokens_estimate == count_tokens(body) == 11
    assert (request.body, request.stream, request.model) == to_chat(body)


def test_translate_body_for_another_model() -> None:
    request = translate(json.dumps(base(model="claude-sonnet-4-5", stream=True)).encode())
    assert request.body_for("claude-sonnet-4-5") == request.body
    mapped = json.loads(request.body_for("qwen3:8b"))
    assert mapped == {**json.loads(request.body), "model": "qwen3:8b"}
    assert next(iter(mapped)) == "model"
    unnamed = translate(json.dumps({"max_tokens": 5, "messages": []}).encode())
    assert unnamed.model is None
    assert json.loads(unnamed.body_for("qwen3:8b"))["model"] == "qwen3:8b"


# -- stream: the basics --------------------------------------------------------------------------


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> bytes:
    choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    return enc({"object": "chat.completion.chunk", "choices": [choice], **extra})


def usage_chunk(prompt: int, completion: int) -> bytes:
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    return enc({"object": "chat.completion.chunk", "choices": [], "usage": usage})


def test_text_stream_events() -> None:
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hel"}),
        chunk({"content": "lo"}),
        chunk({}, "stop"),
        usage_chunk(5, 2),
    ]
    sse = run_stream(chunks, input_tokens_estimate=4)
    events = sse_events(sse)
    check_block_order(events)
    assert events[0][1]["message"] == {
        "id": "msg_test",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 4, "output_tokens": 0},
    }
    assert [e[1]["delta"] for e in events if e[0] == "content_block_delta"] == [
        {"type": "text_delta", "text": "Hel"},
        {"type": "text_delta", "text": "lo"},
    ]
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 2, "input_tokens": 5},
    }
    message = _SDK.stream(sse)
    assert text_of(message) == "Hello"
    assert message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (5, 2)
    assert message.id == "msg_test"


def test_each_chunk_gives_its_events_at_once() -> None:
    stream = MessagesStream("m", "msg_1")
    first = stream.chunk(chunk({"role": "assistant", "content": ""}))
    assert [e for e, _ in sse_events(first)] == ["message_start"]
    assert [e for e, _ in sse_events(stream.chunk(chunk({"content": "a"})))] == [
        "content_block_start",
        "content_block_delta",
    ]
    assert [e for e, _ in sse_events(stream.chunk(chunk({"content": "b"})))] == [
        "content_block_delta"
    ]
    assert stream.chunk(chunk({}, "stop")) == b""
    assert [e for e, _ in sse_events(stream.done())] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert stream.done() == b"" and stream.chunk(chunk({"content": "late"})) == b""


def test_ping_start_and_empty_answer() -> None:
    stream = MessagesStream("m", "msg_1", 9)
    assert stream.ping() == b'event: ping\ndata: {"type":"ping"}\n\n'
    start = stream.start()
    assert sse_events(start)[0][1]["message"]["usage"] == {"input_tokens": 9, "output_tokens": 0}
    assert stream.start() == b""
    rest = stream.chunk(chunk({"role": "assistant"}))
    assert rest == b""
    sse = stream.ping() + start + stream.ping() + stream.done()
    message = _SDK.stream(sse)
    assert message.content == [] and message.stop_reason == "end_turn"
    assert message.usage.output_tokens == 0


def test_undecodable_chunks_are_skipped() -> None:
    stream = MessagesStream("m", "msg_1")
    for raw in [b"", b"not json", b"[DONE]", b'{"choices": 5}', b'{"choices": [1]}', b"{" * 3000]:
        assert stream.chunk(raw) == b""
    sse = stream.chunk(chunk({"content": "ok"})) + stream.done()
    assert text_of(_SDK.stream(sse)) == "ok"


def test_error_ends_the_stream_and_the_sdk_raises() -> None:
    stream = MessagesStream("m", "msg_1")
    sse = stream.chunk(chunk({"content": "part"}))
    error = stream.error("the runner went away", "overloaded_error")
    assert error.startswith(b"event: error\ndata: ")
    assert json.loads(error.split(b"data: ", 1)[1]) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the runner went away"},
    }
    assert stream.done() == b"" and stream.chunk(chunk({"content": "x"})) == b""
    with pytest.raises(anthropic.APIStatusError) as info:
        _SDK.stream(sse + error)
    assert "the runner went away" in str(info.value)


@pytest.mark.parametrize(
    ("finish", "extra", "reason", "sequence"),
    [
        ("stop", {}, "end_turn", None),
        ("length", {}, "max_tokens", None),
        ("content_filter", {}, "refusal", None),
        ("stop", {"stop_reason": "###"}, "stop_sequence", "###"),
        ("stop", {"stop_reason": 128001}, "end_turn", None),
        (None, {}, "end_turn", None),
        ("something_else", {}, "end_turn", None),
    ],
)
def test_stop_reasons(
    finish: str | None, extra: dict[str, Any], reason: str, sequence: Any
) -> None:
    choice = {"index": 0, "delta": {}, "finish_reason": finish, **extra}
    chunks = [chunk({"content": "x"}), enc({"choices": [choice]})]
    message = _SDK.stream(run_stream(chunks))
    assert (message.stop_reason, message.stop_sequence) == (reason, sequence)
    whole = _SDK.create(fold(chunks, "m", "msg_f"))
    assert (whole.stop_reason, whole.stop_sequence) == (reason, sequence)


def test_tool_calls_with_stop_finish_are_tool_use() -> None:
    call = {"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for finish in ("stop", None, "tool_calls", "function_call"):
        chunks = [chunk({"tool_calls": [call]}), chunk({}, finish)]
        assert _SDK.stream(run_stream(chunks)).stop_reason == "tool_use"
        assert _SDK.create(fold(chunks, "m", "msg_f")).stop_reason == "tool_use"
    chunks = [chunk({"tool_calls": [call]}), chunk({}, "length")]
    assert _SDK.stream(run_stream(chunks)).stop_reason == "max_tokens"


def test_output_tokens_without_usage_count_the_pieces() -> None:
    chunks = [
        chunk({"content": "a"}),
        chunk({"content": "b"}),
        chunk({"content": ""}),
        chunk({}, "stop"),
    ]
    message = _SDK.stream(run_stream(chunks, input_tokens_estimate=12))
    assert (message.usage.input_tokens, message.usage.output_tokens) == (12, 2)
    whole = _SDK.create(fold(chunks, "m", "msg_f", input_tokens_estimate=12))
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (12, 2)


def test_usage_inside_the_finish_chunk() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    chunks = [chunk({"content": "a"}), chunk({}, "stop", usage=usage)]
    message = _SDK.stream(run_stream(chunks))
    assert (message.usage.input_tokens, message.usage.output_tokens) == (3, 1)


def test_tool_calls_without_ids_get_stable_distinct_ones() -> None:
    calls = [
        chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": '{"a":1}'}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"name": "g", "arguments": "{}"}}]}),
        chunk({}, "tool_calls"),
    ]
    first = tools_of(_SDK.stream(run_stream(calls, message_id="msg_abc")))
    again = tools_of(_SDK.stream(run_stream(calls, message_id="msg_abc")))
    assert first == again
    assert [t[0] for t in first] == ["toolu_abc_0", "toolu_abc_1"]
    assert [(t[1], t[2]) for t in first] == [("f", {"a": 1}), ("g", {})]
    folded = tools_of(_SDK.create(fold(calls, "m", "msg_abc")))
    assert folded == first


def test_interleaved_tool_calls_are_held_until_the_open_one_completes() -> None:
    def piece(index: int, arguments: str, name: str | None = None) -> bytes:
        function: dict[str, Any] = {"arguments": arguments}
        call: dict[str, Any] = {"index": index, "function": function}
        if name:
            call["id"] = f"call_{index}"
            function["name"] = name
        return chunk({"tool_calls": [call]})

    chunks = [
        chunk({"content": "Two calls."}),
        piece(0, '{"city":', "weather"),
        piece(1, '{"tz":', "time"),
        chunk({"content": " And text."}),
        piece(1, '"UTC"}'),
        piece(0, '"Paris"}'),
        chunk({}, "tool_calls"),
    ]
    sse = run_stream(chunks)
    events = sse_events(sse)
    check_block_order(events)
    message = _SDK.stream(sse)
    assert [b.type for b in message.content] == ["text", "tool_use", "tool_use", "text"]
    assert tools_of(message) == [
        ("call_0", "weather", {"city": "Paris"}),
        ("call_1", "time", {"tz": "UTC"}),
    ]
    assert text_of(message) == "Two calls. And text."


def test_calls_without_an_index_are_told_apart_by_id() -> None:
    def whole(call_id: str, name: str, arguments: str) -> dict[str, Any]:
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    chunks = [
        chunk({"tool_calls": [whole("call_a", "f", '{"x":1}'), whole("call_b", "g", "{}")]}),
        chunk({"tool_calls": [whole("call_c", "h", '{"y":2}')]}),
        chunk({}, "tool_calls"),
    ]
    expected = [("call_a", "f", {"x": 1}), ("call_b", "g", {}), ("call_c", "h", {"y": 2})]
    assert tools_of(_SDK.stream(run_stream(chunks))) == expected
    assert tools_of(_SDK.create(fold(chunks, "m", "msg_f"))) == expected


def test_a_call_whose_name_comes_late_waits_for_it() -> None:
    chunks = [
        chunk({"tool_calls": [{"index": 0, "id": "c0", "function": {"arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": '{"a":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "2}"}}]}),
        chunk({}, "tool_calls"),
    ]
    assert tools_of(_SDK.stream(run_stream(chunks))) == [("c0", "f", {"a": 2})]


def test_arguments_sent_as_an_object_and_text_as_parts() -> None:
    call = {"index": 0, "id": "c", "function": {"name": "f", "arguments": {"a": [1, 2]}}}
    chunks = [
        chunk({"content": [{"type": "text", "text": "hi"}]}),
        chunk({"tool_calls": [call]}),
        chunk({}, "tool_calls"),
    ]
    message = _SDK.stream(run_stream(chunks))
    assert text_of(message) == "hi"
    assert tools_of(message) == [("c", "f", {"a": [1, 2]})]


def test_reasoning_content_is_not_text() -> None:
    chunks = [
        chunk({"role": "assistant", "content": None, "reasoning_content": "think"}),
        chunk({"content": None, "reasoning": "more"}),
        chunk({"content": "answer"}),
        chunk({}, "stop"),
    ]
    assert text_of(_SDK.stream(run_stream(chunks))) == "answer"
    assert text_of(_SDK.create(fold(chunks, "m", "msg_f"))) == "answer"


def test_other_choices_are_ignored() -> None:
    chunks = [
        enc({"choices": [{"index": 1, "delta": {"content": "other"}}]}),
        enc({"choices": [{"delta": {"content": "mine"}}]}),
    ]
    assert text_of(_SDK.stream(run_stream(chunks))) == "mine"


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "choices": st.lists(
                    st.fixed_dictionaries(
                        {},
                        optional={
                            "index": JSONISH,
                            "finish_reason": JSONISH,
                            "stop_reason": JSONISH,
                            "delta": st.fixed_dictionaries(
                                {},
                                optional={
                                    "content": JSONISH,
                                    "role": JSONISH,
                                    "tool_calls": st.lists(
                                        st.fixed_dictionaries(
                                            {},
                                            optional={
                                                "index": JSONISH,
                                                "id": JSONISH,
                                                "function": st.fixed_dictionaries(
                                                    {},
                                                    optional={
                                                        "name": JSONISH,
                                                        "arguments": JSONISH,
                                                    },
                                                ),
                                            },
                                        ),
                                        max_size=3,
                                    ),
                                },
                            ),
                        },
                    ),
                    max_size=2,
                ),
                "usage": st.fixed_dictionaries(
                    {}, optional={"prompt_tokens": JSONISH, "completion_tokens": JSONISH}
                ),
            },
        ),
        max_size=6,
    )
)
def test_odd_but_valid_chunks_never_raise(chunks: list[dict[str, Any]]) -> None:
    raws = [enc(c) for c in chunks]
    sse = run_stream(raws)
    check_block_order(sse_events(sse))
    whole = json.loads(fold(raws, "m", "msg_f"))
    assert whole["type"] == "message"


# -- the property: the SDK reads back what the chat stream said -----------------------------------

ARG_VALUES = st.one_of(
    st.integers(-1000, 1000),
    st.text(max_size=8),
    st.booleans(),
    st.none(),
    st.lists(st.integers(0, 9), max_size=3),
)


@st.composite
def chat_turns(draw: st.DrawFn) -> dict[str, Any]:
    """A random chat stream: text pieces, 0–3 tool calls with arguments split at random points
    and possibly interleaved by index, the finish reason, maybe usage."""
    texts = draw(st.lists(st.text(max_size=6), max_size=5))
    n_calls = draw(st.integers(0, 3))
    calls: list[dict[str, Any]] = []
    for i in range(n_calls):
        args = draw(st.dictionaries(st.text(max_size=5), ARG_VALUES, max_size=3))
        encoded = json.dumps(args)
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(encoded) - 1)), max_size=4))))
        pieces = [encoded[a:b] for a, b in zip([0, *cuts], [*cuts, len(encoded)], strict=True)]
        call_id = draw(st.one_of(st.none(), st.just(f"call_{i}_{draw(st.integers(0, 99))}")))
        calls.append(
            {
                "name": draw(st.from_regex(r"[a-z_]{1,8}", fullmatch=True)),
                "id": call_id,
                "args": args,
                "pieces": [p for p in pieces if p],
            }
        )
    # the order of what follows the first text: each call's pieces (label: its index) and the
    # later text pieces (label -1), interleaved at random (each call's own pieces in order) when
    # asked, else one call after the other and the later text last
    text_after = draw(st.lists(st.text(min_size=1, max_size=4), max_size=2)) if calls else []
    labels = [i for i, c in enumerate(calls) for _ in c["pieces"]] + [-1] * len(text_after)
    if draw(st.booleans()):
        labels = draw(st.permutations(labels))
    return {
        "texts": texts,
        "text_after": text_after,
        "calls": calls,
        "order": labels,
        "role_first": draw(st.booleans()),
        "empty_content": draw(st.booleans()),
        "finish": draw(st.sampled_from(["stop", "length", "tool_calls", "content_filter", None])),
        "usage": draw(st.sampled_from([None, "separate", "in_finish"])),
    }


def turn_chunks(turn: dict[str, Any]) -> list[bytes]:
    chunks: list[bytes] = []
    if turn["role_first"]:
        chunks.append(chunk({"role": "assistant", "content": ""}))
    for text in turn["texts"]:
        chunks.append(chunk({"content": text}))
    sent = [0] * len(turn["calls"])
    later_text = iter(turn["text_after"])
    for label in turn["order"]:
        if label == -1:
            chunks.append(chunk({"content": next(later_text)}))
            continue
        call = turn["calls"][label]
        piece = call["pieces"][sent[label]]
        tool_call: dict[str, Any] = {"index": label, "function": {"arguments": piece}}
        if sent[label] == 0:
            tool_call["type"] = "function"
            tool_call["function"]["name"] = call["name"]
            if call["id"] is not None:
                tool_call["id"] = call["id"]
        sent[label] += 1
        delta: dict[str, Any] = {"tool_calls": [tool_call]}
        if turn["empty_content"]:
            delta["content"] = None if label % 2 else ""
        chunks.append(chunk(delta))
    usage = {"prompt_tokens": 17, "completion_tokens": 23, "total_tokens": 40}
    if turn["usage"] == "in_finish":
        chunks.append(chunk({}, turn["finish"], usage=usage))
    else:
        chunks.append(chunk({}, turn["finish"]))
    if turn["usage"] == "separate":
        chunks.append(usage_chunk(17, 23))
    return chunks


def expected_stop(turn: dict[str, Any]) -> str:
    reasons = {"length": "max_tokens", "content_filter": "refusal"}
    if turn["finish"] in reasons:
        return reasons[turn["finish"]]
    return "tool_use" if turn["calls"] else "end_turn"


def check_tools(turn: dict[str, Any], message: Message, order: str) -> None:
    """The message's tool_use blocks are the turn's calls, in ``order`` (``appearance``: as their
    first pieces came, what the stream does; ``index``: what fold does), each with its own id or
    a distinct ``toolu_`` one, its name and its parsed arguments."""
    calls = list(enumerate(turn["calls"]))
    if order == "appearance":
        first = {label: n for n, label in reversed(list(enumerate(turn["order"])))}
        calls.sort(key=lambda pair: first.get(pair[0], len(turn["order"]) + pair[0]))
    got = tools_of(message)
    assert len(got) == len(calls)
    for (tid, name, args), (_index, call) in zip(got, calls, strict=True):
        assert (name, args) == (call["name"], call["args"])
        assert tid == call["id"] if call["id"] is not None else tid.startswith("toolu_")
    ids = [tid for tid, _name, _args in got]
    assert len(set(ids)) == len(ids)


def expected_text(turn: dict[str, Any]) -> str:
    return "".join(turn["texts"]) + "".join(turn["text_after"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chat_turns())
def test_the_sdk_reads_back_the_chat_stream(turn: dict[str, Any]) -> None:
    chunks = turn_chunks(turn)
    sse = run_stream(chunks, message_id=new_message_id(), input_tokens_estimate=3)
    check_block_order(sse_events(sse))
    message = _SDK.stream(sse)
    assert text_of(message) == expected_text(turn)
    check_tools(turn, message, "appearance")
    assert message.stop_reason == expected_stop(turn)
    if turn["usage"]:
        assert (message.usage.input_tokens, message.usage.output_tokens) == (17, 23)
    else:
        assert message.usage.input_tokens == 3


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chat_turns())
def test_the_sdk_reads_back_the_folded_chat_stream(turn: dict[str, Any]) -> None:
    chunks = turn_chunks(turn)
    message = _SDK.create(fold(chunks, "m", new_message_id(), input_tokens_estimate=3))
    assert isinstance(message, Message)
    assert text_of(message) == expected_text(turn)
    check_tools(turn, message, "index")
    assert message.stop_reason == expected_stop(turn)
    assert message.usage.input_tokens == (17 if turn["usage"] else 3)


# -- fold: whole completions --------------------------------------------------------------------


def test_fold_a_whole_completion() -> None:
    completion = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "qwen",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Checking.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "w", "arguments": '{"city": "Oslo"}'},
                        },
                        {
                            "id": "call_2",
                            "type": "function",
                            "function": {"name": "bad", "arguments": '{"unterminated'},
                        },
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29},
    }
    out = json.loads(fold([enc(completion)], "qwen", "msg_w"))
    assert out == {
        "id": "msg_w",
        "type": "message",
        "role": "assistant",
        "model": "qwen",
        "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "call_1", "name": "w", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "call_2", "name": "bad", "input": {}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 20, "output_tokens": 9},
    }
    message = _SDK.create(fold([enc(completion)], "qwen", "msg_w"))
    assert tools_of(message)[0] == ("call_1", "w", {"city": "Oslo"})


def test_fold_nothing_is_an_empty_message() -> None:
    message = _SDK.create(fold([], "m", "msg_e"))
    assert message.content == [] and message.stop_reason == "end_turn"
    assert json.loads(fold([b"garbage"], "m", "msg_e"))["content"] == []


# -- dialects: chunks as the servers send them (after gateway/sim/server.py) -----------------------

OLLAMA_TEXT = [
    b'{"id":"chatcmpl-42","object":"chat.completion.chunk","created":1700000000,"model":"llama3.2","system_fingerprint":"fp_ollama","choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}',
    b'{"id":"chatcmpl-42","object":"chat.completion.chunk","created":1700000000,"model":"llama3.2","system_fingerprint":"fp_ollama","choices":[{"index":0,"delta":{"role":"assistant","content":"lo"},"finish_reason":null}]}',
    b'{"id":"chatcmpl-42","object":"chat.completion.chunk","created":1700000000,"model":"llama3.2","system_fingerprint":"fp_ollama","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":"stop"}]}',
    b'{"id":"chatcmpl-42","object":"chat.completion.chunk","created":1700000000,"model":"llama3.2","system_fingerprint":"fp_ollama","choices":[],"usage":{"prompt_tokens":11,"completion_tokens":2,"total_tokens":13}}',
]
OLLAMA_TOOL = [
    b'{"id":"chatcmpl-7","object":"chat.completion.chunk","created":1700000000,"model":"llama3.2","system_fingerprint":"fp_ollama","choices":[{"index":0,"delta":{"role":"assistant","content":"","tool_calls":[{"id":"call_ab12cd34","index":0,"type":"function","function":{"name":"get_weather","arguments":"{\\"city\\":\\"Paris\\"}"}}]},"finish_reason":null}]}',
    b'{"id":"chatcmpl-7","object":"chat.completion.chunk","created":1700000000,"model":"llama3.2","system_fingerprint":"fp_ollama","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":"tool_calls"}]}',
]
VLLM_TEXT = [
    b'{"id":"chatcmpl-0f3c","object":"chat.completion.chunk","created":1700000000,"model":"qwen","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}',
    b'{"id":"chatcmpl-0f3c","object":"chat.completion.chunk","created":1700000000,"model":"qwen","choices":[{"index":0,"delta":{"content":"Hel"},"logprobs":null,"finish_reason":null}]}',
    b'{"id":"chatcmpl-0f3c","object":"chat.completion.chunk","created":1700000000,"model":"qwen","choices":[{"index":0,"delta":{"content":"lo"},"logprobs":null,"finish_reason":null}]}',
    b'{"id":"chatcmpl-0f3c","object":"chat.completion.chunk","created":1700000000,"model":"qwen","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"stop","stop_reason":null}]}',
    b'{"id":"chatcmpl-0f3c","object":"chat.completion.chunk","created":1700000000,"model":"qwen","choices":[],"usage":{"prompt_tokens":11,"total_tokens":13,"completion_tokens":2}}',
]
VLLM_TOOL = [
    b'{"id":"chatcmpl-0f3d","object":"chat.completion.chunk","created":1700000000,"model":"qwen","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}',
    b'{"id":"chatcmpl-0f3d","object":"chat.completion.chunk","created":1700000000,"model":"qwen","choices":[{"index":0,"delta":{"tool_calls":[{"id":"chatcmpl-tool-9a8b","type":"function","index":0,"function":{"name":"get_weather"}}]},"logprobs":null,"finish_reason":null}]}',
    b'{"id":"chatcmpl-0f3d","object":"chat.completion.chunk","created":1700000000,"model":"qwen","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\\"city\\": "}}]},"logprobs":null,"finish_reason":null}]}',
    b'{"id":"chatcmpl-0f3d","object":"chat.completion.chunk","created":1700000000,"model":"qwen","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\\"Paris\\"}"}}]},"logprobs":null,"finish_reason":null}]}',
    b'{"id":"chatcmpl-0f3d","object":"chat.completion.chunk","created":1700000000,"model":"qwen","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"tool_calls","stop_reason":null}]}',
]
LLAMACPP_TEXT = [
    b'{"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1700000000,"id":"chatcmpl-Ab3","model":"gguf","system_fingerprint":"b6000-sim0000","object":"chat.completion.chunk"}',
    b'{"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Hel"}}],"created":1700000000,"id":"chatcmpl-Ab3","model":"gguf","system_fingerprint":"b6000-sim0000","object":"chat.completion.chunk"}',
    b'{"choices":[{"finish_reason":null,"index":0,"delta":{"content":"lo"}}],"created":1700000000,"id":"chatcmpl-Ab3","model":"gguf","system_fingerprint":"b6000-sim0000","object":"chat.completion.chunk"}',
    b'{"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"created":1700000000,"id":"chatcmpl-Ab3","model":"gguf","system_fingerprint":"b6000-sim0000","object":"chat.completion.chunk"}',
    b'{"choices":[],"created":1700000000,"id":"chatcmpl-Ab3","model":"gguf","system_fingerprint":"b6000-sim0000","object":"chat.completion.chunk","usage":{"completion_tokens":2,"prompt_tokens":11,"total_tokens":13},"timings":{"prompt_n":11,"predicted_n":2}}',
]
LLAMACPP_TOOL = [
    b'{"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1700000000,"id":"chatcmpl-Ab4","model":"gguf","system_fingerprint":"b6000-sim0000","object":"chat.completion.chunk"}',
    b'{"choices":[{"finish_reason":null,"index":0,"delta":{"tool_calls":[{"index":0,"id":"Xk2p9QmZ","type":"function","function":{"name":"get_weather","arguments":"{\\"city\\""}}]}}],"created":1700000000,"id":"chatcmpl-Ab4","model":"gguf","system_fingerprint":"b6000-sim0000","object":"chat.completion.chunk"}',
    b'{"choices":[{"finish_reason":null,"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":":\\"Paris\\"}"}}]}}],"created":1700000000,"id":"chatcmpl-Ab4","model":"gguf","system_fingerprint":"b6000-sim0000","object":"chat.completion.chunk"}',
    b'{"choices":[{"finish_reason":"tool_calls","index":0,"delta":{}}],"created":1700000000,"id":"chatcmpl-Ab4","model":"gguf","system_fingerprint":"b6000-sim0000","object":"chat.completion.chunk","timings":{"prompt_n":11}}',
]
LITELLM_TEXT = [
    b'{"id":"chatcmpl-5d1e","created":1700000000,"model":"gpt-local","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hel","role":"assistant"}}]}',
    b'{"id":"chatcmpl-5d1e","created":1700000000,"model":"gpt-local","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"lo"}}]}',
    b'{"id":"chatcmpl-5d1e","created":1700000000,"model":"gpt-local","object":"chat.completion.chunk","choices":[{"finish_reason":"stop","index":0,"delta":{}}]}',
    b'{"id":"chatcmpl-5d1e","created":1700000000,"model":"gpt-local","object":"chat.completion.chunk","choices":[{"index":0,"delta":{}}],"usage":{"completion_tokens":2,"prompt_tokens":11,"total_tokens":13,"completion_tokens_details":{"reasoning_tokens":0}}}',
]
LITELLM_TOOL = [
    b'{"id":"chatcmpl-5d1f","created":1700000000,"model":"gpt-local","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","tool_calls":[{"id":"call_Q1w2E3r4T5y6U7i8O9p0A1s2","function":{"arguments":"","name":"get_weather"},"type":"function","index":0}]}}]}',
    b'{"id":"chatcmpl-5d1f","created":1700000000,"model":"gpt-local","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"tool_calls":[{"function":{"arguments":"{\\"city\\":"},"type":"function","index":0}]}}]}',
    b'{"id":"chatcmpl-5d1f","created":1700000000,"model":"gpt-local","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"tool_calls":[{"function":{"arguments":"\\"Paris\\"}"},"type":"function","index":0}]}}]}',
    b'{"id":"chatcmpl-5d1f","created":1700000000,"model":"gpt-local","object":"chat.completion.chunk","choices":[{"finish_reason":"tool_calls","index":0,"delta":{}}]}',
]
OLLAMA_WHOLE = b'{"id":"chatcmpl-9","object":"chat.completion","created":1700000000,"model":"llama3.2","system_fingerprint":"fp_ollama","choices":[{"index":0,"message":{"role":"assistant","content":"Hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":11,"completion_tokens":2,"total_tokens":13}}'
LLAMACPP_WHOLE_TOOL = b'{"choices":[{"finish_reason":"tool_calls","index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"type":"function","function":{"name":"get_weather","arguments":"{\\"city\\":\\"Paris\\"}"},"id":"Xk2p9QmZ"}]}}],"created":1700000000,"model":"gguf","system_fingerprint":"b6000-sim0000","object":"chat.completion","usage":{"completion_tokens":2,"prompt_tokens":11,"total_tokens":13},"id":"chatcmpl-Ab5","timings":{"prompt_n":11}}'


@pytest.mark.parametrize(
    "chunks",
    [OLLAMA_TEXT, VLLM_TEXT, LLAMACPP_TEXT, LITELLM_TEXT],
    ids=["ollama", "vllm", "llamacpp", "litellm"],
)
def test_dialect_text(chunks: list[bytes]) -> None:
    sse = run_stream(chunks)
    check_block_order(sse_events(sse))
    for message in (_SDK.stream(sse), _SDK.create(fold(chunks, "m", "msg_d"))):
        assert [b.type for b in message.content] == ["text"]
        assert text_of(message) == "Hello"
        assert message.stop_reason == "end_turn"
        assert (message.usage.input_tokens, message.usage.output_tokens) == (11, 2)


@pytest.mark.parametrize(
    ("chunks", "call_id"),
    [
        (OLLAMA_TOOL, "call_ab12cd34"),
        (VLLM_TOOL, "chatcmpl-tool-9a8b"),
        (LLAMACPP_TOOL, "Xk2p9QmZ"),
        (LITELLM_TOOL, "call_Q1w2E3r4T5y6U7i8O9p0A1s2"),
    ],
    ids=["ollama", "vllm", "llamacpp", "litellm"],
)
def test_dialect_tool_call(chunks: list[bytes], call_id: str) -> None:
    sse = run_stream(chunks)
    check_block_order(sse_events(sse))
    for message in (_SDK.stream(sse), _SDK.create(fold(chunks, "m", "msg_d"))):
        assert [b.type for b in message.content] == ["tool_use"]
        assert tools_of(message) == [(call_id, "get_weather", {"city": "Paris"})]
        assert message.stop_reason == "tool_use"


@pytest.mark.parametrize(
    ("whole", "text", "tools"),
    [
        (OLLAMA_WHOLE, "Hello", []),
        (LLAMACPP_WHOLE_TOOL, "", [("Xk2p9QmZ", "get_weather", {"city": "Paris"})]),
    ],
    ids=["ollama", "llamacpp"],
)
def test_dialect_whole_completion(whole: bytes, text: str, tools: list[Any]) -> None:
    for message in (_SDK.create(fold([whole], "m", "msg_d")), _SDK.stream(run_stream([whole]))):
        assert text_of(message) == text
        assert tools_of(message) == tools
        assert (message.usage.input_tokens, message.usage.output_tokens) == (11, 2)


def iter_events(sse: bytes) -> Iterator[str]:
    for name, _payload in sse_events(sse):
        yield name


def test_dialect_stream_event_names() -> None:
    names = list(iter_events(run_stream(VLLM_TOOL)))
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
