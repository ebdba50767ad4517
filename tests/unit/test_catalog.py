"""The model catalog (``gateway.hub.catalog.Catalog``) in memory: a store in memory, the board,
and runners whose channels answer ``chat.models.request`` in the test (a WebSocket stand-in that
hands the answer to the channel's reader), on trio's autojump clock. ``/v1/models`` is the union
of the live runners' lists, a silent runner's list leaves it, a list past its bound keeps
nothing, names nobody listed are labelled ``unlisted``, a runner with no channel and no known
list is offered a listing job of its own, and a context length is known only when every live
runner listing the model said it."""

from __future__ import annotations

from typing import Any

import msgspec
import trio
import trio.testing

from gateway.hub.board import Changes, JobBoard
from gateway.hub.bounds import MAX_MODELS
from gateway.hub.catalog import UNLISTED, Catalog
from gateway.hub.channel import Channels, ServerChannel
from gateway.hub.counters import HubCounters
from gateway.hub.settings import HubSettings
from gateway.hub.store import open_store
from gateway.wire.protocol import CAPABILITY, ModelsFrame, encode_frame


class Answering:
    """A channel's WebSocket stand-in: each models request sent is answered at once with
    ``models`` (and ``contexts``), through the channel's own reader."""

    def __init__(self, models: list[str], contexts: dict[str, int] | None = None) -> None:
        self.models = models
        self.contexts = contexts
        self.channel: ServerChannel | None = None
        self.asked = 0

    async def send_text(self, frame: bytes) -> None:
        self.asked += 1
        request = msgspec.json.decode(frame)
        answer = ModelsFrame(request["jobId"], request["requestId"], self.models, self.contexts)
        assert self.channel is not None
        await self.channel.on_texts([encode_frame(answer)])

    def close_nowait(self, code: int, reason: str) -> None:
        pass


class Hub:
    """The parts the catalog works with, in memory."""

    def __init__(self, **settings: Any) -> None:
        changes = Changes()
        self.store = open_store(None)
        self.board = JobBoard(self.store, HubSettings(**settings), changes)
        self.channels = Channels(self.board, changes, HubCounters())
        self.catalog = Catalog(self.store, self.board.settings, self.board, self.channels)

    def runner(self, runner_id: str, project: str = "p") -> None:
        self.board.seen(runner_id)
        self.board.polled(runner_id, "o", project, {CAPABILITY})

    async def listed(
        self, runner_id: str, models: list[str], contexts: dict[str, int] | None = None
    ) -> list[str] | None:
        """The runner's channel asked for its models (as the catalog asks every channel)."""
        ws = Answering(models, contexts)
        ch = ServerChannel(f"job-{runner_id}", runner_id, ws, self.channels)  # type: ignore[arg-type]
        ws.channel = ch
        return await self.catalog.ask(ch, within=5.0)


async def test_the_models_are_the_union_of_the_live_runners_lists_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hub = Hub(offline_after=60.0)
    for runner in ("r1", "r2", "other"):
        hub.runner(runner, "elsewhere" if runner == "other" else "p")
    assert await hub.listed("r1", ["a", "b"]) == ["a", "b"]
    assert hub.catalog.known("o", "p") is None  # r2's list not known yet: nothing refused
    assert await hub.listed("r2", ["b", "c"]) == ["b", "c"]
    await hub.listed("other", ["z"])
    assert hub.catalog.live_lists("o", "p") == (["a", "b", "c"], 0)
    assert hub.catalog.known("o", "p") == ["a", "b", "c"]
    assert hub.board.runners["r1"].models == frozenset({"a", "b"})  # the dispatcher reads it
    stored = {m.runner_id: m.models for m in await hub.store.load_models("o", "p")}
    assert stored == {"r1": ("a", "b"), "r2": ("b", "c")}

    await trio.sleep(30)
    hub.board.seen("r2")
    await trio.sleep(31)  # r1 silent for 61 s: its list leaves the union
    assert hub.catalog.live_lists("o", "p") == (["b", "c"], 0)


async def test_the_union_is_not_walked_again_until_something_changed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hub = Hub()
    hub.runner("r1")
    await hub.listed("r1", ["a"])
    hub.catalog.live_lists("o", "p")
    walks = hub.catalog.walks
    for _ in range(5):
        assert hub.catalog.live_lists("o", "p") == (["a"], 0)
    assert hub.catalog.walks == walks
    await hub.listed("r1", ["a", "b"])  # a list changed: walked once more
    assert hub.catalog.live_lists("o", "p") == (["a", "b"], 0)
    assert hub.catalog.walks == walks + 1


async def test_a_name_nobody_listed_is_labelled_unlisted() -> None:
    hub = Hub()
    hub.runner("r1")
    await hub.listed("r1", ["llama-3"])
    assert hub.catalog.label("llama-3") == "llama-3"
    assert hub.catalog.label("made-up-by-a-client") == UNLISTED
    assert hub.catalog.label(None) == "" and hub.catalog.label("") == ""
    await hub.listed("r1", ["qwen"])  # the runner no longer lists it
    assert hub.catalog.label("llama-3") == UNLISTED


async def test_a_list_past_its_bound_keeps_nothing() -> None:
    hub = Hub()
    hub.runner("r1")
    assert await hub.listed("r1", [f"m{i}" for i in range(MAX_MODELS + 1)]) is None
    assert hub.catalog.of_runner("r1") is None and hub.board.runners["r1"].models is None
    assert await hub.store.load_models("o", "p") == []


async def test_a_context_is_known_when_every_live_runner_listing_the_model_said_it() -> None:
    hub = Hub()
    hub.runner("r1")
    hub.runner("r2")
    await hub.listed("r1", ["a", "b"], {"a": 8192, "b": 4096})
    await hub.listed("r2", ["a"], {"a": 32768})
    assert hub.catalog.context_of("o", "p", "a") == 32768  # the largest said
    assert hub.catalog.context_of("o", "p", "b") == 4096
    assert hub.catalog.context_of("o", "p", "nobody-lists-it") is None
    await hub.listed("r2", ["a", "b"])  # says no context for b now: b's may be larger
    assert hub.catalog.context_of("o", "p", "b") is None


async def test_a_runner_with_no_channel_and_no_known_list_is_offered_a_listing_job(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hub = Hub(models_wait=3.0)
    hub.runner("r1")
    start = trio.current_time()
    assert await hub.catalog.listing("o", "p") == []  # nobody answered within models_wait
    assert trio.current_time() - start == 3.0
    (job,) = hub.board.jobs.values()
    assert job.runners == frozenset({"r1"}) and job.origin == "listing"
    assert job.agent_definition["purpose"] == "models"
    await hub.catalog.discover("o", "p")
    assert len(hub.board.jobs) == 1  # offered once, not again while it stands
