"""Where the runner's slowest chunks spent their latency: ``bench/tailprobe.py``'s stamps joined
per chunk with the simulator's ``sent_at`` and the sink's receive stamps (``python -m bench
--probe``). Pure: lists in, a summary out.

Each steady-state chunk's latency (backend write → sink receive) splits into:

- **to pass**: backend write → the start of the poller pass (or lone-stream read) that read it:
  the kernel's wake-up of the runner, and whatever else the runner ran first (other tasks, a
  garbage collection, the previous pass);
- **in pass**: that pass's start → the start of this chunk's ``pump``: the other turns pumped
  before it in the same pass (the order a burst is relayed in);
- **work**: its ``pump`` → its frame offered (read, parse, split, check, write);
- **deliver**: frame offered → the sink's receive stamp (the kernel, the sink's own wake-up).
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

from bench.common import percentile


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 3)


def _q(values: list[float]) -> dict[str, float | None]:
    return {
        "p50": _ms(percentile(values, 50)),
        "p99": _ms(percentile(values, 99)),
        "max": _ms(max(values) if values else None),
    }


def _overlaps(spans: list[tuple[float, float]], starts: list[float], a: float, b: float) -> int:
    """Index of a span (sorted by start) overlapping [a, b], or -1."""
    i = bisect.bisect_right(starts, b) - 1
    while i >= 0:
        s, e = spans[i]
        if e >= a:
            return i
        if b - s > 1.0:  # spans are short: nothing further back reaches [a, b]
            break
        i -= 1
    return -1


def tail_breakdown(
    out: Any, dump: list[dict[str, Any]], probe: dict[str, Any], long_pass: float = 0.001
) -> dict[str, Any]:
    sent: dict[str, list[float]] = {rec["tag"]: rec["sent_at"] for rec in dump if rec["tag"]}
    steady_from = max((rec["sent_at"][0] for rec in dump if rec["sent_at"]), default=0.0)
    stamps = {(tag, tok): (pump, offered) for tag, tok, pump, offered in probe["chunks"]}
    passes = sorted(probe["passes"])
    pass_starts = [p[0] for p in passes]
    rows = []  # total, to pass, in pass, work, deliver, sent, received
    for key, tok, at in out.tokens:
        times = sent.get(key[1])
        got = stamps.get((key[1], tok))
        if times is None or got is None or tok + 1 >= len(times) or times[tok + 1] <= steady_from:
            continue
        s = times[tok + 1]
        pump, offered = got
        i = bisect.bisect_right(pass_starts, pump) - 1
        began = passes[i][0] if i >= 0 and pump <= passes[i][0] + passes[i][1] else pump
        rows.append((at - s, began - s, pump - began, offered - pump, at - offered, s, at))
    if not rows:
        return {"chunks": 0}
    totals = sorted(r[0] for r in rows)
    cut = percentile(totals, 99) or 0.0
    tail = [r for r in rows if r[0] >= cut]
    names = ("to_pass", "in_pass", "work", "deliver")
    gcs = sorted((g[1], g[1] + g[2], g[0]) for g in probe["gcs"])
    gc_spans = [(a, b) for a, b, _ in gcs]
    gc_starts = [a for a, _, _ in gcs]
    steps = sorted((s[1], s[1] + s[2], s[0]) for s in probe["steps"])
    step_spans = [(a, b) for a, b, _ in steps]
    step_starts = [a for a, _, _ in steps]
    long_passes = sorted((p[0], p[0] + p[1]) for p in passes if p[1] >= long_pass)
    long_cpu = [p[3] for p in passes if p[1] >= long_pass and len(p) > 3]
    long_wall = [p[1] for p in passes if p[1] >= long_pass and len(p) > 3]
    lp_starts = [a for a, _ in long_passes]
    tail_gc = Counter[int]()
    tail_steps = Counter[str]()
    tail_long_pass = 0
    for r in tail:
        s, at = r[5], r[6]
        i = _overlaps(gc_spans, gc_starts, s, at)
        if i >= 0:
            tail_gc[gcs[i][2]] += 1
        j = _overlaps(step_spans, step_starts, s, at)
        if j >= 0:
            tail_steps[steps[j][2]] += 1
        if _overlaps(long_passes, lp_starts, s, at) >= 0:
            tail_long_pass += 1
    by_gen: dict[str, dict[str, Any]] = {}
    for gen in (0, 1, 2):
        took = [g[2] for g in probe["gcs"] if g[0] == gen]
        by_gen[str(gen)] = {
            "n": len(took),
            "total_ms": _ms(sum(took)),
            "max_ms": _ms(max(took) if took else None),
        }
    step_total = sorted(probe["step_total"].items(), key=lambda kv: -kv[1][1])[:6]
    return {
        "chunks": len(rows),
        "all": {
            "total": _q(totals),
            **{n: _q([r[k + 1] for r in rows]) for k, n in enumerate(names)},
        },
        "tail": {
            "cut_ms": _ms(cut),
            "n": len(tail),
            **{n: _ms(percentile([r[k + 1] for r in tail], 50)) for k, n in enumerate(names)},
            "with_gc": dict(tail_gc),
            "with_long_step": dict(tail_steps.most_common(4)),
            "with_long_pass": tail_long_pass,
        },
        "gc": by_gen,
        "gc_slow": [  # generation, ms, CPU ms, objects collected: collections of 1 ms or more
            (g[0], _ms(g[2]), _ms(g[4]), g[3]) for g in probe["gcs"] if g[2] >= 0.001
        ],
        "gc_found": probe.get("gc_found", []),
        "gc_tracked": probe.get("gc_tracked"),
        "full_collect_ms": probe.get("full_collect_ms"),
        "gc_frozen": probe.get("gc_frozen"),
        "passes": {
            "n": len(passes),
            "ms": _q([p[1] for p in passes]),
            "pumps_p50": percentile([p[2] for p in passes], 50),
            "pumps_max": max((p[2] for p in passes), default=0),
            # the passes of 1 ms or more: their time and their CPU time (the rest: preempted)
            "long": len(long_wall),
            "long_ms_total": _ms(sum(long_wall)),
            "long_cpu_ms_total": _ms(sum(long_cpu)),
        },
        "counts": probe.get("counts", {}),
        "long_steps": dict(Counter(s[0] for s in probe["steps"]).most_common(6)),
        "step_seconds": {k: [v[0], round(v[1], 4)] for k, v in step_total},
    }


def brief(b: dict[str, Any]) -> str:
    """The breakdown in a few lines."""
    if not b.get("chunks"):
        return "    probe: no chunk joined"
    a, t = b["all"], b["tail"]
    lines = [
        f"    probe: {b['chunks']} chunks; p50/p99 ms: total {a['total']['p50']}/{a['total']['p99']}"
        + "".join(
            f", {n} {a[n]['p50']}/{a[n]['p99']}" for n in ("to_pass", "in_pass", "work", "deliver")
        ),
        f"    slowest 1% (≥ {t['cut_ms']} ms, {t['n']}): median to_pass {t['to_pass']} in_pass "
        f"{t['in_pass']} work {t['work']} deliver {t['deliver']}; overlapping a GC {t['with_gc']}, "
        f"a long step {t['with_long_step']}, a pass ≥ 1 ms {t['with_long_pass']}",
        f"    GC per generation {b['gc']}, ≥ 1 ms (gen, ms, CPU ms, collected) {b['gc_slow']} (tracked objects {b['gc_tracked']}, frozen {b['gc_frozen']}, a full collection "
        f"now: ms, CPU ms {b['full_collect_ms']}); "
        f"passes {b['passes']}",
        *([f"    full collections found {b['gc_found']}"] if b.get("gc_found") else []),
        f"    counts {b['counts']}",
        f"    long steps {b['long_steps']}; step seconds {b['step_seconds']}",
    ]
    return "\n".join(lines)
