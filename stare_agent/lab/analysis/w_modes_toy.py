"""Fixed, adaptive and critical W on the STARE toy task (stare-agent simulate's), over seeds.

    stare-agent lab w_modes_toy [--config configs/simulate_small_steps.yaml] [--seeds 0 1 2 3 4]
        [--steps N] [--target H] [--fixed 1.1 2] [--margins 0.1 0.5 1] [--out docs/img/w_modes_toy.png]

The toy (docs/simulation.md) collapses under plain GRPO: entropy falls from about 1.2 to 0.15 nats in 400
steps at the default step size; configs/simulate_small_steps.yaml is the smaller-step version where the
first-order theory (and so W*) describes most of the change. Each mode runs O1 with the batch gate at the
config's H_tgt and P = 0.1 from the same start, once per seed:

- GRPO: STARE off (the collapse);
- fixed W, for each --fixed value (1.1 is the paper's);
- adaptive: W from 1.1 stepping by alpha = 0.01 within [1, 1.5] (the paper's schedule);
- critical: W = 1 + (1 + margin) (W*_smoothed - 1) for each --margins value, capped at 4, the fixed 1.1 where
  W* is undefined.

Printed per mode (mean over seeds and a 95% t-interval), over the steps after entropy first reached H_tgt in
that run: mean entropy, mean |H - H_tgt| (band tightness), the share of steps the gate was on, gate flips per
100 steps, mean W applied while the gate was on, and the final-window reward (the accuracy cost). The
per-step entropy of every run goes to --csv if given and the mean curves to --out.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
from pathlib import Path

from stare_agent.config import RunConfig, load_config
from stare_agent.lab.simulate import SimulateConfig, train_toy
from stare_agent.lab.stats import t_interval
from stare_agent.runtime import set_threads
from stare_agent.stare import StareConfig

P = 0.1
"""The high+ share of every mode (the paper's), and of the theory diagnostics in the GRPO runs."""


def modes(target: float, fixed: list[float], margins: list[float]) -> dict[str, StareConfig | None]:
    """Mode name -> its STARE settings; None for GRPO (every weight 1)."""
    base = StareConfig(op="O1", top_ratio=P, gate="batch", target_entropy=target)
    out: dict[str, StareConfig | None] = {"GRPO": None}
    for w in fixed:
        out[f"fixed W={w:g}"] = dataclasses.replace(base, w=w)
    out["adaptive"] = dataclasses.replace(base, w=1.1, w_mode="adaptive", alpha=0.01, w_max=1.5)
    for margin in margins:
        out[f"critical, margin {margin:g}"] = dataclasses.replace(
            base, w=1.1, w_mode="critical", w_max=4.0, w_margin=margin, w_smoothing=0.5
        )
    return out


def run_numbers(rows: list[dict[str, float]], target: float) -> dict[str, float]:
    """Band and gate numbers after entropy first reached the target (the whole run if it never did)."""
    reached = next((i for i, r in enumerate(rows) if r["entropy"] < target), None)
    after = rows[reached:] if reached is not None else rows
    window = max(1, len(rows) // 5)
    gates = [r["gate"] for r in after if r["gate"] == r["gate"]]  # NaN with STARE off
    on = [r["w"] for r in after if r["gate"] == 1.0]
    return {
        "reached_at": float(reached) if reached is not None else float("nan"),
        "entropy_mean": statistics.fmean(r["entropy"] for r in after),
        "distance": statistics.fmean(abs(r["entropy"] - target) for r in after),
        "gate_on": statistics.fmean(gates) if gates else float("nan"),
        "flips_per_100": 100 * sum(a != b for a, b in zip(gates[:-1], gates[1:], strict=True)) / max(len(gates), 1)
        if gates
        else float("nan"),
        "w_when_on": statistics.fmean(on) if on else float("nan"),
        "final_reward": statistics.fmean(r["reward"] for r in rows[-window:]),
        "final_entropy": statistics.fmean(r["entropy"] for r in rows[-window:]),
    }


COLUMNS = [
    ("first step below H_tgt", "reached_at", 0),
    ("entropy after", "entropy_mean", 3),
    ("mean |H - H_tgt| after", "distance", 3),
    ("gate on", "gate_on", 2),
    ("gate flips / 100 steps", "flips_per_100", 1),
    ("mean W while on", "w_when_on", 2),
    ("final-window entropy", "final_entropy", 3),
    ("final-window reward", "final_reward", 3),
]


def cell(values: list[float], digits: int) -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    m, lo, hi = t_interval(values)
    return f"{m:.{digits}f}" if lo is None else f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--config", type=Path, default=None, help="a simulate config: its toy task and H_tgt")
    parser.add_argument("--steps", type=int, default=None, help="(default: the config's toy.steps)")
    parser.add_argument("--target", type=float, default=None, help="H_tgt (default: the config's)")
    parser.add_argument("--fixed", type=float, nargs="+", default=[1.1, 2.0], help="fixed W values")
    parser.add_argument("--margins", type=float, nargs="+", default=[0.1, 0.5, 1.0], help="critical-mode w_margin")
    parser.add_argument("--only", nargs="+", default=None, help="run only these modes (names as printed)")
    parser.add_argument("--csv", type=Path, default=None, help="every run's per-step rows")
    parser.add_argument("--out", type=Path, default=None, help="figure of the mean entropy per mode")
    args = parser.parse_args(argv)
    set_threads(RunConfig())  # one torch thread, as every command runs (docs/benchmarks.md)
    config = load_config(SimulateConfig, args.config)
    task = dataclasses.replace(config.toy, steps=args.steps or config.toy.steps)
    target = config.stare.target_entropy if args.target is None else args.target
    numbers: dict[str, list[dict[str, float]]] = {}
    curves: dict[str, list[list[float]]] = {}
    writer = None
    handle = args.csv.open("w", newline="") if args.csv else None
    try:
        for name, stare in modes(target, args.fixed, args.margins).items():
            if args.only and name not in args.only:
                continue
            for seed in args.seeds:
                rows = train_toy(task, stare, seed, top_ratio=P)
                numbers.setdefault(name, []).append(run_numbers(rows, target))
                curves.setdefault(name, []).append([r["entropy"] for r in rows])
                if handle is not None:
                    if writer is None:
                        writer = csv.DictWriter(handle, fieldnames=["mode", "seed", *rows[0]])
                        writer.writeheader()
                    writer.writerows({"mode": name, "seed": seed, **r} for r in rows)
    finally:
        if handle is not None:
            handle.close()
    source = args.config or "the default toy (configs/simulate.yaml)"
    print(f"{source}: {len(args.seeds)} seeds x {task.steps} steps, lr {task.lr:g}; O1, batch gate, H_tgt = {target}, "
          "P = 0.1; 95% t-intervals")  # fmt: skip
    print("'after': the steps after the run's entropy first fell below H_tgt.")
    print()
    print("| mode | " + " | ".join(title for title, _, _ in COLUMNS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    for name, runs in numbers.items():
        print(f"| {name} | " + " | ".join(cell([r[key] for r in runs], digits) for _, key, digits in COLUMNS) + " |")
    if args.out:
        plot(curves, args.out, target)
        print(f"\nwrote {args.out}")


def plot(curves: dict[str, list[list[float]]], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, runs) in enumerate(curves.items()):
        mean = [statistics.fmean(step) for step in zip(*runs, strict=True)]
        ax.plot(mean, color=f"C{i}", lw=1.5, label=f"{name} (mean of {len(runs)} seeds)")
    ax.axhline(target, color="grey", ls="--", lw=1, label=f"H_tgt = {target}")
    ax.set(xlabel="step", ylabel="batch mean entropy (nats)", title="toy task: W modes", ylim=(0, 1.3))
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
