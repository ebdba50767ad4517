"""``alp-gateway hub prices``: set, list or unset a model's price in the hub's store, and the
budget flags ``hub keys create``/``update`` take (the command line's side of ``money``)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from gateway import logsafe
from gateway.hub.money import PRIORITIES, KeyBudget, Price, budget_of, derive, money
from gateway.hub.settings import HubSettings
from gateway.hub.store import Store, UsageTotal

DAY = 86400.0


def _money(value: str) -> float:
    try:
        found = money(value, "the value")
    except ValueError:
        found = None
    if found is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number >= 0")
    return found


def add_budget_flags(parser: argparse.ArgumentParser) -> None:
    """``--budget-daily``, ``--budget-monthly`` (the currency; 0: none) and ``--priority``."""
    parser.add_argument(
        "--budget-daily",
        type=_money,
        metavar="AMOUNT",
        help="what the key may spend a UTC day, in the hub's currency (0: no budget)",
    )
    parser.add_argument(
        "--budget-monthly",
        type=_money,
        metavar="AMOUNT",
        help="what the key may spend a UTC month, in the hub's currency (0: no budget)",
    )
    parser.add_argument(
        "--priority",
        choices=PRIORITIES,
        help="its turns' class in the queue for a busy runner (default standard)",
    )


def budget_given(args: argparse.Namespace) -> bool:
    """Whether any of the budget flags or ``--priority`` was given."""
    names = ("budget_daily", "budget_monthly", "priority")
    return any(getattr(args, n, None) is not None for n in names)


def merged_budget(args: argparse.Namespace, old: KeyBudget) -> KeyBudget:
    """The budget the flags say, over ``old`` where a flag is not given."""
    daily, monthly = args.budget_daily, args.budget_monthly
    return budget_of(
        old.daily if daily is None else daily,
        old.monthly if monthly is None else monthly,
        args.priority or old.priority,
    )


def add_prices_command(sub: Any, parser: Any) -> None:
    """The ``prices`` command with ``set``, ``list`` and ``unset``, on the hub's ``parser``
    (its ``command`` remembers each, with the flags every hub command takes)."""
    prices = parser.command(sub, "prices", help="set, list or unset the models' prices")
    prices_sub = prices.add_subparsers(
        dest="prices_command",
        metavar="{set,list,unset}",
        parser_class=type(parser),
        required=True,
    )
    set_ = prices.command(
        prices_sub,
        "set",
        help="a model's price per million tokens (input, output) in the hub's currency, or "
        "derived from a GPU's power (--watts, --kwh-price) and the model's measured throughput",
    )
    set_.add_argument("model", help="the model as `hub usage` names it")
    set_.add_argument("--input", type=_money, metavar="PRICE", help="per million input tokens")
    set_.add_argument("--output", type=_money, metavar="PRICE", help="per million output tokens")
    set_.add_argument("--watts", type=_money, metavar="W", help="the GPU's power draw")
    set_.add_argument("--kwh-price", type=_money, metavar="PRICE", help="electricity a kWh")
    set_.add_argument(
        "--reference",
        metavar="NAME",
        help="a hosted API's name whose price the reference column of `hub usage` shows",
    )
    set_.add_argument(
        "--reference-input", type=_money, metavar="PRICE", help="its price per million input"
    )
    set_.add_argument(
        "--reference-output", type=_money, metavar="PRICE", help="its price per million output"
    )
    prices.command(prices_sub, "list", help="every model's price")
    unset = prices.command(prices_sub, "unset", help="forget a model's price (it costs 0)")
    unset.add_argument("model")


def price_of(args: argparse.Namespace) -> Price:
    """The price the flags of ``prices set`` say; ValueError when they say none."""
    gpu = args.watts is not None or args.kwh_price is not None
    if gpu and (args.watts is None or args.kwh_price is None):
        raise ValueError("--watts and --kwh-price go together")
    if gpu and (args.input is not None or args.output is not None):
        raise ValueError("a price is either --input/--output or --watts/--kwh-price, not both")
    if not gpu and args.input is None and args.output is None:
        raise ValueError("prices set needs --input and --output, or --watts and --kwh-price")
    return Price(
        args.model,
        args.input or 0.0,
        args.output or 0.0,
        args.reference,
        args.reference_input,
        args.reference_output,
        args.watts,
        args.kwh_price,
    )


def describe(price: Price, currency: str) -> str:
    """``0.5 / 1.5 USD per million tokens (input / output)`` and its reference."""
    text = f"{price.input:g} / {price.output:g} {currency} per million tokens (input / output)"
    if price.watts is not None:
        text += f", from {price.watts:g} W at {price.kwh_price:g} {currency}/kWh"
    if price.ref_input is not None or price.ref_output is not None:
        name = f" ({price.reference})" if price.reference else ""
        text += f"; reference{name} {price.ref_input or 0:g} / {price.ref_output or 0:g} {currency}"
    return text


async def run_prices(args: argparse.Namespace, store: Store, settings: HubSettings) -> int:
    """``hub prices ...`` on the store; its exit status."""
    currency = settings.currency
    within = f"within key_check_interval ({settings.key_check_interval:g} s)"
    try:
        if args.prices_command == "set":
            price = price_of(args)
            await store.set_price(price)
            if price.watts is not None:
                price = derive(price, *await store.throughput(price.model, time.time() - DAY))
            print(
                f"price of {logsafe.safe(price.model)!r}: {describe(price, currency)}; "
                f"a running hub applies it {within}"
            )
            return 0
        if args.prices_command == "unset":
            if await store.delete_price(args.model):
                print(f"price of {logsafe.safe(args.model)!r} unset: it costs 0 from now on")
                return 0
            print(f"{logsafe.safe(args.model)!r} has no price", file=sys.stderr)
            return 1
        prices = await store.list_prices()
        if not prices:
            print(f"no prices (every model costs 0 {currency})", file=sys.stderr)
            return 0
        for price in prices:
            if price.watts is not None:
                price = derive(price, *await store.throughput(price.model, time.time() - DAY))
            print(f"{logsafe.safe(price.model)}: {describe(price, currency)}")
        return 0
    finally:
        await store.close()


async def update_budget(store: Store, args: argparse.Namespace, currency: str, within: str) -> bool:
    """``keys update``'s budget and priority flags over the key's; False when there is no
    such key (True when none of them was given)."""
    if not budget_given(args):
        return True
    budget = merged_budget(args, (await store.key_budgets()).get(args.name) or KeyBudget())
    if not await store.set_key_budget(args.name, budget):
        return False
    name = logsafe.safe(args.name)
    print(f"API key {name!r} {budget.describe(currency)}; a running hub applies it {within}")
    return True


def cost_cell(value: float, unpriced: int = 0, turns: int = 0) -> str:
    """A cost as `hub usage` prints it; ``no price`` when none of ``turns`` had one."""
    if turns and unpriced >= turns:
        return "no price"
    return f"{value:.4f}"


def cost_summary(totals: list[UsageTotal], currency: str) -> list[str]:
    """`hub usage`'s last lines: the cost (and at reference) per key, per model, in total."""
    lines = []
    for title, group in (("per key", 0), ("per model", 1)):
        sums: dict[str, list[float]] = {}
        for t in totals:
            pair = sums.setdefault((t.key_name, t.model or "-")[group], [0.0, 0.0])
            pair[0] += t.cost or 0.0
            pair[1] += t.ref_cost or 0.0
        listed = ", ".join(
            f"{logsafe.safe(n)} {cost_cell(c)} ({cost_cell(r)})" for n, (c, r) in sums.items()
        )
        lines.append(f"cost {title} (at reference): {listed}")
    cost = sum(t.cost or 0.0 for t in totals)
    ref = sum(t.ref_cost or 0.0 for t in totals)
    unpriced = sum(t.unpriced for t in totals)
    extra = f"; {unpriced} turn(s) of models with no price, counted 0" if unpriced else ""
    lines.append(
        f"total cost {cost_cell(cost)} {currency} ({cost_cell(ref)} {currency} at reference)"
        + extra
    )
    return lines


def with_costs(
    header: tuple[str, ...], rows: Sequence[Sequence[str]], totals: list[UsageTotal], currency: str
) -> tuple[tuple[str, ...], list[Sequence[str]]]:
    """`hub usage`'s table with its COST and AT REFERENCE columns (``rows``: one a total)."""
    header = (*header, f"COST ({currency})", f"AT REFERENCE ({currency})")
    rows = [
        (*row, cost_cell(t.cost, t.unpriced, t.turns), cost_cell(t.ref_cost))
        for row, t in zip(rows, totals, strict=True)
    ]
    return header, rows


async def set_budget(store: Store, args: argparse.Namespace) -> KeyBudget:
    """``keys create``'s budget and priority flags, set on the key just made."""
    budget = merged_budget(args, KeyBudget())
    await store.set_key_budget(args.name, budget)
    return budget


async def budget_cells(
    store: Store, keys: list[dict[str, object]], currency: str
) -> dict[str, str]:
    """``keys list``'s BUDGET column by key name (``-`` for a revoked key)."""
    budgets = await store.key_budgets()
    return {
        str(k["name"]): "-"
        if k["revoked"]
        else (budgets.get(str(k["name"])) or KeyBudget()).describe(currency)
        for k in keys
    }
