"""The bench's results as text tables, with each target of issue #5 checked."""

from __future__ import annotations

from typing import Any

LABELS = {
    "floor": "floor (raw forward)",
    "direct": "direct (sim → client)",
    "runner": "runner → lean sink",
    "e2e": "front door → runner",
    "litellm": "LiteLLM proxy",
}
RELAYS = {
    "floor": ["floor"],
    "direct": [],
    "runner": ["runner"],
    "e2e": ["runner", "hub"],
    "litellm": ["litellm"],
}
SCENARIOS = (
    ("single", "1 stream"),
    ("c64", "64 / 1 session"),
    ("c64s8", "64 / 8 sessions"),
    ("paced", "64 paced"),
)


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep, *(line(r) for r in rows)])


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}"


def _get(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def render(results: dict[str, Any]) -> str:
    paths = results.get("paths", {})
    m = results.get("machine", {})
    out = [
        f"alp-gateway relay bench — {results.get('date')} — {m.get('nproc')} × {m.get('cpu_model')}, "
        f"Python {m.get('python')} — mode {results.get('mode')}, {results.get('bench_seconds')} s"
        + (
            " — WHAT-IF: runner with httpcore's pool patched (bench/whatif_pool.py)"
            if results.get("whatif_pool")
            else ""
        ),
        "",
        "Throughput (chunks/s), latency backend write → sink receive at 20 ms/token (ms), time to first token (ms)",
        "",
    ]
    direct_ttft = _get(paths, "direct", "ttft", "ttft_ms", "p50")
    rows = []
    for name, res in paths.items():
        ttft = _get(res, "ttft", "ttft_ms", "p50")
        added = (
            None if ttft is None or direct_ttft is None or name == "direct" else ttft - direct_ttft
        )
        rows.append(
            [
                LABELS.get(name, name),
                _num(_get(res, "single", "chunks_per_s")),
                _num(_get(res, "c64", "chunks_per_s")),
                _num(_get(res, "c64s8", "chunks_per_s")) if "c64s8" in res else "n/a",
                _num(_get(res, "paced", "latency_ms", "p50"), 3),
                _num(_get(res, "paced", "latency_ms", "p99"), 3),
                _num(ttft, 3),
                _num(added, 3) if added is not None else "—",
            ]
        )
    out.append(
        _table(
            [
                "path",
                "1 stream",
                "64 / 1 session",
                "64 / 8 sessions",
                "lat p50",
                "lat p99",
                "TTFT p50",
                "added TTFT",
            ],
            rows,
        )
    )
    out += ["", "CPU per relayed chunk (µs, the relaying process's own utime+stime / chunks)", ""]
    rows = []
    for name, res in paths.items():
        for proc in RELAYS.get(name, []):
            rows.append(
                [LABELS.get(name, name), proc]
                + [
                    _num(_get(res, key, "cpu_us_per_chunk", proc), 1) if key in res else "n/a"
                    for key, _ in SCENARIOS
                ]
            )
    out.append(_table(["path", "process", *(label for _, label in SCENARIOS)], rows))
    sink = results.get("sink_check")
    if sink:
        out += [
            "",
            "Sink check: the same runner streams read by the hub's own channel receive path",
            "",
        ]
        rows = [
            [
                label,
                _num(_get(sink, key, "chunks_per_s")),
                f"{_get(sink, key, 'hub_busy') or 0:.0%}",
                _num(_get(sink, key, "lean_sink_chunks_per_s")),
                f"{_get(sink, key, 'lean_sink_busy') or 0:.0%}",
            ]
            for key, label in (("single", "1 stream"), ("c64", "64 / 1 session"))
        ]
        out.append(
            _table(["streams", "hub as sink", "hub CPU busy", "lean sink", "bench CPU busy"], rows)
        )
    scale = results.get("scale")
    if scale:
        rss = scale["rss_bytes"]
        t = scale["turns"]
        out += [
            "",
            f"Scale: one runner, {scale['sessions']} open idle sessions, then one turn on each",
            "",
        ]
        rows = [[f"RSS at {k} sessions", f"{v / 1e6:.1f} MB"] for k, v in rss.items()]
        rows += [
            [f"marginal per session ({k})", f"{v / 1e3:.1f} KB"]
            for k, v in scale["marginal_bytes_per_session"].items()
        ]
        rows += [
            ["sessions opened in", f"{scale['open_seconds'][str(scale['sessions'])]} s"],
            [
                f"{t['turns']} concurrent turns",
                f"{t['chunks']} chunks in {t['seconds']} s = "
                f"{_num(t['chunks_per_s'])} chunks/s, {t['errors']} errors",
            ],
            [
                "  TTFT p50 / p99",
                f"{_num(t['ttft_ms']['p50'], 1)} / {_num(t['ttft_ms']['p99'], 1)} ms",
            ],
            ["  runner CPU per chunk", f"{_num(t['cpu_us_per_chunk'], 1)} µs"],
            [
                "  RSS peak / after",
                f"{t['rss_peak_bytes'] / 1e6:.1f} / {t['rss_after_bytes'] / 1e6:.1f} MB",
            ],
        ]
        out.append(_table(["", "value"], rows))
    out += ["", "Targets", ""]
    out.append(_table(["target", "measured", "met"], [[a, b, c] for a, b, c in targets(results)]))
    for note in results.get("notes", []):
        out.append(f"note: {note}")
    return "\n".join(out)


def targets(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    paths = results.get("paths", {})
    rows: list[tuple[str, str, str]] = []

    def check(name: str, ok: bool | None, text: str) -> None:
        rows.append((name, text, "—" if ok is None else ("yes" if ok else "NO")))

    runner, floor, litellm = (
        paths.get("runner", {}),
        paths.get("floor", {}),
        paths.get("litellm", {}),
    )
    ratios = []
    for key, label in SCENARIOS:
        r = _get(runner, key, "cpu_us_per_chunk", "runner")
        f = _get(floor, key, "cpu_us_per_chunk", "floor")
        if r and f:
            ratios.append((label, r / f))
    if ratios:
        check(
            "runner CPU/chunk ≤ 2× floor",
            all(x <= 2 for _, x in ratios),
            ", ".join(f"{label} {x:.2f}×" for label, x in ratios),
        )
    ratios = []
    for key, label in SCENARIOS:
        r = _get(runner, key, "cpu_us_per_chunk", "runner")
        lt = _get(litellm, key, "cpu_us_per_chunk", "litellm")
        if r and lt:
            ratios.append((label, lt / r))
    if ratios:
        check(
            "runner CPU/chunk ≥ 10× below LiteLLM",
            all(x >= 10 for _, x in ratios),
            ", ".join(f"{label} {x:.1f}×" for label, x in ratios),
        )
    r1 = _get(runner, "single", "chunks_per_s")
    d1 = _get(paths, "direct", "single", "chunks_per_s")
    if r1 and d1:
        check("runner 1-stream throughput ≥ 0.8× direct", r1 / d1 >= 0.8, f"{r1 / d1:.2f}×")
    p50 = _get(runner, "paced", "latency_ms", "p50")
    p99 = _get(runner, "paced", "latency_ms", "p99")
    if p50 is not None:
        check("added latency p50 ≤ 0.3 ms (64 paced)", p50 <= 0.3, f"{p50:.3f} ms")
    if p99 is not None:
        check("added latency p99 ≤ 2 ms (64 paced)", p99 <= 2, f"{p99:.3f} ms")
    rt = _get(runner, "ttft", "ttft_ms", "p50")
    dt = _get(paths, "direct", "ttft", "ttft_ms", "p50")
    if rt is not None and dt is not None:
        check(
            "added TTFT p50 ≤ 1 ms", rt - dt <= 1, f"{rt - dt:.3f} ms ({rt:.3f} vs direct {dt:.3f})"
        )
    scale = results.get("scale")
    if scale:
        n = str(scale["sessions"])
        total = scale["rss_bytes"][n]
        check(f"{n} idle sessions ≤ 120 MB RSS", total <= 120e6, f"{total / 1e6:.1f} MB")
        margins = scale["marginal_bytes_per_session"]
        margin = list(margins.values())[-1]  # the last step: one-off growth is behind it
        check(
            "≤ 40 KB per session at the margin",
            margin <= 40e3,
            ", ".join(f"{k}: {v / 1e3:.1f} KB" for k, v in margins.items()),
        )
    e2e = paths.get("e2e", {})
    ratios = []
    for key, label in SCENARIOS:
        h = _get(e2e, key, "cpu_us_per_chunk", "hub")
        r = _get(e2e, key, "cpu_us_per_chunk", "runner")
        if h and r:
            ratios.append((label, h / r))
    if ratios:
        check(
            "hub front door CPU/chunk ≤ 2× runner's",
            all(x <= 2 for _, x in ratios),
            ", ".join(f"{label} {x:.2f}×" for label, x in ratios),
        )
    return rows
