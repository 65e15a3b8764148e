"""GRPO-ds vs STARE on the synthetic tool task, from a quickstart's SFT checkpoint.

Runs every variant for every seed with the quickstart's own RL config (same data, agent, rollout and
optimizer), then prints and writes into OUT (table.md, summary.json): the per-run table (entropy, accuracy,
W*, proxy precision, gate, steps per theory/regime), the cross-seed mean and 95% t-interval of each
variant's final-window entropy and accuracy, with --blocks N the mean entropy / rollout accuracy per block of
N steps; and one entropy figure. Already finished runs are reused, so rerunning the command on a finished
OUT only prints the tables.

    stare-agent lab rl_experiment runs/quickstart-XXXX --out docs/experiments/quickstart \\
        --seeds 0 1 2 --variants grpo-ds stare-O1 stare-C2 [--steps 36] [--blocks 10] [key=value ...]

Variants: grpo-ds (entropy_control.method=none), stare-O1, stare-C2 (the quickstart's STARE settings with
op O1 or C2). Extra key=value words are RL config overrides applied to every run.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from stare_agent.backends.local import rl
from stare_agent.backends.local.common import read_metrics
from stare_agent.config import RLConfig, RunConfig, load_config
from stare_agent.lab.experiment import rl_with_changes
from stare_agent.lab.plots import smooth
from stare_agent.lab.runs import mean, run_summary
from stare_agent.lab.stats import t_interval
from stare_agent.runtime import set_threads
from stare_agent.theory import REGIMES

# Each variant's RL config changes by section, as `stare-agent experiment` writes its variants.
VARIANTS = {
    "grpo-ds": {"entropy_control": {"method": "none"}},
    "stare-O1": {"entropy_control": {"method": "stare"}, "stare": {"op": "O1"}},
    "stare-C2": {"entropy_control": {"method": "stare"}, "stare": {"op": "C2"}},
}

Runs = dict[str, dict[int, list[dict]]]  # variant -> seed -> metrics rows


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def run_table(runs: Runs) -> list[str]:
    """One Markdown row per variant and seed. W* is a median over the steps where it is defined (n/steps)."""
    lines = [
        "| variant | seed | entropy, first 5 steps | final-window entropy | final-window rollout accuracy "
        "| median W* (defined steps) | median proxy precision | gate on | " + " | ".join(REGIMES) + " |",
        "|---|" + "---:|" * (7 + len(REGIMES)),
    ]
    windows, unlabelled = set(), False
    for variant, by_seed in runs.items():
        for seed, rows in by_seed.items():
            r = run_summary(rows)
            windows.add((r["final_window_steps"], r["steps"]))
            unlabelled |= r["regimes"] is None
            regimes = r["regimes"] or {}
            lines.append(
                f"| {variant} | {seed} | {_fmt(r['entropy_first5_mean'], 3)} "
                f"| {_fmt(r['entropy_final_window_mean'], 3)} | {_fmt(r['rollout_accuracy_final_window'], 2)} "
                f"| {_fmt(r['critical_weight']['median'], 2)} ({r['critical_weight']['n']}/{r['steps']}) "
                f"| {_fmt(r['proxy_precision']['median'], 2)} | {_fmt(r['gate_fraction'], 2)} | "
                + " | ".join(str(regimes[name]) if name in regimes else "-" for name in REGIMES)
                + " |"
            )
    lines += ["", "Final window: " + "; ".join(f"the last {w} of {n} steps" for w, n in sorted(windows)) + "."]
    if unlabelled:
        lines.append("Regimes '-': the run logged no theory/regime (older code); its W* median counts every step.")
    return lines


def block_table(runs: Runs, size: int) -> list[str]:
    """Mean entropy / rollout accuracy over blocks of `size` steps (steps 1..size, size+1..2*size, ...)."""
    last = max(r["step"] for by_seed in runs.values() for rows in by_seed.values() for r in rows)
    blocks = [(start, min(start + size - 1, last)) for start in range(1, last + 1, size)]
    lines = [
        f"Mean entropy / rollout accuracy per block of {size} steps:",
        "",
        "| variant | seed | " + " | ".join(f"{a}–{b}" for a, b in blocks) + " |",
        "|---|---:|" + "---|" * len(blocks),
    ]
    for variant, by_seed in runs.items():
        for seed, rows in by_seed.items():
            cells = []
            for a, b in blocks:
                block = [r for r in rows if a <= r["step"] <= b]
                entropy = mean([r["stare/entropy_mean"] for r in block if r.get("stare/entropy_mean") is not None])
                accuracy = mean([r["rollout/accuracy"] for r in block if r.get("rollout/accuracy") is not None])
                cells.append(f"{_fmt(entropy, 3)} / {_fmt(accuracy, 2)}")
            lines.append(f"| {variant} | {seed} | " + " | ".join(cells) + " |")
    return lines


def seed_summary(runs: Runs) -> tuple[list[str], dict[str, dict]]:
    """Per variant, the mean over seeds and a 95% t-interval of final-window entropy and rollout accuracy."""
    lines = [
        "| variant | seeds | final-window entropy, mean [95% CI] | final-window rollout accuracy, mean [95% CI] |",
        "|---|---:|---:|---:|",
    ]
    out = {}
    for variant, by_seed in runs.items():
        summaries = [run_summary(rows) for rows in by_seed.values()]
        cells, out[variant] = [], {"seeds": sorted(by_seed)}
        for key, digits in (("entropy_final_window_mean", 3), ("rollout_accuracy_final_window", 2)):
            m, lo, hi = t_interval([s[key] for s in summaries])
            out[variant][key] = {"mean": m, "ci95": None if lo is None else [lo, hi]}
            interval = "one seed: no interval" if lo is None else f"{lo:.{digits}f}, {hi:.{digits}f}"
            cells.append(f"{m:.{digits}f} [{interval}]")
        lines.append(f"| {variant} | {len(by_seed)} | " + " | ".join(cells) + " |")
    return lines, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("quickstart", type=Path, help="a finished quickstart folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: the quickstart's)")
    parser.add_argument("--blocks", type=int, default=None, metavar="N", help="also print per-block means of N steps")
    args, overrides = parser.parse_known_args(argv)
    if args.blocks is not None and args.blocks < 1:
        parser.error(f"--blocks must be a positive number of steps; got {args.blocks}")

    base_path = args.quickstart / "rl-grpo-ds" / "config.yaml"
    stare_base = load_config(RLConfig, args.quickstart / "rl-stare-O1" / "config.yaml").stare
    runs: Runs = {}
    for variant in args.variants:
        for seed in args.seeds:
            name = f"{variant}-seed{seed}"
            config = load_config(RLConfig, base_path, overrides)
            steps = args.steps or config.steps
            config = replace(
                config,
                run=RunConfig(output_dir=str(args.out), name=name, seed=seed, threads=config.run.threads),
                stare=stare_base,
                steps=steps,
                resume="auto",
            )
            config = rl_with_changes(config, VARIANTS[variant], f"variant {variant}")
            done = args.out / name / "metrics.jsonl"
            if not (done.exists() and len(read_metrics(args.out / name)) >= steps):
                set_threads(config.run)  # as `stare-agent rl` does
                rl.run(config)
            runs.setdefault(variant, {})[seed] = read_metrics(args.out / name)

    cross_seed, cross_seed_json = seed_summary(runs)
    lines = run_table(runs) + ["", "Across seeds (95% t-interval over seeds):", "", *cross_seed]
    if args.blocks:
        lines += ["", *block_table(runs, args.blocks)]
    summary = {
        "runs": {
            f"{v}-seed{seed}": run_summary(rows) for v, by_seed in runs.items() for seed, rows in by_seed.items()
        },
        "across_seeds": cross_seed_json,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(runs, args.out / "entropy.png", stare_base.target_entropy)


def plot(runs: Runs, path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (variant, by_seed) in enumerate(runs.items()):
        for j, rows in enumerate(by_seed.values()):
            steps = [r["step"] for r in rows]
            values = smooth([r["stare/entropy_mean"] for r in rows], 5)
            ax.plot(steps, values, color=f"C{i}", alpha=0.8, linewidth=1.5, label=variant if j == 0 else None)
    ax.axhline(target, color="black", linestyle="--", linewidth=1, label="H_tgt")
    ax.set_xlabel("RL step")
    ax.set_ylabel("policy entropy (nats; running mean of 5 steps)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
