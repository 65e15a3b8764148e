"""Step-time breakdown of RL runs from their metrics.jsonl: where a step's time goes, STARE's share of it,
and the generation and training throughput.

    python benchmarks/rl_step_time.py runs/quickstart-XXXX/rl-grpo-ds runs/quickstart-XXXX/rl-stare-O1

The first step is left out (it includes warming the sandbox pool). Shares are of the mean step time;
`other` is what no timer covers (tokenizing, padding, scoring, logging).
"""

from __future__ import annotations

import sys
from pathlib import Path

from stare_agent.backends.local.common import read_metrics

# time/theory: runs made before both backends shared stare_agent.step, which now counts it in time/stare
PARTS = ["time/generation", "time/tools", "time/forward", "time/stare", "time/theory", "time/backward"]


def breakdown(run_dir: Path) -> str:
    rows = read_metrics(run_dir)[1:]
    step = sum(r["time/step"] for r in rows) / len(rows)
    lines = [
        f"### {run_dir.name} ({len(rows)} steps after the first)",
        "",
        "| part | s / step | share |",
        "|---|---:|---:|",
    ]
    covered = 0.0
    for part in PARTS:
        mean = sum(r.get(part) or 0.0 for r in rows) / len(rows)
        covered += mean
        lines.append(f"| {part.removeprefix('time/')} | {mean:.3f} | {100 * mean / step:.2f}% |")
    lines.append(f"| other | {step - covered:.3f} | {100 * (step - covered) / step:.2f}% |")
    lines.append(f"| **step** | {step:.3f} | 100% |")
    gen = sum(r["perf/generation_tokens_per_s"] for r in rows) / len(rows)
    train = [r["perf/train_tokens_per_s"] for r in rows if r.get("perf/train_tokens_per_s")]
    lines += [
        "",
        f"generation: {gen:,.0f} sampled tokens/s; training (old-log-prob pass + STARE + update): "
        f"{sum(train) / len(train):,.0f} tokens/s",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    for folder in argv if argv is not None else sys.argv[1:]:
        print(breakdown(Path(folder)))


if __name__ == "__main__":
    main()
