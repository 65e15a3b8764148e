"""`stare-agent experiment`'s report: every finished run's numbers, intervals over seeds, tables and the entropy
plot (report.md, report.json, entropy.png); and the readers of a finished evaluation that the analysis tools use.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stare_agent.backends.local.common import read_metrics
from stare_agent.lab.runs import logged, mean, run_summary
from stare_agent.lab.stats import LEVEL, bootstrap_interval, problem_accuracy, t_interval
from stare_agent.theory import REGIMES

if TYPE_CHECKING:
    from stare_agent.lab.experiment import ExperimentConfig


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
    """Every finished run's numbers: {"sft": eval numbers, "sft_coverage": the SFT model's coverage evaluation
    (None without one), "runs": {variant: {seed: {..., "held_out": ..., "coverage": ...}}}}."""
    k = config.coverage_eval.k
    suffix = f"-k{k}" if k else ""

    def coverage(name: str) -> dict[str, Any] | None:
        return eval_numbers(run_dir / f"eval-{name}{suffix}") if k else None

    out: dict[str, Any] = {"sft": eval_numbers(run_dir / "eval-sft"), "sft_coverage": coverage("sft"), "runs": {}}
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
                "coverage": coverage(name),
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
    if config.coverage_eval.k:
        lines += ["", *coverage_table(config, data)]
        summary["sft_coverage"] = _without_lists(data["sft_coverage"])
        for variant, by_seed in data["runs"].items():
            for seed, r in by_seed.items():
                summary["variants"][variant][str(seed)]["coverage"] = _without_lists(r["coverage"])
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


def coverage_table(config: ExperimentConfig, data: dict[str, Any]) -> list[str]:
    """pass@k of the coverage evaluations (k = coverage_eval.k): the SFT model's, and per variant the mean over
    the seeds evaluated (t-interval) and each seed's. Paired differences: `stare-agent lab endpoint`."""
    cover = config.coverage_eval
    key = f"pass@{cover.k}"
    where = f"the first {cover.max_problems} test problems" if cover.max_problems else "every test problem"
    lines = [
        f"Coverage: {key} on {where}, {cover.k} samples each (`coverage_eval`; paired differences between "
        "variants: `stare-agent lab endpoint`):",
        "",
        f"| model | seeds | {key} (%) | per seed |",
        "|---|---:|---:|---|",
    ]
    if data["sft_coverage"]:
        lines.append(f"| SFT | - | {100 * data['sft_coverage'][key]:.1f} | - |")
    for variant, by_seed in data["runs"].items():
        values = {seed: r["coverage"][key] for seed, r in sorted(by_seed.items()) if r["coverage"]}
        if values:
            each = ", ".join(f"s{seed} {100 * v:.1f}" for seed, v in values.items())
            lines.append(f"| {variant} | {len(values)} | {_cell(list(values.values()), 1, 100)} | {each} |")
    return lines


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _without_lists(numbers: dict[str, Any] | None) -> dict[str, Any] | None:
    """The scalars of `numbers` (per-problem and per-step series stay in their own files)."""
    if numbers is None:
        return None
    return {k: v for k, v in numbers.items() if not isinstance(v, list) and k != "by_problem"}


def entropy_targets(config: ExperimentConfig, variants: list[str]) -> dict[float, list[str]]:
    """H_tgt -> the variants (of `variants`) whose method holds entropy to it: stare.target_entropy for stare and
    low_prob_reweight, entropy_bonus.target_entropy for entropy_bonus; variants may set their own."""
    targets: dict[float, list[str]] = {}
    for variant in variants:
        rl = config.variant_rl(variant)
        method = rl.entropy_control.method
        if method in ("stare", "low_prob_reweight"):
            targets.setdefault(rl.stare.target_entropy, []).append(variant)
        elif method == "entropy_bonus":
            targets.setdefault(rl.entropy_bonus.target_entropy, []).append(variant)
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
