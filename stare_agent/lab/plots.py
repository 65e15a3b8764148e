"""Training curves from `metrics.jsonl`: one figure per quantity, every run of a folder on it.

`stare-agent plot RUN_DIR` redraws them: RUN_DIR is an RL run (its own metrics.jsonl) or a folder
of runs (a quickstart directory: each subfolder with an RL metrics.jsonl is one curve).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# metric key -> (file name, axis label)
CURVES = {
    "stare/entropy_mean": ("entropy", "policy entropy (nats, exact, action tokens)"),
    "rollout/reward": ("reward", "mean reward"),
    "rollout/accuracy": ("accuracy", "rollout accuracy"),
    "rollout/response_length": ("response_length", "response tokens per episode"),
    "rollout/tool_calls": ("tool_calls", "tool calls per episode"),
    "rollout/void_turns": ("void_turns", "turns with neither code nor an answer, per episode"),
    "entropy/reasoning": ("entropy_reasoning", "entropy of reasoning tokens (nats)"),
    "entropy/code": ("entropy_code", "entropy of code tokens (nats)"),
    "entropy/after_tool": ("entropy_after_tool", "entropy of the first tokens after a tool output (nats)"),
    "entropy/answer": ("entropy_answer", "entropy of answer tokens (nats)"),
}


def find_runs(folder: str | Path) -> dict[str, list[dict[str, Any]]]:
    """label -> metric rows of each RL run in `folder` (itself, or its direct subfolders)."""
    folder = Path(folder)
    candidates = [folder] if (folder / "metrics.jsonl").exists() else sorted(p for p in folder.iterdir() if p.is_dir())
    runs = {}
    for run in candidates:
        path = run / "metrics.jsonl"
        if not path.exists():
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if rows and any("rollout/reward" in row for row in rows):
            runs[run.name] = rows
    if not runs:
        raise FileNotFoundError(f"no RL metrics.jsonl in {folder} or its subfolders")
    return runs


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Running mean over the last `window` finite values."""
    out, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-window:]
        finite = [a for a in acc if a is not None and math.isfinite(a)]
        out.append(sum(finite) / len(finite) if finite else math.nan)
    return out


def plot_runs(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    out_dir: str | Path,
    *,
    target_entropy: float | None = None,
    window: int = 5,
) -> list[Path]:
    """One PNG per curve in CURVES that some run logged (raw values faint, a running mean of `window` steps
    solid)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, (name, label) in CURVES.items():
        if not any(row.get(key) is not None for rows in runs.values() for row in rows):
            continue  # runs logged before this metric existed
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for i, (run, rows) in enumerate(runs.items()):
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            color = f"C{i}"
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            ax.plot(steps, smooth(values, window), color=color, linewidth=2, label=run)
        if key == "stare/entropy_mean" and target_entropy is not None:
            ax.axhline(target_entropy, color="black", linestyle="--", linewidth=1, label="H_tgt")
        ax.set_xlabel("RL step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def main(folder: str | Path, target_entropy: float | None = None) -> list[Path]:
    """Redraw the plots of a run folder into its `plots/` subfolder."""
    folder = Path(folder)
    if target_entropy is None:
        target_entropy = _target_entropy(folder)
    return plot_runs(find_runs(folder), folder / "plots", target_entropy=target_entropy)


def _target_entropy(folder: Path) -> float | None:
    """H_tgt from the config.yaml of a run inside the folder whose method holds entropy to a target (stare and
    low_prob_reweight: stare.target_entropy; entropy_bonus: its own), if there is one. A run made before
    entropy_control has stare.enabled instead."""
    import yaml

    for config in [folder / "config.yaml", *sorted(folder.glob("*/config.yaml"))]:
        if config.exists():
            saved = yaml.safe_load(config.read_text()) or {}
            if "entropy_control" in saved:
                method = (saved["entropy_control"] or {}).get("method")
            else:
                method = "stare" if (saved.get("stare") or {}).get("enabled") else "none"
            section = {"stare": "stare", "low_prob_reweight": "stare", "entropy_bonus": "entropy_bonus"}.get(method)
            target = (saved.get(section) or {}).get("target_entropy") if section else None
            if target is not None:
                return float(target)
    return None
