"""The first-order theory diagnostics of RL runs, from each run's metrics.jsonl.

docs/quickstart.md ("Choosing the STARE settings by measurement") quotes what this prints.

    stare-agent lab rl_diagnostics RUN_DIR [RUN_DIR ...] [--per-step] [--blocks N]

Per run: steps; steps in each theory/regime; steps per sign of (Lambda, Gamma); proxy precision and W*
as range and median over the steps where each is defined (W* only in the needs_w regime); the mean over
steps of the mean critical surprisal s* of the high+ tokens. The diagnostics use the run's stare.top_ratio
as P whether STARE is on or off, so rerunning a GRPO-ds run with another stare.top_ratio (same seed: same
trajectory) measures another P. --per-step adds each step's Lambda, Gamma, regime, W* and precision;
--blocks N the mean entropy and rollout accuracy over each block of N steps (the trend of a long run).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from stare_agent.backends.local.common import read_metrics
from stare_agent.lab.runs import logged, mean, regime_counts, regimes_text, spread, spread_text
from stare_agent.step import regime_of


def _sign(value: float | None) -> str:
    return "?" if value is None else "+" if value > 0 else "-" if value < 0 else "0"


def diagnostics(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: the run's diagnostics over all its steps (the first line is left to the caller)."""
    steps = len(rows)
    regimes = regime_counts(rows)
    signs = Counter(f"({_sign(r.get('theory/lambda'))}, {_sign(r.get('theory/gamma'))})" for r in rows)
    w_star = logged(rows, "theory/critical_weight")
    s_star = mean(logged(rows, "theory/critical_surprisal_mean"))
    lines = [
        f"- regimes (steps): {regimes_text(regimes)}",
        "- signs of (Lambda, Gamma) (steps): " + ", ".join(f"{k} {n}" for k, n in sorted(signs.items())),
        f"- proxy precision: {spread_text(spread(logged(rows, 'theory/proxy_precision')))}",
        f"- W* = 1 + Lambda/Gamma, defined on {len(w_star)} of {steps} steps: {spread_text(spread(w_star))}",
        "- critical surprisal s* (mean over high+ tokens, then over steps): "
        + ("-" if s_star is None else f"{s_star:.2f} nats"),
    ]
    if regimes is None:
        lines.append("- with no theory/regime logged, W* counts every step, including those where it is no threshold")
    return lines


def per_step(rows: list[dict[str, Any]]) -> list[str]:
    keys = ["theory/lambda", "theory/gamma", "theory/regime", "theory/critical_weight", "theory/proxy_precision"]
    lines = ["| step | Lambda | Gamma | regime | W* | proxy precision |", "|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        cells = [regime_of(r) if k == "theory/regime" else r.get(k) for k in keys]
        lines.append(
            f"| {r['step']} | "
            + " | ".join("-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v) for v in cells)
            + " |"
        )
    return lines


def blocks(rows: list[dict[str, Any]], size: int) -> list[str]:
    """Markdown lines: mean entropy and rollout accuracy over steps 1..size, size+1..2*size, ... (steps without
    an update log no entropy and count for accuracy only)."""
    lines = ["| steps | mean entropy | mean rollout accuracy |", "|---|---:|---:|"]
    last = max((r["step"] for r in rows), default=0)
    for start in range(1, last + 1, size):
        block = [r for r in rows if start <= r["step"] < start + size]
        entropy, accuracy = mean(logged(block, "stare/entropy_mean")), mean(logged(block, "rollout/accuracy"))
        cells = ["-" if v is None else f"{v:.{d}f}" for v, d in ((entropy, 3), (accuracy, 2))]
        lines.append(f"| {start}–{min(start + size - 1, last)} | {cells[0]} | {cells[1]} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", metavar="RUN_DIR", help="an RL run folder (with metrics.jsonl)")
    parser.add_argument("--per-step", action="store_true", help="also print every step's values")
    parser.add_argument("--blocks", type=int, default=None, metavar="N", help="also print means per block of N steps")
    args = parser.parse_args(argv)
    for run_dir in args.runs:
        rows = read_metrics(run_dir)
        lines = [f"### {run_dir} ({len(rows)} steps)", "", *diagnostics(rows)]
        if args.per_step:
            lines += ["", *per_step(rows)]
        if args.blocks:
            lines += ["", *blocks(rows, args.blocks)]
        print("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
