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
from dataclasses import replace
from pathlib import Path
from typing import Any

from stare_agent import plots
from stare_agent.backends.local import evaluate, rl, sft
from stare_agent.backends.local.common import make_client, read_metrics
from stare_agent.config import QuickstartConfig, RunConfig, make_run_dir, save_config
from stare_agent.data import write_records
from stare_agent.models import build_tiny_model, tiny_corpus
from stare_agent.tasks import generate_tasks, make_sft_rows

# Why the quickstart's STARE settings are what they are; written into the summary. The numbers come
# from the measurements in docs/quickstart.md (re-measure there when the task or model changes).
SETTINGS_NOTE = """\
STARE settings were chosen by measurement on this task, not copied from the paper's 7B runs
(docs/quickstart.md has the measurements):
- op O1 with the batch gate: the paper's main variant.
- P = 0.02, not 0.1: after SFT the tiny model is confident (entropy 0.1-0.17 nats on its own
  rollouts) and most positive-advantage tokens have low surprisal. At P = 0.1 only 8-24% of
  the selected high+ tokens were above their critical surprisal s*, Gamma < 0 on every step,
  and amplifying them would lower entropy; at P = 0.02 the proxy precision was 0.5-0.97 and
  Gamma > 0.
- W = 3: the critical weight W* = 1 + Lambda/Gamma measured at P = 0.02 had a median of 3-4
  (range about 1.7-20), far above the paper's ~1.1 because responses are short; W must
  exceed W* for the gate to push entropy up.
- H_tgt = 0.14 nats: where rollouts of the SFT model sit during the first RL steps (0.136, mean
  of steps 1-5 of a measured GRPO-ds run); GRPO-ds then drifts lower (0.115 over the last quarter
  of 36 steps), so the gate engages whenever entropy falls below where RL started. (This run's
  GRPO-ds started at {start:.2f}.)
"""


def _window(rows: list[dict[str, Any]], key: str, fraction: float = 0.25) -> list[float]:
    """The logged values of `key` in the last `fraction` of the steps that have it."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return values[-max(1, int(len(values) * fraction)) :] if values else []


def _window_mean(rows: list[dict[str, Any]], key: str, fraction: float = 0.25) -> float | None:
    tail = _window(rows, key, fraction)
    return sum(tail) / len(tail) if tail else None


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _make_data(config: QuickstartConfig, data_dir: Path) -> dict[str, Path]:
    tasks, seed = config.tasks, config.run.seed
    common = {"difficulty": tasks.difficulty, "families": tasks.families or None}
    sft_problems = generate_tasks(tasks.sft_examples, seed=seed, split="train", **common)
    rl_problems = generate_tasks(tasks.rl_prompts, seed=seed + 1, split="train", **common)
    test_problems = generate_tasks(tasks.test_problems, seed=seed, split="test", **common)

    async def transcripts() -> list[dict[str, Any]]:
        client = make_client(config.rl.sandbox)
        await client.start()
        try:
            return await make_sft_rows(
                sft_problems,
                client,
                seed=seed,
                error_fraction=tasks.error_fraction,
                system_prompt=config.rl.agent.system_prompt,
                output_max_chars=config.rl.agent.output_max_chars,
            )
        finally:
            await client.close()

    def prompts(problems):
        return [{"id": p.id, "problem": p.problem, "answer": p.answer, "meta": p.meta} for p in problems]

    return {
        "sft": write_records(data_dir / "sft.jsonl", asyncio.run(transcripts())),
        "rl": write_records(data_dir / "rl_train.jsonl", prompts(rl_problems)),
        "test": write_records(data_dir / "test.jsonl", prompts(test_problems)),
    }


def run(config: QuickstartConfig) -> Path:
    run_dir = make_run_dir(config.run, "quickstart")
    save_config(config, run_dir)
    seed = config.run.seed
    timings: dict[str, float] = {}

    def stage_run(name: str) -> RunConfig:
        return RunConfig(output_dir=str(run_dir), name=name, seed=seed)

    started = time.perf_counter()
    print("quickstart 1/5: synthetic tasks and SFT transcripts (code run in the sandbox)")
    files = _make_data(config, run_dir / "data")
    timings["data"] = time.perf_counter() - started

    started = time.perf_counter()
    print("quickstart 2/5: tiny model and tokenizer")
    corpus = tiny_corpus() + [
        m["content"] for line in files["sft"].read_text().splitlines() for m in json.loads(line)["messages"]
    ]
    m = config.model
    model_dir = build_tiny_model(
        run_dir / "model",
        corpus,
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        intermediate_size=m.intermediate_size,
        seed=seed,
    )
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
        results[name]["mean_tool_calls"] = report.mean_tool_calls
        results[name]["mean_response_length"] = report.mean_response_length
        timings[f"eval-{name}"] = time.perf_counter() - started

    runs = {f"rl-{name}": read_metrics(run_dir / f"rl-{name}") for name in variants}
    figures = plots.plot_runs(runs, run_dir / "plots", target_entropy=config.rl.stare.target_entropy)
    summary = _summary(config, runs, results, timings, models, figures, stare_name)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "summary.md").write_text(_summary_markdown(summary))
    print((run_dir / "summary.md").read_text())
    print(f"quickstart: everything is in {run_dir} (summary.md, plots/, data/, model/, sft/, rl-*/, eval-*/)")
    return run_dir


def _summary(config, runs, results, timings, models, figures, stare_name) -> dict[str, Any]:
    rl_runs = {}
    for name, rows in runs.items():
        rl_runs[name] = {
            "entropy_first": next((r["stare/entropy_mean"] for r in rows if r.get("stare/entropy_mean")), None),
            "entropy_final_window_mean": _window_mean(rows, "stare/entropy_mean"),
            "entropy_final_window_min": min(_window(rows, "stare/entropy_mean"), default=None),
            "entropy_final_window_max": max(_window(rows, "stare/entropy_mean"), default=None),
            "rollout_accuracy_final_window": _window_mean(rows, "rollout/accuracy"),
            "critical_weight_median": _median(rows, "theory/critical_weight"),
            "proxy_precision_median": _median(rows, "theory/proxy_precision"),
            "gate_fraction": _window_mean(rows, "stare/gate", fraction=1.0),
            "groups_dropped": sum(
                (r.get("rollout/groups_dropped_equal") or 0) + (r.get("rollout/groups_dropped_sandbox") or 0)
                for r in rows
            ),
            "step_seconds_mean": _window_mean(rows, "time/step", fraction=1.0),
            "stare_seconds_share": _share(rows),
        }
    stare = config.rl.stare
    start = rl_runs["rl-grpo-ds"]["entropy_first"] or float("nan")
    return {
        "stare_settings": {
            "op": stare.op,
            "top_ratio": stare.top_ratio,
            "w": stare.w,
            "target_entropy": stare.target_entropy,
            "gate": stare.gate,
            "why": SETTINGS_NOTE.format(start=start),
        },
        "rl": rl_runs,
        "eval": results,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "total_s": round(sum(timings.values()), 1),
        "models": {k: str(v) for k, v in models.items()},
        "plots": [str(p) for p in figures],
        "stare_run": f"rl-{stare_name}",
    }


def _share(rows: list[dict[str, Any]]) -> float | None:
    stare = sum(r.get("time/stare") or 0.0 for r in rows)
    total = sum(r.get("time/step") or 0.0 for r in rows)
    return stare / total if total else None


def _fmt(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _summary_markdown(s: dict[str, Any]) -> str:
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
        "| median W* | median proxy precision | gate on (share of steps) | STARE share of step time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in s["rl"].items():
        lines.append(
            f"| {name} | {_fmt(r['entropy_first'])} | {_fmt(r['entropy_final_window_mean'])} "
            f"[{_fmt(r['entropy_final_window_min'])}, {_fmt(r['entropy_final_window_max'])}] "
            f"| {_fmt(r['rollout_accuracy_final_window'])} | {_fmt(r['critical_weight_median'], 2)} "
            f"| {_fmt(r['proxy_precision_median'], 2)} | {_fmt(r['gate_fraction'], 2)} "
            f"| {_fmt(r['stare_seconds_share'] * 100 if r['stare_seconds_share'] is not None else None, 2)}% |"
        )
    lines += [
        "",
        "## Evaluation on held-out synthetic problems",
        "",
        "| model | k | avg@k | pass@1 | pass@k | tool calls / episode | response tokens |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in s["eval"].items():
        k = r["k"]
        lines.append(
            f"| {name} | {k} | {_fmt(r['avg@k'])} | {_fmt(r['pass@k'].get(1))} | {_fmt(r['pass@k'].get(k))} "
            f"| {_fmt(r['mean_tool_calls'], 2)} | {_fmt(r['mean_response_length'], 1)} |"
        )
    lines += ["", "## Why these STARE settings", "", st["why"], "## Files", ""]
    lines += [f"- {name}: `{path}`" for name, path in s["models"].items()]
    lines += [f"- plot: `{p}`" for p in s["plots"]]
    return "\n".join(lines) + "\n"
