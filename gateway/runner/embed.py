"""One ``/v1/embeddings`` request carried on a Chat Channel (docs/protocol.md §6, embeddings):
posted to a backend that serves its model, its answer sent back verbatim as one chunk frame.

The request's body goes to ``POST {backend}/embeddings`` as it came (only the model set when an
alias chose another), holding one of the backend's slots as a turn does; the answer's body,
whatever its size, is one ``chat.completion.chunk`` frame (its bytes spliced in, never parsed)
and ``chat.completion.done``; a backend's error answer is ``chat.completion.error`` with
``backend returned <status>: <the body, cut short, its key masked>``, as a turn's.
"""

from __future__ import annotations

import logging

import trio

from gateway.observe import Redactor
from gateway.runner.backend import BackendError, ProbeFailed
from gateway.runner.backends import BackendPool
from gateway.wire import protocol

log = logging.getLogger("gateway.embed")

ERROR_BODY_LIMIT = 512  # characters of a backend's error answer the error frame carries


async def embed(pool: BackendPool, job_id: str, frame: protocol.EmbeddingsRequest) -> list[bytes]:
    """The frames that answer ``frame``: its answer's chunk and done, or one error."""
    rid = frame.requestId
    try:
        route = await pool.route(None, bytes(frame.body))
        async with pool.turn(route, job_id, rid) as backend:
            try:
                with trio.fail_after(backend.idle_timeout):
                    answer = await backend.fetch("POST", "/embeddings", route.body)
            except trio.TooSlowError:
                raise BackendError(f"backend {backend.url} sent no embeddings in time") from None
            except ProbeFailed as exc:
                raise BackendError(f"backend {backend.url} {exc.reason}") from None
            key = backend.key
    except BackendError as exc:
        return [protocol.encode_frame(protocol.ErrorFrame(job_id, rid, str(exc)))]
    body = answer.body
    if not answer.ok:
        text = Redactor([key], limit=None)(body)
        if len(text) > ERROR_BODY_LIMIT:
            text = text[:ERROR_BODY_LIMIT].strip() + "…"
        error = f"backend returned {answer.status}: {text.strip()}"
        return [protocol.encode_frame(protocol.ErrorFrame(job_id, rid, error))]
    if not body.strip().startswith(b"{"):
        error = "backend sent embeddings that are not a JSON object"
        return [protocol.encode_frame(protocol.ErrorFrame(job_id, rid, error))]
    frames = protocol.TurnFrames(job_id, rid)
    return [frames.chunk(body.strip()), frames.done]
