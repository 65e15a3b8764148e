"""Which program style each sample of an evaluation chose: the collapse onto one style, measured directly.

    stare-agent lab program_styles TEST_FILE EVAL_DIR [EVAL_DIR ...] [--by-family] [--min-ratio 0.8]

TEST_FILE is the synthetic test set the evaluations ran on (`stare-agent data make-tasks`); each row names
every correct program of its problem, one per style (`meta.solution_code`, the family's usual one, then
`meta.other_solutions`). A sample's first tool call is matched to the nearest of its problem's programs
(whitespace ignored; difflib's similarity ratio at least --min-ratio, else "other"). The evaluation folders must
hold every sample's programs (`programs` in the benchmark's JSON, which `stare-agent eval` writes).

Per evaluation: the share of samples that called the tool; among those, the share in each style and "other";
the mean over problems of the entropy of the style over the problem's samples (nats: ln 3 = 1.10 for an even
split over three styles, 0 when every sample picks one); distinct first programs per problem; and the accuracy
of the samples of each style. --by-family adds each family's style shares per evaluation.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from stare_agent.lab.report import eval_results

OTHER = "other"


def normalize(code: str) -> str:
    """The program with its whitespace collapsed (indentation and blank lines do not make a style)."""
    return " ".join(code.split())


def classify(program: str, references: list[str], min_ratio: float) -> str:
    """'style 1', 'style 2', ... (the reference it is closest to, in reference order) or 'other'."""
    mine = normalize(program)
    ratios = [difflib.SequenceMatcher(None, mine, normalize(ref), autojunk=False).ratio() for ref in references]
    best = max(range(len(ratios)), key=lambda i: (ratios[i], -i))
    return f"style {best + 1}" if ratios[best] >= min_ratio else OTHER


def entropy(counts: Counter[str]) -> float:
    total = sum(counts.values())
    return -sum(n / total * math.log(n / total) for n in counts.values() if n)


def load_references(test_file: Path) -> dict[str, dict[str, Any]]:
    """problem id -> {"family", "programs"} from the test set's rows."""
    out = {}
    for line_no, line in enumerate(test_file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        meta = row.get("meta") or {}
        if "solution_code" not in meta:
            raise SystemExit(
                f"{test_file}:{line_no}: row {row.get('id')!r} has no meta.solution_code (not a synthetic task)"
            )
        out[row["id"]] = {
            "family": meta.get("family", "?"),
            "programs": [meta["solution_code"], *meta.get("other_solutions", [])],
        }
    return out


def load_samples(eval_dir: Path) -> list[dict[str, Any]]:
    """The per-problem results of the folder's one benchmark, each with its samples' programs."""
    finished = eval_results(eval_dir)
    if finished is None:
        raise SystemExit(f"{eval_dir}: no results.json (not a finished evaluation)")
    report, problems = finished
    if problems and "programs" not in problems[0]:
        path = eval_dir / f"{report['name']}.json"
        raise SystemExit(f"{path}: no per-sample programs (evaluated before they were recorded); evaluate again")
    return problems


def styles_of(problems: list[dict[str, Any]], refs: dict[str, dict[str, Any]], min_ratio: float, where: Path):
    """Per problem: (family, [(style, first program, reward or None) per sample that called the tool], samples)."""
    out = []
    for problem in problems:
        pid = problem["problem_id"]
        if pid not in refs:
            raise SystemExit(f"{where}: problem {pid!r} is not in the test file")
        # rewards hold only the scored samples; align by finish reason (sandbox errors have none)
        scored = iter(problem["rewards"])
        rewards = [None if reason == "sandbox_error" else next(scored) for reason in problem["finish_reasons"]]
        chosen = [
            (classify(programs[0], refs[pid]["programs"], min_ratio), normalize(programs[0]), reward)
            for programs, reward in zip(problem["programs"], rewards, strict=True)
            if programs
        ]
        out.append((refs[pid]["family"], chosen, len(rewards)))
    return out


def summary(per_problem, n_styles: int) -> dict[str, Any]:
    samples = sum(n for _, _, n in per_problem)
    chosen = [c for _, cs, _ in per_problem for c in cs]
    counts = Counter(style for style, _, _ in chosen)
    right: dict[str, list[float]] = defaultdict(list)
    for style, _, reward in chosen:
        if reward is not None:
            right[style].append(reward)
    spread = [entropy(Counter(s for s, _, _ in cs)) for _, cs, _ in per_problem if len(cs) >= 2]
    distinct = [len({p for _, p, _ in cs}) for _, cs, _ in per_problem if cs]
    names = [f"style {i + 1}" for i in range(n_styles)] + [OTHER]
    return {
        "tool_share": len(chosen) / samples if samples else 0.0,
        "shares": {name: counts[name] / len(chosen) if chosen else 0.0 for name in names},
        "style_entropy": sum(spread) / len(spread) if spread else None,
        "distinct": sum(distinct) / len(distinct) if distinct else None,
        "accuracy": {name: (sum(right[name]) / len(right[name]), len(right[name])) for name in names if right[name]},
    }


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_file", type=Path)
    parser.add_argument("eval_dirs", type=Path, nargs="+")
    parser.add_argument("--by-family", action="store_true")
    parser.add_argument("--min-ratio", type=float, default=0.8)
    args = parser.parse_args(argv)
    refs = load_references(args.test_file)
    n_styles = max(len(r["programs"]) for r in refs.values())
    names = [f"style {i + 1}" for i in range(n_styles)] + [OTHER]
    runs = {d: styles_of(load_samples(d), refs, args.min_ratio, d) for d in args.eval_dirs}

    print(
        "| evaluation | samples with a tool call (%) | "
        + " | ".join(f"{n} (%)" for n in names)
        + " | style entropy per problem (nats) | distinct first programs per problem | accuracy per style (%) |"
    )
    print("|---|---:|" + "---:|" * len(names) + "---:|---:|---|")
    for folder, per_problem in runs.items():
        s = summary(per_problem, n_styles)
        accuracy = ", ".join(f"{name} {_pct(acc)} ({n})" for name, (acc, n) in s["accuracy"].items())
        cells = [
            folder.name,
            _pct(s["tool_share"]),
            *(_pct(s["shares"][n]) for n in names),
            _num(s["style_entropy"], 3),
            _num(s["distinct"], 2),
            accuracy,
        ]
        print("| " + " | ".join(cells) + " |")
    if args.by_family:
        families = sorted({family for per_problem in runs.values() for family, _, _ in per_problem})
        print()
        print("Style shares (%) per family, " + " / ".join(names) + ":")
        print()
        print("| family | " + " | ".join(folder.name for folder in runs) + " |")
        print("|---|" + "---|" * len(runs))
        for family in families:
            cells = []
            for per_problem in runs.values():
                s = summary([p for p in per_problem if p[0] == family], n_styles)
                cells.append(" / ".join(f"{100 * s['shares'][n]:.0f}" for n in names))
            print(f"| {family} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
