"""GRPO-ds vs STARE on the synthetic tool task, from a quickstart's SFT checkpoint.

Runs every variant for every seed with the quickstart's own RL config (same data, agent, rollout and
optimizer), then writes a table (final-window entropy and accuracy, W*, proxy precision) and one
entropy figure into OUT. Already finished runs are reused, so the script can be resumed.

    python benchmarks/rl_experiment.py runs/quickstart-XXXX --out docs/experiments/quickstart \\
        --seeds 0 1 2 --variants grpo-ds stare-O1 stare-C2 [--steps 36] [key=value ...]

Variants: grpo-ds (stare.enabled=false), stare-O1, stare-C2 (the quickstart's STARE settings with
op O1 or C2). Extra key=value words are RL config overrides applied to every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from stare_agent.backends.local import rl
from stare_agent.backends.local.common import read_metrics
from stare_agent.config import RLConfig, RunConfig, load_config
from stare_agent.plots import smooth

VARIANTS = {
    "grpo-ds": {"enabled": False},
    "stare-O1": {"enabled": True, "op": "O1"},
    "stare-C2": {"enabled": True, "op": "C2"},
}


def window(rows: list[dict], key: str, fraction: float = 0.25) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    tail = values[-max(1, int(len(values) * fraction)) :]
    return sum(tail) / len(tail)


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows if r.get(key) is not None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("quickstart", type=Path, help="a finished quickstart folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: the quickstart's)")
    args, overrides = parser.parse_known_args(argv)

    base_path = args.quickstart / "rl-grpo-ds" / "config.yaml"
    stare_base = load_config(RLConfig, args.quickstart / "rl-stare-O1" / "config.yaml").stare
    runs: dict[str, dict[int, list[dict]]] = {}
    for variant in args.variants:
        for seed in args.seeds:
            name = f"{variant}-seed{seed}"
            config = load_config(RLConfig, base_path, overrides)
            steps = args.steps or config.steps
            config = replace(
                config,
                run=RunConfig(output_dir=str(args.out), name=name, seed=seed),
                stare=replace(stare_base, **VARIANTS[variant]),
                steps=steps,
                resume="auto",
            )
            done = args.out / name / "metrics.jsonl"
            if not (done.exists() and len(read_metrics(args.out / name)) >= steps):
                rl.run(config)
            runs.setdefault(variant, {})[seed] = read_metrics(args.out / name)

    lines = [
        "| variant | seed | entropy, first 5 steps | final-window entropy | final-window rollout accuracy "
        "| median W* | median proxy precision | gate on |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summary = {}
    for variant, by_seed in runs.items():
        for seed, rows in by_seed.items():
            first = sum(r["stare/entropy_mean"] for r in rows[:5]) / min(5, len(rows))
            entry = {
                "entropy_first5": first,
                "entropy_final": window(rows, "stare/entropy_mean"),
                "accuracy_final": window(rows, "rollout/accuracy"),
                "critical_weight_median": median(rows, "theory/critical_weight"),
                "proxy_precision_median": median(rows, "theory/proxy_precision"),
                "gate_on": window(rows, "stare/gate", 1.0) if any("stare/gate" in r for r in rows) else None,
            }
            summary[f"{variant}-seed{seed}"] = entry
            gate = "-" if entry["gate_on"] is None else f"{entry['gate_on']:.2f}"
            lines.append(
                f"| {variant} | {seed} | {first:.3f} | {entry['entropy_final']:.3f} | {entry['accuracy_final']:.2f} "
                f"| {entry['critical_weight_median']:.2f} | {entry['proxy_precision_median']:.2f} | {gate} |"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(runs, args.out / "entropy.png", stare_base.target_entropy)


def plot(runs: dict[str, dict[int, list[dict]]], path: Path, target: float) -> None:
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
