"""The W3C ``traceparent`` value as the runner and the hub take it: checked, pure, no I/O.

A job's ``agentDefinition.traceparent``, a turn frame's ``traceparent`` (docs/protocol.md §6)
and a client's ``traceparent`` header at the hub's front door all pass through
``valid_traceparent``: a value that is not a well-formed trace context is dropped, never refused.
"""

from __future__ import annotations

import re

_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def valid_traceparent(value: object) -> str | None:
    """``value`` (lower-cased) when it is a well-formed W3C ``traceparent``, else None."""
    if not isinstance(value, str):
        return None
    text = value.strip().lower()
    if not _TRACEPARENT.match(text) or text.startswith("ff-"):
        return None
    _, trace_id, span_id, _ = text.split("-")
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return text
