"""Which models each runner serves: asked on every channel a runner opens (and, for a runner
with no channel and no known list, on a listing job offered to it alone), kept on the board
(where the dispatcher places sessions by model) and in the store (across restarts).

``/v1/models`` is the union of the live runners' lists: steady, never one runner's answer.
"""

from __future__ import annotations

import logging
import math
import time
import uuid

import trio

from gateway.hub.board import Job, JobBoard
from gateway.hub.bounds import MAX_MODELS, MAX_TEXT, too_many
from gateway.hub.channel import Channels, Reply, ServerChannel
from gateway.hub.settings import HubSettings
from gateway.hub.store import ModelList, Store
from gateway.wire import protocol
from gateway.wire.protocol import ModelsFrame

log = logging.getLogger("gateway.hub.catalog")

LISTING_DEFINITION = {"jobType": "chat_llm", "needs": [protocol.CAPABILITY], "purpose": "models"}
RETRY_LISTING = 300.0  # s: a runner that did not list its models is asked again after this
UNLISTED = "unlisted"  # the ledger's and the metrics' name of a model no runner listed
MAX_LABEL = MAX_TEXT  # characters of a model name the ledger and the metrics keep


class ModelsAnswer:
    """The sink of one ``chat.models.request``: its answer, or None (lost, or an error)."""

    def __init__(self) -> None:
        self.models: list[str] | None = None
        self.refused: str | None = None  # the bound a list passed (then nothing of it is kept)
        self.contexts: dict[str, int] = {}
        self.extensions: frozenset[str] = frozenset()  # of the hello's, those it took up
        self.done = trio.Event()

    def chunk(self, chunk: object, frame: bytes) -> None:
        pass

    def flush(self) -> None:
        pass

    def reply(self, frame: Reply) -> None:
        if isinstance(frame, ModelsFrame):
            self.refused = too_many("the models list", frame.models, MAX_MODELS, MAX_LABEL)
            if self.refused is None:
                self.models = list(frame.models)
                listed = set(self.models)  # a context only for a model listed (bounded with it)
                self.contexts = {m: n for m, n in (frame.contexts or {}).items() if m in listed}
                self.extensions = frozenset(frame.extensions or ())
        self.done.set()

    def lost(self) -> bool:
        self.done.set()
        return False

    def resume_count(self) -> int:
        return 0

    def resumed(self) -> None:
        pass


class Catalog:
    """The models of every runner of the hub (see the module's docstring); ``run`` asks."""

    def __init__(
        self, store: Store, settings: HubSettings, board: JobBoard, channels: Channels
    ) -> None:
        self.store = store
        self.settings = settings
        self.board = board
        self.channels = channels
        self._lists: dict[str, tuple[str, ...]] = {}  # runner id -> its last list
        # runner id -> the context length of each model it listed whose backend says it (kept in
        # memory only: asked again on every channel a runner opens)
        self._contexts: dict[str, dict[str, int]] = {}
        # (owner, project, model) -> context_of's answer, as live_lists keeps its own
        self._context: dict[tuple[str, str, str], tuple[int | None, int, int, float]] = {}
        # runner id -> the extensions of the hello it took up, as its last models answer said
        self._extensions: dict[str, frozenset[str]] = {}
        self._listed: dict[str, int] = {}  # model -> how many runners' lists name it
        # per project, ``live_lists``' answer and what it holds until: the next list kept, a
        # runner new or back (the board's ``generation``), or a counted runner going silent
        self._live: dict[tuple[str, str], tuple[list[str], int, int, int, float]] = {}
        self._version = 0  # bumped whenever a runner's list changes
        self.walks = 0  # times ``live_lists`` walked the runners (tests count them)
        self._loaded: set[tuple[str, str]] = set()  # projects whose stored lists were read
        self._asking: set[str] = set()  # runner ids asked right now
        # runners that did not answer a models request (a runner without chat.models.request:
        # its list stays unknown, and no turn waits for it)
        self._silent: set[str] = set()
        # runner id -> the listing job offered to it alone, and when it was offered
        self._listing: dict[str, tuple[Job, float]] = {}
        self._failed: dict[str, float] = {}  # runner id -> when a listing gave nothing
        self._send: trio.MemorySendChannel[ServerChannel] | None = None
        self._offered = trio.Event()  # a listing job was offered
        self.answered = trio.Event()  # set (and renewed) whenever a runner's list comes
        channels.on_open.append(self._opened)

    # -- what is known ---------------------------------------------------------------------

    async def load(self, owner: str, project: str) -> None:
        """The project's runners' stored lists (once: what a runner lists later is kept here)."""
        if (owner, project) in self._loaded:
            return
        self._loaded.add((owner, project))
        for stored in await self.store.load_models(owner, project):
            if stored.runner_id not in self._lists:
                self._set(stored.runner_id, stored.models)
            state = self.board.runners.get(stored.runner_id)
            if state is not None and state.models is None:
                state.models = frozenset(stored.models)

    def label(self, model: str | None) -> str:
        """A turn's model as the ledger and the metrics name it: "" for the runner's default,
        the model when a runner listed it (capped), else ``UNLISTED`` (a client's made-up name
        never becomes a metrics series or a stored row of its own)."""
        if not model:
            return ""
        return model[:MAX_LABEL] if model in self._listed else UNLISTED

    def _set(self, runner_id: str, models: tuple[str, ...]) -> None:
        """A runner's list kept, and the models listed counted (``label`` looks there)."""
        old = self._lists.get(runner_id)
        if old == models:
            return
        for model in set(old or ()):
            left = self._listed[model] - 1
            if left:
                self._listed[model] = left
            else:
                del self._listed[model]
        for model in set(models):
            self._listed[model] = self._listed.get(model, 0) + 1
        self._lists[runner_id] = models
        self._version += 1

    def of_runner(self, runner_id: str) -> list[str] | None:
        """The models the runner listed last (None: not known)."""
        found = self._lists.get(runner_id)
        return None if found is None else list(found)

    def context_of(self, owner: str, project: str, model: str) -> int | None:
        """The largest context length (tokens) the project's live runners that list ``model``
        said for it; None when one of them did not say it (its may be larger) or none lists it.
        Kept as ``live_lists`` keeps its answer (no walk over the fleet per turn); nothing to
        find while no runner said a context."""
        if not self._contexts:
            return None
        board = self.board
        now = trio.current_time()
        cached = self._context.get((owner, project, model))
        if (
            cached is not None
            and cached[1] == self._version
            and cached[2] == board.generation
            and now <= cached[3]
        ):
            return cached[0]
        largest: int | None = None
        until = math.inf
        for runner_id in board.runners.of(owner, project):
            if not board.alive(runner_id):
                continue
            until = min(until, board.last_seen[runner_id] + self.settings.offline_after)
            if model not in self._lists.get(runner_id, ()):
                continue
            context = self._contexts.get(runner_id, {}).get(model)
            if context is None:
                largest = None
                break
            largest = context if largest is None else max(largest, context)
        self._context[(owner, project, model)] = (largest, self._version, board.generation, until)
        return largest

    async def embeds(self, ch: ServerChannel) -> bool:
        """Whether the channel's runner took up the embeddings extension (docs/protocol.md §6):
        as its last models answer said, else asked now (within ``models_timeout``)."""
        if ch.runner_id not in self._extensions:
            await self.ask(ch, self.settings.models_timeout)
        return protocol.EMBEDDINGS in self._extensions.get(ch.runner_id, frozenset())

    def live_lists(self, owner: str, project: str) -> tuple[list[str], int]:
        """(every model the project's live runners listed, in order; how many live runners have
        not listed theirs). Computed again only when it may have changed (a list kept, a runner
        new or back, one of those counted gone silent): not a walk over the fleet per turn."""
        board = self.board
        now = trio.current_time()
        cached = self._live.get((owner, project))
        if (
            cached is not None
            and cached[2] == self._version
            and cached[3] == board.generation
            and now <= cached[4]
        ):
            return list(cached[0]), cached[1]
        self.walks += 1
        models: dict[str, None] = {}
        unknown = 0
        until = math.inf  # the first of the counted runners to go silent goes then
        for runner_id, state in board.runners.of(owner, project).items():
            if not board.alive(runner_id):
                continue
            until = min(until, board.last_seen[runner_id] + self.settings.offline_after)
            found = self._lists.get(runner_id)
            if found is None:
                unknown += 1
            else:
                if state.models is None:
                    state.models = frozenset(found)
                models.update(dict.fromkeys(found))
        listed = list(models)
        self._live[(owner, project)] = (listed, unknown, self._version, board.generation, until)
        return list(listed), unknown

    def known(self, owner: str, project: str) -> list[str] | None:
        """Every model the project's live runners serve when each of them listed its models;
        None when that is not known (then no model is refused)."""
        models, unknown = self.live_lists(owner, project)
        if unknown or not models:
            return None
        return models

    async def listing(self, owner: str, project: str) -> list[str] | None:
        """The models for ``/v1/models``: the live runners' lists; a live runner whose list is
        not known yet but can be asked is asked, and waited for (``models_wait`` at most), so
        that a first read is the union too, not the first runner's answer. None: no runner is
        live."""
        await self.load(owner, project)
        deadline = trio.current_time() + self.settings.models_wait
        while True:
            await self._want(owner, project)
            models, unknown = self.live_lists(owner, project)
            if not self._coming(owner, project):
                return models if models or unknown else None
            with trio.move_on_at(deadline) as waited:
                await self.answered.wait()
            if waited.cancelled_caught:
                return self.live_lists(owner, project)[0]

    async def discover(self, owner: str, project: str) -> None:
        """Ask the project's live runners whose models are not known yet, without waiting for
        their answers (the status page shows them at its next read)."""
        await self.load(owner, project)
        await self._want(owner, project)

    def _coming(self, owner: str, project: str) -> bool:
        """Whether a live runner of the project whose list is not known is being asked for it
        (on its channel, or on a listing job offered to it)."""
        board = self.board
        for runner_id in board.runners.of(owner, project):
            if not board.alive(runner_id):
                continue
            if runner_id in self._lists:
                continue
            if runner_id in self._asking or runner_id in self._listing:
                return True
        return False

    async def refresh(self, owner: str, project: str) -> None:
        """Ask the project's open channels again (a kept list may be stale: a runner restarted
        with other models), at once and together, each within ``models_timeout``."""
        channels = [
            ch
            for ch in self.channels.all()
            if (state := self.board.runners.get(ch.runner_id)) is not None
            and (state.owner, state.project) == (owner, project)
        ]
        by_runner = {ch.runner_id: ch for ch in channels}  # one channel per runner is enough
        async with trio.open_nursery() as nursery:
            for ch in by_runner.values():
                nursery.start_soon(self.ask, ch, self.settings.models_timeout)

    # -- asking ------------------------------------------------------------------------

    def _opened(self, ch: ServerChannel) -> None:
        """Every channel that opens is asked for its runner's models (in ``run``'s task); a
        runner whose list is not known yet is marked as being asked (the dispatcher waits for
        its answer before it gives a turn that names a model to it)."""
        if self._send is not None and ch.runner_id not in self._asking:
            self._asking.add(ch.runner_id)
            try:
                self._send.send_nowait(ch)
            except trio.WouldBlock:
                self._asking.discard(ch.runner_id)
                return
            state = self.board.runners.get(ch.runner_id)
            if state is not None and state.models is None and ch.runner_id not in self._silent:
                state.listing = True

    async def _want(self, owner: str, project: str) -> None:
        """Offer a listing job to each live capable runner of the project whose models are not
        known and that has no channel open to ask."""
        board = self.board
        with_channel = self.channels.runners()
        now = trio.current_time()
        for runner_id, state in list(board.runners.of(owner, project).items()):
            if not board.alive(runner_id):
                continue
            if runner_id in self._lists or runner_id in self._listing:
                continue
            if runner_id in with_channel or now < self._failed.get(runner_id, -math.inf):
                continue
            if state.capabilities is not None and protocol.CAPABILITY not in state.capabilities:
                continue
            job = await board.enqueue(
                owner,
                project,
                [protocol.CAPABILITY],
                dict(LISTING_DEFINITION),
                origin="listing",
                runners=frozenset({runner_id}),
            )
            self._listing[runner_id] = (job, now)
            self._offered.set()
            log.info(
                "runner %s: its models are not known: offered listing job %s", runner_id, job.id
            )

    async def ask(self, ch: ServerChannel, within: float) -> list[str] | None:
        """``chat.models.request`` on ``ch``: its answer (kept and stored), or None."""
        rid = uuid.uuid4().hex
        answer = ModelsAnswer()
        ch.open(rid, answer)
        try:
            with trio.move_on_after(within):
                sent = await ch.send(
                    protocol.encode_frame(protocol.ModelsRequestFrame(ch.job_id, rid))
                )
                if sent:
                    await answer.done.wait()
        finally:
            ch.close_request(rid)
        models = answer.models
        if answer.refused is not None:
            log.warning(
                "the models answer of runner %s is refused, nothing of it kept: %s",
                ch.runner_id,
                answer.refused,
            )
        if models is None:
            log.info("no models from the channel of job %s (runner %s)", ch.job_id, ch.runner_id)
            self._silent.add(ch.runner_id)  # turns are not held for its answer again
            return None
        self._silent.discard(ch.runner_id)
        if self._contexts.get(ch.runner_id) != answer.contexts:
            self._contexts[ch.runner_id] = answer.contexts
            self._version += 1  # what context_of kept may have changed
        self._extensions[ch.runner_id] = answer.extensions
        await self._keep(ch, models)
        return models

    def learn(self, runner_id: str, models: tuple[str, ...]) -> None:
        """A runner's list as another replica of a team asked it (read from the store)."""
        if self._lists.get(runner_id) != models:
            self._contexts.pop(runner_id, None)  # not in the store: not known for this list
        self._set(runner_id, models)
        self._silent.discard(runner_id)
        state = self.board.runners.get(runner_id)
        if state is not None and state.models != frozenset(models):
            state.models = frozenset(models)
            state.listing = False
            self.board.changes.notify()  # the dispatcher places by model
        event, self.answered = self.answered, trio.Event()
        event.set()

    async def _keep(self, ch: ServerChannel, models: list[str]) -> None:
        job = self.board.jobs.get(ch.job_id)
        state = self.board.runners.get(ch.runner_id)
        owner, project = (job.owner, job.project) if job is not None else ("", "")
        if state is not None:
            owner, project = state.owner, state.project
            changed = state.models != frozenset(models)
            state.models = frozenset(models)
        else:
            changed = True
        self._set(ch.runner_id, tuple(models))
        self._failed.pop(ch.runner_id, None)
        self._wake()
        if changed:
            self.board.changes.notify()  # the dispatcher places by model
        await self.store.save_models(
            ModelList(ch.runner_id, owner, project, tuple(models), time.time())
        )
        await self.board.coordination.models_saved(ch.runner_id)

    def _wake(self) -> None:
        """Wake whoever waits for a runner's list (``answered``, renewed)."""
        event, self.answered = self.answered, trio.Event()
        event.set()

    async def _serve(self, ch: ServerChannel) -> None:
        try:
            models = await self.ask(ch, self.settings.models_timeout)
        finally:
            self._asking.discard(ch.runner_id)
            state = self.board.runners.get(ch.runner_id)
            if state is not None and state.listing:
                state.listing = False  # answered, or not within models_timeout: no more waiting
                self.board.changes.notify()
        listing = self._listing.get(ch.runner_id)
        ours = listing is not None and listing[0].id == ch.job_id  # a listing job's channel
        if ours:
            del self._listing[ch.runner_id]
            if models is None:
                self._failed[ch.runner_id] = trio.current_time() + RETRY_LISTING
        if models is None:
            self._wake()  # no list comes from it: a listing() waiting for it looks again
        if ours:
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                await self.channels.cancel_job(ch.job_id, "models listed")

    async def run(self) -> None:
        """Ask every channel that opens, until cancelled; listing jobs never claimed in
        ``models_wait`` are taken back."""
        send, receive = trio.open_memory_channel[ServerChannel](256)
        self._send = send
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._expire_listings)
            async for ch in receive:
                nursery.start_soon(self._serve, ch)

    async def _expire_listings(self) -> None:
        """Take back a listing job no runner claimed within ``models_wait`` (asleep while there
        is none: no timer runs for nothing)."""
        while True:
            if not self._listing:
                self._offered = trio.Event()
                await self._offered.wait()
                continue
            due = min(offered for _job, offered in self._listing.values())
            await trio.sleep_until(due + self.settings.models_wait)
            now = trio.current_time()
            wait = self.settings.models_wait
            for runner_id, (job, offered) in list(self._listing.items()):
                if job.over or (job.claimed_by is None and now - offered >= wait):
                    await self.board.withdraw(job.id, "its runner did not take it")
                    del self._listing[runner_id]
                    self._failed[runner_id] = now + RETRY_LISTING
                    self._wake()
