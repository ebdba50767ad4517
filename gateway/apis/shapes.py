"""OpenAI shapes at the front door: chat body, errors, SSE events, folded completions, models."""

from __future__ import annotations

import math
import re
import time
import uuid
from typing import Any

import msgspec

from gateway.wire import protocol
from gateway.wire.errors import HTTPError, error_envelope

OWNED_BY = "alp-runner"
DONE_EVENT = b"data: [DONE]\n\n"
KEEPALIVE = b": keepalive\n\n"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]

# -- errors ---------------------------------------------------------------------------


class Code:
    """The ``code`` of every answer that names why a turn could not be served (one place)."""

    NO_RUNNER = "no_runner"  # no runner of the key's project is connected (or none came in time)
    NO_CAPABLE_RUNNER = "no_capable_runner"  # runners connected, none advertises chat-llm:v1
    # every capable runner is at capacity, and the project's queue is full (503 + Retry-After)
    QUEUE_FULL = "queue_full"
    # every capable runner stayed at capacity while the request waited queue_wait in the queue
    QUEUE_TIMEOUT = "queue_timeout"
    MODEL_NOT_FOUND = "model_not_found"  # no runner of the project lists the model (404)
    TOO_MANY_SESSIONS = "too_many_sessions"  # the key holds max_sessions_per_key busy sessions
    SESSION_ENDED = "session_ended"  # the session was ended (its key revoked) under the turn
    # the prompt's estimate is over the context its runners' backend said for the model (400)
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    KEY_REVOKED = "api_key_revoked"  # the turn's API key was revoked while it was in flight


def no_runner(within: float, what: str = "") -> HTTPError:
    """503: no capable runner came within ``within`` s (``what``: for what, when not a chat)."""
    message = f"no runner with {protocol.CAPABILITY} connected within {within:g} s{what}"
    return HTTPError(503, message, Code.NO_RUNNER)


def runner_gone(model: str, runners: str, waited: float) -> HTTPError:
    """503 with Retry-After: ``model`` is listed only by ``runners``, which stopped (their last
    poll withdrew chat-llm:v1), and none came back within ``waited`` s."""
    _, headers = _retry_after(waited)
    message = (
        f"model {model!r} is served only by runner {runners}, which stopped: waited {waited:g} s "
        "for it to come back"
    )
    return HTTPError(503, message, Code.NO_RUNNER, headers=headers)


def no_runner_connected(owner: str, project: str, server: str = "", what: str = "") -> HTTPError:
    """503 at once: no runner of the key's project gave a sign of life lately (other projects'
    runners are never named); the hint names this hub (``server``) as the runner's Server."""
    at = f" --server {server}" if server else ""
    message = (
        f"no runner is connected for project {owner}/{project}{what}: start one with "
        f"`alp-gateway run{at} --project {owner}/{project}`"
    )
    return HTTPError(503, message, Code.NO_RUNNER)


def no_capable_runner(connected: int, what: str = "") -> HTTPError:
    """503 at once: runners are connected, none advertises chat-llm:v1 and none holds a job."""
    message = (
        f"{connected} runner(s) connected, none advertises {protocol.CAPABILITY}{what}: their "
        "backends are down (see `alp-gateway doctor`)"
    )
    return HTTPError(503, message, Code.NO_CAPABLE_RUNNER)


def _retry_after(seconds: float) -> tuple[int, list[tuple[bytes, bytes]]]:
    retry_after = max(1, math.ceil(seconds))
    return retry_after, [(b"retry-after", str(retry_after).encode())]


def queue_full(
    busy: int, length: int, position: int, of: int, retry: float, what: str = ""
) -> HTTPError:
    """503 at once with Retry-After: every capable runner is at capacity and ``length``
    requests wait already (``position`` of ``of``: the place it would have taken)."""
    retry_after, headers = _retry_after(retry)
    message = (
        f"every runner is busy ({busy} at capacity) and the queue is full ({length} waiting): "
        f"position {position} of {of}{what}: retry in {retry_after} s, or start another runner"
    )
    return HTTPError(503, message, Code.QUEUE_FULL, headers=headers)


def queue_timeout(busy: int, waited: float, position: int, of: int, what: str = "") -> HTTPError:
    """503 with Retry-After: the request waited ``waited`` s in the queue while every capable
    runner stayed at capacity (``position`` of ``of``: where it was when it gave up)."""
    retry_after, headers = _retry_after(waited)
    message = (
        f"every runner is busy ({busy} at capacity, none took this request within {waited:g} s "
        f"in the queue): position {position} of {of}{what}: retry in {retry_after} s, or start "
        "another runner"
    )
    return HTTPError(503, message, Code.QUEUE_TIMEOUT, headers=headers)


def too_many_sessions(limit: int) -> HTTPError:
    """429: the key holds ``limit`` sessions, all busy with a turn (none could be ended)."""
    message = (
        f"this API key already holds {limit} chat sessions, each with a turn in flight: wait for "
        "one to finish, or reuse a session (X-Chat-Session)"
    )
    return HTTPError(429, message, Code.TOO_MANY_SESSIONS, type_="rate_limit_error")


def channel_lost(message: str = "the chat channel to the runner was lost mid-turn") -> HTTPError:
    """502: the turn's channel went, and no other took it (as ``Turn.lose``'s answer)."""
    return HTTPError(502, message, "channel_lost")


def runner_busy(backlog: int, bound: int) -> HTTPError:
    """503 at once with Retry-After: the session's runner does not read its channel fast enough
    (``backlog`` bytes of requests wait unsent on it, ``bound`` at most)."""
    _, headers = _retry_after(1)
    message = (
        f"the runner of this chat session is not reading its requests ({backlog} bytes wait on "
        f"its channel, the hub's bound is {bound}): retry shortly"
    )
    return HTTPError(503, message, "runner_busy", headers=headers)


_BACKEND_STATUS = re.compile(r"^backend returned (\d{3})\b")
_PASSED_ON = {400, 404, 413, 422}  # the backend refused the request itself: the client's to fix


def upstream_error(message: str, code: str = "upstream_error") -> HTTPError:
    """502 for a turn the runner failed; but a backend's own 400/404/413/422 (``backend
    returned 404: ...``) is passed on as that status, a request error the SDKs do not retry."""
    found = _BACKEND_STATUS.match(message)
    if found is not None and int(found.group(1)) in _PASSED_ON:
        status = int(found.group(1))
        if status == 404 and "model" in message.lower():
            return HTTPError(404, message, Code.MODEL_NOT_FOUND, type_="invalid_request_error")
        return HTTPError(status, message, "invalid_request", type_="invalid_request_error")
    if _RUNNER_LACKS_MODEL.match(message):  # the runner's own answer (gateway/runner/backends.py)
        return HTTPError(404, message, Code.MODEL_NOT_FOUND, type_="invalid_request_error")
    return HTTPError(502, message, code)


_RUNNER_LACKS_MODEL = re.compile(r"model .* is not available on this runner")


def stream_error_event(message: str, code: str) -> bytes:
    """The SSE event that ends a stream already started with an error."""
    return b"data: " + error_envelope(message, "upstream_error", code) + b"\n\n"


def invalid_key() -> HTTPError:
    return HTTPError(401, "Incorrect API key provided.", "invalid_api_key")


def no_key() -> HTTPError:
    return HTTPError(
        401,
        "You didn't provide an API key. You need to provide your API key in an Authorization "
        "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
        "invalid_api_key",
    )


# -- the chat body ------------------------------------------------------------------------


class _ChatFields(msgspec.Struct):
    """What the front door reads of a chat-completions body (the rest is passed on unread)."""

    messages: list[msgspec.Raw]
    stream: bool | None = None
    model: Any = None
    stream_options: Any = None
    max_tokens: Any = None
    max_completion_tokens: Any = None


_chat_fields_decoder = msgspec.json.Decoder(_ChatFields)


class ChatBody(msgspec.Struct, frozen=True):
    """A valid chat-completions body as the front door read it (one decode). A frozen Struct,
    not a frozen dataclass: one is built per turn, and a frozen dataclass sets each field
    through ``object.__setattr__`` in Python."""

    body: bytes  # as the client sent it
    stream: bool
    model: str | None  # its ``model`` when a string
    stream_options: Any  # as given (None: absent)
    usage_asked: bool  # ``stream_options.include_usage`` is true
    max_tokens: int | None  # ``max_completion_tokens`` or ``max_tokens`` when a positive int


def _invalid_json(why: str) -> HTTPError:
    return HTTPError(
        400, f"We could not parse the JSON body of your request: {why}", "invalid_json"
    )


def parse_chat_request(body: bytes) -> ChatBody:
    """A valid chat-completions body, read once; HTTPError 400 otherwise (not JSON, not UTF-8,
    nested too deeply, ``messages`` missing or not a list, ``stream`` not a boolean)."""
    if not body.strip():
        raise _invalid_json("it is empty.")
    try:
        parsed = _chat_fields_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise HTTPError(
            400, f"Invalid chat completions request: {exc}", "invalid_request"
        ) from None
    except msgspec.DecodeError as exc:
        raise _invalid_json(str(exc)) from None
    except RecursionError:
        raise _invalid_json("it is nested too deeply.") from None
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        raise _invalid_json("it is not UTF-8.") from None
    options = parsed.stream_options
    asked = isinstance(options, dict) and options.get("include_usage") is True
    limit = parsed.max_completion_tokens
    if limit is None:
        limit = parsed.max_tokens
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        limit = None
    model = parsed.model if isinstance(parsed.model, str) else None
    return ChatBody(body, bool(parsed.stream), model, options, asked, limit)


IMAGE_TOKENS = 1600  # an image in a prompt estimate (as Anthropic's count_tokens counts one)


class _Message(msgspec.Struct):
    content: Any = None
    tool_calls: Any = None


class _Prompt(msgspec.Struct):
    messages: list[_Message] = []
    tools: Any = None


_prompt_decoder = msgspec.json.Decoder(_Prompt)


# what a chat template adds around the text (issue 35, point 5): each message's role and its
# delimiters (ChatML's ``<|im_start|>user\n ... <|im_end|>\n`` is 5 tokens, Llama 3's header and
# ``<|eot_id|>`` 5), and the assistant's turn opened for the answer (3); docs/hub.md has the error
MESSAGE_TOKENS = 5
REPLY_TOKENS = 3


def estimate_prompt_tokens(body: bytes) -> int:
    """A chat body's prompt tokens, ESTIMATED (the hub has no tokenizer): ``ceil(chars / 4)``
    over the messages' text, tool calls and tools, plus ``IMAGE_TOKENS`` per image, plus the
    chat template's ``MESSAGE_TOKENS`` a message and ``REPLY_TOKENS``. Read at admission (the
    token limits' and budgets' reservation) and when a turn ended without the backend's usage."""
    try:
        prompt = _prompt_decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return math.ceil(len(body) / 4)
    chars = 0
    images = 0
    for message in prompt.messages:
        content = message.content
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    continue
                if isinstance(part.get("text"), str):
                    chars += len(part["text"])
                elif part.get("type") in ("image_url", "input_image", "image"):
                    images += 1
        if message.tool_calls is not None:
            chars += len(msgspec.json.encode(message.tool_calls))
    if prompt.tools is not None:
        chars += len(msgspec.json.encode(prompt.tools))
    template = MESSAGE_TOKENS * len(prompt.messages) + REPLY_TOKENS
    return math.ceil(chars / 4) + images * IMAGE_TOKENS + template


# -- SSE and whole completions -----------------------------------------------------------------


def sse_data(chunk: msgspec.Raw) -> bytes:
    """One SSE event around a chunk's raw bytes (one copy, no parsing)."""
    event = b"data: " + chunk + b"\n\n"
    if b"\r" in event or event.find(b"\n", 0, len(event) - 2) >= 0:
        # a pretty-printed chunk: one data line per line (SSE joins them back with \n)
        lines = event[6:-2].replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        return b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"
    return event


class _Kind(msgspec.Struct):
    object: Any = None


_kind_decoder = msgspec.json.Decoder(_Kind)


def object_kind(chunk: bytes) -> Any:
    """The ``object`` field of a JSON object (``"chat.completion"``...), None if unreadable."""
    try:
        return _kind_decoder.decode(chunk).object
    except msgspec.DecodeError:
        return None


def whole_completion(chunks: list[bytes]) -> bytes:
    """The answer to a non-streamed turn: the backend's own ``chat.completion`` verbatim, or one
    folded from its streamed chunks."""
    if len(chunks) == 1 and object_kind(chunks[0]) != "chat.completion.chunk":
        return chunks[0]
    return msgspec.json.encode(aggregate_chunks(chunks))


# -- one chat.completion from streamed chunks ---------------------------------------------

_SET_KEYS = frozenset({"role", "index", "type", "id"})


def _merge_tool_calls(into: list[dict[str, Any]], deltas: list[Any]) -> None:
    for position, delta in enumerate(deltas):
        if not isinstance(delta, dict):
            continue
        index = delta.get("index", position)
        target = next((tc for tc in into if tc.get("index") == index), None)
        if target is None:
            target = {"index": index}
            into.append(target)
        for key, value in delta.items():
            if value is None or key == "index":
                continue
            if key == "function" and isinstance(value, dict):
                fn = target.setdefault("function", {})
                for fkey, fval in value.items():
                    if not isinstance(fval, str):
                        if fval is not None:
                            fn[fkey] = fval
                    elif fkey == "name" and fn.get("name") == fval:
                        continue  # a backend repeating the whole name in every delta
                    else:
                        fn[fkey] = fn.get(fkey, "") + fval
            else:
                target[key] = value


def _merge_delta(message: dict[str, Any], delta: dict[str, Any]) -> None:
    for key, value in delta.items():
        if value is None:
            continue
        if key == "tool_calls" and isinstance(value, list):
            _merge_tool_calls(message.setdefault("tool_calls", []), value)
        elif isinstance(value, str) and key not in _SET_KEYS:
            message[key] = (message.get(key) or "") + value
        else:
            message[key] = value


def aggregate_chunks(chunks: list[bytes]) -> dict[str, Any]:
    """Fold streamed ``chat.completion.chunk`` objects into one ``chat.completion`` object."""
    head: dict[str, Any] = {}
    usage: Any = None
    choices: dict[int, dict[str, Any]] = {}
    for raw in chunks:
        try:
            obj = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            continue
        if not isinstance(obj, dict):
            continue
        for key in ("id", "created", "model", "system_fingerprint", "service_tier"):
            if obj.get(key) is not None and key not in head:
                head[key] = obj[key]
        if obj.get("usage"):
            usage = obj["usage"]
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            target = choices.setdefault(
                index,
                {
                    "index": index,
                    "message": {"role": "assistant", "content": None},
                    "logprobs": None,
                    "finish_reason": None,
                },
            )
            delta = choice.get("delta", choice.get("message"))
            if isinstance(delta, dict):
                _merge_delta(target["message"], delta)
            if choice.get("finish_reason") is not None:
                target["finish_reason"] = choice["finish_reason"]
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict):
                merged = target["logprobs"] or {}
                for key, value in logprobs.items():
                    if isinstance(value, list):
                        merged[key] = (merged.get(key) or []) + value
                target["logprobs"] = merged
    for choice in choices.values():
        calls = choice["message"].get("tool_calls")
        if calls:
            calls.sort(key=lambda tc: tc.get("index", 0))
            for call in calls:
                call.pop("index", None)
    return {
        "id": head.get("id", "chatcmpl-" + uuid.uuid4().hex),
        "object": "chat.completion",
        "created": head.get("created", int(time.time())),
        "model": head.get("model", ""),
        **(
            {"system_fingerprint": head["system_fingerprint"]}
            if "system_fingerprint" in head
            else {}
        ),
        **({"service_tier": head["service_tier"]} if "service_tier" in head else {}),
        "choices": [choices[i] for i in sorted(choices)],
        "usage": usage,
    }


# -- models ------------------------------------------------------------------------------


def model_object(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": OWNED_BY}


def model_list(models: list[str], created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_object(m, created) for m in models]}


def embeddings_unsupported(model: str, runner_id: str) -> HTTPError:
    """501: the runner that serves the model does not carry embeddings (an older alp-gateway)."""
    message = (
        f"the runner serving model '{model}' ({runner_id}) does not carry embeddings: upgrade "
        "its alp-gateway (embeddings are an extension of the chat channel)"
    )
    return HTTPError(501, message, "embeddings_unsupported")


def context_exceeded(model: str, prompt: int, context: int) -> HTTPError:
    """400: the prompt (estimated) is over the context the model's backend runs with, which
    would cut the front of it without a word; how to raise it, by model server."""
    message = (
        f"This prompt is about {prompt} tokens (estimated), over the context of model "
        f"'{model}': {context} tokens on its runner's backend, which would drop the start of "
        "the conversation. Raise the backend's context (Ollama: num_ctx, e.g. `PARAMETER "
        "num_ctx 32768` in a Modelfile, or OLLAMA_CONTEXT_LENGTH for the server; llama.cpp: "
        "--ctx-size; vLLM: --max-model-len) or send a shorter conversation."
    )
    return HTTPError(400, message, Code.CONTEXT_LENGTH_EXCEEDED, type_="invalid_request_error")


def model_not_found(model_id: str, available: list[str] | None = None) -> HTTPError:
    """404 (not retried by the SDKs); ``available``: the models there are, named."""
    message = f"The model '{model_id}' does not exist"
    if available is not None:
        listed = ", ".join(f"'{m}'" for m in available) if available else "none"
        message += f"; the models available are: {listed}"
    return HTTPError(404, message, Code.MODEL_NOT_FOUND, type_="invalid_request_error")
