"""The Responses API stream translation (gateway/apis/responses/stream.py and
items.py), no sockets: chat streams translated and read back by the openai SDK's own machinery
(hypothesis); the backends' chunk dialects; folded answers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.apis.responses.stream import KEEPALIVE, ResponsesStream, fold
from gateway.apis.shapes import aggregate_chunks

# -- helpers ---------------------------------------------------------------------------------


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> bytes:
    choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    return json.dumps({"object": "chat.completion.chunk", "choices": [choice], **extra}).encode()


def usage_chunk(prompt: int, completion: int) -> bytes:
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    return json.dumps({"object": "chat.completion.chunk", "choices": [], "usage": usage}).encode()


def events(sse: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event; checks the framing."""
    out = []
    assert sse.endswith(b"\n\n") or not sse
    for block in sse.split(b"\n\n")[:-1]:
        lines = block.split(b"\n")
        assert (
            len(lines) == 2 and lines[0].startswith(b"event: ") and lines[1].startswith(b"data: ")
        )
        name = lines[0][7:].decode()
        data = json.loads(lines[1][6:])
        assert data["type"] == name
        out.append((name, data))
    return out


def run_stream(chunks: list[bytes], request: dict[str, Any] | None = None) -> bytes:
    stream = ResponsesStream("m", "resp_1", 1700000000, request)
    out = stream.start()
    for raw in chunks:
        out += stream.chunk(raw)
    return out + stream.done()


# -- the openai SDK reading our bytes --------------------------------------------------------------


class Served:
    """What the mock transport answers next."""

    body: bytes = b""
    content_type: str = "text/event-stream"


served = Served()


def _handler(request: httpx.Request) -> httpx.Response:
    assert request.url.path == "/v1/responses"
    return httpx.Response(200, headers={"content-type": served.content_type}, content=served.body)


client = openai.OpenAI(
    api_key="sk-test",
    base_url="http://hub.test/v1",
    http_client=httpx.Client(transport=httpx.MockTransport(_handler)),
    max_retries=0,
)


def sdk_stream(sse: bytes) -> tuple[list[Any], Any]:
    """The SDK's events for our SSE bytes, and the final response (response.completed's, parsed
    by the stream helper; or response.incomplete's / response.failed's)."""
    served.body, served.content_type = sse, "text/event-stream"
    with client.responses.stream(model="m", input="hi") as stream:
        seen = list(stream)
        final = seen[-1].response
        if seen[-1].type == "response.completed":
            final = stream.get_final_response()
    return seen, final


def sdk_create(body: bytes) -> Any:
    served.body, served.content_type = body, "application/json"
    return client.responses.create(model="m", input="hi")


# -- the stream, by hand ----------------------------------------------------------------------------


def test_keepalive_start_once_and_events_framed_with_sequence_numbers() -> None:
    stream = ResponsesStream("m", "resp_1", 1)
    assert stream.keepalive() == KEEPALIVE == b": keepalive\n\n"
    head = stream.start()
    assert stream.start() == b""
    assert [name for name, _ in events(head)] == ["response.created", "response.in_progress"]
    for _, data in events(head):
        assert data["response"]["status"] == "in_progress" and data["response"]["output"] == []
    body = stream.chunk(chunk({"content": "hi"}, "stop")) + stream.done()
    seqs = [data["sequence_number"] for _, data in events(head + body)]
    assert seqs == list(range(len(seqs)))
    assert stream.chunk(chunk({"content": "late"})) == b"" and stream.done() == b""
    assert stream.keepalive() == b""


def test_the_first_chunk_brings_the_start_events_when_start_was_not_called() -> None:
    stream = ResponsesStream("m", "resp_1", 1)
    names = [name for name, _ in events(stream.chunk(chunk({"content": "x"})))]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]


def test_odd_chunks_never_raise_undecodable_ones_are_empty() -> None:
    stream = ResponsesStream("m", "resp_1", 1)
    stream.start()
    for raw in [
        b"not json",
        b"",
        b"[1,2]",
        b'{"choices": "x"}',
        b'{"choices": [{"delta": {"tool_calls": "x"}}]}',
        b"{}",
        b'{"choices": null}',
        b'{"choices": [{"index": 0, "delta": null, "finish_reason": null}]}',
        b'{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}',
        b'{"choices": [{"index": 0, "delta": {"content": null}}]}',
        b'{"choices": [{"index": 0, "delta": {"content": ""}}]}',
        b'{"choices": [{"index": 0, "delta": {"content": ["x"]}}]}',
        b'{"choices": [{"index": 1, "delta": {"content": "other choice"}}]}',
    ]:
        assert stream.chunk(raw) == b""
    names = [name for name, _ in events(stream.done())]
    assert names == ["response.completed"]


def test_length_is_incomplete_with_max_output_tokens() -> None:
    out = run_stream([chunk({"content": "cut"}), chunk({}, "length"), usage_chunk(5, 1)])
    last = events(out)[-1]
    assert last[0] == "response.incomplete"
    response = last[1]["response"]
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["input_tokens"] == 5 and response["usage"]["output_tokens"] == 1
    _seen, final = sdk_stream(out)
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"


def test_content_filter_is_incomplete_too() -> None:
    response = events(run_stream([chunk({"content": "x"}, "content_filter")]))[-1][1]["response"]
    assert response["incomplete_details"] == {"reason": "content_filter"}


def test_error_ends_the_stream_with_response_failed() -> None:
    stream = ResponsesStream("m", "resp_1", 1)
    out = stream.start() + stream.chunk(chunk({"content": "part"}))
    failed = stream.error("backend returned 500: boom", "upstream_error")
    assert stream.done() == b"" and stream.error("again") == b""
    name, data = events(failed)[-1]
    assert name == "response.failed"
    assert data["response"]["status"] == "failed"
    assert data["response"]["error"] == {
        "code": "upstream_error",
        "message": "backend returned 500: boom",
    }
    seen, final = sdk_stream(out + failed)
    assert (
        seen[-1].type == "response.failed" and final.error.message == "backend returned 500: boom"
    )


def test_a_backend_error_chunk_fails_the_response() -> None:
    stream = ResponsesStream("m", "resp_1", 1)
    out = stream.chunk(b'{"error": {"message": "model crashed", "code": "internal"}}')
    assert events(out)[-1][1]["response"]["error"] == {
        "code": "internal",
        "message": "model crashed",
    }
    assert stream.done() == b""


def test_reasoning_content_becomes_a_reasoning_item() -> None:
    out = run_stream(
        [
            chunk({"role": "assistant", "content": None, "reasoning_content": "let me think"}),
            chunk({"reasoning_content": " more"}),
            chunk({"content": "answer"}),
            chunk({}, "stop"),
        ]
    )
    _seen, final = sdk_stream(out)
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "let me think more"
    assert final.output_text == "answer"


def test_duplicate_backend_call_ids_are_made_unique() -> None:
    calls = [
        {
            "index": i,
            "id": "call_0",
            "type": "function",
            "function": {"name": "f", "arguments": "{}"},
        }
        for i in range(2)
    ]
    _seen, final = sdk_stream(run_stream([chunk({"tool_calls": calls}, "tool_calls")]))
    ids = [item.call_id for item in final.output]
    assert ids[0] == "call_0" and len(set(ids)) == 2


def test_namespace_and_custom_calls_come_back_as_their_items() -> None:
    request = {
        "tools": [
            {
                "type": "namespace",
                "name": "mcp__cal__",
                "tools": [{"type": "function", "name": "create"}],
            },
            {"type": "custom", "name": "apply_patch"},
        ]
    }
    args = json.dumps({"input": "*** Begin Patch\n*** End Patch"})
    out = run_stream(
        [
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "a",
                            "function": {"name": "mcp__cal__create", "arguments": "{}"},
                        }
                    ]
                }
            ),
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": 1,
                            "id": "b",
                            "function": {"name": "apply_patch", "arguments": args[:7]},
                        }
                    ]
                }
            ),
            chunk(
                {"tool_calls": [{"index": 1, "function": {"arguments": args[7:]}}]}, "tool_calls"
            ),
        ],
        request,
    )
    _seen, final = sdk_stream(out)
    call, custom = final.output
    assert (call.type, call.name, call.namespace, call.call_id) == (
        "function_call",
        "create",
        "mcp__cal__",
        "a",
    )
    assert (custom.type, custom.name, custom.input, custom.call_id) == (
        "custom_tool_call",
        "apply_patch",
        "*** Begin Patch\n*** End Patch",
        "b",
    )


def test_arguments_before_the_name_are_kept() -> None:
    out = run_stream(
        [
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
            chunk(
                {
                    "tool_calls": [
                        {"index": 0, "id": "c", "function": {"name": "f", "arguments": "1}"}}
                    ]
                },
                "tool_calls",
            ),
        ]
    )
    _seen, final = sdk_stream(out)
    assert (final.output[0].name, final.output[0].arguments) == ("f", '{"a":1}')


def test_request_fields_are_echoed_store_is_false() -> None:
    request = {
        "instructions": "be brief",
        "tools": [{"type": "function", "name": "f"}],
        "temperature": 0.5,
        "store": True,
    }
    response = events(run_stream([chunk({"content": "x"}, "stop")], request))[-1][1]["response"]
    assert response["instructions"] == "be brief" and response["temperature"] == 0.5
    assert response["tools"] == request["tools"] and response["store"] is False
    assert response["previous_response_id"] is None


# -- random chat streams read back by the SDK (hypothesis) ------------------------------------------


@dataclass
class Turn:
    """A random chat stream and what it means."""

    chunks: list[bytes]
    text: str
    calls: list[tuple[str, str | None, str]]  # (name, backend id or None, arguments)
    order: list[str]  # output item types, in order of appearance
    finish: str
    usage: tuple[int, int] | None
    by_index: list[tuple[str, str | None, str]] = field(default_factory=list)  # calls by chat index

    def as_whole(self) -> Turn:
        """What one whole chat.completion of this turn means: its message, then its calls by
        index (a completion keeps no order of appearance)."""
        order = ["message"] * bool(self.text) + ["function_call"] * len(self.by_index)
        return Turn([], self.text, self.by_index, order, self.finish, self.usage)


_texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)
_names = st.sampled_from(["shell", "read_file", "apply_patch_json", "f"])
_args = st.dictionaries(
    st.sampled_from(["cmd", "path", "n", "x"]), st.one_of(st.integers(), _texts), max_size=3
)


@st.composite
def turns(draw: st.DrawFn) -> Turn:
    pieces = draw(st.lists(_texts, max_size=6))
    ncalls = draw(st.integers(0, 3))
    calls: list[tuple[str, str | None, list[str]]] = []
    for i in range(ncalls):
        arguments = json.dumps(draw(_args))
        cuts = sorted(draw(st.lists(st.integers(0, len(arguments)), max_size=4)))
        split = [arguments[a:b] for a, b in zip([0, *cuts], [*cuts, len(arguments)], strict=True)]
        call_id = draw(st.one_of(st.none(), st.just(f"call_{i}_x")))
        calls.append((draw(_names), call_id, split))
    # the events in a random interleaving that keeps each call's pieces in order
    queue: list[tuple[str, int, int]] = [("text", 0, j) for j in range(len(pieces))]
    for i, (_name, _id, split) in enumerate(calls):
        queue += [("call", i, j) for j in range(len(split))]
    order_keys = draw(st.permutations(range(len(queue))))
    ordered = [queue[k] for k in order_keys]
    # restore each stream's own order: the k-th slot of a stream gets its k-th piece
    counters: dict[tuple[str, int], int] = {}
    events_: list[tuple[str, int, int]] = []
    for kind, i, _j in ordered:
        key = (kind, i)
        events_.append((kind, i, counters.get(key, 0)))
        counters[key] = counters.get(key, 0) + 1
    role_first = draw(st.booleans())
    chunks: list[bytes] = []
    if role_first:
        chunks.append(chunk({"role": "assistant", "content": draw(st.sampled_from(["", None]))}))
    order: list[str] = []
    seen_calls: set[int] = set()
    call_order: list[int] = []  # the calls by first appearance: the order of their items
    text_started = False
    for kind, i, j in events_:
        if kind == "text":
            chunks.append(chunk({"content": pieces[j]}))
            if pieces[j] and not text_started:
                text_started = True
                order.append("message")
        else:
            name, call_id, split = calls[i]
            delta: dict[str, Any] = {"index": i, "function": {"arguments": split[j]}}
            if j == 0:
                delta["function"]["name"] = name
                delta["type"] = "function"
                if call_id is not None:
                    delta["id"] = call_id
            chunks.append(chunk({"tool_calls": [delta]}))
            if i not in seen_calls:
                seen_calls.add(i)
                call_order.append(i)
                order.append("function_call")
    finish = draw(st.sampled_from(["stop", "length", "tool_calls", "content_filter"]))
    usage = draw(st.one_of(st.none(), st.tuples(st.integers(0, 10**6), st.integers(0, 10**6))))
    if draw(st.booleans()):
        chunks.append(chunk({}, finish))
    elif chunks:
        last = json.loads(chunks[-1])
        last["choices"][0]["finish_reason"] = finish
        chunks[-1] = json.dumps(last).encode()
    else:
        chunks.append(chunk({}, finish))
    if usage is not None:
        chunks.append(usage_chunk(*usage))
    return Turn(
        chunks,
        "".join(pieces),
        [(calls[i][0], calls[i][1], "".join(calls[i][2])) for i in call_order],
        order,
        finish,
        usage,
        [(name, call_id, "".join(split)) for name, call_id, split in calls],
    )


def check_response(final: Any, turn: Turn) -> None:
    """The SDK's response object says what the chat stream said."""
    incomplete = turn.finish in ("length", "content_filter")
    assert final.status == ("incomplete" if incomplete else "completed")
    assert final.id == "resp_1" and final.model == "m"
    assert [item.type for item in final.output] == turn.order
    assert final.output_text == turn.text
    got = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in got] == [(name, args) for name, _id, args in turn.calls]
    ids = [c.call_id for c in got]
    assert len(set(ids)) == len(ids) and all(ids)
    for call, (_name, call_id, _args) in zip(got, turn.calls, strict=True):
        if call_id is not None:
            assert call.call_id == call_id
    if turn.usage is None:
        assert final.usage is None
    else:
        assert (final.usage.input_tokens, final.usage.output_tokens) == turn.usage
        assert final.usage.total_tokens == sum(turn.usage)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns())
def test_random_streams_read_back_by_the_sdk(turn: Turn) -> None:
    stream = ResponsesStream("m", "resp_1", 1700000000)
    out = stream.start()
    for raw in turn.chunks:
        out += stream.chunk(raw)
    out += stream.done()
    seen, final = sdk_stream(out)
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    check_response(final, turn)
    # the deltas the SDK saw add up to the text
    deltas = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert deltas == turn.text


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns())
def test_random_turns_folded_read_back_by_the_sdk(turn: Turn) -> None:
    folded = fold(turn.chunks, "m", "resp_1", 1700000000)
    response = sdk_create(folded)
    assert isinstance(response, openai.types.responses.Response)
    check_response(response, turn)
    assert json.loads(folded)["output_text"] == turn.text
    # one whole chat.completion (a non-streaming backend) folds to the same
    whole = msgspec.json.encode(aggregate_chunks(turn.chunks))
    again = sdk_create(fold([whole], "m", "resp_1", 1700000000))
    check_response(again, turn.as_whole())


# -- the backends' dialects ------------------------------------------------------------------------


def _ollama_like() -> list[bytes]:
    head = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "llama3",
        "system_fingerprint": "fp_ollama",
    }
    call = {
        "id": "call_abc",
        "index": 0,
        "type": "function",
        "function": {"name": "shell", "arguments": '{"cmd":"ls"}'},
    }
    frames = [
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": "Let me look."},
                    "finish_reason": None,
                }
            ],
        },
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": "", "tool_calls": [call]},
                    "finish_reason": None,
                }
            ],
        },
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "finish_reason": "tool_calls",
                }
            ],
        },
        {
            **head,
            "choices": [],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        },
    ]
    return [json.dumps(f).encode() for f in frames]


def _vllm_like() -> list[bytes]:
    head = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 1, "model": "qwen"}

    def c(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        return json.dumps(
            {
                **head,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}
                ],
            }
        ).encode()

    return [
        c({"role": "assistant", "content": ""}),
        c({"content": "Let me look."}),
        c(
            {
                "tool_calls": [
                    {
                        "id": "chatcmpl-tool-9",
                        "type": "function",
                        "index": 0,
                        "function": {"name": "shell"},
                    }
                ]
            }
        ),
        c({"tool_calls": [{"index": 0, "function": {"arguments": '{"cmd":'}}]}),
        c({"tool_calls": [{"index": 0, "function": {"arguments": '"ls"}'}}]}),
        c({}, "tool_calls", stop_reason=None),
        json.dumps(
            {
                **head,
                "choices": [],
                "usage": {"prompt_tokens": 10, "total_tokens": 15, "completion_tokens": 5},
            }
        ).encode(),
    ]


def _llamacpp_like() -> list[bytes]:
    def c(
        delta: dict[str, Any], finish: str | None = None, choices: bool = True, **extra: Any
    ) -> bytes:
        frame = {
            "choices": [{"finish_reason": finish, "index": 0, "delta": delta}] if choices else [],
            "created": 1,
            "id": "chatcmpl-3",
            "model": "gguf",
            "system_fingerprint": "b1",
            "object": "chat.completion.chunk",
            **extra,
        }
        return json.dumps(frame).encode()

    return [
        c({"role": "assistant", "content": None}),
        c({"content": "Let me look."}),
        c(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "Xy12",
                        "type": "function",
                        "function": {"name": "shell", "arguments": '{"cmd'},
                    }
                ]
            }
        ),
        c({"tool_calls": [{"index": 0, "function": {"arguments": '":"ls"}'}}]}),
        c({}, "tool_calls"),
        c(
            {},
            choices=False,
            usage={"completion_tokens": 5, "prompt_tokens": 10, "total_tokens": 15},
            timings={"prompt_n": 10},
        ),
    ]


def _litellm_like() -> list[bytes]:
    head = {"id": "chatcmpl-4", "created": 1, "model": "gpt", "object": "chat.completion.chunk"}

    def c(choice: dict[str, Any], **extra: Any) -> bytes:
        return json.dumps({**head, "choices": [choice], **extra}).encode()

    usage = {
        "completion_tokens": 5,
        "prompt_tokens": 10,
        "total_tokens": 15,
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    return [
        c({"index": 0, "delta": {"content": "Let me look.", "role": "assistant"}}),
        c(
            {
                "index": 0,
                "delta": {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "call_q",
                            "function": {"arguments": "", "name": "shell"},
                            "type": "function",
                            "index": 0,
                        }
                    ],
                },
            }
        ),
        c(
            {
                "index": 0,
                "delta": {
                    "tool_calls": [
                        {"function": {"arguments": '{"cmd":"ls"}'}, "type": "function", "index": 0}
                    ]
                },
            }
        ),
        c({"finish_reason": "tool_calls", "index": 0, "delta": {}}),
        c({"index": 0, "delta": {}}, usage=usage),
    ]


def _finish_with_usage_inside() -> list[bytes]:
    return [
        chunk({"role": "assistant"}),
        chunk({"content": "Let me look."}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_z",
                        "type": "function",
                        "function": {"name": "shell", "arguments": '{"cmd":"ls"}'},
                    }
                ]
            }
        ),
        chunk(
            {},
            "tool_calls",
            usage={"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        ),
    ]


@pytest.mark.parametrize(
    "chunks",
    [_ollama_like(), _vllm_like(), _llamacpp_like(), _litellm_like(), _finish_with_usage_inside()],
    ids=["ollama", "vllm", "llamacpp", "litellm", "usage-in-finish"],
)
def test_dialects(chunks: list[bytes]) -> None:
    for final in (sdk_stream(run_stream(chunks))[1], sdk_create(fold(chunks, "m", "resp_1", 1))):
        assert final.status == "completed"
        assert final.output_text == "Let me look."
        message, call = final.output
        assert message.type == "message" and call.type == "function_call"
        assert call.name == "shell" and json.loads(call.arguments) == {"cmd": "ls"}
        assert call.call_id
        assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (
            10,
            5,
            15,
        )


def test_a_whole_chat_completion_folds() -> None:
    whole = {
        "id": "chatcmpl-5",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Done.",
                    "reasoning_content": "thought",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 1},
        },
    }
    response = sdk_create(fold([json.dumps(whole).encode()], "m", "resp_9", 7))
    assert response.id == "resp_9" and response.created_at == 7 and response.object == "response"
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.output_text == "Done." and response.output[2].call_id == "call_1"
    assert response.usage.input_tokens_details.cached_tokens == 1
