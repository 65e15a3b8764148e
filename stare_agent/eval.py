"""Tool-integrated evaluation: every problem k times through the agent loop, scored as avg@k and pass@k.

The same episode loop as RL (`agent.run_batch`) runs each benchmark problem k times; sampling
(temperature, top-p) belongs to `generate_batch`. A report per benchmark holds avg@k (mean reward
of the k samples, averaged over problems) and the unbiased pass@k of Chen et al. (2021) for k = 1,
2, 4, ... up to k. No training framework is imported: any batch generator and any sandbox client
that fits `agent.ToolClient` will do.

Samples the sandbox failed on (finish_reason "sandbox_error", reward None) are not wrong answers:
they are left out of the scores and counted (see `evaluate`).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from tqdm.auto import tqdm

from stare_agent.agent import AgentConfig, EpisodeResult, GenerateBatch, ToolClient, run_batch
from stare_agent.data import Problem

# Samples per problem in the paper's evaluation: 32 on the small competition sets, 4 on the large ones;
# sampled at temperature 0.7, top-p 0.95 (the generator's settings, not this module's).
PAPER_SETTINGS = {"aime24": 32, "aime25": 32, "amc23": 32, "math500": 4, "minerva_math": 4, "olympiadbench": 4}
PAPER_TEMPERATURE = 0.7
PAPER_TOP_P = 0.95


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the binomials (they overflow
    floats for n in the hundreds).
    """
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"need n >= 1 and 0 <= c <= n; got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}]; got k={k} (pass@k needs at least k samples)")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def avg_at_k(rewards: Sequence[float]) -> float:
    """Mean reward over the samples of one problem (avg@k when there are k of them)."""
    if not rewards:
        raise ValueError("avg@k of no samples is undefined")
    return sum(rewards) / len(rewards)


def pass_ks(k: int) -> list[int]:
    """The k's pass@ is reported for: 1, 2, 4, ... up to k, and k itself."""
    ks = [2**i for i in range(k.bit_length()) if 2**i <= k]
    return ks if ks[-1] == k else ks + [k]


@dataclass
class ProblemResult:
    """The k samples of one problem. `rewards` holds the scoreable samples only; the other lists hold every
    sample, in sample order."""

    problem_id: str
    answer: str
    """Gold answer."""
    rewards: list[float]
    """1.0/0.0 per scoreable sample; samples that ended in sandbox_error are left out."""
    predictions: list[str | None]
    """The model's extracted final answer per sample (None: it gave none)."""
    finish_reasons: list[str]
    tool_calls: list[int]
    response_lengths: list[int]
    """Response tokens per sample (sampled and observation tokens)."""
    sandbox_errors: int = 0
    """Samples that ended in sandbox_error."""
    programs: list[list[str]] = field(default_factory=list)
    """The code of each tool call the sample ran, per sample: what a study of program diversity reads."""


@dataclass
class BenchmarkReport:
    name: str
    problems: int
    """Problems evaluated, unscored ones included."""
    samples_per_problem: int
    avg_at_k: float
    """Mean over scored problems of avg@k, in [0, 1]; 0.0 when no problem could be scored."""
    pass_at: dict[int, float]
    """pass@k per k in pass_ks(samples_per_problem), over the problems with at least k scoreable samples;
    a k no problem reaches is absent."""
    mean_response_length: float
    """Over scoreable samples (sandbox errors cut episodes short); 0.0 when there are none."""
    mean_tool_calls: float
    """Tool calls per episode, over scoreable samples."""
    finish_reasons: dict[str, int]
    """Count per finish reason over every sample, sandbox_error included."""
    sandbox_errors: int
    """Samples that ended in sandbox_error (not scored)."""
    unscored_problems: int = 0
    """Problems whose every sample ended in sandbox_error: left out of avg@k and pass@k."""
    seconds: float = 0.0
    """Wall-clock time of the evaluation."""
    results: list[ProblemResult] = field(default_factory=list, repr=False)
    """Per-problem results, in problem order (written to {name}.json, not to results.json)."""


def _problem_result(problem: Problem, episodes: Sequence[EpisodeResult]) -> ProblemResult:
    return ProblemResult(
        problem_id=problem.id,
        answer=problem.answer,
        rewards=[e.reward for e in episodes if e.reward is not None],
        predictions=[e.answer for e in episodes],
        finish_reasons=[e.finish_reason for e in episodes],
        tool_calls=[e.tool_calls for e in episodes],
        response_lengths=[e.response_len for e in episodes],
        sandbox_errors=sum(e.finish_reason == "sandbox_error" for e in episodes),
        programs=[[t.code for t in e.turns if t.code is not None] for e in episodes],
    )


def _correct(rewards: Sequence[float]) -> int:
    return sum(reward >= 1.0 for reward in rewards)  # correct = full reward (rewards are 1.0 or 0.0)


def _report(name: str, k: int, results: list[ProblemResult], seconds: float) -> BenchmarkReport:
    scored = [r for r in results if r.rewards]
    pass_at = {}
    for j in pass_ks(k):
        # a problem with fewer than j scoreable samples has no unbiased pass@j estimate
        values = [pass_at_k(len(r.rewards), _correct(r.rewards), j) for r in scored if len(r.rewards) >= j]
        if values:
            pass_at[j] = sum(values) / len(values)
    lengths, calls = [], []
    for r in results:
        for reason, length, n_calls in zip(r.finish_reasons, r.response_lengths, r.tool_calls, strict=True):
            if reason != "sandbox_error":
                lengths.append(length)
                calls.append(n_calls)
    return BenchmarkReport(
        name=name,
        problems=len(results),
        samples_per_problem=k,
        avg_at_k=sum(avg_at_k(r.rewards) for r in scored) / len(scored) if scored else 0.0,
        pass_at=pass_at,
        mean_response_length=sum(lengths) / len(lengths) if lengths else 0.0,
        mean_tool_calls=sum(calls) / len(calls) if calls else 0.0,
        finish_reasons=dict(Counter(reason for r in results for reason in r.finish_reasons)),
        sandbox_errors=sum(r.sandbox_errors for r in results),
        unscored_problems=len(results) - len(scored),
        seconds=seconds,
        results=results,
    )


def _transcript(problem: Problem, episode: EpisodeResult) -> dict[str, Any]:
    return {
        "problem_id": problem.id,
        "problem": problem.problem,
        "gold": problem.answer,
        "response_text": episode.response_text,
        "answer": episode.answer,
        "reward": episode.reward,
        "finish_reason": episode.finish_reason,
        "sandbox_error": episode.sandbox_error,
        "turns": [{"code": t.code, "status": t.status, "output": t.output} for t in episode.turns],
    }


def _summary(report: BenchmarkReport) -> dict[str, Any]:
    summary = asdict(report)
    del summary["results"]
    return summary


async def evaluate(
    problems: Sequence[Problem],
    *,
    name: str,
    k: int,
    tokenizer: Any,
    generate_batch: GenerateBatch,
    client: ToolClient,
    agent_config: AgentConfig | None = None,
    batch_size: int = 64,
    transcripts: int = 8,
    out_dir: str | Path | None = None,
    progress: bool = False,
) -> BenchmarkReport:
    """Run every problem k times through the agent loop and score the benchmark.

    Episodes go to `run_batch` in chunks of at most `batch_size`; a problem's k samples stay together
    (whole problems per chunk when k <= batch_size). With `out_dir`, writes `{name}.json` (the report
    and per-problem results) and `{name}_transcripts.jsonl` (the first sample of the first
    `transcripts` problems).

    Sandbox failures are not scored as wrong: a sample that ended in sandbox_error is left out of its
    problem's rewards and counted in `sandbox_errors`, so a problem is scored on its n <= k scoreable
    samples. A problem with none is left out of avg@k and pass@k and counted in `unscored_problems`.
    pass@j averages only the problems with n >= j (the estimator needs j samples); avg@k uses every
    scored problem.
    """
    if k < 1 or batch_size < 1 or transcripts < 0:
        raise ValueError(f"need k >= 1, batch_size >= 1, transcripts >= 0; got {k}, {batch_size}, {transcripts}")
    started = time.perf_counter()
    episodes = [problem for problem in problems for _ in range(k)]  # problem i's samples at [i*k, (i+1)*k)
    step = (batch_size // k) * k or batch_size
    results: list[EpisodeResult] = []
    with tqdm(total=len(episodes), desc=name, unit="episode", disable=not progress) as bar:
        for start in range(0, len(episodes), step):
            chunk = episodes[start : start + step]
            results += await run_batch(
                chunk, tokenizer=tokenizer, generate_batch=generate_batch, client=client, config=agent_config
            )
            bar.update(len(chunk))
    per_problem = [results[i * k : (i + 1) * k] for i in range(len(problems))]
    report = _report(
        name,
        k,
        [_problem_result(p, eps) for p, eps in zip(problems, per_problem, strict=True)],
        time.perf_counter() - started,
    )
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        record = {"report": _summary(report), "problems": [asdict(r) for r in report.results]}
        (out / f"{name}.json").write_text(json.dumps(record, indent=2, ensure_ascii=False), encoding="utf-8")
        with (out / f"{name}_transcripts.jsonl").open("w", encoding="utf-8") as f:
            for problem, eps in list(zip(problems, per_problem, strict=True))[:transcripts]:
                f.write(json.dumps(_transcript(problem, eps[0]), ensure_ascii=False) + "\n")
    return report


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def write_reports(reports: Sequence[BenchmarkReport], out_dir: str | Path) -> None:
    """results.json (every report, without per-problem results) and results.md (one table row per benchmark)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = [_summary(r) for r in reports]
    (out / "results.json").write_text(json.dumps(summaries, indent=2, ensure_ascii=False), encoding="utf-8")
    lines = [
        "avg@k and pass@k in percent; samples that ended in a sandbox error are not scored.",
        "",
        "| benchmark | problems | k | avg@k | pass@1 | pass@k | mean length | tool calls/episode | sandbox errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in reports:
        k = r.samples_per_problem
        lines.append(
            f"| {r.name} | {r.problems} | {k} | {_percent(r.avg_at_k)} | {_percent(r.pass_at.get(1))} | "
            f"{_percent(r.pass_at.get(k))} | {r.mean_response_length:.1f} | {r.mean_tool_calls:.2f} | "
            f"{r.sandbox_errors} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


# --- every snapshot of a run on one validation set (`stare-agent eval snapshots=RUN`) --------------------------------

Select = Literal["avg@k", "pass@k"]
"""The metrics a best snapshot can be named by; pass@k is pass@ the set's samples per problem. (pass@1 is avg@k:
with rewards of 0 or 1 both are the mean share of correct samples.)"""


@dataclass
class SnapshotScore:
    """One snapshot's evaluation on the validation set."""

    step: int
    path: str
    report: BenchmarkReport


def selected_value(report: BenchmarkReport, select: Select) -> float | None:
    """The report's value of `select`; None when it has none (no problem scored, or none with k scoreable samples)."""
    if select == "avg@k":
        return report.avg_at_k if report.unscored_problems < report.problems else None
    return report.pass_at.get(report.samples_per_problem)


def best_snapshot(scores: Sequence[SnapshotScore], select: Select) -> SnapshotScore | None:
    """The snapshot with the highest `select`; a tie goes to the earliest step (the fewest updates for the same
    score). None when no snapshot has a value."""
    valued = [s for s in scores if selected_value(s.report, select) is not None]
    return max(valued, key=lambda s: (selected_value(s.report, select), -s.step), default=None)


def write_snapshot_reports(
    scores: Sequence[SnapshotScore], select: Select, out_dir: str | Path
) -> SnapshotScore | None:
    """snapshots.json and snapshots.md (one row per snapshot, by step, the best named) and snapshots.png (avg@k and
    pass@k against the step, the best marked); returns the best (best_snapshot)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    scores = sorted(scores, key=lambda s: s.step)
    best = best_snapshot(scores, select)
    name = scores[0].report.name if scores else ""
    named = best and {"step": best.step, "path": best.path, select: selected_value(best.report, select)}
    record = {
        "set": name,
        "select": select,
        "best": named,
        "snapshots": [
            {"step": s.step, "path": s.path, select: selected_value(s.report, select), **_summary(s.report)}
            for s in scores
        ],
    }
    (out / "snapshots.json").write_text(json.dumps(record, indent=2, ensure_ascii=False), encoding="utf-8")
    verdict = "no snapshot has a value" if best is None else f"the best is step {best.step} ({best.path})"
    lines = [
        f"Every snapshot on {name}, best by {select}: {verdict}. avg@k and pass@k in percent; samples that ended in a "
        "sandbox error are not scored.",
        "",
        "| step | snapshot | problems | k | avg@k | pass@1 | pass@k | sandbox errors | best |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in scores:
        r, k = s.report, s.report.samples_per_problem
        lines.append(
            f"| {s.step} | {s.path} | {r.problems} | {k} | {_percent(selected_value(r, 'avg@k'))} | "
            f"{_percent(r.pass_at.get(1))} | {_percent(r.pass_at.get(k))} | {r.sandbox_errors} | "
            f"{'best' if s is best else ''} |"
        )
    (out / "snapshots.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    _plot_snapshots(scores, select, best, out / "snapshots.png")
    return best


def _plot_snapshots(scores: Sequence[SnapshotScore], select: Select, best: SnapshotScore | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    steps = [s.step for s in scores]
    k_above_1 = any(s.report.samples_per_problem > 1 for s in scores)  # pass@1 is avg@k
    for metric in ("avg@k", "pass@k") if k_above_1 else ("avg@k",):
        values = [selected_value(s.report, metric) for s in scores]
        points = [(step, 100 * v) for step, v in zip(steps, values, strict=True) if v is not None]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=metric, linewidth=2.2 if metric == select else 1.0)
    if best is not None:
        value = 100 * selected_value(best.report, select)
        ax.plot(
            [best.step], [value], marker="*", markersize=16, color="black", linestyle="none", label=f"best by {select}"
        )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel("accuracy on the validation set (%)")
    ax.set_title(f"every snapshot on {scores[0].report.name}" if scores else "no snapshots")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
