"""The Responses API request translation (gateway/apis/responses/request.py and
tools.py), no sockets: each request rule and refusal, a request as Codex sends it."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from gateway.apis.responses.errors import ResponsesError
from gateway.apis.responses.request import to_chat, translate

# -- helpers ---------------------------------------------------------------------------------


def chat_of(request: dict[str, Any]) -> dict[str, Any]:
    body, _stream, _model = to_chat(json.dumps(request).encode())
    decoded: dict[str, Any] = json.loads(body)
    return decoded


def refused(request: dict[str, Any] | bytes) -> ResponsesError:
    body = request if isinstance(request, bytes) else json.dumps(request).encode()
    with pytest.raises(ResponsesError) as info:
        to_chat(body)
    assert info.value.status == 400
    return info.value


# -- the request ---------------------------------------------------------------------------------


def test_string_input_is_a_user_message_and_model_and_stream_come_back() -> None:
    body, stream, model = to_chat(b'{"model": "qwen", "input": "hello", "stream": true}')
    chat = json.loads(body)
    assert (stream, model) == (True, "qwen")
    assert chat["model"] == "qwen"
    assert chat["messages"] == [{"role": "user", "content": "hello"}]
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}


def test_not_streamed_has_no_stream_options_and_model_may_be_absent() -> None:
    body, stream, model = to_chat(b'{"input": "hello"}')
    chat = json.loads(body)
    assert (stream, model) == (False, None)
    assert chat["stream"] is False and "stream_options" not in chat and "model" not in chat


def test_instructions_come_first_and_developer_is_system_merged() -> None:
    chat = chat_of(
        {
            "instructions": "You are Codex.",
            "input": [
                {
                    "type": "message",
                    "role": "developer",
                    "content": [{"type": "input_text", "text": "sandbox"}],
                },
                {"role": "system", "content": "more"},
                {"role": "user", "content": "hi"},
                {"role": "developer", "content": "later"},
            ],
        }
    )
    assert chat["messages"] == [
        {"role": "system", "content": "You are Codex.\n\nsandbox\n\nmore"},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "later"},
    ]


def test_text_parts_are_joined_and_assistant_output_text_kept() -> None:
    chat = chat_of(
        {
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "a"},
                        {"type": "input_text", "text": "b"},
                    ],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "c"}],
                },
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            ]
        }
    )
    assert chat["messages"] == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c"},
        {"role": "assistant", "content": "no"},
    ]


def test_input_image_by_url_is_an_image_part() -> None:
    chat = chat_of(
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "what is it?"},
                        {
                            "type": "input_image",
                            "image_url": "data:image/png;base64,AAAA",
                            "detail": "low",
                        },
                    ],
                }
            ]
        }
    )
    assert chat["messages"][0]["content"] == [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
    ]


def test_input_image_by_file_id_is_refused_clearly() -> None:
    err = refused(
        {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}
    )
    assert err.code == "unsupported_parameter"
    assert err.param == "input[0].content[0].file_id"
    assert "file_id is not supported" in err.message and "image_url" in err.message


def test_input_file_and_images_outside_user_messages_are_refused() -> None:
    err = refused(
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}
    )
    assert "input_file" in err.message
    err = refused(
        {
            "input": [
                {
                    "role": "system",
                    "content": [{"type": "input_image", "image_url": "http://x/i.png"}],
                }
            ]
        }
    )
    assert err.param == "input[0].content"


def test_function_calls_merge_into_one_assistant_message_and_outputs_are_tool_messages() -> None:
    chat = chat_of(
        {
            "input": [
                {"role": "user", "content": "list and read"},
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "xyz"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Sure."}],
                },
                {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "name": "cat",
                    "arguments": {"path": "a"},
                },
                {"type": "function_call_output", "call_id": "c1", "output": "a b"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "A"}],
                },
                {"type": "function_call", "call_id": "c3", "name": "ls", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c3", "output": ""},
            ]
        }
    )
    assert chat["messages"] == [
        {"role": "user", "content": "list and read"},
        {
            "role": "assistant",
            "content": "Sure.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "cat", "arguments": '{"path":"a"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a b"},
        {"role": "tool", "tool_call_id": "c2", "content": "A"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c3", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c3", "content": ""},
    ]


def test_an_image_in_a_tool_output_follows_the_tool_messages_as_a_user_message() -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    chat = chat_of(
        {
            "input": [
                {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "ls", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": [image]},
                {"type": "function_call_output", "call_id": "c2", "output": "x"},
            ]
        }
    )
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["assistant", "tool", "tool", "user"]
    assert chat["messages"][3]["content"][0]["type"] == "image_url"


def test_custom_tool_calls_round_trip_as_function_calls_with_input() -> None:
    chat = chat_of(
        {
            "tools": [
                {
                    "type": "custom",
                    "name": "apply_patch",
                    "description": "patch",
                    "format": {"type": "grammar"},
                }
            ],
            "input": [
                {
                    "type": "custom_tool_call",
                    "call_id": "c1",
                    "name": "apply_patch",
                    "input": "*** Begin Patch",
                },
                {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done"},
            ],
        }
    )
    call = chat["messages"][0]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"input": "*** Begin Patch"}
    assert chat["messages"][1] == {"role": "tool", "tool_call_id": "c1", "content": "Done"}
    tool = chat["tools"][0]["function"]
    assert tool["name"] == "apply_patch" and tool["description"] == "patch"
    assert tool["parameters"]["required"] == ["input"]


def test_unknown_and_stateful_input_items_are_refused_hosted_records_ignored() -> None:
    err = refused({"input": [{"type": "item_reference", "id": "msg_1"}]})
    assert err.param == "input[0].type" and "no response state" in err.message
    err = refused({"input": [{"type": "bogus"}]})
    assert err.param == "input[0].type" and "'bogus'" in err.message
    chat = chat_of(
        {
            "input": [
                {"type": "web_search_call", "id": "ws", "status": "completed"},
                {"type": "local_shell_call", "call_id": "x", "action": {}},
                {"role": "user", "content": "hi"},
            ]
        }
    )
    assert chat["messages"] == [{"role": "user", "content": "hi"}]


def test_function_tools_pass_on_hosted_ones_are_dropped_unknown_refused() -> None:
    schema = {"type": "object", "properties": {"cmd": {"type": "string"}}}
    chat = chat_of(
        {
            "input": "hi",
            "tools": [
                {
                    "type": "function",
                    "name": "shell",
                    "description": "run",
                    "parameters": schema,
                    "strict": False,
                },
                {"type": "web_search", "external_web_access": False},
                {"type": "local_shell"},
                {"type": "image_generation"},
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
        }
    )
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "shell",
                "description": "run",
                "parameters": schema,
                "strict": False,
            },
        }
    ]
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is False
    err = refused({"input": "hi", "tools": [{"type": "functon", "name": "x"}]})
    assert err.param == "tools[0].type" and "'functon'" in err.message


def test_only_unservable_tools_leave_no_tools_nor_tool_choice() -> None:
    chat = chat_of(
        {
            "input": "hi",
            "tools": [{"type": "web_search"}],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
        }
    )
    assert "tools" not in chat and "tool_choice" not in chat and "parallel_tool_calls" not in chat


def test_namespace_tools_are_flattened() -> None:
    chat = chat_of(
        {
            "input": [
                {
                    "type": "function_call",
                    "call_id": "c",
                    "name": "create",
                    "namespace": "mcp__cal__",
                    "arguments": "{}",
                }
            ],
            "tools": [
                {
                    "type": "namespace",
                    "name": "mcp__cal__",
                    "description": "calendar",
                    "tools": [
                        {"type": "function", "name": "create", "parameters": {"type": "object"}}
                    ],
                }
            ],
        }
    )
    assert chat["tools"][0]["function"]["name"] == "mcp__cal__create"
    assert chat["messages"][0]["tool_calls"][0]["function"]["name"] == "mcp__cal__create"


def test_tool_choice_forms() -> None:
    tools = [{"type": "function", "name": "f"}]
    for choice in ("auto", "none", "required"):
        assert (
            chat_of({"input": "x", "tools": tools, "tool_choice": choice})["tool_choice"] == choice
        )
    chat = chat_of({"input": "x", "tools": tools, "tool_choice": {"type": "function", "name": "f"}})
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    err = refused({"input": "x", "tools": tools, "tool_choice": {"type": "function", "name": "g"}})
    assert err.param == "tool_choice.name"
    err = refused({"input": "x", "tools": tools, "tool_choice": {"type": "web_search_preview"}})
    assert err.param == "tool_choice"
    err = refused({"input": "x", "tools": tools, "tool_choice": 3})
    assert err.param == "tool_choice"


def test_sampling_fields_and_text_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    chat = chat_of(
        {
            "input": "x",
            "max_output_tokens": 100,
            "temperature": 0.2,
            "top_p": 1,
            "text": {
                "format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True},
                "verbosity": "low",
            },
        }
    )
    assert chat["max_tokens"] == 100 and chat["temperature"] == 0.2 and chat["top_p"] == 1
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": schema, "strict": True},
    }
    assert chat_of({"input": "x", "text": {"format": {"type": "json_object"}}})[
        "response_format"
    ] == {"type": "json_object"}
    assert "response_format" not in chat_of({"input": "x", "text": {"format": {"type": "text"}}})


def test_ignored_fields_do_not_reach_the_chat_body() -> None:
    chat = chat_of(
        {
            "model": "m",
            "input": "x",
            "store": False,
            "reasoning": {"effort": "high", "summary": "auto"},
            "include": ["reasoning.encrypted_content"],
            "metadata": {"a": "b"},
            "prompt_cache_key": "k",
            "truncation": "auto",
            "user": "u",
            "service_tier": "auto",
            "something_new": {"x": 1},
            "previous_response_id": None,
        }
    )
    assert set(chat) == {"model", "messages", "stream"}


def test_previous_response_id_is_refused_with_the_decision() -> None:
    err = refused({"input": "x", "previous_response_id": "resp_1"})
    assert err.message == (
        "previous_response_id is not supported: send the whole conversation in input (store: false)"
    )
    assert (err.code, err.param) == ("unsupported_parameter", "previous_response_id")
    err = refused({"input": "x", "conversation": "conv_1"})
    assert (err.code, err.param) == ("unsupported_parameter", "conversation")


@pytest.mark.parametrize(
    "body",
    [b"", b"   ", b"{not json", b"[1, 2", b"\xff\xfe"],
)
def test_undecodable_bodies_are_invalid_json(body: bytes) -> None:
    assert refused(body).code == "invalid_json"


def test_nesting_too_deep_is_a_400() -> None:
    depth = sys.getrecursionlimit() + 100
    deep = b'{"input": [{"role": "user", "content": ' + b"[" * depth + b"]" * depth + b"}]}"
    assert refused(deep).status == 400


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        ([1], None),
        ({"input": 3}, "input"),
        ({"input": "x", "model": 1}, "model"),
        ({"input": "x", "stream": "yes"}, "stream"),
        ({"input": "x", "instructions": ["a"]}, "instructions"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0].text",
        ),
        ({"input": [{"role": "user", "content": [{"type": "audio"}]}]}, "input[0].content[0].type"),
        ({"input": ["x"]}, "input[0]"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
            "input[0].name",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": 1}]},
            "input[0].output",
        ),
        ({"input": "x", "tools": {"type": "function"}}, "tools"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "{}"}]},
            "tools[0].parameters",
        ),
        ({"input": "x", "max_output_tokens": "10"}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "top_p": True}, "top_p"),
        ({}, "input"),
        ({"input": []}, "input"),
    ],
)
def test_wrong_types_are_refused_naming_the_field(request_: Any, param: str | None) -> None:
    err = refused(json.dumps(request_).encode())
    assert err.param == param
    if param is not None:
        assert param.split("[")[0] in err.message


def test_a_codex_request_translates() -> None:
    """The shape Codex CLI sends to a ``wire_api = "responses"`` provider."""
    request = {
        "model": "qwen3-coder",
        "instructions": "You are a coding agent running in the Codex CLI.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "<permissions/>"}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "<environment_context/>"}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "fix the bug"}],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "t"}],
                "content": None,
                "encrypted_content": None,
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "name": "shell_command",
                "arguments": '{"command":"ls"}',
                "call_id": "call_1",
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "README.md\n"},
            {
                "type": "custom_tool_call",
                "id": "ctc_1",
                "status": "completed",
                "call_id": "call_2",
                "name": "apply_patch",
                "input": "*** Begin Patch",
            },
            {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Success."},
        ],
        "tools": [
            {
                "type": "function",
                "name": "shell_command",
                "description": "Runs a command",
                "strict": False,
                "parameters": {
                    "type": "object",
                    "properties": {"command": {"type": "string"}},
                    "required": ["command"],
                    "additionalProperties": False,
                },
            },
            {
                "type": "custom",
                "name": "apply_patch",
                "description": "Edit files",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
            },
            {"type": "web_search", "external_web_access": False},
            {
                "type": "function",
                "name": "view_image",
                "description": "View an image",
                "strict": False,
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}},
                    "required": ["path"],
                    "additionalProperties": False,
                },
            },
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199-abc",
        "text": {"verbosity": "medium"},
    }
    translated = translate(json.dumps(request).encode())
    chat = json.loads(translated.chat)
    assert translated.stream and translated.model == "qwen3-coder"
    assert translated.request["prompt_cache_key"] == "0199-abc"
    assert [m["role"] for m in chat["messages"]] == [
        "system",
        "user",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
    ]
    assert (
        chat["messages"][0]["content"].startswith("You are a coding agent")
        and "<permissions/>" in chat["messages"][0]["content"]
    )
    assert [t["function"]["name"] for t in chat["tools"]] == [
        "shell_command",
        "apply_patch",
        "view_image",
    ]
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is False
    assert set(chat) == {
        "model",
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "stream",
        "stream_options",
    }
