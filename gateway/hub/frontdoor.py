"""The front door's routes (``/v1``): the API key checked, each dialect's request mapped onto
one turn (``TurnSpec``) and handed to the hub's serving; and the models."""

from __future__ import annotations

import logging
import time

from gateway.apis import dialects, messages
from gateway.apis.dialects import TurnSpec
from gateway.apis.shapes import (
    context_exceeded,
    invalid_key,
    model_list,
    model_not_found,
    model_object,
    no_key,
    no_runner_connected,
    parse_chat_request,
)
from gateway.hub.catalog import Catalog
from gateway.hub.keys import Keys
from gateway.hub.serving import Serving, server_url
from gateway.hub.settings import HubSettings
from gateway.hub.store import ADMIN_TOKEN_PREFIX, ApiKey
from gateway.wire.errors import HTTPError
from gateway.wire.http import Request, bearer, header
from gateway.wire.traceparent import valid_traceparent

log = logging.getLogger("gateway.hub.frontdoor")

SESSION_HEADER = b"x-chat-session"
# The headers that name a session, first found wins, on every chat route: ours, then those the
# coding agents send by themselves (docs/hub.md "Sessions"), so that each of an agent's own
# sessions is one Chat Job of its own without any setting on the agent.
SESSION_HEADERS = (
    SESSION_HEADER,
    b"x-claude-code-session-id",  # Claude Code (2.1): one per `claude` session
    b"session-id",  # Codex CLI 0.171: its thread's id (also thread-id, prompt_cache_key)
    b"session_id",  # Codex CLI before it
    b"x-opencode-session",  # OpenCode
)
_SESSION_RANK = {name: n for n, name in enumerate(SESSION_HEADERS)}  # name -> its precedence
MAX_SESSION_ID = 200  # characters of a session id a client may name
# the session of a key's /v1/embeddings requests: one Chat Job of their own, never a chat's
EMBEDDINGS_SESSION = "embeddings"
SERVED = (
    "POST /v1/chat/completions",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "POST /v1/responses",
    "POST /v1/embeddings",
    "GET /v1/models",
)


class FrontDoor:
    """The ``/v1`` routes of one hub: chat completions, Anthropic Messages, the Responses API
    (one chat turn each), and the models."""

    def __init__(
        self, settings: HubSettings, keys: Keys, catalog: Catalog, serving: Serving
    ) -> None:
        self.settings = settings
        self.keys = keys
        self.catalog = catalog
        self.serving = serving

    async def _key(self, req: Request) -> ApiKey:
        if header(req.scope, b"authorization") is None:
            raise no_key()
        token = bearer(req.scope)
        key = await self.keys.check(token) if token else None
        if key is None:
            raise _wrong_credential(token, self.keys)
        return key

    async def _anthropic_key(self, req: Request) -> ApiKey:
        """The API key of ``x-api-key`` or ``Authorization: Bearer`` (Anthropic's clients send
        the first); HTTPError 401 with Anthropic's ``authentication_error``."""
        raw = header(req.scope, b"x-api-key")
        token = raw.decode("latin-1").strip() if raw else bearer(req.scope)
        if not token:
            raise HTTPError(401, "x-api-key header is required", None, type_="authentication_error")
        key = await self.keys.check(token)
        if key is None:
            err = _wrong_credential(token, self.keys)
            raise HTTPError(401, err.message, None, type_="authentication_error")
        return key

    # -- /v1/models ----------------------------------------------------------------------

    async def list_models(self, req: Request) -> None:
        key = await self._key(req)
        await req.resp.json(200, model_list(await self._models(req, key), int(time.time())))

    async def retrieve_model(self, req: Request) -> None:
        key = await self._key(req)
        model_id = req.params["model"]
        if model_id not in await self._models(req, key):
            raise model_not_found(model_id)
        await req.resp.json(200, model_object(model_id, int(time.time())))

    async def _models(self, req: Request, key: ApiKey) -> list[str]:
        models = await self.catalog.listing(key.owner, key.project)
        if models is None:
            raise no_runner_connected(key.owner, key.project, server_url(req), " to list models")
        return models

    # -- the three chat APIs ------------------------------------------------------------

    async def chat(self, req: Request) -> None:
        """``POST /v1/chat/completions``: one chat turn."""
        key = await self._key(req)
        sid = _session_id(req)
        parsed = parse_chat_request(await req.body(self.settings.max_body))
        model = await self._model_for(key, parsed.model)
        spec = dialects.chat_spec(parsed, model, self.settings.count_usage)
        self._check_context(key, spec)
        await self.serving.serve(req, key, spec, sid, _traceparent(req))

    async def messages(self, req: Request) -> None:
        """``POST /v1/messages`` (Anthropic Messages): translated to one chat turn, the answer
        translated back; every error in Anthropic's shape."""
        try:
            key = await self._anthropic_key(req)
            sid = _session_id(req)
            request = dialects.messages_request(await req.body(self.settings.max_body))
            model = await self._model_for(key, request.model)
            spec = dialects.messages_spec(request, model)
            self._check_context(key, spec)
        except HTTPError as err:
            await req.resp.whole(err.status, dialects.anthropic_error_body(err), err.headers)
            return
        await self.serving.serve(req, key, spec, sid, _traceparent(req))

    async def count_tokens(self, req: Request) -> None:
        """``POST /v1/messages/count_tokens``: an estimate (characters / 4, images 1,600 each:
        the hub has no tokenizer of the runners' models)."""
        try:
            await self._anthropic_key(req)
            body = await req.body(self.settings.max_body)
            try:
                tokens = messages.count_tokens(body)
            except messages.MessagesError as exc:
                raise HTTPError(exc.status, exc.message, None, type_=exc.type) from None
        except HTTPError as err:
            await req.resp.whole(err.status, dialects.anthropic_error_body(err), err.headers)
            return
        await req.resp.json(200, {"input_tokens": tokens})

    async def responses(self, req: Request) -> None:
        """``POST /v1/responses`` (OpenAI Responses API): translated to one chat turn, the
        answer translated back."""
        key = await self._key(req)
        sid = _session_id(req)
        request = dialects.responses_request(await req.body(self.settings.max_body))
        model = await self._model_for(key, request.model)
        spec = dialects.responses_spec(request, model)
        self._check_context(key, spec)
        await self.serving.serve(req, key, spec, sid, _traceparent(req))

    async def embeddings(self, req: Request) -> None:
        """``POST /v1/embeddings``: carried to a runner whose backend serves the model, bodies
        verbatim both ways (docs/protocol.md §6, embeddings), counted in usage as a turn of the
        key's ``embeddings`` session (apart from its chat sessions: a chat job is not moved)."""
        key = await self._key(req)
        body = await req.body(self.settings.max_body)
        spec = dialects.embeddings_spec(body, None)
        model = await self._model_for(key, spec.model)
        if model != spec.model:
            spec = dialects.embeddings_spec(body, model)
        await self.serving.serve(req, key, spec, EMBEDDINGS_SESSION, _traceparent(req))

    async def not_served(self, req: Request) -> None:
        """``/v1/completions``: the channel carries chat turns and embeddings only."""
        raise HTTPError(
            404,
            f"{req.scope['path']} is not served by this hub (its runners carry chat turns "
            f"and embeddings only); it serves {', '.join(SERVED)}",
            "unknown_url",
        )

    def _check_context(self, key: ApiKey, spec: TurnSpec) -> None:
        """A turn whose prompt (estimated) is over the context its model's backend runs with is
        refused (400 ``context_length_exceeded``) before its admission: a backend would drop
        the start of the prompt without a word (issue 37, point 3). Only when every live runner
        that lists the model said its context: the largest of them is the bound."""
        if spec.model is None:
            return
        context = self.catalog.context_of(key.owner, key.project, spec.model)
        if context is None:
            return
        prompt = spec.dialect.prompt_estimate(spec.body)
        if prompt > context:
            raise context_exceeded(spec.model, prompt, context)

    async def _model_for(self, key: ApiKey, model: str | None) -> str | None:
        """The model the runner is asked for: ``model`` when a live runner of the project lists
        it (or the lists are not known), else the hub's ``default_model`` when one is set (a
        client with fixed model names: Claude Code), else 404 before any job is opened."""
        default = self.settings.default_model
        if model is None:
            return default
        await self.catalog.load(key.owner, key.project)
        known = self.catalog.known(key.owner, key.project)
        if known is None and default:
            await self.catalog.listing(key.owner, key.project)  # learn them first
            known = self.catalog.known(key.owner, key.project)
        if known is None or model in known:
            return model
        await self.catalog.refresh(key.owner, key.project)  # before a model is called unknown
        known = self.catalog.known(key.owner, key.project)
        if known is None or model in known:
            return model
        if default:
            return default
        raise model_not_found(model, known)


def _wrong_credential(token: str | None, keys: Keys) -> HTTPError:
    """401 for a token that is no API key; saying so when it is the hub's admin credential."""
    if token is not None and token.startswith(ADMIN_TOKEN_PREFIX) and keys.is_admin(token):
        return HTTPError(
            401,
            "This is the hub's admin credential, not an API key: make an API key with "
            "`alp-gateway hub keys create NAME` (or on the status page) and use that.",
            "invalid_api_key",
        )
    return invalid_key()


def _session_id(req: Request) -> str:
    """The session the client names in the first of ``SESSION_HEADERS`` it sends ("" without
    one); 400 past ``MAX_SESSION_ID`` characters. The request's headers are read once."""
    best = len(SESSION_HEADERS)
    name, text = b"", ""
    for key, value in req.scope["headers"]:
        if key in _SESSION_RANK and _SESSION_RANK[key] < best:
            if found := value.decode("latin-1").strip():
                best, name, text = _SESSION_RANK[key], key, found
    if len(text) > MAX_SESSION_ID:
        raise HTTPError(
            400,
            f"the {name.decode()} header is over {MAX_SESSION_ID} characters",
            "invalid_request",
        )
    return text


def _traceparent(req: Request) -> str | None:
    """The request's W3C ``traceparent`` header when well-formed (tracing: passed on to the
    runner in the Chat Job's definition or the turn's frame), else None."""
    raw = header(req.scope, b"traceparent")
    return valid_traceparent(raw.decode("latin-1")) if raw else None
