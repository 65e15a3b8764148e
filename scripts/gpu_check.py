"""The verdicts of scripts/gpu_check.sh: read a finished run's own files and say PASS or FAIL, with why.

    python scripts/gpu_check.py QUICKSTART_DIR --exit-code RC --wall-s SECONDS --limit-s 480
    python scripts/gpu_check.py RL_RUN_DIR --exit-code RC --openrlhf STEPS
    python scripts/gpu_check.py RL_RUN_DIR --openrlhf 3 --resumed-from 2 --first-exit-code RC1 [--exit-code RC2] \
        --attention NAME --run-uid UID [--root-reason TEXT]          # gpu_check.sh's stage 2
    python scripts/gpu_check.py --openrlhf-overrides     # the OpenRLHF stage's overrides, one per line

The quickstart (nothing is re-run): it exited 0 within the limit and wrote summary.json; SFT logged its loss and
the loss fell; each RL run logged one metrics row per configured step and updated the model at least once with a
finite loss, and the STARE run logged stare/* metrics; each evaluation wrote results.json. Prints the throughput
the runs measured (tokens/s of SFT, of RL generation and of the RL update). It needs only the standard library
(PyYAML, where installed, gives the configured RL step count to compare with).

An OpenRLHF run (check_openrlhf; reads its TensorBoard log, so it needs the tensorboard package OpenRLHF brings):
it exited 0, trained exactly STEPS steps, each once, with a finite loss, wrote the final Hugging Face model, and the
engine's log-probs of the sampled tokens stayed near the trainer's after the first step (a weight sync that does
not reach the engine shows as a jump; step 1's absolute gap is printed next to the bound). Prints the attention
implementation the run's config.yaml records. With --resumed-from, the folder holds two runs: the first trained
steps 1..N and saved a checkpoint at N, the second resumed from it and trained N+1..STEPS only. With --attention,
the run's config.yaml records every setting of OPENRLHF_SHAPE (gradient checkpointing included) and that attention.
With --run-uid, the run's files belong to that uid; when it is not 0 the in-engine sandbox ran without root and
must have been called; when it is 0, --root-reason says why and the verdict says the non-root check was skipped.
The judging functions (judge_*) take plain values, so each check is tested without a run (tests/test_gpu_check.py).
Exits 0 (PASS) or 1 (FAIL).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
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


OPENRLHF_STEPS, OPENRLHF_SAVED_AT = 3, 2
"""The OpenRLHF stage trains OPENRLHF_STEPS steps in two runs of one folder, as a long run is stopped and resumed:
the first trains steps 1..OPENRLHF_SAVED_AT and saves a checkpoint there (save_every), the second is the same
command with resume=auto and must train the remaining steps only (judge_resume)."""
OPENRLHF_SHAPE = {
    "openrlhf.ds.zero_stage": 3,
    "openrlhf.train.colocate_all": True,
    "openrlhf.vllm.enable_prefix_caching": True,
    "openrlhf.vllm.enable_sleep": True,
    "openrlhf.ds.enable_sleep": True,
    "openrlhf.actor.gradient_checkpointing_enable": True,
    "optim.lr": 2e-4,
}
"""The OpenRLHF stage's run: the paper configs' placement and memory settings, reduced to one GPU (ZeRO-3, actor and
engine colocated, so the weights go by CUDA IPC, both sleep modes, prefix caching, gradient checkpointing; the
attention implementation is added by attention_implementation()), at the quickstart's RL learning rate, at which two
missed syncs move the engine's log-probs past the sync bound. Measured through the CPU shim on the e2e tests' model
(without gradient checkpointing, which recomputes the same values), mean |engine - trainer| per step: 0.0016, 0.0204,
0.0469 nats with the sync dropped (bound 0.0248: FAIL at step 3), and 0.0014, 0.0062, 0.0005 with it working (PASS;
the slack matters: 0.0062 is 4.4x the first step's). 1e-3 shows a dropped sync at step 2 already (0.0997), but breaks
that model within one step."""

ATTENTION_FLAG = "openrlhf.ds.attn_implementation"

SYNC_FACTOR, SYNC_SLACK_NATS = 3.0, 0.02
"""A step after the first fails the sync check when its mean |engine - trainer| log-prob of the sampled tokens
exceeds SYNC_FACTOR x the first step's + SYNC_SLACK_NATS (the first step's engine and trainer hold the same weights
by construction: both load them from the checkpoint; a later step's engine holds them only if the sync worked)."""


def attention_implementation() -> tuple[str, str]:
    """(ds.attn_implementation, why) for this Python: flash_attention_2, the paper configs' choice, where flash_attn
    imports (its CUDA extension loads with it), else sdpa, PyTorch's own kernels (docs/cluster.md, "If flash-attn
    does not build"). OpenRLHF loads the actor with what it is given and fails when that one is unavailable."""
    try:
        import flash_attn
    except Exception as exc:  # not installed (ImportError), or a build whose extension does not load (OSError, ...)
        return "sdpa", f"flash_attn does not import ({type(exc).__name__}: {exc})"
    return "flash_attention_2", f"flash_attn {getattr(flash_attn, '__version__', '(no version)')} imports"


def tensorboard_runs(folder: Path) -> list[dict[str, dict[int, float]]]:
    """tag -> {step: value} of each TensorBoard event file OpenRLHF wrote under `folder`, oldest first. Each start of
    its trainer writes files of its own (a resumed run too), so a step that two runs trained shows in both. Read file
    by file, not as TensorBoard shows the folder: a run hides from that view what earlier runs logged after the step
    it starts from (hooks.continued_writer), so a resumed run that started over would hide the first run's steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = []
    for path in sorted(folder.rglob("events.out.tfevents.*")) if folder.is_dir() else []:
        accumulator = EventAccumulator(str(path))
        accumulator.Reload()
        events = {tag: accumulator.Scalars(tag) for tag in accumulator.Tags()["scalars"]}
        started = min((e.wall_time for tagged in events.values() for e in tagged), default=math.inf)
        runs.append((started, {tag: {e.step: e.value for e in tagged} for tag, tagged in events.items()}))
    return [scalars for _, scalars in sorted(runs, key=lambda run: run[0])]


EXIT_CODES = {
    1: "an error, its traceback in the run's log",
    2: "its config was refused",
    3: "the sandbox failed",
    4: "no step trained",
    6: "an update with a non-finite gradient",
    124: "it ran past gpu_check.sh's time limit",
}
"""What `stare-agent rl`'s exit codes mean (stare_agent/cli.py, _expected_failure), and timeout's 124."""


def judge_exits(exit_code: int | None, first_exit_code: int | None) -> list[str]:
    """Failures for the exit codes: `exit_code` of the run (of the resumed run where there are two; None: it was not
    started), `first_exit_code` of the first of two runs (None: the folder holds one run)."""
    failures = []
    if first_exit_code is not None and first_exit_code != 0:
        failures.append(
            f"the first run exited with {first_exit_code}: {EXIT_CODES.get(first_exit_code, 'see its log')}"
        )
    what = "the run" if first_exit_code is None else "the resumed run"
    if exit_code is None:
        failures.append(f"{what} was not started")
    elif exit_code != 0:
        failures.append(f"{what} exited with {exit_code}: {EXIT_CODES.get(exit_code, 'see its log')}")
    return failures


def judge_trained(trained_per_run: list[list[int]], steps: int) -> tuple[list[str], list[int]]:
    """(failures, the steps trained) from the steps at which each run logged train/policy_loss, oldest run first:
    steps 1..`steps`, each trained once (a resumed run that trains a step its checkpoint already holds logs it
    again, in its own event file)."""
    counts = Counter(step for run in trained_per_run for step in run)
    trained = sorted(counts)
    failures = []
    if not trained:
        failures.append("no step was trained (no train/policy_loss in its TensorBoard log)")
    elif len(trained) != steps:
        failures.append(f"{len(trained)} of {steps} steps trained")
    elif trained != list(range(1, steps + 1)):
        failures.append(f"steps {trained} trained, not 1 to {steps}")
    twice = {step: count for step, count in sorted(counts.items()) if count > 1}
    if twice:
        failures.append(
            "a step was trained more than once (each must appear once in the metrics): "
            + ", ".join(f"step {step} by {count} runs" for step, count in twice.items())
        )
    return failures, trained


def judge_resume(
    trained_per_run: list[list[int]], saved_at: int, steps: int, saved: list[int]
) -> tuple[list[str], list[str]]:
    """(failures, report lines) for a folder of two runs of one command: the first trained steps 1..`saved_at` and
    saved a DeepSpeed checkpoint there (`saved`: the steps of checkpoints/_actor/global_step*), the second ran with
    resume=auto and trained steps saved_at+1..`steps` only. A second run that did not resume starts at step 1 again;
    one that resumed from another checkpoint starts elsewhere. `trained_per_run` as in judge_trained."""
    first_asked, resumed_asked = list(range(1, saved_at + 1)), list(range(saved_at + 1, steps + 1))
    runs = [sorted(run) for run in trained_per_run if run]
    lines = [
        f"resume: steps trained by each run {runs}; asked: {first_asked}, a checkpoint at step {saved_at}, then "
        f"{resumed_asked} resumed from it (checkpoints of steps {sorted(saved)})"
    ]
    failures = []
    if saved_at not in saved:
        failures.append(
            f"no checkpoint of step {saved_at} (checkpoints/_actor/global_step{saved_at}): the first run did not save "
            f"it, so there was nothing to resume from"
        )
    if len(runs) != 2:
        failures.append(f"{len(runs)} runs trained steps ({runs}), not 2: the first and the resumed one")
        return failures, lines
    first, resumed = runs
    if first != first_asked:
        failures.append(f"the first run trained steps {first}, not {first_asked}")
    if resumed != resumed_asked:
        why = "started over" if resumed[:1] == [1] else f"started at step {resumed[0]}"
        failures.append(
            f"the resumed run trained steps {resumed}, not {resumed_asked}: it did not resume from the checkpoint of "
            f"step {saved_at} ({why})"
        )
    return failures, lines


def judge_sync(trained: list[int], diffs: dict[int, float], worst: dict[int, float]) -> tuple[list[str], list[str]]:
    """(failures, report lines) for the engine's log-probs of the sampled tokens against the trainer's: `diffs` and
    `worst` are the mean and the max |engine - trainer| per step (nats). At the first step both sides hold the
    checkpoint's weights, so its gap is absolute: what bf16 and two implementations of the model (attention kernels
    included) differ by; it is printed next to the bound derived from it. A later step fails above SYNC_FACTOR x that
    + SYNC_SLACK_NATS: the engine did not receive the trained weights."""
    failures: list[str] = []
    if len(trained) == 1:
        failures.append("1 step trained; the sync check needs at least 2")
    elif len(trained) > 1 and not all(step in diffs for step in trained):
        failures.append("train/rollout_logprob_abs_diff is not logged for every step: the sync cannot be checked")
    if not trained or trained[0] not in diffs:
        return failures, []
    start, first = trained[0], diffs[trained[0]]
    bound = SYNC_FACTOR * first + SYNC_SLACK_NATS
    most = f", max {worst[start]:.4f}" if start in worst else ""
    lines = [
        f"step {start}, engine and trainer on the same weights: absolute gap {first:.4f} nats mean{most}; "
        f"bound for later steps {SYNC_FACTOR:g} x {first:.4f} + {SYNC_SLACK_NATS:g} = {bound:.4f} nats"
    ]
    if failures:
        return failures, lines
    lines.append(
        "engine vs trainer log-probs of the sampled tokens (mean |diff|, nats): "
        + ", ".join(f"step {step} {diffs[step]:.4f}" for step in trained)
        + f" (bound after step {start}: {bound:.4f})"
    )
    drifted = {step: diffs[step] for step in trained[1:] if not diffs[step] <= bound}
    if drifted:
        failures.append(
            f"the engine's log-probs drifted from the trainer's after step {start} ({first:.4f} nats, then "
            + ", ".join(f"{value:.4f} at step {step}" for step, value in drifted.items())
            + "): the weight sync did not reach the engine"
        )
    return failures, lines


def recorded(config: dict[str, Any], key: str) -> Any:
    """The value a run's config.yaml records for an override key (`openrlhf.ds.zero_stage`, `optim.lr`), or None.
    The openrlhf block keeps OpenRLHF's flag names, dots and all, as its keys."""
    section, _, flag = key.partition(".")
    if section == "openrlhf":
        return (config.get("openrlhf") or {}).get(flag)
    value: Any = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def judge_settings(config: dict[str, Any], expected: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    """(failures, report lines) from the run's config.yaml (`config`): the attention implementation and gradient
    checkpointing it records, which are what OpenRLHF was given (it loads the actor with that attention or fails),
    and, with `expected` (override key -> value), a failure for each key it records otherwise."""
    attention = recorded(config, ATTENTION_FLAG) or "not set (OpenRLHF's default: flash_attention_2)"
    checkpointing = "on" if recorded(config, "openrlhf.actor.gradient_checkpointing_enable") else "off"
    lines = [f"attention: {attention}; gradient checkpointing: {checkpointing} (as the run's config.yaml records)"]
    if expected and not config:
        return ["the run wrote no config.yaml: what it ran with cannot be checked"], lines
    failures = [
        f"the run's config.yaml records {key}={recorded(config, key)!r}, not the GPU check's {value!r}"
        for key, value in (expected or {}).items()
        if recorded(config, key) != value
    ]
    return failures, lines


def judge_user(
    owner: int | None, uid: int, root_reason: str, tool_calls: dict[int, float]
) -> tuple[list[str], list[str]]:
    """(failures, report lines) for the in-engine sandbox as a user without root. `owner`: the uid the run's
    config.yaml belongs to (who the run was); `uid`: the one gpu_check.sh started it as; `tool_calls`: sandbox calls
    per episode at each step. The kernels run inside the vLLM engine actors, with the run's uid. Not root: the run
    must have been that user and the policy must have called the sandbox. Root: skipped, with `root_reason` said."""
    calls = ", ".join(f"step {step} {value:.2f}" for step, value in sorted(tool_calls.items())) or "none logged"
    failures = []
    if owner is None:
        failures.append("the run wrote no config.yaml: which user it ran as is unknown")
    elif owner != uid:
        failures.append(f"the run's files belong to uid {owner}, not to uid {uid} it was started as")
    if uid == 0:
        if not root_reason:
            failures.append("the RL ran as root without a reason: the sandbox was not checked without root")
            return failures, []
        return failures, [f"in-engine sandbox without root: SKIPPED, the RL ran as root: {root_reason}"]
    if not any(value > 0 for value in tool_calls.values()):
        failures.append(
            f"no episode called the sandbox (tool calls per episode: {calls}): it was not checked as uid {uid}"
        )
        return failures, []
    return failures, [f"in-engine sandbox ran as uid {uid}, not root: tool calls per episode {calls}"]


def check_openrlhf(
    run: Path,
    exit_code: int | None,
    steps: int,
    *,
    first_exit_code: int | None = None,
    resumed_from: int | None = None,
    expected: dict[str, Any] | None = None,
    uid: int | None = None,
    root_reason: str = "",
) -> tuple[list[str], list[str]]:
    """(failures, report lines) for an OpenRLHF RL run folder `run` (run.output_dir/run.name) of `steps` steps.

    FAIL when the run exited non-zero, trained no step, fewer than `steps` or one twice, left no final Hugging Face
    model (run/final), or when the engine's log-probs of the sampled tokens drifted away from the trainer's after the
    first step (judge_sync): the engine did not receive the trained weights. With `resumed_from`, the folder holds a
    first run (exit code `first_exit_code`) and a resumed one (`exit_code`, None if not started): judge_resume. With
    `expected`, judge_settings; with `uid`, judge_user (`root_reason` where it is 0).
    """
    if resumed_from is None:
        lines = [f"openrlhf run: exit code {exit_code}"]
    else:
        lines = [
            f"openrlhf runs: exit code {first_exit_code} (steps 1-{resumed_from}), "
            f"{'not started' if exit_code is None else exit_code} (resumed)"
        ]
    failures = judge_exits(exit_code, first_exit_code)
    runs = tensorboard_runs(run / "tb")
    logged: dict[str, dict[int, float]] = {}
    for scalars in runs:
        for tag, values in scalars.items():
            logged.setdefault(tag, {}).update(values)
    trained_per_run = [sorted(scalars.get("train/policy_loss", {})) for scalars in runs]
    found, trained = judge_trained(trained_per_run, steps)
    failures += found
    losses = [logged["train/policy_loss"][step] for step in trained]
    if not all(math.isfinite(loss) for loss in losses):
        failures.append(f"train/policy_loss not finite: {losses}")
    lines.append(f"trained steps {trained}, policy loss {[round(loss, 4) for loss in losses]}")

    if resumed_from is not None:
        tags = [p.name.removeprefix("global_step") for p in (run / "checkpoints" / "_actor").glob("global_step*")]
        found, more = judge_resume(trained_per_run, resumed_from, steps, [int(tag) for tag in tags if tag.isdigit()])
        failures, lines = failures + found, lines + more

    final = run / "final"
    if not (final / "config.json").is_file() or not any(final.glob("*.safetensors")):
        failures.append(f"the final Hugging Face model is missing ({final} has no config.json and *.safetensors)")

    found, more = judge_sync(
        trained, logged.get("train/rollout_logprob_abs_diff", {}), logged.get("train/rollout_logprob_abs_diff_max", {})
    )
    failures, lines = failures + found, lines + more
    found, more = judge_settings(_yaml_or_empty(run / "config.yaml"), expected)
    failures, lines = failures + found, lines + more
    if uid is not None:
        config = run / "config.yaml"
        owner = config.stat().st_uid if config.is_file() else None
        found, more = judge_user(owner, uid, root_reason, logged.get("train/rollout/tool_calls", {}))
        failures, lines = failures + found, lines + more
    return failures, lines


def _yaml_or_empty(path: Path) -> dict[str, Any]:
    try:
        import yaml
    except ImportError:
        return {}
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def stage_settings(attention: str) -> dict[str, Any]:
    """Override key -> value of the OpenRLHF stage's run: OPENRLHF_SHAPE and the attention implementation."""
    return {**OPENRLHF_SHAPE, ATTENTION_FLAG: attention}


def openrlhf_overrides(attention: str) -> list[str]:
    """The OpenRLHF stage's command-line overrides (gpu_check.sh reads them: --openrlhf-overrides): the steps and
    the step of the first run's checkpoint first, then stage_settings."""
    words = {True: "true", False: "false"}
    return [f"steps={OPENRLHF_STEPS}", f"save_every={OPENRLHF_SAVED_AT}"] + [
        f"{key}={words[value] if isinstance(value, bool) else value}"
        for key, value in stage_settings(attention).items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, nargs="?", help="the quickstart folder, or with --openrlhf the RL run's")
    parser.add_argument("--exit-code", type=int, help="the run's exit code (with --resumed-from: the resumed run's)")
    parser.add_argument("--wall-s", type=float, default=0.0)
    parser.add_argument("--limit-s", type=float, default=math.inf)
    parser.add_argument("--openrlhf", type=int, metavar="STEPS", help="judge an OpenRLHF RL run of STEPS steps")
    parser.add_argument(
        "--resumed-from",
        type=int,
        metavar="STEP",
        help="the folder holds a first run that saved at STEP and a resumed run of the same command",
    )
    parser.add_argument("--first-exit-code", type=int, help="with --resumed-from: the first run's exit code")
    parser.add_argument(
        "--attention", help="the attention gpu_check.sh chose: config.yaml must record it and OPENRLHF_SHAPE"
    )
    parser.add_argument("--run-uid", type=int, help="the uid gpu_check.sh ran the RL as")
    parser.add_argument("--root-reason", default="", help="why the RL ran as root, where it did")
    parser.add_argument("--openrlhf-overrides", action="store_true", help="print the OpenRLHF stage's overrides")
    args = parser.parse_args(argv)
    if args.openrlhf_overrides:
        attention, why = attention_implementation()
        print(f"gpu_check: attention {attention}: {why}", file=sys.stderr)
        print("\n".join(openrlhf_overrides(attention)))
        return 0
    resumed = args.openrlhf is not None and args.resumed_from is not None
    if args.run is None:
        parser.error("RUN is required")
    if resumed and args.first_exit_code is None:
        parser.error("--resumed-from needs --first-exit-code (and --exit-code once the resumed run was started)")
    if not resumed and args.exit_code is None:
        parser.error("--exit-code is required")
    if args.openrlhf is not None:
        failures, lines = check_openrlhf(
            args.run,
            args.exit_code,
            args.openrlhf,
            first_exit_code=args.first_exit_code if resumed else None,
            resumed_from=args.resumed_from,
            expected=stage_settings(args.attention) if args.attention else None,
            uid=args.run_uid,
            root_reason=args.root_reason,
        )
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
