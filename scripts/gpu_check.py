"""The verdict of scripts/gpu_check.sh: reads a finished quickstart folder and says PASS or FAIL, with why.

    python scripts/gpu_check.py QUICKSTART_DIR --exit-code RC --wall-s SECONDS --limit-s 480

Checks, each from the run's own files (nothing is re-run): the quickstart exited 0 within the limit and wrote
summary.json; SFT logged its loss and the loss fell; each RL run logged one metrics row per configured
step and updated the model at least once with a finite loss, and the STARE run logged stare/* metrics; each
evaluation wrote results.json. Prints the throughput the runs measured (tokens/s of SFT, of RL generation and
of the RL update) and exits 0 (PASS) or 1 (FAIL). It needs only the standard library (PyYAML, where installed,
gives the configured RL step count to compare with).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def values(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [row[key] for row in rows if isinstance(row.get(key), (int, float))]


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def check(run: Path, exit_code: int, wall_s: float, limit_s: float) -> tuple[list[str], list[str]]:
    """(failures, report lines) for the quickstart folder `run`."""
    failures: list[str] = []
    lines = [f"quickstart: exit code {exit_code}, wall {wall_s:.0f} s (limit {limit_s:.0f} s)"]
    if exit_code != 0:
        failures.append(f"the quickstart exited with {exit_code} (its log is quickstart.log)")
    if wall_s >= limit_s:
        failures.append(f"wall time {wall_s:.0f} s is not under {limit_s:.0f} s")
    summary_path = run / "summary.json"
    if not summary_path.is_file():
        failures.append(f"{summary_path} is missing: the quickstart did not finish")
        return failures, lines
    summary = json.loads(summary_path.read_text())
    lines.append("stage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in summary.get("timings_s", {}).items()))
    config = _yaml_or_empty(run / "config.yaml")

    sft = read_rows(run / "sft" / "metrics.jsonl")
    losses = values(sft, "train/loss")
    if len(losses) < 2:
        failures.append(f"SFT logged {len(losses)} loss values; at least 2 are needed to see it fall")
    elif not losses[-1] < losses[0]:
        failures.append(f"SFT loss did not fall: first {losses[0]:.4f}, last {losses[-1]:.4f}")
    else:
        lines.append(f"SFT: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(sft)} logged steps")
    sft_speed = values(sft, "perf/tokens_per_s")
    if sft_speed:
        lines.append(f"SFT: {sft_speed[-1]:.0f} tokens/s (training, forward + backward)")

    steps = (config.get("rl") or {}).get("steps")
    rl_dirs = sorted(p for p in run.glob("rl-*") if p.is_dir())
    if len(rl_dirs) != 2:
        failures.append(f"expected 2 RL runs (GRPO-ds and STARE), found {[p.name for p in rl_dirs]}")
    for rl_dir in rl_dirs:
        rows = read_rows(rl_dir / "metrics.jsonl")
        if steps is not None and len(rows) != steps:
            failures.append(f"{rl_dir.name}: {len(rows)} metrics rows for {steps} configured steps")
        # every logged step trained one full batch (a run that cannot fill one ends instead: stare_agent/batching.py)
        updated = [row for row in rows if "train/loss" in row]
        if not updated:
            failures.append(f"{rl_dir.name}: no step trained the model (no batch could be filled)")
        elif not all(math.isfinite(row.get("train/loss", math.nan)) for row in updated):
            failures.append(f"{rl_dir.name}: train/loss missing or not finite on an updated step")
        if rl_dir.name != "rl-grpo-ds" and updated and not values(updated, "stare/entropy_mean"):
            failures.append(f"{rl_dir.name}: no stare/* metrics logged")
        gen, upd = mean(values(rows, "perf/generation_tokens_per_s")), mean(values(rows, "perf/train_tokens_per_s"))
        lines.append(
            f"{rl_dir.name}: {len(rows)} steps ({len(updated)} updated), generation {_fmt(gen)} tokens/s, "
            f"update {_fmt(upd)} tokens/s, entropy {_fmt(mean(values(rows, 'stare/entropy_mean')), 3)} nats "
            "(mean over steps)"
        )

    evals = sorted(p for p in run.glob("eval-*") if p.is_dir())
    if len(evals) != 3 or not all((p / "results.json").is_file() for p in evals):
        failures.append(f"expected results.json in 3 eval folders, found {[p.name for p in evals]}")
    for name, result in summary.get("eval", {}).items():
        lines.append(f"eval {name}: avg@{result.get('k')} {_fmt(result.get('avg@k'), 3)}")
    return failures, lines


def _yaml_or_empty(path: Path) -> dict[str, Any]:
    try:
        import yaml
    except ImportError:
        return {}
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the quickstart folder (run.output_dir/run.name)")
    parser.add_argument("--exit-code", type=int, required=True)
    parser.add_argument("--wall-s", type=float, required=True)
    parser.add_argument("--limit-s", type=float, required=True)
    args = parser.parse_args(argv)
    failures, lines = check(args.run, args.exit_code, args.wall_s, args.limit_s)
    print("\n".join(f"  {line}" for line in lines))
    for failure in failures:
        print(f"  FAIL: {failure}")
    print(f"local quickstart: {'PASS' if not failures else 'FAIL'}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
