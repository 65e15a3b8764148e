"""How wide is a held-out accuracy's interval at a given number of problems? From one finished evaluation.

    stare-agent lab heldout_noise EVAL_DIR [EVAL_DIR ...] [--subsets 32 64 128]

For each evaluation folder (`stare-agent eval` output with one benchmark), prints avg@k and its 95% bootstrap
interval over problems for the whole set and for its first N problems: the evaluation noise a comparison of two
models on that many problems has to overcome. The quickstart evaluates 32 problems.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stare_agent.lab.report import eval_numbers
from stare_agent.lab.stats import bootstrap_interval


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("eval_dirs", type=Path, nargs="+")
    parser.add_argument("--subsets", type=int, nargs="+", default=[32, 64, 128])
    args = parser.parse_args(argv)
    print("| evaluation | problems | avg@k (%) | 95% bootstrap interval | half-width (points) |")
    print("|---|---:|---:|---:|---:|")
    for folder in args.eval_dirs:
        numbers = eval_numbers(folder)
        if numbers is None:
            raise SystemExit(f"{folder}: no results.json (not a finished evaluation)")
        accuracy = numbers["per_problem"]
        for n in sorted({*(s for s in args.subsets if s < len(accuracy)), len(accuracy)}):
            part = accuracy[:n]
            lo, hi = bootstrap_interval(part)
            mean = sum(part) / n
            interval = f"[{100 * lo:.1f}, {100 * hi:.1f}]"
            print(f"| {folder.name} | {n} | {100 * mean:.1f} | {interval} | {50 * (hi - lo):.1f} |")


if __name__ == "__main__":
    main()
