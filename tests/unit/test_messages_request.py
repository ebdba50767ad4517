"""The Anthropic Messages request translation (gateway/apis/messages/request.py) and
the error shape (messages/errors.py), no sockets: request bodies to chat bodies, what is refused
and how the ``anthropic`` SDK reads the refusal, count_tokens; a request the SDK itself builds
(a MockTransport hands us its bytes; no network)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import msgspec
import pytest
from fake_anthropic import FakeAnthropic

from gateway.apis.messages.errors import MessagesError, error_body, error_type_for_status
from gateway.apis.messages.request import count_tokens, to_chat, translate
from gateway.apis.messages.stream import fold

# -- helpers ---------------------------------------------------------------------------------


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
