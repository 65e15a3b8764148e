"""`stare-agent experiment`: RL variants x seeds from one SFT checkpoint, each evaluated on held-out problems.

The folder `run.output_dir/run.name` holds, as the quickstart's does:

    config.yaml, data/, model/, sft/, eval-sft/          made once ("prepare"), seeded by run.seed
    rl-<variant>-s<seed>/, eval-<variant>-s<seed>/      one RL run and its evaluation per variant and seed
    report.md, report.json, entropy.png                 over every finished run ("report")

A stage whose output is complete is skipped, so rerunning the command resumes a sweep. The shared stages and
each run happen under a file lock, so several commands (say `seeds=[0]` and `seeds=[1]`, one per core) may
share one folder: a command waits for a run another one is doing and then reuses it.
Each run's numbers come from its own metrics.jsonl and eval results; the report's intervals are over seeds.

With `results_dir`, a sweep outlives its output folder: the data, the SFT model (weights and tokenizer, no
optimizer state) and each finished run's numbers (not its checkpoints) are copied there, and a later command,
on this machine or another, restores them instead of making them again. New runs then start from the very SFT
weights the kept runs started from: remaking SFT would give other weights (float sums differ with thread
timing), so the runs of a sweep would not share their start.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import statistics
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from stare_agent.backends.local import evaluate, rl, sft
from stare_agent.backends.local.common import TRAINER_STATE, latest_checkpoint, read_metrics
from stare_agent.backends.local.quickstart import logged, make_data, mean, run_summary
from stare_agent.config import ConfigError, ExperimentConfig, RunConfig, load_config, run_path, save_config, to_dict
from stare_agent.models import build_tiny_model, tiny_corpus
from stare_agent.stats import LEVEL, bootstrap_interval, problem_accuracy, t_interval
from stare_agent.theory import REGIMES


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created), held for the block: one process prepares, the others wait."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _final_checkpoint(run_dir: Path, steps: int) -> Path | None:
    """The run's last checkpoint if the run reached `steps`; None while it has not."""
    last = latest_checkpoint(run_dir)
    return last if last is not None and last.name == f"step-{steps:06d}" else None


def _stage_run(run_dir: Path, name: str, seed: int, threads: int) -> RunConfig:
    return RunConfig(output_dir=str(run_dir), name=name, seed=seed, threads=threads)


def prepare(config: ExperimentConfig, run_dir: Path) -> dict[str, Path]:
    """Data, tiny model, SFT and the SFT model's evaluation, each made only if missing; their paths."""
    data_dir, seed = run_dir / "data", config.run.seed
    with _locked(run_dir / ".prepare.lock"):
        files = {
            name: data_dir / f"{stem}.jsonl" for name, stem in (("sft", "sft"), ("rl", "rl_train"), ("test", "test"))
        }
        if not all(path.exists() for path in files.values()):
            print("experiment: synthetic tasks and SFT transcripts (code run in the sandbox)")
            files = make_data(config, run_dir)
        model_dir = run_dir / "model"
        if not (model_dir / "config.json").exists():
            print("experiment: tiny model and tokenizer")
            corpus = tiny_corpus() + [
                m["content"] for line in files["sft"].read_text().splitlines() for m in json.loads(line)["messages"]
            ]
            build_tiny_model(model_dir, corpus, **asdict(config.model), seed=seed)
        finished = run_dir / "sft" / "finished"  # names the final checkpoint once SFT has returned
        if finished.exists():
            checkpoint = Path(finished.read_text().strip())
        else:
            print("experiment: SFT")
            checkpoint = sft.run(
                replace(
                    config.sft,
                    run=_stage_run(run_dir, "sft", seed, config.run.threads),
                    model=replace(config.sft.model, path=str(model_dir)),
                    data=replace(config.sft.data, train_file=str(files["sft"])),
                    resume="auto",
                )
            )
            finished.write_text(f"{checkpoint}\n")
        _keep_sft(config, files, checkpoint)
        _evaluate(config, run_dir, "eval-sft", checkpoint, files["test"], seed)
        _keep(config, run_dir, "eval-sft")
    return {**files, "sft_model": checkpoint}


def _evaluate(config: ExperimentConfig, run_dir: Path, name: str, model: Path, test: Path, seed: int) -> None:
    if (run_dir / name / "results.json").exists():
        return
    print(f"experiment: evaluating {name.removeprefix('eval-')} on {test}")
    evaluate.run(
        replace(
            config.eval,
            run=_stage_run(run_dir, name, seed, config.run.threads),
            model=replace(config.eval.model, path=str(model)),
            files=[str(test)],
        )
    )


def run_variant(config: ExperimentConfig, run_dir: Path, files: dict[str, Path], variant: str, seed: int) -> None:
    """One RL run (resumed from its last checkpoint if it was cut short) and its evaluation."""
    name = f"{variant}-s{seed}"
    with _locked(run_dir / f".{name}.lock"):  # another command on this folder may be running the same one
        _run_variant(config, run_dir, files, variant, seed, name)


def _run_variant(
    config: ExperimentConfig, run_dir: Path, files: dict[str, Path], variant: str, seed: int, name: str
) -> None:
    if _done(run_dir, name):  # evaluated (here, or restored from the results folder without checkpoints)
        return
    final = _final_checkpoint(run_dir / f"rl-{name}", config.rl.steps)
    if final is None:
        print(f"experiment: RL {name}, {config.rl.steps} steps")
        final = rl.run(
            replace(
                config.rl,
                run=_stage_run(run_dir, f"rl-{name}", seed, config.run.threads),
                model=replace(config.rl.model, path=str(files["sft_model"])),
                data=replace(config.rl.data, train_file=str(files["rl"])),
                stare=config.variant_stare(variant),
                resume="auto",
            )
        )
    # Every model is scored with the same evaluation seed: the comparison between runs is paired.
    _evaluate(config, run_dir, f"eval-{name}", final, files["test"], config.run.seed)
    _keep(config, run_dir, f"rl-{name}", f"eval-{name}")


def _done(run_dir: Path, name: str) -> bool:
    return (run_dir / f"eval-{name}" / "results.json").exists()


# --- the results folder ----------------------------------------------------------------------------------

RL_KEPT = ("metrics.jsonl", "config.yaml")  # of an RL run; an evaluation's folder is kept whole (no subfolders)
SFT_KEPT = "sft/model"  # the SFT checkpoint in the results folder, without its optimizer state


def _keep(config: ExperimentConfig, run_dir: Path, *names: str) -> None:
    """Copy finished runs' numbers into the results folder (replacing what it had of them)."""
    if not config.results_dir:
        return
    for name in names:
        source = run_dir / name
        if name.startswith("rl-"):
            files = [source / f for f in RL_KEPT]
        else:
            files = [p for p in source.iterdir() if p.is_file()]
        _copy_files(files, Path(config.results_dir) / name)


def _keep_sft(config: ExperimentConfig, data: dict[str, Path], checkpoint: Path) -> None:
    """The data and the SFT model into the results folder, unless it has them (then they were restored)."""
    results = Path(config.results_dir)
    if config.results_dir and not (results / SFT_KEPT).exists():
        _copy_files(list(data.values()), results / "data")
        _copy_files([p for p in checkpoint.iterdir() if p.is_file() and p.name != TRAINER_STATE], results / SFT_KEPT)


def _copy_files(files: list[Path], target: Path) -> None:
    """`target` made anew holding copies of `files`; it appears whole (renamed into place) or not at all."""
    partial = target.with_name(f".partial-{target.name}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for path in files:
        shutil.copy2(path, partial / path.name)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


def restore(results: Path, run_dir: Path) -> list[str]:
    """Copy into `run_dir` what the results folder has and `run_dir` lacks: the data and SFT model, and every
    finished run; the names of the stages restored."""
    restored = []
    if (results / "data").is_dir() and not (run_dir / "data").exists():
        shutil.copytree(results / "data", run_dir / "data")
        restored.append("data")
    finished = run_dir / "sft" / "finished"
    if (results / SFT_KEPT).is_dir() and not finished.exists():
        model = run_dir / SFT_KEPT
        shutil.copytree(results / SFT_KEPT, model, dirs_exist_ok=True)
        finished.write_text(f"{model}\n")
        restored.append("SFT model")
    for kept in sorted(results.glob("eval-*")):
        if (kept / "results.json").exists() and not (run_dir / kept.name / "results.json").exists():
            name = kept.name.removeprefix("eval-")
            for part in (kept, results / f"rl-{name}"):
                if part.is_dir():
                    shutil.copytree(part, run_dir / part.name, dirs_exist_ok=True)
            restored.append(name)
    return restored


# Keys that may differ between commands sharing one experiment folder: what to run now, and how fast.
PER_COMMAND = ("seeds", "only", "stage", "variants")


def _join(config: ExperimentConfig, folder: Path, where: tuple[str, ...] = ()) -> ExperimentConfig:
    """`config` checked against `folder`'s config.yaml (written if it has none; new variants added to it).
    Returns the command's config with the folder's variants joined in."""
    saved = folder / "config.yaml"
    if not saved.exists():
        save_config(config, folder)
        return config
    joined = check_same_experiment(config, saved, where)
    if joined.variants != load_config(ExperimentConfig, saved).variants:
        save_config(replace(load_config(ExperimentConfig, saved), variants=joined.variants), folder)
    return replace(config, variants=joined.variants)


def check_same_experiment(config: ExperimentConfig, saved_path: Path, where: tuple[str, ...] = ()) -> ExperimentConfig:
    """The config to save: the folder's own config with any new variants added. Anything else that differs
    from the folder's config (data, model, SFT, RL or eval settings, or an existing variant's changes) is an
    error naming the keys: its finished runs would otherwise be reused as if made with the new settings.
    Keys in `where` (where the folder is) may differ too."""
    saved = load_config(ExperimentConfig, saved_path)
    mine, theirs = _flat(to_dict(config)), _flat(to_dict(saved))
    free = {"run.threads", "results_dir", *where}
    differ = sorted(
        key
        for key in mine.keys() | theirs.keys()
        if key.split(".")[0] not in PER_COMMAND and key not in free and mine.get(key) != theirs.get(key)
    )
    differ += [
        f"variants.{name}"
        for name in sorted(config.variants.keys() & saved.variants.keys())
        if config.variants[name] != saved.variants[name]
    ]
    if differ:
        raise ConfigError(
            f"{saved_path.parent} holds an experiment made with other settings ({', '.join(differ)} differ from "
            f"{saved_path}); use another run.name, or the same settings (seeds, only and stage may differ, and "
            "new variants may be added)"
        )
    return replace(saved, variants={**saved.variants, **config.variants})


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "variants":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def run(config: ExperimentConfig) -> Path:
    run_dir = run_path(config.run, "experiment")
    with _locked(run_dir / ".config.lock"):
        folder_config = config
        if config.results_dir:  # its settings must be this command's, as the output folder's must
            folder_config = _join(config, Path(config.results_dir), where=("run.output_dir", "run.name"))
            for name in restore(Path(config.results_dir), run_dir):
                print(f"experiment: {name} restored from {config.results_dir}")
        folder_config = _join(folder_config, run_dir)  # the report covers every variant of both folders
    if config.stage != "report":
        names = [f"{v}-s{seed}" for seed in config.seeds for v in config.only or list(config.variants)]
        # Data and SFT only when something needs them: a sweep restored whole goes straight to its report.
        if config.stage == "prepare" or not _done(run_dir, "sft") or not all(_done(run_dir, n) for n in names):
            files = prepare(config, run_dir)
        if config.stage == "all":
            for seed in config.seeds:
                for variant in config.only or list(config.variants):
                    if not _done(run_dir, f"{variant}-s{seed}"):
                        run_variant(config, run_dir, files, variant, seed)
    report = write_report(folder_config, run_dir)  # every variant of the folder, not only this command's
    print(report.read_text())
    print(f"experiment: everything is in {run_dir}")
    return run_dir


# --- the report -------------------------------------------------------------------------------------------


def eval_results(eval_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The report and per-problem results of a finished evaluation of one benchmark; None if unfinished."""
    results = eval_dir / "results.json"
    if not results.exists():
        return None
    (report,) = json.loads(results.read_text())  # one benchmark: the held-out test file
    return report, json.loads((eval_dir / f"{report['name']}.json").read_text())["problems"]


def eval_numbers(eval_dir: Path) -> dict[str, Any] | None:
    """avg@k, pass@k (largest k) and the per-problem accuracies of a finished evaluation; None if unfinished."""
    finished = eval_results(eval_dir)
    if finished is None:
        return None
    report, problems = finished
    scored = {p["problem_id"]: [r for r in p["rewards"] if r is not None] for p in problems}
    accuracy = {pid: problem_accuracy(rewards) for pid, rewards in scored.items() if rewards}
    k_max = max(int(k) for k in report["pass_at"])
    return {
        "avg@k": report["avg_at_k"],
        "k": report["samples_per_problem"],
        f"pass@{k_max}": report["pass_at"][str(k_max)],
        "pass_k": k_max,
        "per_problem": list(accuracy.values()),
        "by_problem": accuracy,
        "tool_calls": report["mean_tool_calls"],
        "response_tokens": report["mean_response_length"],
    }


def entropy_band(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Band tightness and gate behaviour of one run: final-window entropy spread and gate flips."""
    entropy = logged(rows, "stare/entropy_mean")
    tail = entropy[-max(1, len(entropy) // 4) :]
    gates = logged(rows, "stare/gate")
    return {
        "entropy_final_window_std": statistics.pstdev(tail) if len(tail) > 1 else None,
        "entropy_drop": (mean(entropy[:5]) - mean(tail)) if entropy else None,
        "gate_flips": sum(a != b for a, b in zip(gates[:-1], gates[1:], strict=True)) if gates else None,
        # the reward signal: groups with unequal rewards among all groups sampled (refills included)
        "informative_groups": _share_of(rows, "rollout/groups_kept", "rollout/groups_dropped_equal"),
        "w_mean": mean(logged(rows, "stare/w")) if gates else None,  # no gate logged: STARE off, W unused
    }


def _share_of(rows: list[dict[str, Any]], part: str, rest: str) -> float | None:
    kept, other = sum(r.get(part) or 0 for r in rows), sum(r.get(rest) or 0 for r in rows)
    return kept / (kept + other) if kept + other else None


def families(test_file: Path) -> dict[str, str]:
    """problem id -> task family, from the test file's `meta.family` (synthetic tasks)."""
    out = {}
    for line in test_file.read_text().splitlines():
        row = json.loads(line)
        out[row["id"]] = (row.get("meta") or {}).get("family", "-")
    return out


def family_table(data: dict[str, Any], family_of: dict[str, str], pass_key: str) -> list[str]:
    """Held-out avg@k (%) per task family: the SFT model, and each variant's mean over its seeds."""
    names = sorted(set(family_of.values()))

    def by_family(by_problem: dict[str, float]) -> dict[str, float]:
        groups: dict[str, list[float]] = {}
        for pid, accuracy in by_problem.items():
            groups.setdefault(family_of.get(pid, "-"), []).append(accuracy)
        return {name: statistics.fmean(v) for name, v in groups.items()}

    columns = {"SFT": [by_family(data["sft"]["by_problem"])]} if data["sft"] else {}
    for variant, by_seed in data["runs"].items():
        columns[variant] = [by_family(r["held_out"]["by_problem"]) for r in by_seed.values()]
    lines = [
        "Held-out avg@k (%) per task family (variants: mean over seeds):",
        "",
        "| family | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for name in names:
        cells = []
        for runs in columns.values():
            values = [r[name] for r in runs if name in r]
            cells.append(f"{100 * statistics.fmean(values):.1f}" if values else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def collect(config: ExperimentConfig, run_dir: Path) -> dict[str, Any]:
    """Every finished run's numbers: {"sft": eval numbers, "runs": {variant: {seed: {...}}}}."""
    out: dict[str, Any] = {"sft": eval_numbers(run_dir / "eval-sft"), "runs": {}}
    for variant in config.variants:
        for seed in sorted({*config.seeds, *_seeds_on_disk(run_dir, variant)}):
            name = f"{variant}-s{seed}"
            held_out = eval_numbers(run_dir / f"eval-{name}")
            if held_out is None:
                continue
            rows = read_metrics(run_dir / f"rl-{name}")
            out["runs"].setdefault(variant, {})[seed] = {
                **run_summary(rows),
                **entropy_band(rows),
                "held_out": held_out,
                "entropy": logged(rows, "stare/entropy_mean"),
            }
    return out


def _seeds_on_disk(run_dir: Path, variant: str) -> list[int]:
    prefix = f"eval-{variant}-s"
    seeds = []
    for path in run_dir.glob(f"{prefix}*"):
        tail = path.name.removeprefix(prefix)
        if tail.isdigit():
            seeds.append(int(tail))
    return seeds


def _cell(values: list[float], digits: int, scale: float = 1.0) -> str:
    values = [v * scale for v in values if v is not None]
    if not values:
        return "-"
    m, lo, hi = t_interval(values)
    return f"{m:.{digits}f}" if lo is None else f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def write_report(config: ExperimentConfig, run_dir: Path) -> Path:
    """report.md and report.json over every finished run, and entropy.png."""
    data = collect(config, run_dir)
    sft_numbers = data["sft"]
    lines = [f"# Experiment `{run_dir.name}`", ""]
    lines.append(
        f"RL: {config.rl.steps} steps of {config.rl.rollout.prompts_per_step} prompts x "
        f"{config.rl.rollout.group_size} rollouts, lr {config.rl.optim.lr:g}, from one SFT checkpoint "
        f"(SFT epochs: {config.sft.epochs}). Held out: {config.tasks.test_problems} problems x k = {config.eval.k} "
        f"at T = {config.eval.temperature:g}. Intervals: {LEVEL:.0%} t-intervals over seeds; the SFT row's is a "
        "bootstrap over problems (its evaluation noise)."
    )
    lines.append("")
    pass_key = f"pass@{sft_numbers['pass_k']}" if sft_numbers else "pass@k"
    lines += [
        f"| model | seeds | held-out avg@k (%) | held-out {pass_key} (%) | avg@k minus SFT (points) "
        "| final-window entropy | entropy drop (first 5 minus final window) | final-window entropy std "
        "| gate on | gate flips | mean W | informative groups | " + " / ".join(REGIMES) + " (steps, summed) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    if sft_numbers:
        lo, hi = bootstrap_interval(sft_numbers["per_problem"])
        lines.append(
            f"| SFT | - | {100 * sft_numbers['avg@k']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] "
            f"| {100 * sft_numbers[pass_key]:.1f} | - | - | - | - | - | - | - | - | - |"
        )
    summary: dict[str, Any] = {"sft": _without_lists(sft_numbers), "variants": {}}
    for variant, by_seed in data["runs"].items():
        runs = list(by_seed.values())
        held = [r["held_out"] for r in runs]
        diffs = [h["avg@k"] - sft_numbers["avg@k"] for h in held] if sft_numbers else []
        regimes = {name: sum((r["regimes"] or {}).get(name, 0) for r in runs) for name in REGIMES}
        lines.append(
            f"| {variant} | {len(runs)} | {_cell([h['avg@k'] for h in held], 1, 100)} "
            f"| {_cell([h.get(pass_key) for h in held], 1, 100)} | {_cell(diffs, 1, 100)} "
            f"| {_cell([r['entropy_final_window_mean'] for r in runs], 3)} "
            f"| {_cell([r['entropy_drop'] for r in runs], 3)} "
            f"| {_cell([r['entropy_final_window_std'] for r in runs], 3)} "
            f"| {_cell([r['gate_fraction'] for r in runs], 2)} | {_cell([r['gate_flips'] for r in runs], 1)} "
            f"| {_cell([r['w_mean'] for r in runs], 2)} | {_cell([r['informative_groups'] for r in runs], 2)} | "
            + " / ".join(str(regimes[n]) for n in REGIMES)
            + " |"
        )
        summary["variants"][variant] = {
            str(seed): _without_lists(r) | {"held_out": _without_lists(r["held_out"])} for seed, r in by_seed.items()
        }
    lines += [
        "",
        "Per run:",
        "",
        f"| model | seed | avg@k (%) | {pass_key} (%) | first-5 entropy | final-window entropy "
        "| final-window rollout accuracy | gate on | median W* (defined steps) |",
        "|---|---:|" + "---:|" * 7,
    ]
    for variant, by_seed in data["runs"].items():
        for seed, r in sorted(by_seed.items()):
            h, w_star = r["held_out"], r["critical_weight"]
            median = "-" if w_star["median"] is None else f"{w_star['median']:.2f}"
            lines.append(
                f"| {variant} | {seed} | {100 * h['avg@k']:.1f} | {100 * h[pass_key]:.1f} "
                f"| {r['entropy_first5_mean']:.3f} | {r['entropy_final_window_mean']:.3f} "
                f"| {r['rollout_accuracy_final_window']:.2f} | {_num(r['gate_fraction'])} "
                f"| {median} ({w_star['n']}/{r['steps']}) |"
            )
    test_file = run_dir / "data" / "test.jsonl"
    if test_file.exists() and (sft_numbers or data["runs"]):
        lines += ["", *family_table(data, families(test_file), pass_key)]
    figure = _plot(data["runs"], run_dir / "entropy.png", entropy_targets(config, list(data["runs"])))
    if figure:
        lines += ["", f"![entropy]({figure.name})"]
    (run_dir / "report.json").write_text(json.dumps(summary, indent=2))
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _without_lists(numbers: dict[str, Any] | None) -> dict[str, Any] | None:
    """The scalars of `numbers` (per-problem and per-step series stay in their own files)."""
    if numbers is None:
        return None
    return {k: v for k, v in numbers.items() if not isinstance(v, list) and k != "by_problem"}


def entropy_targets(config: ExperimentConfig, variants: list[str]) -> dict[float, list[str]]:
    """H_tgt -> the variants (of `variants`, STARE on) that hold entropy to it; variants may set their own."""
    targets: dict[float, list[str]] = {}
    for variant in variants:
        stare = config.variant_stare(variant)
        if stare.enabled:
            targets.setdefault(stare.target_entropy, []).append(variant)
    return targets


def _plot(runs: dict[str, dict[int, dict[str, Any]]], path: Path, targets: dict[float, list[str]]) -> Path | None:
    """Entropy per step: each seed thin, the mean over seeds thick, one colour per variant; a dashed line at
    each H_tgt the variants use."""
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (variant, by_seed) in enumerate(runs.items()):
        colour = f"C{i}"
        curves = [r["entropy"] for r in by_seed.values()]
        for curve in curves:
            ax.plot(range(1, len(curve) + 1), curve, color=colour, lw=0.6, alpha=0.35)
        length = min(len(c) for c in curves)
        average = [statistics.fmean(c[j] for c in curves) for j in range(length)]
        ax.plot(range(1, length + 1), average, color=colour, lw=2, label=f"{variant} (mean of {len(curves)})")
    for target, variants in sorted(targets.items()):
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"H_tgt = {target:g} ({', '.join(variants)})")
    ax.set(xlabel="RL step", ylabel="policy entropy (nats, action tokens)", title="entropy per step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
