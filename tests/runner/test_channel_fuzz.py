"""Arbitrary frames (hypothesis) against the decoder and a live channel: the session survives,
every bad request with a requestId gets an error frame, oversized frames are refused."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import ADMIN, Turns, open_chat, request_frame, runner_config, running, send
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.hub import Hub, ServerChannel, open_hub
from gateway.sim import open_sim
from gateway.wire import protocol

# -- the decoder alone -------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
TYPES = [
    protocol.COMPLETION_REQUEST,
    protocol.COMPLETION_CANCEL,
    protocol.MODELS_REQUEST,
    protocol.END,
    "chat.completion.chunk",
    "chat.other",
    "",
]


@st.composite
def frame_objects(draw: Callable[..., Any], types: list[str] = TYPES) -> dict[str, Any]:
    obj: dict[str, Any] = draw(
        st.dictionaries(st.sampled_from(["jobId", "model", "body", "x"]), json_values, max_size=3)
    )
    obj["type"] = draw(st.sampled_from(types) | st.text(max_size=10))
    rid = draw(st.none() | st.text(min_size=1, max_size=12) | st.integers())
    if rid is not None:
        obj["requestId"] = rid
    if draw(st.booleans()):
        obj["body"] = draw(st.dictionaries(st.text(max_size=8), json_values, max_size=4))
    return obj


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=64),
        st.text(max_size=64),
        frame_objects().map(json.dumps),
        json_values.map(json.dumps),
    )
)
def test_decoder_never_raises_anything_but_frame_error(data: str | bytes) -> None:
    try:
        frame = protocol.decode_frame(data)
    except protocol.FrameError:
        return
    assert isinstance(
        frame,
        (
            protocol.CompletionRequest,
            protocol.CompletionCancel,
            protocol.ModelsRequest,
            protocol.End,
            protocol.Unknown,
        ),
    )


def test_deep_nesting_is_a_frame_error_with_the_request_id() -> None:
    deep = (
        '{"type":"chat.completion.request","requestId":"r9","body":{"a":'
        + "[" * 5000
        + "]" * 5000
        + "}}"
    )
    with pytest.raises(protocol.FrameError) as info:
        protocol.decode_frame(deep)
    assert info.value.request_id == "r9"


# -- a live channel, driven from hypothesis' thread -------------------------------------------


class Live:
    """Hub, simulator and runner in a trio loop on a thread; one open chat session."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.ready = threading.Event()
        self.token: trio.lowlevel.TrioToken | None = None
        self.stop: trio.Event | None = None
        self.error: BaseException | None = None
        self.counter = itertools.count()

    def run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by the fixture
            self.error = exc
            self.ready.set()

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self.stop = trio.Event()
        async with open_sim() as sim, open_hub(Hub(admin_token=ADMIN)) as (hub, url):
            config = runner_config(url, sim.url, self.state, max_frame_size=1 << 20)
            async with running(config) as runner:
                self.hub, self.sim, self.runner = hub, sim, runner
                self.job, self.channel = await open_chat(hub)
                self.turns = Turns(self.channel)
                self.ready.set()
                await self.stop.wait()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return trio.from_thread.run(fn, *args, trio_token=self.token)

    async def exchange(self, frames: list[str | bytes], expect: set[str]) -> None:
        n = next(self.counter)
        sentinel = f"sentinel-{n}"
        for frame in frames:
            await send(self.channel, frame)
        await send(self.channel, request_frame(self.job.id, sentinel, sim={"chunks": 1}))
        await self.turns.settled(*expect, within=20)  # done or error: the test checks each
        await self.turns.until(sentinel, within=20)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    live = Live(tmp_path_factory.mktemp("fuzz"))
    thread = threading.Thread(target=live.run, daemon=True)
    thread.start()
    assert live.ready.wait(30), "the live session did not start"
    if live.error:
        raise live.error
    yield live
    assert live.stop is not None
    trio.from_thread.run_sync(live.stop.set, trio_token=live.token)
    thread.join(10)


FUZZ_TYPES = [t for t in TYPES if t != protocol.END]  # chat.end ends the session by design


@st.composite
def bad_frames(draw: Callable[..., Any]) -> tuple[str | bytes, str | None]:
    """A frame to send and the requestId that must be answered (None: no answer required)."""
    kind = draw(st.sampled_from(["object", "json", "text", "binary", "huge", "deep", "foreign"]))
    if kind == "binary":
        return draw(st.binary(min_size=1, max_size=64)), None
    if kind == "text":
        return draw(st.text(max_size=64)), None
    if kind == "json":
        return json.dumps(draw(json_values)), None
    rid = "f" + draw(st.text(alphabet="abcdefghij0123456789", min_size=1, max_size=8))
    if kind == "huge":
        body = {
            "messages": [{"role": "user", "content": "x" * draw(st.integers(1, 200_000))}],
            "sim": {"chunks": 1},
        }
        return json.dumps(
            {"type": protocol.COMPLETION_REQUEST, "requestId": rid, "body": body}
        ), rid
    if kind == "deep":
        depth = draw(st.integers(600, 5000))
        nested = "[" * depth + "]" * depth
        text = f'{{"type":"chat.completion.request","requestId":"{rid}","body":{{"a":{nested}}}}}'
        return text, rid
    if kind == "foreign":
        return json.dumps(request_frame("some-other-job", rid)), rid
    obj = draw(frame_objects(FUZZ_TYPES))
    answered = obj.get("type") in (protocol.COMPLETION_REQUEST, protocol.MODELS_REQUEST)
    if answered and isinstance(obj.get("requestId"), str):
        obj["requestId"] = rid
        if isinstance(obj.get("body"), dict):
            obj["body"]["sim"] = {"chunks": 1}
        return json.dumps(obj), rid
    if "requestId" in obj and obj.get("type") == protocol.COMPLETION_CANCEL:
        obj["requestId"] = rid  # never one of ours
    return json.dumps(obj), None


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(bad_frames(), min_size=1, max_size=5))
def test_channel_survives_arbitrary_frames(
    live: Live, frames: list[tuple[str | bytes, str | None]]
) -> None:
    n = next(live.counter)
    sent: list[str | bytes] = []
    expect: set[str] = set()
    for data, rid in frames:
        if rid is not None:  # unique per example, so answers never mix across examples
            unique = f"{n}-{rid}"
            data = data.replace(f'"{rid}"', f'"{unique}"') if isinstance(data, str) else data
            rid = unique
            if rid in expect:
                continue
            expect.add(rid)
        sent.append(data)
    live.call(live.exchange, sent, expect)
    for rid in expect:
        assert live.turns.last(rid)["type"] in (
            "chat.completion.done",
            "chat.completion.error",
            "chat.models.response",
        )


def test_duplicate_request_id_in_flight_is_refused(live: Live) -> None:
    async def scenario() -> None:
        job = live.job
        await send(live.channel, request_frame(job.id, "dup", sim={"chunks": 40, "interval": 0.02}))
        stream = await live.sim.wait_for_streams(len(live.sim.streams) + 1)
        await stream.wait_sent(1)
        await send(live.channel, request_frame(job.id, "dup", sim={"chunks": 1}))
        await live.turns.until("dup", within=10, errors={"dup"})
        frames = live.turns.of("dup")
        errors = [f for f in frames if f["type"] == "chat.completion.error"]
        assert errors and "duplicate" in errors[0]["error"]
        # the original turn goes on to its own end
        with trio.fail_after(10):
            while not any(f["type"] == "chat.completion.done" for f in live.turns.of("dup")):
                await live.turns.next()

    live.call(scenario)


def test_oversized_frame_is_refused_and_the_session_survives(live: Live) -> None:
    async def scenario() -> None:
        old: ServerChannel = live.channel
        big = request_frame(live.job.id, "big", sim={"chunks": 1})
        big["body"]["messages"][0]["content"] = "x" * (2 << 20)  # over the 1 MiB limit set above
        await send(old, big)
        with trio.fail_after(10):
            await old.closed.wait()
        new = await live.hub.channels.wait(live.job.id, 15)
        assert new is not None and new is not old
        live.channel, live.turns = new, Turns(new)
        await live.exchange([], set())

    live.call(scenario)
