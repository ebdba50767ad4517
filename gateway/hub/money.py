"""What a turn costs and what a key may spend: model prices, a turn's cost and its reference
cost, a key's budgets and priority class, and the UTC day and month they count in (pure).

A price is per million tokens, input and output, in the one currency the hub's ``currency``
setting names; a model without one costs nothing (its cost is None, said "no price"). A price
may be derived from a GPU's power and the model's measured throughput (``derive``): what the
electricity of one second of the GPU costs, spread over the tokens it makes in that second.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

MILLION = 1_000_000
DAY = 86400
PRIORITIES = ("interactive", "standard", "background")  # the classes, highest first
STANDARD = PRIORITIES.index("standard")


@dataclass(frozen=True)
class Price:
    """A model's price per million tokens; ``reference``: a hosted API's name whose price
    ``ref_input``/``ref_output`` say what the same tokens would have cost there; ``watts`` and
    ``kwh_price``: the price is derived from the GPU's power (``input``/``output`` as last
    measured, 0 until the ledger has the model's throughput)."""

    model: str
    input: float = 0.0
    output: float = 0.0
    reference: str | None = None
    ref_input: float | None = None
    ref_output: float | None = None
    watts: float | None = None
    kwh_price: float | None = None

    def cost(self, prompt: int, completion: int) -> float:
        """What ``prompt`` input and ``completion`` output tokens cost at this price."""
        return (prompt * self.input + completion * self.output) / MILLION

    def ref_cost(self, prompt: int, completion: int) -> float | None:
        """What the same tokens cost at the reference price (None: no reference named)."""
        if self.ref_input is None and self.ref_output is None:
            return None
        return (prompt * (self.ref_input or 0.0) + completion * (self.ref_output or 0.0)) / MILLION

    def as_json(self) -> dict[str, object]:
        return {
            "model": self.model,
            "input": self.input,
            "output": self.output,
            "reference": self.reference,
            "referenceInput": self.ref_input,
            "referenceOutput": self.ref_output,
            "watts": self.watts,
            "kwhPrice": self.kwh_price,
        }


def per_million(watts: float, kwh_price: float, tokens_per_second: float) -> float:
    """The price per million tokens of a GPU drawing ``watts`` at ``kwh_price`` a kWh that
    makes ``tokens_per_second`` (0 when the throughput is not known)."""
    if tokens_per_second <= 0:
        return 0.0
    per_second = watts / 1000.0 * kwh_price / 3600.0
    return per_second / tokens_per_second * MILLION


def derive(price: Price, input_tps: float, output_tps: float) -> Price:
    """A GPU-priced model's price at the measured throughputs (prompt tokens a second of
    prefill, completion tokens a second of decoding); any other price as it is."""
    if price.watts is None or price.kwh_price is None:
        return price
    return Price(
        price.model,
        round(per_million(price.watts, price.kwh_price, input_tps), 6),
        round(per_million(price.watts, price.kwh_price, output_tps), 6),
        price.reference,
        price.ref_input,
        price.ref_output,
        price.watts,
        price.kwh_price,
    )


def money(value: str | float | int | None, what: str) -> float | None:
    """A price or budget as given (None or "" : none); ValueError unless a finite number >= 0."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number >= 0, not {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number >= 0, not {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{what} must be a number >= 0, not {value!r}")
    return number


@dataclass(frozen=True)
class KeyBudget:
    """A key's budgets in the hub's currency (None: none) and its priority class."""

    daily: float | None = None
    monthly: float | None = None
    priority: str = "standard"

    @property
    def rank(self) -> int:
        """The class as the queue orders it: 0 interactive, 1 standard, 2 background."""
        return PRIORITIES.index(self.priority) if self.priority in PRIORITIES else STANDARD

    def describe(self, currency: str) -> str:
        parts = [
            f"{label}={value:g} {currency}"
            for label, value in (("budget/day", self.daily), ("budget/month", self.monthly))
            if value is not None
        ]
        return " ".join([*parts, f"priority={self.priority}"])

    def as_json(self) -> dict[str, object]:
        return {"budgetDaily": self.daily, "budgetMonthly": self.monthly, "priority": self.priority}


NO_BUDGET = KeyBudget()  # a key without budgets, of the standard class (frozen: one for all)


def budget_of(
    daily: str | float | None = None,
    monthly: str | float | None = None,
    priority: str | None = None,
) -> KeyBudget:
    """A KeyBudget from given values (0 or None: no budget); ValueError on a bad one."""
    if priority is not None and priority not in PRIORITIES:
        raise ValueError(f"the priority must be one of {', '.join(PRIORITIES)}, not {priority!r}")
    return KeyBudget(
        money(daily, "the daily budget") or None,
        money(monthly, "the monthly budget") or None,
        priority or "standard",
    )


def day_start(at: float) -> int:
    """The start of the UTC day ``at`` falls in."""
    return int(at) // DAY * DAY


def month_start(at: float) -> int:
    """The start of the UTC month ``at`` falls in."""
    when = datetime.datetime.fromtimestamp(int(at), datetime.UTC)
    return int(when.replace(day=1, hour=0, minute=0, second=0).timestamp())


def next_month(at: float) -> int:
    """The start of the UTC month after the one ``at`` falls in."""
    when = datetime.datetime.fromtimestamp(month_start(at), datetime.UTC)
    year, month = (when.year + 1, 1) if when.month == 12 else (when.year, when.month + 1)
    return int(when.replace(year=year, month=month).timestamp())


def utc(at: float) -> str:
    """``2026-12-07T00:00:00Z``."""
    when = datetime.datetime.fromtimestamp(int(at), datetime.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")
