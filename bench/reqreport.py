"""The request path's results as text tables: every path's figures, and ratios to the plain pair
and to each peer (the rounds of ``bench/reqload.py`` folded: median, and the range)."""

from __future__ import annotations

import statistics
from typing import Any

from bench.reqload import TOKENS

LABELS = {
    "direct": "direct (client → simulator)",
    "plain-e2e": "plain aiohttp Server + plain runner",
    "e2e": "hub + runner",
    "e2e-base": "hub + runner of --base-tree",
    "litellm": "LiteLLM proxy (one hop)",
    "portkey": "Portkey gateway (one hop)",
}
ORDER = ("direct", "plain-e2e", "e2e", "e2e-base", "litellm", "portkey")
# the references every path is held against, when they ran
REFERENCES = (
    ("plain-e2e", "the plain pair"),
    ("litellm", "LiteLLM"),
    ("portkey", "Portkey"),
    ("e2e-base", "the --base-tree hub + runner"),
)
# the paths whose CPU per turn is also compared at one rate they all sustained
COMMON = ("plain-e2e", "e2e", "e2e-base", "portkey")
IDLE_FIGURES = ("ttft", "whole", "stream_end")


def _median(values: list[Any]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _spread(values: list[Any]) -> dict[str, Any]:
    got = [v for v in values if v is not None]
    med = _median(got)
    return {
        "median": None if med is None else round(med, 3),
        "min": min(got) if got else None,
        "max": max(got) if got else None,
        "rounds": got,
    }


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """The rounds folded per path: idle added TTFT and latency (each round's path minus direct,
    then the median over rounds), the highest sustained rate per kind, the CPU per turn of each
    process there and at the highest rate every ``COMMON`` path kept pace with in that round
    (the common rate)."""
    book = results.get("requests") or {}
    out: dict[str, Any] = {"idle": {}, "load": {}}
    rounds = book.get("idle", [])
    names = [n for n in ORDER if any(n in r for r in rounds)]
    for name in names:
        row: dict[str, Any] = {}
        for figure in IDLE_FIGURES:
            for q in ("p50", "p99"):
                own = [_get(r, name, f"{figure}_ms", q) for r in rounds]
                floor = [_get(r, "direct", f"{figure}_ms", q) for r in rounds]
                row[f"{figure}_{q}"] = _spread(own)
                added = [
                    None if a is None or b is None else round(a - b, 3)
                    for a, b in zip(own, floor, strict=True)
                ]
                row[f"added_{figure}_{q}"] = _spread(added)
        row["errors"] = sum(_get(r, name, "error_count") or 0 for r in rounds)
        out["idle"][name] = row
    for kind in ("whole", "stream"):
        kind_rounds = book.get(kind, [])
        if not kind_rounds:
            continue
        rows: dict[str, Any] = {}
        commons = []
        for r in kind_rounds:
            rates = [_get(r, n, "max_paced_rate") for n in COMMON if n in r]
            commons.append(min(rates) if rates and None not in rates else None)
        for name in [n for n in ORDER if any(n in r for r in kind_rounds)]:
            at_max = [_get(r, name, "at_max") for r in kind_rounds]
            at_paced = [_get(r, name, "at_max_paced") for r in kind_rounds]
            procs = sorted(
                {
                    p
                    for r in kind_rounds
                    for rung in _get(r, name, "rungs") or []
                    for p in rung.get("cpu_us_per_turn", {})
                }
            )
            at_common: dict[str, list[float]] = {p: [] for p in procs}
            for r, common in zip(kind_rounds, commons, strict=True):
                for rung in _get(r, name, "rungs") or []:
                    if common is not None and rung["rate"] == common:
                        for p in procs:
                            at_common[p].append(rung["cpu_us_per_turn"].get(p))
            rows[name] = {
                "max_rate": _spread([_get(r, name, "max_rate") for r in kind_rounds]),
                "max_paced_rate": _spread([_get(r, name, "max_paced_rate") for r in kind_rounds]),
                "capped_by_direct": any(_get(r, name, "capped_by_direct") for r in kind_rounds),
                "p99_ms_at_max": _spread([_get(a, "p99_ms") for a in at_max]),
                "added_p99_ms_at_max": _spread([_get(a, "added_p99_ms") for a in at_max]),
                "bench_busy_at_max": _spread([_get(a, "bench_busy") for a in at_max]),
                "cpu_us_per_turn_at_max": {
                    p: _spread([_get(a, "cpu_us_per_turn", p) for a in at_max]) for p in procs
                },
                "cpu_us_per_turn_at_max_paced": {
                    p: _spread([_get(a, "cpu_us_per_turn", p) for a in at_paced]) for p in procs
                },
                "cpu_us_per_turn_at_common": {p: _spread(v) for p, v in at_common.items()},
            }
        out["load"][kind] = {"common_rate": _spread(commons), "paths": rows}
    out["ratios"] = ratios(out)
    out["paired"] = paired(book)
    return out


def _round_cpu(rnd: dict[str, Any], name: str, rate: float | None) -> dict[str, float] | None:
    """A path's CPU per turn of each relaying process at one rung of one round."""
    for rung in _get(rnd, name, "rungs") or []:
        if rate is not None and rung["rate"] == rate:
            return {p: v for p, v in rung["cpu_us_per_turn"].items() if p != "sim"}
    return None


def paired(book: dict[str, Any], ours: str = "e2e") -> dict[str, Any]:
    """``ours`` over each reference round by round (the two measured minutes apart at most, the
    machine's state alike): the median of the rounds' ratios and their range. CPU per turn at
    the round's common rate; for the plain pair, also the hub over the plain Server and the
    runner over the plain runner."""
    out: dict[str, Any] = {}
    for ref, _label in REFERENCES:
        figures: dict[str, list[float | None]] = {}

        def add(
            label: str, a: float | None, b: float | None, figures: dict[str, Any] = figures
        ) -> None:
            figures.setdefault(label, []).append(None if a is None or not b else round(a / b, 3))

        for rnd in book.get("idle", []):
            if ours not in rnd or ref not in rnd or "direct" not in rnd:
                continue
            for figure_, label in (
                ("ttft", "idle added TTFT p50"),
                ("whole", "idle added latency p50"),
            ):
                floor = _get(rnd, "direct", f"{figure_}_ms", "p50")
                a, b = (
                    _get(rnd, ours, f"{figure_}_ms", "p50"),
                    _get(rnd, ref, f"{figure_}_ms", "p50"),
                )
                add(
                    label,
                    None if a is None or floor is None else a - floor,
                    None if b is None or floor is None else b - floor,
                )
        for kind in ("whole", "stream"):
            for rnd in book.get(kind, []):
                if ours not in rnd or ref not in rnd:
                    continue
                add(
                    f"sustained turns/s, {kind}",
                    _get(rnd, ours, "max_rate"),
                    _get(rnd, ref, "max_rate"),
                )
                add(
                    f"keeps pace to, {kind}",
                    _get(rnd, ours, "max_paced_rate"),
                    _get(rnd, ref, "max_paced_rate"),
                )
                rates = [_get(rnd, n, "max_paced_rate") for n in COMMON if n in rnd]
                common = min(rates) if rates and None not in rates else None
                a, b = _round_cpu(rnd, ours, common), _round_cpu(rnd, ref, common)
                add(
                    f"CPU µs/turn at the common rate, {kind}",
                    sum(a.values()) if a else None,
                    sum(b.values()) if b else None,
                )
                a_pace = _get(rnd, ours, "at_max_paced", "cpu_us_per_turn")
                b_pace = _get(rnd, ref, "at_max_paced", "cpu_us_per_turn")
                add(
                    f"CPU µs/turn at each one's pace limit, {kind}",
                    sum(v for p, v in a_pace.items() if p != "sim") if a_pace else None,
                    sum(v for p, v in b_pace.items() if p != "sim") if b_pace else None,
                )
                if ref in ("plain-e2e", "e2e-base"):
                    server, runner = (
                        ("plainhub", "peer") if ref == "plain-e2e" else ("hub", "runner")
                    )
                    add(f"  the hub alone, {kind}", _get(a, "hub"), _get(b, server))
                    add(f"  the runner alone, {kind}", _get(a, "runner"), _get(b, runner))
        kept = {k: _spread(v) for k, v in figures.items() if any(x is not None for x in v)}
        if kept:
            out[ref] = kept
    return out


def _relay_cpu(row: dict[str, Any], where: str) -> float | None:
    """A path's CPU per turn summed over its relaying processes (the simulator left out)."""
    cpu = row.get(where, {})
    values = [v["median"] for p, v in cpu.items() if p != "sim"]
    if not values or None in values:
        return None
    return round(sum(values), 1)


FIGURES = (
    ("idle added TTFT p50", "idle", "added_ttft_p50"),
    ("idle added TTFT p99", "idle", "added_ttft_p99"),
    ("idle added latency, non-streamed p50", "idle", "added_whole_p50"),
    ("idle added latency, non-streamed p99", "idle", "added_whole_p99"),
    ("sustained turns/s, non-streamed", "whole", "max_rate"),
    ("sustained turns/s, streamed", "stream", "max_rate"),
    ("CPU µs/turn at max, non-streamed", "whole", "cpu_at_max"),
    ("CPU µs/turn at max, streamed", "stream", "cpu_at_max"),
    ("CPU µs/turn at the common rate, non-streamed", "whole", "cpu_at_common"),
    ("CPU µs/turn at the common rate, streamed", "stream", "cpu_at_common"),
)


def figure(summ: dict[str, Any], name: str, where: str, key: str) -> float | None:
    if where == "idle":
        return _get(summ, "idle", name, key, "median")
    row = _get(summ, "load", where, "paths", name)
    if row is None:
        return None
    if key == "max_rate":
        return _get(row, "max_rate", "median")
    if key == "cpu_at_max":
        return _relay_cpu(row, "cpu_us_per_turn_at_max")
    return _relay_cpu(row, "cpu_us_per_turn_at_common")


def ratios(summ: dict[str, Any]) -> dict[str, Any]:
    """Every path's figures over each reference's (the plain pair, LiteLLM, Portkey, the base)."""
    out: dict[str, Any] = {}
    for ref, _label in REFERENCES:
        per: dict[str, Any] = {}
        for name in ORDER:
            if name in ("direct", ref):
                continue
            row = {}
            for label, where, key in FIGURES:
                a, b = figure(summ, name, where, key), figure(summ, ref, where, key)
                row[label] = None if a is None or not b else round(a / b, 3)
            if any(v is not None for v in row.values()):
                per[name] = row
        if per:
            out[ref] = per
    return out


# -- text ---------------------------------------------------------------------------------------


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep, *(line(r) for r in rows)])


def _num(value: Any, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _range(s: dict[str, Any] | None, digits: int = 0) -> str:
    """``median (min–max)`` over the rounds, or the median alone with one round."""
    if not s or s.get("median") is None:
        return "—"
    if len(s["rounds"]) < 2:
        return _num(s["median"], digits)
    return f"{_num(s['median'], digits)} ({_num(s['min'], digits)}–{_num(s['max'], digits)})"


def _cpu(row: dict[str, Any] | None, where: str) -> str:
    if not row:
        return "—"
    parts = [f"{p} {_num(v['median'])}" for p, v in row.get(where, {}).items() if p != "sim"]
    total = _relay_cpu(row, where)
    if not parts:
        return "—"
    return (" + ".join(parts) + (f" = {_num(total)}" if len(parts) > 1 else "")) or "—"


def idle_brief(row: dict[str, Any]) -> str:
    """One line of a path's idle short turns, as they go."""
    parts = [
        f"TTFT p50 {_get(row, 'ttft_ms', 'p50')} p99 {_get(row, 'ttft_ms', 'p99')} ms",
        f"non-streamed p50 {_get(row, 'whole_ms', 'p50')} p99 {_get(row, 'whole_ms', 'p99')} ms",
    ]
    if row.get("errors"):
        parts.append(f"{row['error_count']} ERRORS, e.g. {row['errors'][0]}")
    return ", ".join(parts)


def render(results: dict[str, Any]) -> str:
    summ = results.get("request_summary") or summary(results)
    if not summ["idle"] and not summ["load"]:
        return ""
    book = results.get("requests") or {}
    n_rounds = max((len(v) for v in book.values()), default=0)
    out = [
        f"The request path: short turns ({TOKENS}-token answers), median of {n_rounds} alternating "
        "round(s), (min–max) over the rounds",
    ]
    if summ["idle"]:
        rows = []
        for name, row in summ["idle"].items():
            line = [LABELS.get(name, name)]
            for figure_ in IDLE_FIGURES[:2]:
                for q in ("p50", "p99"):
                    key = f"{figure_}_{q}" if name == "direct" else f"added_{figure_}_{q}"
                    line.append(_range(row[key], 3))
            line.append(str(row["errors"]))
            rows.append(line)
        head = ["path", "added TTFT p50", "added TTFT p99", "added latency p50"]
        head += ["added latency p99", "errors"]
        out += [
            "",
            "One at a time on an idle path (ms): streamed, request → first chunk; non-streamed, "
            "request → the whole answer; added: minus direct's (the direct row: its own)",
            "",
            _table(head, rows),
        ]
    for kind, label in (("whole", "non-streamed"), ("stream", "streamed (to [DONE])")):
        got = summ["load"].get(kind)
        if not got:
            continue
        rows = []
        for name, row in got["paths"].items():
            capped = " (direct's ceiling)" if row["capped_by_direct"] and name != "direct" else ""
            rows.append(
                [
                    LABELS.get(name, name),
                    _range(row["max_rate"]) + capped,
                    _range(row["p99_ms_at_max"], 2),
                    _range(row["added_p99_ms_at_max"], 2),
                    _cpu(row, "cpu_us_per_turn_at_max"),
                    _range(row["max_paced_rate"]),
                    _cpu(row, "cpu_us_per_turn_at_max_paced"),
                    _cpu(row, "cpu_us_per_turn_at_common"),
                    _num(_get(row, "cpu_us_per_turn_at_max", "sim", "median")),
                    _range(row["bench_busy_at_max"], 2),
                ]
            )
        head = ["path", "sustained turns/s", "p99 ms there", "added p99 ms", "CPU µs/turn there"]
        head += ["keeps pace to", "CPU µs/turn there"]
        head += [f"CPU µs/turn at {_range(got['common_rate'])}/s"]
        head += ["sim µs/turn", "bench busy"]
        out += [
            "",
            f"Load sweep, {label} short turns from 64 clients (8 sessions for the hub and the "
            "plain pair): the highest offered rate with no error and p99 ≤ 10 ms over direct's "
            "at that rate (sustained); the highest with no error and ≥ 95 % of it done, whatever "
            "the latency (keeps pace); CPU per turn of each process (its /proc counters) at each, "
            "and at the highest rate the hub, the plain pair and Portkey all kept pace with (the "
            "common rate); the simulator's CPU per turn and the bench's busy share at the "
            "sustained rate",
            "",
            _table(head, rows),
        ]
    pairs = summ.get("paired") or {}
    refs = [ref for ref, _ in REFERENCES if ref in pairs]
    if refs:
        labels = list(dict.fromkeys(k for ref in refs for k in pairs[ref]))
        rows = [[label] + [_xrange(pairs[ref].get(label)) for ref in refs] for label in labels]
        out += [
            "",
            f"{LABELS['e2e']} over each, round by round (the median of the rounds' ratios, "
            "and their range)",
            "",
            _table(["figure", *(f"× {dict(REFERENCES)[r]}" for r in refs)], rows),
        ]
    for ref, label in REFERENCES:
        per = summ["ratios"].get(ref)
        if not per:
            continue
        labels = [f[0] for f in FIGURES]
        rows = [
            [LABELS.get(name, name)] + [_x(row.get(f)) for f in labels] for name, row in per.items()
        ]
        short = [
            "TTFT p50",
            "TTFT p99",
            "lat p50",
            "lat p99",
            "turns/s whole",
            "turns/s stream",
            "CPU/turn whole",
            "CPU/turn stream",
            "CPU/turn whole @common",
            "CPU/turn stream @common",
        ]
        out += [
            "",
            f"Over {label} (× its figure; added idle TTFT and latency, sustained rate, CPU per "
            "turn of the relaying processes)",
            "",
            _table(["path", *short], rows),
        ]
    return "\n".join(out)


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _xrange(s: dict[str, Any] | None) -> str:
    if not s or s.get("median") is None:
        return "—"
    if len(s["rounds"]) < 2:
        return _x(s["median"])
    return f"{_x(s['median'])} ({s['min']:.2f}–{s['max']:.2f})"
