"""The paths a stream can take from the simulator to the bench, each with the same ``run``.

``run(n, sessions, latency, tag)`` starts ``n`` streams at once, spread round-robin over
``sessions`` sessions (Chat Channels for the runner paths, session sockets for the floor, the
``X-Chat-Session`` header for the front door; plain concurrent requests where a path has no
sessions), waits for all of them and returns an ``Outcome``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from bench.common import Child
from bench.sinks import FloorSession, SinkChannel, SSEClient, Stream, clock


@dataclass
class Outcome:
    events: int = 0
    start: float = 0.0
    end: float = 0.0
    # (stream key, token index, received at): key is ("tag", tag) or ("id", sim id)
    tokens: list[tuple[tuple[str, str], int, float]] = field(default_factory=list)
    firsts: list[float] = field(default_factory=list)  # first event received - request sent
    errors: list[str] = field(default_factory=list)


def chat_body(tag: str) -> dict[str, object]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": f"bench-tag-{tag}"}],
        "stream": True,
    }


def messages_body(tag: str) -> dict[str, object]:
    """The same turn as ``chat_body``, as an Anthropic Messages request (``POST /v1/messages``)."""
    return {
        "model": "sim-model",
        "max_tokens": 4096,
        "messages": [{"role": "user", "content": f"bench-tag-{tag}"}],
        "stream": True,
    }


def responses_body(tag: str) -> dict[str, object]:
    """The same turn as ``chat_body``, as a Responses API request (``POST /v1/responses``)."""
    return {"model": "sim-model", "input": f"bench-tag-{tag}", "stream": True}


def _collect(streams: list[Stream], start: float) -> Outcome:
    out = Outcome(start=start)
    for s in streams:
        out.events += s.events
        out.end = max(out.end, s.last_at)
        if s.first_at is not None:
            out.firsts.append(s.first_at - s.sent)
        out.tokens.extend((("tag", s.tag), tok, at) for tok, at in s.tokens)
        if s.error:
            out.errors.append(s.error)
    return out


class Path:
    name = ""
    sessions = True  # False: "n streams over k sessions" means nothing here
    procs: dict[str, tuple[Child, bool]]  # label -> (process, count its descendants too)

    async def run(
        self, n: int, sessions: int, latency: bool, tag: str, stagger: float = 0.0
    ) -> Outcome:
        """``n`` streams over ``sessions``; stream ``i`` starts ``i * stagger`` s after the first."""
        raise NotImplementedError


async def _later(delay: float, fn, *args) -> None:  # type: ignore[no-untyped-def]
    if delay > 0:
        await trio.sleep(delay)
    await fn(*args)


class ChannelPath(Path):
    """A relay (the runner, the plain peer) → lean sink: ``chat.completion.request`` frames down
    the sink's Chat Channels, chunk frames back."""

    def __init__(self, name: str, proc: str, relay: Child, channels: list[SinkChannel]) -> None:
        self.name = name
        self.procs = {proc: (relay, False)}
        self.channels = channels

    async def run(
        self, n: int, sessions: int, latency: bool, tag: str, stagger: float = 0.0
    ) -> Outcome:
        streams = [Stream(f"{tag}-{i}", latency) for i in range(n)]
        start = clock()
        async with trio.open_nursery() as nursery:
            for i, s in enumerate(streams):
                nursery.start_soon(
                    _later, i * stagger, self.channels[i % sessions].turn, chat_body(s.tag), s
                )
        return _collect(streams, start)


class HttpPath(Path):
    """An SSE client reading one HTTP endpoint: the simulator, the hub's front door (chat
    completions, Messages, Responses: ``body`` makes the request of a tag), LiteLLM."""

    def __init__(
        self,
        name: str,
        client: SSEClient,
        procs: dict[str, tuple[Child, bool]],
        sessions: bool,
        body: Callable[[str], dict[str, object]] = chat_body,
    ) -> None:
        self.name = name
        self.client = client
        self.procs = procs
        self.sessions = sessions
        self.body = body

    async def run(
        self, n: int, sessions: int, latency: bool, tag: str, stagger: float = 0.0
    ) -> Outcome:
        streams = [Stream(f"{tag}-{i}", latency) for i in range(n)]
        start = clock()
        async with trio.open_nursery() as nursery:
            for i, s in enumerate(streams):
                body = json.dumps(self.body(s.tag)).encode()
                session = f"bench-{i % sessions}" if self.sessions else None
                nursery.start_soon(_later, i * stagger, self.client.stream, body, s, session)
        return _collect(streams, start)


class FloorPath(Path):
    """A floor forwarder: raw backend bytes on shared session sockets."""

    def __init__(self, name: str, floor: Child, sessions: list[FloorSession]) -> None:
        self.name = name
        self.procs = {"floor": (floor, False)}
        self.floor = floor
        self.socks = sessions

    async def run(
        self, n: int, sessions: int, latency: bool, tag: str, stagger: float = 0.0
    ) -> Outcome:
        used = self.socks[:sessions]
        for s in used:
            s.reset(latency)
        per = [0] * sessions
        start = clock()
        t0 = trio.current_time()
        sent: list[float] = []
        for i in range(n):
            if i and stagger > 0:
                await trio.sleep_until(t0 + i * stagger)
            per[i % sessions] += 1
            sent.append(clock())
            await used[i % sessions].request(json.dumps(chat_body(f"{tag}-{i}")).encode())
        with trio.move_on_after(120):
            async with trio.open_nursery() as nursery:
                for s, count in zip(used, per, strict=True):
                    nursery.start_soon(s.wait_dones, count)
                nursery.start_soon(self._settled, used, nursery.cancel_scope)
        out = Outcome(start=start)
        for s in used:
            out.events += s.events
            out.end = max(out.end, s.last_at)
            out.tokens.extend((("id", f"chatcmpl-sim-{sid}"), tok, at) for sid, tok, at in s.tokens)
        if n == 1 and used[0].first_at is not None:
            out.firsts.append(used[0].first_at - sent[0])
        return out

    async def _settled(self, used: list[FloorSession], scope: trio.CancelScope) -> None:
        """Fallback end: the floor has nothing in flight and the sink got every byte it forwarded
        (a [DONE] cut in two by a backend read that filled the buffer is not counted)."""
        await trio.sleep(1)
        while True:
            status = await self.floor.rpc("status")
            if status["active"] == 0 and status["bytes"] == sum(s.bytes for s in self.socks):
                scope.cancel()
                return
            await trio.sleep(0.5)
