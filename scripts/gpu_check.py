"""The verdicts of scripts/gpu_check.sh: read a finished run's own files and say PASS or FAIL, with why.

    python scripts/gpu_check.py QUICKSTART_DIR --exit-code RC --wall-s SECONDS --limit-s 480
    python scripts/gpu_check.py RL_RUN_DIR --exit-code RC --openrlhf STEPS
    python scripts/gpu_check.py --openrlhf-overrides     # the OpenRLHF stage's overrides, one per line

The quickstart (nothing is re-run): it exited 0 within the limit and wrote summary.json; SFT logged its loss and
the loss fell; each RL run logged one metrics row per configured step and updated the model at least once with a
finite loss, and the STARE run logged stare/* metrics; each evaluation wrote results.json. Prints the throughput
the runs measured (tokens/s of SFT, of RL generation and of the RL update). It needs only the standard library
(PyYAML, where installed, gives the configured RL step count to compare with).

An OpenRLHF run (check_openrlhf; reads its TensorBoard log, so it needs the tensorboard package OpenRLHF brings):
it exited 0, trained exactly STEPS steps with a finite loss, wrote the final Hugging Face model, and the engine's
log-probs of the sampled tokens stayed near the trainer's after the first step (a weight sync that does not reach
the engine shows as a jump). Exits 0 (PASS) or 1 (FAIL).
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


OPENRLHF_STEPS = 3
OPENRLHF_SHAPE = {
    "openrlhf.ds.zero_stage": 3,
    "openrlhf.train.colocate_all": True,
    "openrlhf.vllm.enable_prefix_caching": True,
    "openrlhf.vllm.enable_sleep": True,
    "openrlhf.ds.enable_sleep": True,
    "openrlhf.ds.attn_implementation": "sdpa",
    "optim.lr": 2e-4,
}
"""The OpenRLHF stage's run: the paper configs' placement and memory settings, reduced to one GPU (ZeRO-3, actor and
engine colocated, so the weights go by CUDA IPC, both sleep modes, prefix caching), at the quickstart's RL learning
rate, at which two missed syncs move the engine's log-probs past the sync bound. Measured through the CPU shim on
the e2e tests' model, mean |engine - trainer| per step: 0.0016, 0.0204, 0.0469 nats with the sync dropped (bound
0.0248: FAIL at step 3), and 0.0014, 0.0062, 0.0005 with it working (PASS; the slack matters: 0.0062 is 4.4x the
first step's). 1e-3 shows a dropped sync at step 2 already (0.0997), but breaks that model within one step."""

SYNC_FACTOR, SYNC_SLACK_NATS = 3.0, 0.02
"""A step after the first fails the sync check when its mean |engine - trainer| log-prob of the sampled tokens
exceeds SYNC_FACTOR x the first step's + SYNC_SLACK_NATS (the first step's engine and trainer hold the same weights
by construction: both load them from the checkpoint; a later step's engine holds them only if the sync worked)."""


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from the TensorBoard event files OpenRLHF wrote under `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, dict[int, float]] = {}
    for events in sorted(p for p in folder.iterdir() if p.is_file() or p.is_dir()) if folder.is_dir() else []:
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            found.setdefault(tag, {}).update((e.step, e.value) for e in accumulator.Scalars(tag))
    return found


def check_openrlhf(run: Path, exit_code: int, steps: int) -> tuple[list[str], list[str]]:
    """(failures, report lines) for an OpenRLHF RL run folder `run` (run.output_dir/run.name) of `steps` steps.

    FAIL when the run exited non-zero, trained no step or fewer than `steps`, left no final Hugging Face model
    (run/final), or when the engine's log-probs of the sampled tokens drifted away from the trainer's after the
    first step (SYNC_FACTOR, SYNC_SLACK_NATS): the engine did not receive the trained weights.
    """
    failures: list[str] = []
    lines = [f"openrlhf run: exit code {exit_code}"]
    if exit_code != 0:
        failures.append(f"the run exited with {exit_code} (4: no step trained; its log is openrlhf.log)")
    logged = tensorboard_scalars(run / "tb")
    trained = sorted(logged.get("train/policy_loss", {}))
    if not trained:
        failures.append("no step was trained (no train/policy_loss in its TensorBoard log)")
    elif len(trained) != steps:
        failures.append(f"{len(trained)} of {steps} steps trained")
    losses = [logged["train/policy_loss"][step] for step in trained]
    if not all(math.isfinite(loss) for loss in losses):
        failures.append(f"train/policy_loss not finite: {losses}")
    lines.append(f"trained steps {trained}, policy loss {[round(loss, 4) for loss in losses]}")

    final = run / "final"
    if not (final / "config.json").is_file() or not any(final.glob("*.safetensors")):
        failures.append(f"the final Hugging Face model is missing ({final} has no config.json and *.safetensors)")

    diffs = logged.get("train/rollout_logprob_abs_diff", {})
    if trained and len(trained) >= 2:
        if not all(step in diffs for step in trained):
            failures.append("train/rollout_logprob_abs_diff is not logged for every step: the sync cannot be checked")
        else:
            first, bound = diffs[trained[0]], SYNC_FACTOR * diffs[trained[0]] + SYNC_SLACK_NATS
            drifted = {step: diffs[step] for step in trained[1:] if not diffs[step] <= bound}
            lines.append(
                "engine vs trainer log-probs of the sampled tokens (mean |diff|, nats): "
                + ", ".join(f"step {step} {diffs[step]:.4f}" for step in trained)
                + f" (bound after step 1: {bound:.4f})"
            )
            if drifted:
                failures.append(
                    f"the engine's log-probs drifted from the trainer's after step 1 ({first:.4f} nats, then "
                    + ", ".join(f"{value:.4f} at step {step}" for step, value in drifted.items())
                    + "): the weight sync did not reach the engine"
                )
    elif trained:
        failures.append(f"{len(trained)} step trained; the sync check needs at least 2")
    return failures, lines


def _yaml_or_empty(path: Path) -> dict[str, Any]:
    try:
        import yaml
    except ImportError:
        return {}
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def openrlhf_overrides() -> list[str]:
    """The OpenRLHF stage's command-line overrides (gpu_check.sh reads them: --openrlhf-overrides)."""
    words = {True: "true", False: "false"}
    return [f"steps={OPENRLHF_STEPS}"] + [
        f"{key}={words[value] if isinstance(value, bool) else value}" for key, value in OPENRLHF_SHAPE.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, nargs="?", help="the quickstart folder, or with --openrlhf the RL run's")
    parser.add_argument("--exit-code", type=int)
    parser.add_argument("--wall-s", type=float, default=0.0)
    parser.add_argument("--limit-s", type=float, default=math.inf)
    parser.add_argument("--openrlhf", type=int, metavar="STEPS", help="judge an OpenRLHF RL run of STEPS steps")
    parser.add_argument("--openrlhf-overrides", action="store_true", help="print the OpenRLHF stage's overrides")
    args = parser.parse_args(argv)
    if args.openrlhf_overrides:
        print("\n".join(openrlhf_overrides()))
        return 0
    if args.run is None or args.exit_code is None:
        parser.error("RUN and --exit-code are required")
    if args.openrlhf is not None:
        failures, lines = check_openrlhf(args.run, args.exit_code, args.openrlhf)
        what = "OpenRLHF run"
    else:
        failures, lines = check(args.run, args.exit_code, args.wall_s, args.limit_s)
        what = "local quickstart"
    print("\n".join(f"  {line}" for line in lines))
    for failure in failures:
        print(f"  FAIL: {failure}")
    print(f"{what}: {'PASS' if not failures else 'FAIL'}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
