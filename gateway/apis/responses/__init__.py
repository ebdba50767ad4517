"""The OpenAI Responses API (``POST /v1/responses``) over chat completions, sans-IO: a request
translation, a stream translation, the tools both need and their errors.

The hub's runners speak chat completions only. ``request``: a Responses request → its
chat-completions body (``translate``, ``to_chat``); ``stream``: the turn's chat chunks →
Responses SSE events (``ResponsesStream``) or one ``response`` object (``fold``); ``tools``:
Responses tools as chat function tools and back; ``items``: the output items the stream builds;
``errors``: ``ResponsesError``. Their public names are re-exported here, the front door's one
import.
"""

from gateway.apis.responses.errors import ResponsesError
from gateway.apis.responses.request import (
    ResponsesAsChat,
    decode_request,
    to_chat,
    translate,
)
from gateway.apis.responses.stream import (
    ENDED,
    KEEPALIVE,
    STARTED,
    ResponsesStream,
    fold,
    output_text,
)
from gateway.apis.responses.tools import DROPPED_TOOL_TYPES, tool_names

__all__ = [
    "DROPPED_TOOL_TYPES",
    "ENDED",
    "KEEPALIVE",
    "STARTED",
    "ResponsesAsChat",
    "ResponsesError",
    "ResponsesStream",
    "decode_request",
    "fold",
    "output_text",
    "tool_names",
    "to_chat",
    "translate",
]
