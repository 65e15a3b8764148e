"""Numbers from an RL run's metrics rows (metrics.jsonl): the quickstart's summary, the experiment's report and
the analysis tools (rl_experiment, rl_diagnostics) all read runs through these, so a number means the same in each.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from stare_agent.step import regime_of
from stare_agent.theory import REGIMES


def logged(rows: list[dict[str, Any]], key: str) -> list[Any]:
    """The values of `key` over the steps, skipping steps where it is missing or null (undefined that step)."""
    return [r[key] for r in rows if r.get(key) is not None]


def final_window(rows: list[dict[str, Any]], key: str, fraction: float = 0.25) -> list[float]:
    """The logged values of `key` in the last `fraction` of the steps that have it."""
    values = logged(rows, key)
    return values[-max(1, int(len(values) * fraction)) :] if values else []


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def spread(values: list[float]) -> dict[str, Any]:
    """n, min, median and max of `values` (the statistics None when there are none)."""
    if not values:
        return {"n": 0, "min": None, "median": None, "max": None}
    return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values)}


def regime_counts(rows: list[dict[str, Any]]) -> dict[str, int] | None:
    """Steps in each theory/regime (theory.REGIMES, then any other value logged); None for a run that logged
    no regime (one from before the metric), so that it reads as unknown rather than as zero steps."""
    counts = Counter(regime_of(r) for r in rows)
    if set(counts) == {None}:
        return None
    return {name: counts.pop(name, 0) for name in REGIMES} | {str(k): n for k, n in counts.items()}


def run_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers the quickstart summary and `stare-agent lab rl_experiment` report for one RL run's metrics rows.

    W* (`critical_weight`) and proxy precision are n/min/median/max over the steps where they are defined
    (null elsewhere): a median over the other steps would mix in values that are not thresholds on W.
    """
    entropy = logged(rows, "stare/entropy_mean")
    tail = final_window(rows, "stare/entropy_mean")
    return {
        "steps": len(rows),
        "entropy_first": entropy[0] if entropy else None,
        "entropy_first5_mean": mean(entropy[:5]),
        "final_window_steps": len(tail),
        "entropy_final_window_mean": mean(tail),
        "entropy_final_window_min": min(tail, default=None),
        "entropy_final_window_max": max(tail, default=None),
        "rollout_accuracy_final_window": mean(final_window(rows, "rollout/accuracy")),
        "regimes": regime_counts(rows),
        "critical_weight": spread(logged(rows, "theory/critical_weight")),
        "proxy_precision": spread(logged(rows, "theory/proxy_precision")),
        "gate_fraction": mean(logged(rows, "stare/gate")),
        "groups_dropped": sum(
            (r.get("rollout/groups_dropped_equal") or 0) + (r.get("rollout/groups_dropped_sandbox") or 0) for r in rows
        ),
        "step_seconds_mean": mean(logged(rows, "time/step")),
        "stare_seconds_share": _share(rows),
    }


def regimes_text(counts: dict[str, int] | None) -> str:
    """'rising 0, needs_w 38, ...' from regime_counts."""
    if counts is None:
        return "not logged (a run from before theory/regime)"
    return ", ".join(f"{name} {n}" for name, n in counts.items())


def spread_text(s: dict[str, Any]) -> str:
    """'0.08-0.24 (median 0.16 over 40 steps)' from spread."""
    if not s["n"]:
        return "undefined on every step"
    return f"{fmt(s['min'], 2)}-{fmt(s['max'], 2)} (median {fmt(s['median'], 2)} over {s['n']} steps)"


def _share(rows: list[dict[str, Any]]) -> float | None:
    stare = sum(r.get("time/stare") or 0.0 for r in rows)
    total = sum(r.get("time/step") or 0.0 for r in rows)
    return stare / total if total else None


def fmt(value: Any, digits: int = 3) -> str:
    """A number for a table: `digits` decimals for floats, '-' for None."""
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)
