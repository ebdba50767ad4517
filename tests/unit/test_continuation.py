"""The one continuation module both sides use (gateway/apis/continuation.py), in memory: the
answer so far, the body that asks for the rest and the stitch, with the runner's rules (the
defaults) and the hub's (``text_only=False``, ``extend=False``). The runs over sockets are in
tests/test_continue.py (the runner) and tests/test_turn_faults.py (the hub)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import msgspec
import pytest

from gateway.apis.continuation import SoFar, Stitch, answer_so_far, continuation_body


def chunk(delta: dict[str, Any] | None = None, **fields: Any) -> bytes:
    choice: dict[str, Any] = {"index": fields.pop("index", 0), "delta": delta or {}}
    if "finish_reason" in fields:
        choice["finish_reason"] = fields.pop("finish_reason")
    obj = {"id": "c-1", "object": "chat.completion.chunk", "choices": [choice], **fields}
    return json.dumps(obj).encode()


TEXT = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "Hel"}),
    chunk({"content": "lo"}),
]


@pytest.mark.parametrize("text_only", [True, False])
def test_the_text_so_far_and_the_first_id_on_both_sides(text_only: bool) -> None:
    assert answer_so_far(TEXT, text_only=text_only) == SoFar("c-1", "Hello", False)
    finished = [*TEXT, chunk({}, finish_reason="stop")]
    assert answer_so_far(finished, text_only=text_only) == SoFar("c-1", "Hello", True)


def test_the_runner_reads_its_reads_payloads_and_msgspec_raw_is_read_as_the_hub_keeps_it() -> None:
    reads = [TEXT[:2], TEXT[2:]]
    assert answer_so_far(itertools.chain.from_iterable(reads)) == SoFar("c-1", "Hello", False)
    raws = [msgspec.Raw(c) for c in TEXT]
    assert answer_so_far(raws, text_only=False) == SoFar("c-1", "Hello", False)


@pytest.mark.parametrize("text_only", [True, False])
@pytest.mark.parametrize(
    "cut",
    [
        chunk({"tool_calls": [{"index": 0, "id": "t", "function": {"name": "f"}}]}),
        chunk({"function_call": {"name": "f", "arguments": ""}}),
        b"not json",
        b"[1, 2]",
    ],
)
def test_a_tool_call_begun_or_a_payload_that_is_no_chunk_is_never_continued(
    text_only: bool, cut: bytes
) -> None:
    assert answer_so_far([*TEXT, cut], text_only=text_only) is None


@pytest.mark.parametrize(
    "extra",
    [
        chunk({"reasoning_content": "think"}),
        chunk({"reasoning": "think"}),
        chunk({"content": "other"}, index=1),
    ],
)
def test_reasoning_or_a_second_choice_the_runner_refuses_the_hub_continues_its_text(
    extra: bytes,
) -> None:
    assert answer_so_far([*TEXT, extra]) is None
    hub = answer_so_far([*TEXT, extra], text_only=False)
    assert hub is not None and hub.text.startswith("Hello")


def test_the_hub_reads_a_whole_completions_message() -> None:
    whole = b'{"id":"w","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"}}]}'
    assert answer_so_far([whole], text_only=False) == SoFar("w", "Hi", False)


BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
PREFILLED = json.dumps(
    {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: "}],
    }
).encode()


def messages(body: bytes | None) -> list[dict[str, Any]]:
    assert body is not None
    return json.loads(body)["messages"]


@pytest.mark.parametrize("extend", [True, False])
def test_the_answer_so_far_becomes_the_final_assistant_message(extend: bool) -> None:
    out = continuation_body(BODY, "Hello", extend=extend)
    assert messages(out)[-1] == {"role": "assistant", "content": "Hello"}
    assert json.loads(out or b"")["model"] == "m"  # the rest of the request as it was


def test_the_runner_extends_a_final_assistant_message_the_hub_adds_its_own() -> None:
    assert messages(continuation_body(PREFILLED, "ok"))[1:] == [
        {"role": "assistant", "content": "Sure: ok"}
    ]
    assert messages(continuation_body(PREFILLED, "ok", extend=False))[1:] == [
        {"role": "assistant", "content": "Sure: "},
        {"role": "assistant", "content": "ok"},
    ]


@pytest.mark.parametrize("body", [b"not json", b"[]", b'{"messages": "x"}', b"{}"])
def test_a_body_without_a_list_of_messages_gets_none(body: bytes) -> None:
    assert continuation_body(body, "x") is None
    assert continuation_body(body, "x", extend=False) is None


def test_an_assistant_message_of_parts_is_not_extended() -> None:
    parts = json.dumps({"messages": [{"role": "assistant", "content": [{"type": "text"}]}]})
    assert continuation_body(parts.encode(), "x") is None


def test_stitch_gives_the_first_parts_id_and_drops_the_second_role_delta() -> None:
    stitch = Stitch("first")
    assert stitch(chunk({"role": "assistant"})) is None  # only who speaks: said already
    assert stitch(chunk({"role": "assistant", "content": ""})) is None
    out = stitch(chunk({"role": "assistant", "content": "x"}))
    assert out is not None
    obj = json.loads(out)
    assert obj["id"] == "first" and obj["choices"][0]["delta"] == {"content": "x"}
    end = stitch(chunk({}, finish_reason="stop"))  # a finish says something
    assert end is not None and json.loads(end)["choices"][0]["finish_reason"] == "stop"
    usage = chunk({}, usage={"prompt_tokens": 1, "completion_tokens": 2})
    assert stitch(usage) is not None
    assert stitch(b"[DONE]") == b"[DONE]"  # not a chunk: as it came


def test_stitch_without_a_first_id_keeps_the_chunks_own() -> None:
    out = Stitch(None)(chunk({"content": "x"}))
    assert out is not None and json.loads(out)["id"] == "c-1"


def test_stitch_a_reads_payloads_leaves_out_the_dropped() -> None:
    payloads = [chunk({"role": "assistant"}), chunk({"content": "a"}), chunk({"content": "b"})]
    out = Stitch("first").payloads(payloads)
    assert [json.loads(p)["choices"][0]["delta"]["content"] for p in out] == ["a", "b"]
