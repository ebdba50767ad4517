"""The Anthropic Messages stream translation (gateway/apis/messages/stream.py), no
sockets: chat chunks to SSE events and whole messages, read back by the ``anthropic`` SDK's own
parsers (a MockTransport hands it our bytes; no network)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import msgspec
import pytest
from anthropic.types import Message
from fake_anthropic import FakeAnthropic
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.apis.messages.stream import MessagesStream, fold, new_message_id

# -- helpers ---------------------------------------------------------------------------------


_SDK = FakeAnthropic()


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
