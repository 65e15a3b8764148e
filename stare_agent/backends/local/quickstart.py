"""`stare-agent quickstart`: the whole pipeline on a CPU in one command, from nothing.

1. synthetic tool tasks: SFT transcripts (code really run in the sandbox), RL prompts, test problems;
2. a tiny model: a tokenizer trained on that text and a random Qwen2;
3. SFT on the transcripts;
4. RL twice from the same SFT checkpoint for the same steps: GRPO-ds (stare.enabled=false) and STARE;
5. evaluation of the SFT, GRPO-ds and STARE models on the held-out test problems;
6. plots of both RL runs on shared axes and a summary (summary.md, summary.json).
Every stage writes its own run folder (with its resolved config.yaml) inside the quickstart folder.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from stare_agent import plots
from stare_agent.backends.local import evaluate, rl, sft
from stare_agent.backends.local.common import read_metrics
from stare_agent.config import QuickstartConfig, RunConfig, run_path, save_config
from stare_agent.data import write_records
from stare_agent.models import build_tiny_model, tiny_corpus
from stare_agent.runtime import make_client
from stare_agent.stare import StareConfig
from stare_agent.stats import bootstrap_interval, problem_accuracy
from stare_agent.step import regime_of
from stare_agent.tasks import generate_tasks, make_sft_rows
from stare_agent.theory import REGIMES

# --- numbers from an RL run's metrics rows: the summary below, benchmarks/rl_experiment.py and
# benchmarks/rl_diagnostics.py all report them through these, so a number means the same in each.


def logged(rows: list[dict[str, Any]], key: str) -> list[Any]:
    """The values of `key` over the steps, skipping steps where it is missing or null (undefined that step)."""
    return [r[key] for r in rows if r.get(key) is not None]


def final_window(rows: list[dict[str, Any]], key: str, fraction: float = 0.25) -> list[float]:
    """The logged values of `key` in the last `fraction` of the steps that have it."""
    values = logged(rows, key)
    return values[-max(1, int(len(values) * fraction)) :] if values else []


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def spread(values: list[float]) -> dict[str, Any]:
    """n, min, median and max of `values` (the statistics None when there are none)."""
    if not values:
        return {"n": 0, "min": None, "median": None, "max": None}
    return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values)}


def regime_counts(rows: list[dict[str, Any]]) -> dict[str, int] | None:
    """Steps in each theory/regime (theory.REGIMES, then any other value logged); None for a run that logged
    no regime (one from before the metric), so that it reads as unknown rather than as zero steps."""
    counts = Counter(regime_of(r) for r in rows)
    if set(counts) == {None}:
        return None
    return {name: counts.pop(name, 0) for name in REGIMES} | {str(k): n for k, n in counts.items()}


def run_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers the quickstart summary and benchmarks/rl_experiment.py report for one RL run's metrics rows.

    W* (`critical_weight`) and proxy precision are n/min/median/max over the steps where they are defined
    (null elsewhere): a median over the other steps would mix in values that are not thresholds on W.
    """
    entropy = logged(rows, "stare/entropy_mean")
    tail = final_window(rows, "stare/entropy_mean")
    return {
        "steps": len(rows),
        "entropy_first": entropy[0] if entropy else None,
        "entropy_first5_mean": mean(entropy[:5]),
        "final_window_steps": len(tail),
        "entropy_final_window_mean": mean(tail),
        "entropy_final_window_min": min(tail, default=None),
        "entropy_final_window_max": max(tail, default=None),
        "rollout_accuracy_final_window": mean(final_window(rows, "rollout/accuracy")),
        "regimes": regime_counts(rows),
        "critical_weight": spread(logged(rows, "theory/critical_weight")),
        "proxy_precision": spread(logged(rows, "theory/proxy_precision")),
        "gate_fraction": mean(logged(rows, "stare/gate")),
        "groups_dropped": sum(
            (r.get("rollout/groups_dropped_equal") or 0) + (r.get("rollout/groups_dropped_sandbox") or 0) for r in rows
        ),
        "step_seconds_mean": mean(logged(rows, "time/step")),
        "stare_seconds_share": _share(rows),
    }


def make_data(config: QuickstartConfig, run_dir: Path) -> dict[str, Path]:
    tasks, seed = config.tasks, config.run.seed
    common = {"difficulty": tasks.difficulty, "families": tasks.families or None}
    sft_problems = generate_tasks(tasks.sft_examples, seed=seed, split="train", **common)
    rl_problems = generate_tasks(tasks.rl_prompts, seed=seed + 1, split="train", **common)
    test_problems = generate_tasks(tasks.test_problems, seed=seed, split="test", **common)

    async def transcripts() -> list[dict[str, Any]]:
        client = make_client(config.rl.sandbox)
        try:
            await client.start()
            save_config(config, run_dir)  # the run starts once the sandbox answers
            return await make_sft_rows(
                sft_problems,
                client,
                seed=seed,
                error_fraction=tasks.error_fraction,
                styles=tasks.solution_styles,
                system_prompt=config.rl.agent.system_prompt,
                output_max_chars=config.rl.agent.output_max_chars,
            )
        finally:
            await client.close()

    def prompts(problems):
        return [{"id": p.id, "problem": p.problem, "answer": p.answer, "meta": p.meta} for p in problems]

    data_dir = run_dir / "data"
    return {
        "sft": write_records(data_dir / "sft.jsonl", asyncio.run(transcripts())),
        "rl": write_records(data_dir / "rl_train.jsonl", prompts(rl_problems)),
        "test": write_records(data_dir / "test.jsonl", prompts(test_problems)),
    }


def run(config: QuickstartConfig) -> Path:
    run_dir = run_path(config.run, "quickstart")
    seed = config.run.seed
    timings: dict[str, float] = {}

    def stage_run(name: str) -> RunConfig:
        return RunConfig(output_dir=str(run_dir), name=name, seed=seed)

    started = time.perf_counter()
    print("quickstart 1/5: synthetic tasks and SFT transcripts (code run in the sandbox)")
    files = make_data(config, run_dir)
    timings["data"] = time.perf_counter() - started

    started = time.perf_counter()
    print("quickstart 2/5: tiny model and tokenizer")
    corpus = tiny_corpus() + [
        m["content"] for line in files["sft"].read_text().splitlines() for m in json.loads(line)["messages"]
    ]
    model_dir = build_tiny_model(run_dir / "model", corpus, **asdict(config.model), seed=seed)
    timings["model"] = time.perf_counter() - started

    started = time.perf_counter()
    print("quickstart 3/5: SFT")
    sft_config = replace(
        config.sft,
        run=stage_run("sft"),
        model=replace(config.sft.model, path=str(model_dir)),
        data=replace(config.sft.data, train_file=str(files["sft"])),
    )
    models = {"sft": sft.run(sft_config)}
    timings["sft"] = time.perf_counter() - started

    stare_name = f"stare-{config.rl.stare.op if isinstance(config.rl.stare.op, str) else 'custom'}"
    variants = {"grpo-ds": replace(config.rl.stare, enabled=False), stare_name: config.rl.stare}
    for i, (name, stare) in enumerate(variants.items()):
        started = time.perf_counter()
        print(f"quickstart 4/5: RL {i + 1}/2: {name}, {config.rl.steps} steps from the SFT checkpoint")
        rl_config = replace(
            config.rl,
            run=stage_run(f"rl-{name}"),
            model=replace(config.rl.model, path=str(models["sft"])),
            data=replace(config.rl.data, train_file=str(files["rl"])),
            stare=stare,
        )
        models[name] = rl.run(rl_config)
        timings[f"rl-{name}"] = time.perf_counter() - started

    results = {}
    for name, path in models.items():
        started = time.perf_counter()
        print(f"quickstart 5/5: evaluating {name} on {config.tasks.test_problems} held-out problems")
        eval_config = replace(
            config.eval,
            run=stage_run(f"eval-{name}"),
            model=replace(config.eval.model, path=str(path)),
            files=[str(files["test"])],
        )
        report = evaluate.run(eval_config)[0]
        results[name] = {"avg@k": report.avg_at_k, "pass@k": report.pass_at, "k": report.samples_per_problem}
        per_problem = [problem_accuracy(p.rewards) for p in report.results if p.rewards]
        results[name]["avg@k_ci95"] = list(bootstrap_interval(per_problem)) if per_problem else None
        results[name]["mean_tool_calls"] = report.mean_tool_calls
        results[name]["mean_response_length"] = report.mean_response_length
        timings[f"eval-{name}"] = time.perf_counter() - started

    runs = {f"rl-{name}": read_metrics(run_dir / f"rl-{name}") for name in variants}
    figures = plots.plot_runs(runs, run_dir / "plots", target_entropy=config.rl.stare.target_entropy)
    summary = make_summary(config, runs, results, timings, models, figures, stare_name)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "summary.md").write_text(summary_markdown(summary))
    print((run_dir / "summary.md").read_text())
    print(f"quickstart: everything is in {run_dir} (summary.md, plots/, data/, model/, sft/, rl-*/, eval-*/)")
    return run_dir


def make_summary(config, runs, results, timings, models, figures, stare_name) -> dict[str, Any]:
    """summary.json: every number in it is computed from this quickstart's metrics, evals and timers."""
    stare = config.rl.stare
    return {
        "stare_settings": {
            "op": stare.op,
            "top_ratio": stare.top_ratio,
            "w": stare.w,
            "target_entropy": stare.target_entropy,
            "gate": stare.gate,
            "measured": settings_note(stare, runs["rl-grpo-ds"], runs[f"rl-{stare_name}"]),
        },
        "rl": {name: run_summary(rows) for name, rows in runs.items()},
        "eval": results,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "total_s": round(sum(timings.values()), 1),
        "models": {k: str(v) for k, v in models.items()},
        "plots": [str(p) for p in figures],
        "stare_run": f"rl-{stare_name}",
    }


def settings_note(stare: StareConfig, baseline: list[dict[str, Any]], controlled: list[dict[str, Any]]) -> str:
    """What this run measured about the STARE settings, from the metrics rows of its two RL runs.

    baseline is the GRPO-ds run: its theory/* diagnostics use stare.top_ratio as P without changing the
    trajectory, so they show what STARE faces; controlled is the STARE run (its gate duty and entropy).
    """
    b, c = run_summary(baseline), run_summary(controlled)
    w_star = logged(baseline, "theory/critical_weight")
    return "\n".join(
        [
            f"Settings: op {stare.op}, gate {stare.gate}, P = {stare.top_ratio}, W = {stare.w}, "
            f"H_tgt = {stare.target_entropy}. How they were chosen: docs/quickstart.md, section 'Choosing the "
            "STARE settings by measurement'. What this run measured about them, from the GRPO-ds run's theory/* "
            f"diagnostics at P = {stare.top_ratio} ({b['steps']} steps) and from the STARE run:",
            "",
            "- P: proxy precision (share of high+ tokens above their critical surprisal s*) "
            f"{spread_text(b['proxy_precision'])}. Steps per regime: {regimes_text(b['regimes'])}. A W > W* raises "
            "first-order entropy only on needs_w steps; on rising steps it rises without help, on no_w_helps "
            "steps no W > 1 raises it.",
            f"- W: W* = 1 + Lambda/Gamma is defined (Gamma > 0, Lambda >= 0) on {len(w_star)} of {b['steps']} "
            f"steps: {spread_text(b['critical_weight'])}; W = {stare.w} exceeds it on "
            f"{sum(stare.w > x for x in w_star)} of them.",
            f"- H_tgt: GRPO-ds entropy {_fmt(b['entropy_first'])} at step 1 and "
            f"{_fmt(b['entropy_final_window_mean'])} over its last {b['final_window_steps']} of {b['steps']} "
            f"steps; STARE {_fmt(c['entropy_first'])} and {_fmt(c['entropy_final_window_mean'])}, with the gate on "
            f"(mean of stare/gate over steps) {_fmt(c['gate_fraction'], 2)}.",
        ]
    )


def regimes_text(counts: dict[str, int] | None) -> str:
    """'rising 0, needs_w 38, ...' from regime_counts."""
    if counts is None:
        return "not logged (a run from before theory/regime)"
    return ", ".join(f"{name} {n}" for name, n in counts.items())


def spread_text(s: dict[str, Any]) -> str:
    """'0.08-0.24 (median 0.16 over 40 steps)' from spread."""
    if not s["n"]:
        return "undefined on every step"
    return f"{_fmt(s['min'], 2)}-{_fmt(s['max'], 2)} (median {_fmt(s['median'], 2)} over {s['n']} steps)"


def _share(rows: list[dict[str, Any]]) -> float | None:
    stare = sum(r.get("time/stare") or 0.0 for r in rows)
    total = sum(r.get("time/step") or 0.0 for r in rows)
    return stare / total if total else None


def _fmt(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def summary_markdown(s: dict[str, Any]) -> str:
    st = s["stare_settings"]
    lines = [
        "# Quickstart summary",
        "",
        f"Total {s['total_s']:.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in s["timings_s"].items()) + ".",
        "",
        "## RL: GRPO-ds vs STARE (same SFT checkpoint, same steps)",
        "",
        f"STARE: op {st['op']}, P = {st['top_ratio']}, W = {st['w']}, H_tgt = {st['target_entropy']}, "
        f"gate {st['gate']}.",
        "",
        "| run | entropy at start | final-window mean entropy [min, max] | rollout accuracy (final window) "
        "| median W* (defined steps) | median proxy precision | gate on (share of steps) | STARE share of step time "
        "| " + " | ".join(REGIMES) + " |",
        "|---|" + "---:|" * (7 + len(REGIMES)),
    ]
    for name, r in s["rl"].items():
        w_star, share = r["critical_weight"], r["stare_seconds_share"]
        regimes = r["regimes"] or {}
        lines.append(
            f"| {name} | {_fmt(r['entropy_first'])} | {_fmt(r['entropy_final_window_mean'])} "
            f"[{_fmt(r['entropy_final_window_min'])}, {_fmt(r['entropy_final_window_max'])}] "
            f"| {_fmt(r['rollout_accuracy_final_window'])} | {_fmt(w_star['median'], 2)} ({w_star['n']}/{r['steps']}) "
            f"| {_fmt(r['proxy_precision']['median'], 2)} | {_fmt(r['gate_fraction'], 2)} "
            f"| {_fmt(share * 100 if share is not None else None, 2)}% | "
            + " | ".join(_fmt(regimes.get(name)) for name in REGIMES)
            + " |"
        )
    lines += [
        "",
        "Final window: "
        + "; ".join(sorted({f"the last {r['final_window_steps']} of {r['steps']} steps" for r in s["rl"].values()}))
        + ". W* is a median "
        "over the steps where it is defined (needs_w); the regime columns count steps.",
        "",
        "## Evaluation on held-out synthetic problems",
        "",
        "| model | k | avg@k [95% bootstrap interval over problems] | pass@1 | pass@k | tool calls / episode "
        "| response tokens |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in s["eval"].items():
        k, ci = r["k"], r.get("avg@k_ci95")
        interval = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
        lines.append(
            f"| {name} | {k} | {_fmt(r['avg@k'])}{interval} | {_fmt(r['pass@k'].get(1))} | {_fmt(r['pass@k'].get(k))} "
            f"| {_fmt(r['mean_tool_calls'], 2)} | {_fmt(r['mean_response_length'], 1)} |"
        )
    lines += [
        "",
        "A difference between two models smaller than their intervals is not shown by this evaluation: see "
        "docs/experiments.md for the comparison over RL seeds on 256 problems (`stare-agent experiment`).",
    ]
    lines += ["", "## The STARE settings, measured on this run", "", st["measured"], "", "## Files", ""]
    lines += [f"- {name}: `{path}`" for name, path in s["models"].items()]
    lines += [f"- plot: `{p}`" for p in s["plots"]]
    return "\n".join(lines) + "\n"
