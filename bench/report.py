"""The bench's results as text tables: every path and scenario, ratios, the targets of issue #10."""

from __future__ import annotations

from typing import Any

LABELS = {
    "floor-trio": "trio floor, a task per stream",
    "floor-trio-streams": "trio streams floor",
    "floor-asyncio": "asyncio floor",
    "floor-trio-poller": "trio floor, one poller",
    "direct": "direct (sim → client)",
    "peer": "plain asyncio peer",
    "runner": "runner",
    "e2e": "e2e front door → runner",
    "e2e-messages": "e2e /v1/messages → runner",
    "e2e-responses": "e2e /v1/responses → runner",
    "e2e-base": "e2e, the hub and runner of --base-tree",
    "plain-e2e": "plain aiohttp Server → plain peer",
    "litellm": "LiteLLM proxy",
    "portkey": "Portkey gateway",
    "peer-wss": "plain asyncio peer, wss",
    "runner-wss": "runner, wss",
}
# the relaying processes of each path (their CPU per chunk is what is compared)
RELAYS = {
    "floor-trio": ["floor"],
    "floor-trio-streams": ["floor"],
    "floor-asyncio": ["floor"],
    "floor-trio-poller": ["floor"],
    "direct": [],
    "peer": ["peer"],
    "runner": ["runner"],
    "e2e": ["runner", "hub"],
    "e2e-messages": ["runner", "hub"],
    "e2e-responses": ["runner", "hub"],
    "e2e-base": ["runner", "hub"],
    "plain-e2e": ["peer", "plainhub"],
    "litellm": ["litellm"],
    "portkey": ["portkey"],
    "peer-wss": ["peer"],
    "runner-wss": ["runner"],
}
# each path's event loop, and the floor of that loop
LOOP = {
    "floor-trio": "trio",
    "floor-trio-streams": "trio",
    "floor-asyncio": "asyncio",
    "floor-trio-poller": "trio",
    "peer": "asyncio",
    "peer-wss": "asyncio",
    "runner": "trio",
    "runner-wss": "trio",
    "e2e": "trio",
    "e2e-messages": "trio",
    "e2e-responses": "trio",
    "e2e-base": "trio",
    "plain-e2e": "asyncio",
    "litellm": "asyncio",
    "portkey": "node",
}
# the floors of each loop: a path's "× floor" is over the cheapest of them in that scenario
FLOORS_OF = {"trio": ("floor-trio-poller", "floor-trio"), "asyncio": ("floor-asyncio",)}


def floor_cpu(paths: dict[str, Any], loop: str, key: str) -> float | None:
    """The CPU µs per chunk of the cheapest floor of ``loop`` in scenario ``key``."""
    found = [c for f in FLOORS_OF.get(loop, ()) if (c := cpu(paths, f, key)) is not None]
    return min(found) if found else None


SCENARIOS = (
    (
        "lockstep",
        "lockstep: {streams} streams / {sessions} sessions, {chunks} tokens each, "
        "released together every {ms} ms",
    ),
    ("spread", "spread: {streams} streams / 1 session paced {ms} ms, starts spread over one step"),
    (
        "spread8",
        "spread8: {streams} streams / {sessions} sessions paced {ms} ms, starts spread over one step",
    ),
    ("single", "full speed: 1 stream"),
    ("c64s8", "full speed: {streams} streams / {sessions} sessions"),
    ("c64", "full speed: {streams} streams / 1 session"),
)


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep, *(line(r) for r in rows)])


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def peer_of(name: str) -> str:
    """The plain peer a path is held against: over the same transport (ws or wss)."""
    return "peer-wss" if name.endswith("-wss") else "peer"


def cpu(paths: dict[str, Any], name: str, key: str, proc: str | None = None) -> float | None:
    """CPU µs per chunk of a path's (first, or named) relaying process in one scenario."""
    relays = RELAYS.get(name, [])
    if not relays:
        return None
    return _get(paths, name, key, "cpu_us_per_chunk", proc or relays[0])


def _scenario_title(results: dict[str, Any], key: str, template: str) -> str:
    sc = results.get("scenarios", {}).get(key, {})
    return template.format(
        streams=sc.get("streams", "?"),
        sessions=sc.get("sessions", "?"),
        chunks=sc.get("chunks", "?"),
        ms=round(sc.get("interval", 0) * 1000),
    )


def scenario_table(results: dict[str, Any], key: str) -> str | None:
    paths = results.get("paths", {})
    present = [n for n in paths if key in paths[n]]
    if not present:
        return None
    paced = any(_get(paths, n, key, "latency_ms") for n in present)
    direct_ttft = _get(paths, "direct", key, "ttft_ms", "p50")
    head = ["path", "chunks/s", "CPU µs/chunk", "× peer", "× floor (same loop)"]
    if paced:
        head += ["lat p50 ms", "lat p99 ms", "p50 × peer", "p99 × peer"]
    head += ["TTFT p50 ms", "added TTFT ms"]
    rows = []
    for name in present:
        res = paths[name][key]
        if not res.get("chunks"):
            rows.append([LABELS.get(name, name), "no chunk relayed", *[""] * (len(head) - 2)])
            continue
        relays = RELAYS.get(name, [])
        own = cpu(paths, name, key)
        peer = peer_of(name)
        floor = floor_cpu(paths, LOOP.get(name, ""), key)
        cpu_text = (
            " + ".join(
                f"{p} {_num(_get(res, 'cpu_us_per_chunk', p), 1)}"
                if len(relays) > 1
                else _num(_get(res, "cpu_us_per_chunk", p), 1)
                for p in relays
            )
            or "—"
        )
        row = [
            LABELS.get(name, name),
            _num(res.get("chunks_per_s")),
            cpu_text,
            _x(_ratio(own, cpu(paths, peer, key))),
            _x(_ratio(own, floor)) if floor is not None else "—",
        ]
        if paced:
            p50 = _get(res, "latency_ms", "p50")
            p99 = _get(res, "latency_ms", "p99")
            relay = name != "direct"  # the direct path relays nothing: no ratio
            row += [
                _num(p50, 2),
                _num(p99, 2),
                _x(_ratio(p50, _get(paths, peer, key, "latency_ms", "p50")) if relay else None),
                _x(_ratio(p99, _get(paths, peer, key, "latency_ms", "p99")) if relay else None),
            ]
        ttft = _get(res, "ttft_ms", "p50")
        added = (
            None if ttft is None or direct_ttft is None or name == "direct" else ttft - direct_ttft
        )
        row += [_num(ttft, 2), _num(added, 2)]
        rows.append(row)
    return _table(head, rows)


# -- end to end (issue 18): hub + runner against the plain pair ----------------------------

# path -> (its Server's process, its runner's process), as labelled in cpu_us_per_chunk
PAIRS = {"e2e": ("hub", "runner"), "plain-e2e": ("plainhub", "peer")}
PAIR_LABELS = {"e2e": "hub + runner", "plain-e2e": "plain Server + plain peer (baseline)"}
# the runner alone (its channel ending in the lean sink) of each pair: the front door's share
ALONE = {"e2e": "runner", "plain-e2e": "peer"}
PLAIN = "plain-e2e"
E2E_SCENARIOS = ("lockstep", "c64s8", "single")  # paced first, then full speed
E2E_FIGURES = (
    "server_cpu_us_per_chunk",
    "runner_cpu_us_per_chunk",
    "whole_cpu_us_per_chunk",
    "added_latency_ms_p50",
    "added_latency_ms_p99",
)


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def e2e_summary(results: dict[str, Any]) -> dict[str, Any]:
    """Each pair's figures per scenario, the front door's idle TTFT, each with its ratio to the
    plain pair's (``x_plain``). Stored in the JSON as ``e2e``."""
    paths = results.get("paths", {})
    out: dict[str, Any] = {"scenarios": {}, "ttft": {}}
    for key in E2E_SCENARIOS:
        rows: dict[str, dict[str, Any]] = {}
        for name, (server, runner) in PAIRS.items():
            res = _get(paths, name, key)
            if not res or not res.get("chunks"):
                continue
            s = _get(res, "cpu_us_per_chunk", server)
            r = _get(res, "cpu_us_per_chunk", runner)
            row: dict[str, Any] = {
                "chunks": res.get("chunks"),
                "chunks_per_s": res.get("chunks_per_s"),
                "server_cpu_us_per_chunk": s,
                "runner_cpu_us_per_chunk": r,
                "whole_cpu_us_per_chunk": None if s is None or r is None else round(s + r, 2),
            }
            for q in ("p50", "p99"):
                row[f"latency_ms_{q}"] = _get(res, "latency_ms", q)
                row[f"added_latency_ms_{q}"] = _minus(
                    _get(res, "latency_ms", q), _get(paths, "direct", key, "latency_ms", q)
                )
            rows[name] = row
        plain = rows.get(PLAIN, {})
        for row in rows.values():
            row["x_plain"] = {
                f: None if (r := _ratio(row.get(f), plain.get(f))) is None else round(r, 3)
                for f in E2E_FIGURES
            }
        if rows:
            out["scenarios"][key] = rows
    direct = _get(paths, "direct", "ttft", "ttft_ms", "p50")
    for name, alone in ALONE.items():
        t = _get(paths, name, "ttft", "ttft_ms", "p50")
        if t is None:
            continue
        a = _get(paths, alone, "ttft", "ttft_ms", "p50")
        out["ttft"][name] = {
            "ttft_ms_p50": t,
            "ttft_ms_p99": _get(paths, name, "ttft", "ttft_ms", "p99"),
            "runner_alone_ms_p50": a,
            "front_door_added_ms": _minus(t, a),
            "added_over_direct_ms": _minus(t, direct),
        }
    plain_t = out["ttft"].get(PLAIN, {})
    for row in out["ttft"].values():
        row["x_plain"] = {
            f: None if (r := _ratio(row.get(f), plain_t.get(f))) is None else round(r, 3)
            for f in ("front_door_added_ms", "added_over_direct_ms")
        }
    return out


def e2e_tables(results: dict[str, Any]) -> list[str]:
    summary = results.get("e2e") or e2e_summary(results)
    out: list[str] = []
    for key, rows in summary["scenarios"].items():
        paced = any(r.get("latency_ms_p50") is not None for r in rows.values())
        head = ["pair", "chunks/s", "Server µs/chunk", "× plain", "runner µs/chunk", "× plain"]
        head += ["whole path µs/chunk", "× plain"]
        if paced:
            head += ["added lat p50 ms", "× plain", "added lat p99 ms", "× plain"]
        table = []
        for name, row in rows.items():
            x = row["x_plain"]
            line = [PAIR_LABELS.get(name, name), _num(row["chunks_per_s"])]
            for f in E2E_FIGURES[:3]:
                line += [_num(row[f], 1), _x(x[f])]
            if paced:
                for f in E2E_FIGURES[3:]:
                    line += [_num(row[f], 2), _x(x[f])]
            table.append(line)
        title = dict(SCENARIOS).get(key, key)
        out += [
            "",
            "End to end (client → Server front door → runner → backend): "
            + _scenario_title(results, key, title),
            "",
            _table(head, table),
        ]
    if summary["ttft"]:
        table = []
        for name, row in summary["ttft"].items():
            x = row["x_plain"]
            table.append(
                [
                    PAIR_LABELS.get(name, name),
                    _num(row["ttft_ms_p50"], 3),
                    f"{_num(row['runner_alone_ms_p50'], 3)} ({ALONE[name]})",
                    _num(row["front_door_added_ms"], 3),
                    _x(x["front_door_added_ms"]),
                    _num(row["added_over_direct_ms"], 3),
                    _x(x["added_over_direct_ms"]),
                ]
            )
        head = ["pair", "TTFT p50", "runner alone p50", "front door added", "× plain"]
        head += ["added over direct", "× plain"]
        out += ["", "End to end, idle time to first token (ms, p50)", "", _table(head, table)]
    return out


def targets_18(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Issue 18 point 6's targets, each checked: (target, measured, "yes" / "NO" / "—")."""
    summary = results.get("e2e") or e2e_summary(results)
    rows: list[tuple[str, str, str]] = []

    def check(label: str, a: float | None, b: float | None, limit: float, what: str) -> None:
        r = _ratio(a, b)
        if a is None or b is None or (r is None):
            rows.append((label, "not measured", "—"))
        else:
            rows.append(
                (label, f"{r:.2f}× ({a:.2f} vs {what} {b:.2f})", "yes" if r <= limit else "NO")
            )

    lock = summary["scenarios"].get("lockstep", {})
    hub = lock.get("e2e", {})
    plain = lock.get(PLAIN, {})
    check(
        "lockstep: hub CPU/chunk ≤ the runner's own (same run)",
        hub.get("server_cpu_us_per_chunk"),
        hub.get("runner_cpu_us_per_chunk"),
        1.0,
        "runner µs",
    )
    for key in ("lockstep", "c64s8"):
        sc = summary["scenarios"].get(key, {})
        check(
            f"{key}: whole-path CPU/chunk ≤ 0.5× the plain pair's",
            _get(sc, "e2e", "whole_cpu_us_per_chunk"),
            _get(sc, PLAIN, "whole_cpu_us_per_chunk"),
            0.5,
            "plain µs",
        )
    for q in ("p50", "p99"):
        check(
            f"lockstep: whole-path added latency {q} ≤ 0.5× the plain pair's",
            hub.get(f"added_latency_ms_{q}"),
            plain.get(f"added_latency_ms_{q}"),
            0.5,
            "plain ms",
        )
    t = summary["ttft"].get("e2e", {})
    added = t.get("front_door_added_ms")
    if added is None:
        rows.append(
            ("front door added idle TTFT ≤ 1 ms over the runner alone", "not measured", "—")
        )
    else:
        rows.append(
            (
                "front door added idle TTFT ≤ 1 ms over the runner alone",
                f"{added:.3f} ms ({t['ttft_ms_p50']:.3f} vs runner {t['runner_alone_ms_p50']:.3f})",
                "yes" if added <= 1.0 else "NO",
            )
        )
    return rows


# -- the translated front door (issue 19): /v1/messages and /v1/responses against chat ------

TRANSLATED = ("e2e-messages", "e2e-responses")
FRONT = ("e2e", *TRANSLATED)  # the front door's three APIs, chat completions first
FRONT_LABELS = {
    "e2e": "chat completions (e2e)",
    "e2e-messages": "Anthropic Messages (e2e-messages)",
    "e2e-responses": "Responses (e2e-responses)",
}
TRANSLATED_LIMIT = 1.5  # issue 19 point 6: hub CPU per chunk ≤ 1.5× chat completions'


def translated_summary(results: dict[str, Any]) -> dict[str, Any]:
    """The front door's three APIs per scenario (lockstep, then full speed): the hub's and the
    runner's CPU per chunk, the latency per chunk, each translated API's hub CPU over chat
    completions' (``hub_x_e2e``). Stored in the JSON as ``translated``."""
    paths = results.get("paths", {})
    out: dict[str, Any] = {}
    for key in ("lockstep", "c64s8", "c64", "single"):
        rows: dict[str, dict[str, Any]] = {}
        for name in FRONT:
            res = _get(paths, name, key)
            if not res or not res.get("chunks"):
                continue
            rows[name] = {
                "chunks": res.get("chunks"),
                "chunks_per_s": res.get("chunks_per_s"),
                "hub_cpu_us_per_chunk": _get(res, "cpu_us_per_chunk", "hub"),
                "runner_cpu_us_per_chunk": _get(res, "cpu_us_per_chunk", "runner"),
                "latency_ms_p50": _get(res, "latency_ms", "p50"),
                "latency_ms_p99": _get(res, "latency_ms", "p99"),
            }
        if not any(n in rows for n in TRANSLATED):
            continue
        chat = rows.get("e2e", {}).get("hub_cpu_us_per_chunk")
        for row in rows.values():
            r = _ratio(row["hub_cpu_us_per_chunk"], chat)
            row["hub_x_e2e"] = None if r is None else round(r, 3)
        out[key] = rows
    return out


def translated_tables(results: dict[str, Any]) -> list[str]:
    summary = results.get("translated") or translated_summary(results)
    out: list[str] = []
    for key, rows in summary.items():
        paced = any(r.get("latency_ms_p50") is not None for r in rows.values())
        head = ["API", "chunks/s", "hub µs/chunk", "× e2e", "runner µs/chunk"]
        if paced:
            head += ["lat p50 ms", "lat p99 ms"]
        table = []
        for name, row in rows.items():
            line = [
                FRONT_LABELS.get(name, name),
                _num(row["chunks_per_s"]),
                _num(row["hub_cpu_us_per_chunk"], 1),
                _x(row["hub_x_e2e"]) if name != "e2e" else "—",
                _num(row["runner_cpu_us_per_chunk"], 1),
            ]
            if paced:
                line += [_num(row["latency_ms_p50"], 2), _num(row["latency_ms_p99"], 2)]
            table.append(line)
        title = dict(SCENARIOS).get(key, key)
        out += [
            "",
            "Translated front door (client → hub /v1/messages, /v1/responses → runner → "
            "backend; each chunk's events written at once), against chat completions: "
            + _scenario_title(results, key, title),
            "",
            _table(head, table),
        ]
    return out


def targets_19(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Issue 19 point 6, each translated API checked: (target, measured, "yes" / "NO" / "—")."""
    summary = results.get("translated") or translated_summary(results)
    lock = summary.get("lockstep", {})
    chat = _get(lock, "e2e", "hub_cpu_us_per_chunk")
    rows: list[tuple[str, str, str]] = []
    for name in TRANSLATED:
        label = (
            f"lockstep: {name} hub CPU/chunk ≤ {TRANSLATED_LIMIT}× e2e's (chat completions, "
            "same run)"
        )
        own = _get(lock, name, "hub_cpu_us_per_chunk")
        r = _ratio(own, chat)
        if r is None:
            rows.append((label, "not measured", "—"))
        else:
            rows.append(
                (
                    label,
                    f"{r:.2f}× ({own:.2f} vs e2e µs {chat:.2f})",
                    "yes" if r <= TRANSLATED_LIMIT else "NO",
                )
            )
    return rows


def render(results: dict[str, Any]) -> str:
    paths = results.get("paths", {})
    m = results.get("machine", {})
    out = [
        f"alp-gateway relay bench — {results.get('date')} — {m.get('nproc')} × {m.get('cpu_model')}, "
        f"Python {m.get('python')} — mode {results.get('mode')}, median of {results.get('repeat')} "
        f"alternating round(s), {results.get('bench_seconds')} s"
        + (f" — {results['label']}" if results.get("label") else "")
        + (
            " — WHAT-IF: runner with httpcore's pool patched (bench/whatif_pool.py)"
            if results.get("whatif_pool")
            else ""
        ),
        "",
        "CPU µs/chunk: the relaying process's own CPU (kernel run time) / chunks it relayed. "
        "× peer: to the plain asyncio peer over the same transport; × floor: to the floor of "
        "the path's event loop. Latency: backend write → sink receive, steady state. "
        "TTFT: request sent → first chunk received, under the scenario's load; added: minus direct's.",
    ]
    for key, template in SCENARIOS:
        table = scenario_table(results, key)
        if table:
            out += ["", _scenario_title(results, key, template), "", table]
    rows = []
    direct_ttft = _get(paths, "direct", "ttft", "ttft_ms", "p50")
    for name, res in paths.items():
        ttft = _get(res, "ttft", "ttft_ms", "p50")
        if ttft is None:
            continue
        added = None if direct_ttft is None or name == "direct" else ttft - direct_ttft
        rows.append(
            [
                LABELS.get(name, name),
                _num(ttft, 3),
                _num(_get(res, "ttft", "ttft_ms", "p99"), 3),
                _num(added, 3),
            ]
        )
    if rows:
        out += ["", "Time to first token, one-chunk turns one at a time on an idle path (ms)", ""]
        out.append(_table(["path", "TTFT p50", "TTFT p99", "added TTFT p50"], rows))
    if any(n in paths for n in PAIRS):
        out += e2e_tables(results)
    if any(n in paths for n in TRANSLATED):
        out += translated_tables(results)
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
        out += ["", *_scale(scale)]
    if any(n in paths for n in PAIRS):
        out += ["", "Targets (issue 18, point 6: end to end, against the plain pair)", ""]
        out.append(_table(["target", "measured", "met"], [list(t) for t in targets_18(results)]))
    if any(n in paths for n in TRANSLATED):
        out += ["", "Targets (issue 19, point 6: the translated front door, against chat)", ""]
        out.append(_table(["target", "measured", "met"], [list(t) for t in targets_19(results)]))
    out += ["", "Targets (issue #10, point 4, and the scale targets)", ""]
    out.append(_table(["target", "measured", "met"], [[a, b, c] for a, b, c in targets(results)]))
    for note in results.get("notes", []):
        out.append(f"note: {note}")
    return "\n".join(out)


def _scale(scale: dict[str, Any]) -> list[str]:
    rss = scale["rss_bytes"]
    t = scale["turns"]
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
        ["  TTFT p50 / p99", f"{_num(t['ttft_ms']['p50'], 1)} / {_num(t['ttft_ms']['p99'], 1)} ms"],
        ["  runner CPU per chunk", f"{_num(t['cpu_us_per_chunk'], 1)} µs"],
        [
            "  RSS peak / after",
            f"{t['rss_peak_bytes'] / 1e6:.1f} / {t['rss_after_bytes'] / 1e6:.1f} MB",
        ],
    ]
    return [
        f"Scale: one runner, {scale['sessions']} open idle sessions, then one turn on each",
        "",
        _table(["", "value"], rows),
    ]


def targets(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Issue #10's targets, each checked: (target, measured, "yes" / "NO" / "—")."""
    paths = results.get("paths", {})
    rows: list[tuple[str, str, str]] = []

    def check(name: str, ok: bool | None, text: str) -> None:
        rows.append((name, text, "—" if ok is None else ("yes" if ok else "NO")))

    def ratio_check(label: str, a: float | None, b: float | None, limit: float, what: str) -> None:
        r = _ratio(a, b)
        if r is None:
            check(label, None, "not measured")
        else:
            check(label, r <= limit, f"{r:.2f}× ({a:.2f} vs {what} {b:.2f})")

    for runner, peer, suffix in (("runner", "peer", ""), ("runner-wss", "peer-wss", ", wss")):
        if runner not in paths:
            continue
        r_cpu = cpu(paths, runner, "lockstep")
        ratio_check(
            f"lockstep CPU/chunk ≤ 0.8× peer{suffix}",
            r_cpu,
            cpu(paths, peer, "lockstep"),
            0.8,
            "peer µs",
        )
        for q in ("p50", "p99"):
            ratio_check(
                f"lockstep latency {q} ≤ 0.8× peer{suffix}",
                _get(paths, runner, "lockstep", "latency_ms", q),
                _get(paths, peer, "lockstep", "latency_ms", q),
                0.8,
                "peer ms",
            )
    r_cpu = cpu(paths, "runner", "lockstep")
    f_cpu = floor_cpu(paths, "trio", "lockstep")
    p_cpu = cpu(paths, "peer", "lockstep")
    fp = _ratio(f_cpu, p_cpu)
    if fp is not None and fp > 0.8:
        ratio_check(
            f"lockstep CPU/chunk ≤ 1.2× trio floor (the floor costs {fp:.2f}× peer > 0.8×)",
            r_cpu,
            f_cpu,
            1.2,
            "floor µs",
        )
    else:
        ratio_check("lockstep CPU/chunk ≤ 1.5× trio floor", r_cpu, f_cpu, 1.5, "floor µs")
    for key, label in (("single", "1 stream"), ("c64s8", "64 streams / 8 sessions")):
        ratio_check(
            f"full speed {label}: CPU/chunk ≤ 0.5× peer",
            cpu(paths, "runner", key),
            cpu(paths, "peer", key),
            0.5,
            "peer µs",
        )
    rt = _get(paths, "runner", "ttft", "ttft_ms", "p50")
    dt = _get(paths, "direct", "ttft", "ttft_ms", "p50")
    if rt is not None and dt is not None:
        check(
            "added TTFT p50 ≤ 0.5 ms (idle, one turn at a time)",
            rt - dt <= 0.5,
            f"{rt - dt:.3f} ms ({rt:.3f} vs direct {dt:.3f})",
        )
    else:
        check("added TTFT p50 ≤ 0.5 ms", None, "not measured")
    h = cpu(paths, "e2e", "lockstep", "hub")
    r = cpu(paths, "e2e", "lockstep", "runner")
    if h is not None and r is not None:
        check(
            "e2e lockstep: hub front door CPU/chunk next to the runner's",
            None,
            f"hub {h:.1f} µs, runner {r:.1f} µs ({h / r:.2f}×)",
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
    return rows
