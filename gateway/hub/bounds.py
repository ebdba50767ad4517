"""The bounds of what a runner sends the hub (docs/protocol.md §7): its name, labels and
capabilities, the models it lists, the free text of its reports. Pure: the numbers, and the one
line that says which bound a value passed (None when it is within them)."""

from __future__ import annotations

from collections.abc import Sequence

MAX_NAME = 200  # characters of a runner's name (its registration's, a claim's)
MAX_LABELS = 64  # labels a registration carries
MAX_CAPABILITIES = 64  # capabilities a poll advertises
MAX_MODELS = 1000  # model names a runner lists
MAX_TEXT = 200  # characters of one label, capability or model name
MAX_LOGS = 8192  # characters of a final report's ``logs``
MAX_REASON = 200  # characters of a report's ``completionReason``, a heartbeat's ``stage``
MAX_MESSAGE = 1000  # characters of a heartbeat's ``message``


def too_long(what: str, value: str, limit: int) -> str | None:
    """``"name" is 8000000 characters, over the 200 a runner may send``, or None."""
    if len(value) <= limit:
        return None
    return f"{what} is {len(value)} characters, over the {limit} a runner may send"


def too_many(what: str, values: Sequence[str], count: int, length: int = MAX_TEXT) -> str | None:
    """Which bound a list passed (its count, or the length of one of its items), or None."""
    if len(values) > count:
        return f"{what} holds {len(values)} items, over the {count} a runner may send"
    longest = max(values, key=len, default="")
    if len(longest) > length:
        return (
            f"an item of {what} is {len(longest)} characters, over the {length} a runner may send"
        )
    return None
