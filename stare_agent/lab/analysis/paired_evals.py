"""Two evaluations of each run on the same problems (say a run's checkpoint at step 60 and at step 120): the change.

    stare-agent lab paired_evals --before EVAL_DIR [EVAL_DIR ...] --after EVAL_DIR [EVAL_DIR ...] [--curve]

The i-th folder of --before is paired with the i-th of --after (one pair per seed). Per pair: avg@k and the
largest pass@k before and after, and their changes; over the pairs: the mean change with its 95% t-interval
(over seeds), and the pooled per-problem change of avg@k with a bootstrap interval over problems (how much of
it the test set alone could make); and the problems solved (at least one right sample) before and never after, and
the reverse: what moves pass@k, with the exact two-sided sign test (McNemar's) on those discordant problems (it
takes them as independent; with several pairs over one test set they are not quite). Problems are matched by id;
both evaluations must hold the same ones. --curve adds the whole pass@k curve (k = 1, 2, 4, ... up to the samples
per problem): before and after, the change over pairs and the pooled per-problem change, where a coverage loss
at large k shows even when pass@1 rises.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from stare_agent.eval import pass_at_k, pass_ks
from stare_agent.lab.report import eval_numbers, eval_results
from stare_agent.lab.stats import bootstrap_interval, t_interval


def _numbers(folder: Path) -> dict:
    numbers = eval_numbers(folder)
    if numbers is None:
        raise SystemExit(f"{folder}: no results.json (not a finished evaluation)")
    return numbers


def sign_test(a: int, b: int) -> float:
    """Exact two-sided p-value of a split of a + b discordant problems into a and b under a fair coin."""
    n = a + b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(a, b) + 1)) / 2**n
    return min(1.0, 2 * tail)


def problem_rewards(folder: Path) -> dict[str, list[float]]:
    """problem id -> its scored rewards, from the folder's one benchmark."""
    finished = eval_results(folder)
    if finished is None:
        raise SystemExit(f"{folder}: no results.json (not a finished evaluation)")
    _, problems = finished
    return {p["problem_id"]: [r for r in p["rewards"] if r is not None] for p in problems if p["rewards"]}


def problem_pass(rewards: list[float], k: int) -> float:
    return pass_at_k(len(rewards), sum(r >= 1.0 for r in rewards), k)


def curve(pairs: list[tuple[Path, Path]]) -> list[str]:
    """Markdown rows: pass@k before and after for every k both evaluations reach, with the changes."""
    data = [(problem_rewards(b), problem_rewards(a)) for b, a in pairs]
    n = min(len(r) for before, after in data for r in [*before.values(), *after.values()])
    lines = [
        "| k | pass@k before (%, mean over pairs) | after | change over pairs (points, 95% t-interval) "
        "| change per problem, pooled (95% bootstrap) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for k in pass_ks(n):
        before = [statistics.fmean(problem_pass(r, k) for r in b.values()) for b, _ in data]
        after = [statistics.fmean(problem_pass(r, k) for r in a.values()) for _, a in data]
        pooled = [problem_pass(a[pid], k) - problem_pass(b[pid], k) for b, a in data for pid in b]
        low, high = bootstrap_interval(pooled)
        lines.append(
            f"| {k} | {100 * statistics.fmean(before):.1f} | {100 * statistics.fmean(after):.1f} "
            f"| {_interval([y - x for x, y in zip(before, after, strict=True)])} "
            f"| {100 * statistics.fmean(pooled):+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] |"
        )
    return lines


def _interval(values: list[float]) -> str:
    mean, low, high = t_interval(values)
    if low is None:
        return f"{100 * mean:+.1f} (one pair: no interval)"
    return f"{100 * mean:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, nargs="+", required=True)
    parser.add_argument("--after", type=Path, nargs="+", required=True)
    parser.add_argument("--curve", action="store_true", help="also the whole pass@k curve")
    args = parser.parse_args(argv)
    if len(args.before) != len(args.after):
        raise SystemExit(
            f"--before has {len(args.before)} folders and --after {len(args.after)}: pair them one to one"
        )
    d_avg, d_pass, per_problem, pass_key = [], [], [], None
    lost, gained, problems = 0, 0, 0
    rows = []
    for before, after in zip(args.before, args.after, strict=True):
        b, a = _numbers(before), _numbers(after)
        if b["pass_k"] != a["pass_k"] or set(b["by_problem"]) != set(a["by_problem"]):
            raise SystemExit(f"{before} and {after} are not evaluations of the same problems at the same k")
        pass_key = f"pass@{a['pass_k']}"
        d_avg.append(a["avg@k"] - b["avg@k"])
        d_pass.append(a[pass_key] - b[pass_key])
        per_problem += [a["by_problem"][pid] - b["by_problem"][pid] for pid in b["by_problem"]]
        lost += sum(b["by_problem"][pid] > 0 and a["by_problem"][pid] == 0 for pid in b["by_problem"])
        gained += sum(b["by_problem"][pid] == 0 and a["by_problem"][pid] > 0 for pid in b["by_problem"])
        problems += len(b["by_problem"])
        rows.append(
            f"| {before} | {after} | {100 * b['avg@k']:.1f} | {100 * a['avg@k']:.1f} | {100 * d_avg[-1]:+.1f} "
            f"| {100 * b[pass_key]:.1f} | {100 * a[pass_key]:.1f} | {100 * d_pass[-1]:+.1f} |"
        )
    print(f"| before | after | avg@k before (%) | after | change | {pass_key} before (%) | after | change |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    low, high = bootstrap_interval(per_problem)
    mean = sum(per_problem) / len(per_problem)
    print()
    print(f"- avg@k change, mean over {len(d_avg)} pairs (points, 95% t-interval): {_interval(d_avg)}")
    print(f"- {pass_key} change, mean over {len(d_pass)} pairs (points, 95% t-interval): {_interval(d_pass)}")
    print(
        f"- avg@k change per problem, pooled over pairs ({len(per_problem)} problem-runs; 95% bootstrap over them): "
        f"{100 * mean:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"
    )
    print(
        f"- problems solved before and never after: {lost} of {problems}; never before, solved after: {gained} "
        f"(sign test p = {sign_test(lost, gained):.3f})"
    )
    if args.curve:
        print()
        print("\n".join(curve(list(zip(args.before, args.after, strict=True)))))


if __name__ == "__main__":
    main()
