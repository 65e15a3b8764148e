"""An experiment's primary endpoint: pass@k of each arm minus its baseline's, paired by seed and by problem.

    stare-agent lab endpoint EXPERIMENT_DIR --compare ARM:BASELINE [--compare ARM:BASELINE ...] [--k K]
        [--suffix -k64] [--json PATH]

EXPERIMENT_DIR is an experiment's output or results folder; each model is read from eval-<variant>-s<seed><suffix>
(the suffix defaults to the folder's coverage evaluation, `-k<coverage_eval.k>`, and to none without one). For
every comparison, over the seeds both arms finished, on the same problems:
- the seed-level difference: per seed, the arm's pass@k over the problems minus the baseline's, and its mean with
  the 95% t-interval over seeds;
- per problem, the difference of pass@k averaged over those seeds, and a bootstrap over the problems of its mean
  (10,000 resamples, percentile 95% interval, two-sided p-value from the same resamples);
- Holm's adjustment of those p-values over all the comparisons of the command, beside the unadjusted ones.
pass@k is the unbiased estimator over each problem's scored samples (k defaults to the largest the evaluations
reach). The arms and baselines are variant names of the folder; a comparison finished by no seed is an error.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from stare_agent.lab.analysis.paired_evals import problem_pass, problem_rewards
from stare_agent.lab.stats import bootstrap_test, holm, t_interval


@dataclass
class Comparison:
    """One arm against its baseline: the numbers of the endpoint (pass@k as fractions)."""

    arm: str
    baseline: str
    seeds: list[int]
    problems: int
    k: int
    arm_pass: float
    """The arm's pass@k, mean over the seeds."""
    baseline_pass: float
    per_seed: list[float]
    """arm minus baseline, one per seed (in `seeds` order)."""
    seed_mean: float
    seed_low: float | None
    seed_high: float | None
    boot_low: float
    boot_high: float
    p: float
    p_holm: float = 1.0


def _seeds(folder: Path, variant: str, suffix: str) -> set[int]:
    prefix, seeds = f"eval-{variant}-s", set()
    for path in folder.glob(f"{prefix}*{suffix}"):
        tail = path.name.removeprefix(prefix).removesuffix(suffix)  # removesuffix('') leaves the name
        if tail.isdigit() and (path / "results.json").exists():
            seeds.add(int(tail))
    return seeds


def compare(folder: Path, arm: str, baseline: str, suffix: str, k: int | None) -> Comparison:
    """`arm` against `baseline` in `folder`, over the seeds both finished; the Holm p is set by `endpoint`."""
    seeds = sorted(_seeds(folder, arm, suffix) & _seeds(folder, baseline, suffix))
    if not seeds:
        raise SystemExit(
            f"{folder}: no seed has finished evaluations of both {arm} and {baseline} "
            f"(eval-<variant>-s<seed>{suffix}/results.json)"
        )
    arms = [problem_rewards(folder / f"eval-{arm}-s{s}{suffix}") for s in seeds]
    bases = [problem_rewards(folder / f"eval-{baseline}-s{s}{suffix}") for s in seeds]
    problems = set(bases[0])
    for seed, a, b in zip(seeds, arms, bases, strict=True):
        if set(a) != problems or set(b) != problems:
            raise SystemExit(f"{folder}: seed {seed} of {arm} or {baseline} was evaluated on other problems")
    samples = min(len(r) for run in arms + bases for r in run.values())
    k = samples if k is None else k
    if not 1 <= k <= samples:
        raise SystemExit(f"--k {k}: the evaluations have at most {samples} scored samples for some problem")
    ids = sorted(problems)
    arm_by = [[problem_pass(run[pid], k) for pid in ids] for run in arms]
    base_by = [[problem_pass(run[pid], k) for pid in ids] for run in bases]
    per_seed = [statistics.fmean(a) - statistics.fmean(b) for a, b in zip(arm_by, base_by, strict=True)]
    mean, low, high = t_interval(per_seed)
    per_problem = [
        statistics.fmean(a[i] - b[i] for a, b in zip(arm_by, base_by, strict=True)) for i in range(len(ids))
    ]
    boot_low, boot_high, p = bootstrap_test(per_problem)
    return Comparison(
        arm, baseline, seeds, len(ids), k,
        statistics.fmean(statistics.fmean(a) for a in arm_by), statistics.fmean(statistics.fmean(b) for b in base_by),
        per_seed, mean, low, high, boot_low, boot_high, p,
    )  # fmt: skip


def endpoint(folder: Path, pairs: list[tuple[str, str]], suffix: str, k: int | None) -> list[Comparison]:
    """Every comparison, with Holm's adjustment over all of them."""
    out = [compare(folder, arm, baseline, suffix, k) for arm, baseline in pairs]
    for comparison, adjusted in zip(out, holm([c.p for c in out]), strict=True):
        comparison.p_holm = adjusted
    return out


def table(comparisons: list[Comparison]) -> list[str]:
    """Markdown rows, points (percentage points) for differences."""
    ks = sorted({c.k for c in comparisons})
    k_label = f"pass@{ks[0]}" if len(ks) == 1 else "pass@k"

    def pts(value: float) -> str:
        return f"{100 * value:+.1f}"

    lines = [
        f"| arm | baseline | seeds | problems | arm {k_label} (%) | baseline (%) | difference per seed (points) "
        "| seed-level difference (95% t-interval) | per-problem difference (95% bootstrap) | p | p (Holm) |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for c in comparisons:
        seed_cell = pts(c.seed_mean)
        if c.seed_low is not None:
            seed_cell += f" [{pts(c.seed_low)}, {pts(c.seed_high)}]"
        lines.append(
            f"| {c.arm} | {c.baseline} | {len(c.seeds)} | {c.problems} | {100 * c.arm_pass:.1f} "
            f"| {100 * c.baseline_pass:.1f} | {', '.join(pts(d) for d in c.per_seed)} | {seed_cell} "
            f"| {pts(c.seed_mean)} [{pts(c.boot_low)}, {pts(c.boot_high)}] | {c.p:.3f} | {c.p_holm:.3f} |"
        )
    return lines


def _default_suffix(folder: Path) -> str:
    """-k<K> for the folder's coverage evaluation; read from its config.yaml as written (an old experiment's
    config need not load as today's ExperimentConfig)."""
    saved = folder / "config.yaml"
    tree = yaml.safe_load(saved.read_text()) if saved.exists() else None
    k = ((tree or {}).get("coverage_eval") or {}).get("k", 0)
    return f"-k{k}" if k else ""


def _pair(text: str) -> tuple[str, str]:
    arm, sep, baseline = text.partition(":")
    if not sep or not arm or not baseline:
        raise argparse.ArgumentTypeError(f"--compare {text!r}: expected ARM:BASELINE (two variant names)")
    return arm, baseline


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stare-agent lab endpoint", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the experiment's output or results folder")
    parser.add_argument("--compare", type=_pair, action="append", required=True, metavar="ARM:BASELINE")
    parser.add_argument("--k", type=int, default=None, help="pass@k (default: the samples per problem)")
    parser.add_argument("--suffix", default=None, help="evaluation folder suffix (default: the coverage evaluation's)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    suffix = _default_suffix(args.folder) if args.suffix is None else args.suffix
    comparisons = endpoint(args.folder, args.compare, suffix, args.k)
    print("\n".join(table(comparisons)))
    if args.json:
        args.json.write_text(json.dumps([asdict(c) for c in comparisons], indent=2) + "\n")


if __name__ == "__main__":
    main()
