"""/v1/models without a session: open channels, else stored answers, else a listing session."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import trio

from gateway.hub.board import JobBoard
from gateway.hub.channel import Channels, ServerChannel
from gateway.hub.frontdoor.relay import next_reply
from gateway.hub.frontdoor.sessions import Sessions
from gateway.hub.http import HTTPError
from gateway.hub.settings import HubSettings
from gateway.hub.store import ModelList, Store
from gateway.wire import protocol

log = logging.getLogger("gateway.hub.frontdoor")


def model_ids(models: Any) -> list[str]:
    """The model ids of a ``chat.models.response`` (strings, or objects with an ``id``)."""
    out: list[str] = []
    for item in models if isinstance(models, list) else []:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict) and isinstance(item.get("id"), str):
            out.append(item["id"])
    return out


class Models:
    """Which models one project's runners serve, answered without waiting for a chat session."""

    def __init__(
        self,
        store: Store,
        settings: HubSettings,
        board: JobBoard,
        channels: Channels,
        sessions: Sessions,
    ) -> None:
        self.store = store
        self.settings = settings
        self.board = board
        self.channels = channels
        self.sessions = sessions
        self._listing: dict[tuple[str, str], trio.Lock] = {}  # one listing session per project
        # each project's runners' last model lists (read from the store once, then kept here)
        self._lists: dict[tuple[str, str], dict[str, tuple[str, ...]]] = {}

    async def known(self, owner: str, project: str) -> list[str] | None:
        """Every model the project's live runners list, when each of them has answered a models
        request (the answer is kept); None when that is not known (then nothing is refused)."""
        lists = await self._lists_of(owner, project)
        runners = [
            runner_id
            for runner_id, state in self.board.runners.items()
            if (state.owner, state.project) == (owner, project) and self.board.alive(runner_id)
        ]
        if not runners or any(runner_id not in lists for runner_id in runners):
            return None
        return list(dict.fromkeys(m for runner_id in runners for m in lists[runner_id]))

    async def of_runner(self, owner: str, project: str, runner_id: str) -> list[str] | None:
        """The models the runner listed last (None: it has not answered a models request)."""
        found = (await self._lists_of(owner, project)).get(runner_id)
        return None if found is None else list(found)

    async def unknown(self, owner: str, project: str, model: str) -> list[str] | None:
        """The models there are when no live runner of the project lists ``model``, else None
        (also when that is not known). A kept list may be stale (a runner restarted with other
        models): the project's open channels are asked again before a model is called unknown."""
        known = await self.known(owner, project)
        if known is None or model in known:
            return None
        await self._ask_open_channels(owner, project)
        known = await self.known(owner, project)
        return None if known is None or model in known else known

    async def _lists_of(self, owner: str, project: str) -> dict[str, tuple[str, ...]]:
        lists = self._lists.get((owner, project))
        if lists is None:
            stored = await self.store.load_models(owner, project)
            lists = self._lists.setdefault(
                (owner, project), {m.runner_id: m.models for m in stored}
            )
        return lists

    async def listing(self, owner: str, project: str) -> list[str]:
        """Every model id ``owner/project`` can serve, deduplicated, in order; HTTPError 503
        when no runner is known and none came to a listing session within ``models_wait``."""
        answers = await self._ask_open_channels(owner, project)
        if answers is not None:
            return answers
        known = await self._recent(owner, project)
        if known is not None:
            return known
        lock = self._listing.setdefault((owner, project), trio.Lock())
        async with lock:
            # a listing just before ours may have answered
            known = await self._recent(owner, project)
            if known is not None:
                return known
            return await self._listing_session(owner, project)

    async def _ask_open_channels(self, owner: str, project: str) -> list[str] | None:
        """The answers of the project's open channels; None when none is open or none answered."""
        channels = []
        for ch in self.channels.all():
            job = self.board.jobs.get(ch.job_id)
            if job is not None and (job.owner, job.project) == (owner, project):
                channels.append(ch)
        if not channels:
            return None
        answers: list[list[str] | None] = [None] * len(channels)

        async def ask(slot: int, ch: ServerChannel) -> None:
            answers[slot] = await self._ask(ch, self.settings.models_timeout, owner, project)

        async with trio.open_nursery() as nursery:
            for slot, ch in enumerate(channels):
                nursery.start_soon(ask, slot, ch)
        if all(answer is None for answer in answers):
            return None
        return list(dict.fromkeys(m for answer in answers if answer is not None for m in answer))

    async def _recent(self, owner: str, project: str) -> list[str] | None:
        """The last answers of runners seen within ``offline_after``; None when there are none."""
        now = trio.current_time()
        lists = [
            stored.models
            for stored in await self.store.load_models(owner, project)
            if now - self.board.last_seen.get(stored.runner_id, -float("inf"))
            <= self.settings.offline_after
        ]
        if not lists:
            return None
        return list(dict.fromkeys(m for models in lists for m in models))

    async def _listing_session(self, owner: str, project: str) -> list[str]:
        """A Chat Job opened only to ask ``chat.models.request``, then ended (``chat.end``)."""
        within = self.settings.models_wait
        deadline = trio.current_time() + within
        job_id, ch = await self.sessions.open_job(owner, project, within, " to list models")
        try:
            models = await self._ask(ch, max(deadline - trio.current_time(), 0.0), owner, project)
        finally:
            with trio.CancelScope(shield=True):
                await self.channels.cancel_job(job_id, "models listed")
        if models is None:
            raise HTTPError(
                503,
                f"the runner of job {job_id} did not answer {protocol.MODELS_REQUEST} "
                f"within {within:g} s",
                "no_models",
            )
        log.info("listing session %s: %d model(s)", job_id, len(models))
        return models

    async def _ask(
        self, ch: ServerChannel, within: float, owner: str, project: str
    ) -> list[str] | None:
        """``chat.models.request`` on one channel: its answer (also stored), or None."""
        rid = uuid.uuid4().hex
        rx = ch.open_request(rid)
        try:
            with trio.move_on_after(within):
                frame = protocol.ModelsRequestFrame(ch.job_id, rid)
                await ch.send(protocol.encode_frame(frame).decode())
                while True:
                    reply = await next_reply(rx)
                    if reply is None:
                        return None
                    if reply.type == protocol.MODELS_RESPONSE:
                        models = model_ids(reply.models)
                        listed = ModelList(ch.runner_id, owner, project, tuple(models), time.time())
                        await self.store.save_models(listed)
                        (await self._lists_of(owner, project))[ch.runner_id] = listed.models
                        return models
        except Exception as exc:
            log.info("no models from the channel of job %s: %r", ch.job_id, exc)
        finally:
            ch.close_request(rid)
        return None
