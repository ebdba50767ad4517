"""The fault bench's figures: each fault × API folded from its runs, and the table printed."""

from __future__ import annotations

import argparse
from typing import Any

from bench.common import percentile

TARGET_ZERO = ("none", "cut", "frozen", "sigkill", "backend")  # errors: target 0


def _pct(values: list[float], p: float) -> float | None:
    found = percentile(values, p)
    return None if found is None else round(found, 4)


def summarize(fault: str, runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per API: runs, errors, answers equal, one answer, the gap p50/p99/max, how they were
    saved; ``rest-frozen``: the wait; ``hub-restart``: return, next TTFT, ledger."""
    out: dict[str, Any] = {}
    for api in args.apis:
        rows = [r for r in runs if r["api"] == api]
        if not rows:
            continue
        gaps = [r["gap_s"] for r in rows if r["gap_s"] is not None]
        found: dict[str, Any] = {
            "runs": len(rows),
            "errors": sum(r["failed"] is not None for r in rows),
            "error_kinds": sorted({r["failed"] for r in rows if r["failed"]}),
            "equal": sum(bool(r["equal"]) for r in rows),
            "one_answer": sum(not r["failed"] and r["shape"] is None for r in rows),
            "gap_p50_s": _pct(gaps, 50),
            "gap_p99_s": _pct(gaps, 99),
            "gap_max_s": round(max(gaps), 4) if gaps else None,
            "fired": sum(r.get("fired_at") is not None for r in rows),
            "resumed": sum(r.get("turnsResumed", 0) for r in rows),
            "continued": sum(r.get("turnsContinued", 0) for r in rows),
            "failovers": sum(r.get("failovers", 0) for r in rows),
            "runner_continued": sum(r.get("runner_continued", 0) for r in rows),
        }
        if fault == "rest-frozen":
            waits = [r["wait_s"] for r in rows if r.get("wait_s") is not None]
            client = [r["client_wait_s"] for r in rows if r.get("client_wait_s") is not None]
            found.update(
                client_wait_p50_s=_pct(client, 50),
                client_wait_max_s=round(max(client), 4) if client else None,
                served=len(waits),
                wait_p50_s=_pct(waits, 50),
                wait_p99_s=_pct(waits, 99),
                wait_max_s=round(max(waits), 4) if waits else None,
                bound_s=2 * args.ping + 1,
                within_bound=sum(bool(r.get("within_bound")) for r in rows),
            )
        if fault == "hub-restart":
            back = [r["return_s"] for r in rows if r.get("return_s") is not None]
            ttft = [r["ttft_s"] for r in rows if r.get("ttft_s") is not None]
            found.update(
                return_p50_s=_pct(back, 50),
                return_p99_s=_pct(back, 99),
                return_max_s=round(max(back), 4) if back else None,
                returned=len(back),
                ttft_p50_s=_pct(ttft, 50),
                ttft_p99_s=_pct(ttft, 99),
                cut_turn_errors=sum(r.get("cut_turn") != "whole" for r in rows),
                first_turn_errors=sum(r.get("first_turn") != "whole" for r in rows),
                same_runner=sum(
                    r.get("served_next") is not None and r.get("served_next") == r.get("served_cut")
                    for r in rows
                ),
                ledger_ok=sum(bool(r.get("ledger_ok")) for r in rows),
            )
        out[api] = found
    return out


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:,.0f}"


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def table(results: dict[str, Any]) -> str:
    """A Markdown table: a row per fault × API."""
    head = (
        "| fault | API | runs | errors | text equal | one answer | gap p50 ms | gap p99 ms "
        "| how | fault's own figures |"
    )
    lines = [head, "|" + "---|" * 10]
    for fault, found in results["faults"].items():
        for api, f in found["summary"].items():
            how = []
            if f["resumed"]:
                how.append(f"resumed {f['resumed']}")
            if f["continued"]:
                how.append(f"continued {f['continued']}")
            if f["runner_continued"]:
                how.append(f"continued in the runner {f['runner_continued']}")
            own = ""
            if fault == "rest-frozen":
                own = (
                    f"freeze → first delta p50 {_s(f['wait_p50_s'])} s, p99 "
                    f"{_s(f['wait_p99_s'])} s, max {_s(f['wait_max_s'])} s; ≤ "
                    f"{f['bound_s']:g} s: {f['within_bound']}/{f['runs']}; the first client "
                    f"waited p50 {_s(f.get('client_wait_p50_s'))} s, max "
                    f"{_s(f.get('client_wait_max_s'))} s"
                )
            elif fault == "hub-restart":
                own = (
                    f"runners back p50 {_s(f['return_p50_s'])} s, p99 {_s(f['return_p99_s'])} s "
                    f"({f['returned']}/{f['runs']}); next turn TTFT p50 {_s(f['ttft_p50_s'])} s, "
                    f"p99 {_s(f['ttft_p99_s'])} s; same runner {f['same_runner']}/{f['runs']}; "
                    f"cut turn errored {f['cut_turn_errors']}/{f['runs']}; ledger ok "
                    f"{f['ledger_ok']}/{f['runs']}"
                )
            elif fault != "none":
                own = f"fired {f['fired']}/{f['runs']}"
            if f["error_kinds"]:
                own += ("; " if own else "") + "errors: " + ", ".join(f["error_kinds"])
            errors = f"{f['errors']}"
            lines.append(
                f"| {fault} | {api} | {f['runs']} | {errors} | {f['equal']}/{f['runs']} "
                f"| {f['one_answer']}/{f['runs']} | {_ms(f['gap_p50_s'])} | {_ms(f['gap_p99_s'])} "
                f"| {', '.join(how) or '—'} | {own} |"
            )
    return "\n".join(lines)
