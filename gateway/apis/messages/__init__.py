"""Anthropic's Messages API over OpenAI chat completions, sans-IO: a request translation, a stream
translation and their errors.

``request``: a ``POST /v1/messages`` body → the chat-completions body (``translate``,
``to_chat``) and ``count_tokens``; ``stream``: the turn's chat chunks → Anthropic's SSE events
(``MessagesStream``) or one ``message`` (``fold``); ``errors``: the error shape both share.
Their public names are re-exported here, the front door's one import.
"""

from gateway.apis.messages.errors import (
    MessagesError,
    error_body,
    error_type_for_status,
)
from gateway.apis.messages.request import (
    MessagesAsChat,
    count_tokens,
    estimate_tokens,
    to_chat,
    translate,
)
from gateway.apis.messages.stream import MessagesStream, fold, new_message_id

__all__ = [
    "MessagesAsChat",
    "MessagesError",
    "MessagesStream",
    "count_tokens",
    "error_body",
    "error_type_for_status",
    "estimate_tokens",
    "fold",
    "new_message_id",
    "to_chat",
    "translate",
]
