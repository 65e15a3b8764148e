"""The local evaluation command, the plot command and a whole (very small) quickstart, on CPU."""

from __future__ import annotations

import json

import pytest
import yaml
from tiny import TINY_QUICKSTART  # tests/tiny.py

from stare_agent.backends.local import evaluate
from stare_agent.cli import main
from stare_agent.config import EvalConfig, load_config
from stare_agent.data import write_records
from stare_agent.lab import quickstart
from stare_agent.lab.quickstart import QuickstartConfig
from stare_agent.lab.tasks import generate_tasks


def test_eval_on_a_tiny_model_writes_reports(tmp_path, tiny_model_dir):
    problems = generate_tasks(3, seed=0, split="test", difficulty=1)
    path = write_records(tmp_path / "mine.jsonl", [{"q": p.problem, "a": p.answer} for p in problems])
    config = load_config(
        EvalConfig,
        None,
        [
            f"run.output_dir={tmp_path}",
            "run.name=ev",
            f"model.path={tiny_model_dir}",
            f"files=[{path}]",
            "problem_field=q",
            "answer_field=a",
            "benchmarks=[amc23]",
            "max_problems=2",
            "k=2",
            "max_turn_tokens=16",
            "agent.max_total_tokens=700",
            "agent.tool_mode=stateless",
            "sandbox.pool_size=1",
        ],
    )
    reports = evaluate.run(config)
    assert [r.name for r in reports] == ["amc23", "mine"] and [r.problems for r in reports] == [2, 2]
    assert all(r.samples_per_problem == 2 and 0.0 <= r.avg_at_k <= 1.0 for r in reports)
    out = tmp_path / "ev"
    assert {"results.json", "results.md", "amc23.json", "mine_transcripts.jsonl", "config.yaml"} <= {
        p.name for p in out.iterdir()
    }
    assert "| mine | 2 | 2 |" in (out / "results.md").read_text()


def test_eval_without_anything_to_evaluate_says_so(capsys, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default run.output_dir is ./runs: keep it out of the checkout
    assert main(["eval", f"model.path={tiny_model_dir}"]) == 2
    assert "nothing to evaluate" in capsys.readouterr().err
    assert main(["rl", "model.path=/nonexistent", "data.train_file=x.jsonl"]) == 2


def _rl_rows(w_stars, gate=None):
    """Hand-made RL metrics rows: entropy 0.20, 0.18, ... and a W* (None = undefined) per step."""
    rows = []
    for i, w_star in enumerate(w_stars):
        rows.append(
            {
                "step": i + 1,
                "stare/entropy_mean": 0.2 - 0.02 * i,
                "rollout/accuracy": 0.1 * (i + 1),
                "theory/critical_weight": w_star,
                "theory/proxy_precision": 0.5 + 0.1 * i,
                "theory/regime": "needs_w" if w_star is not None else "no_w_helps",
                "time/step": 1.0,
                "time/stare": 0.01,
                **({} if gate is None else {"stare/gate": gate[i]}),
            }
        )
    return rows


def test_the_quickstart_summary_is_computed_from_the_run_metrics():
    config = QuickstartConfig()  # P = 0.02, W = 3
    runs = {"rl-grpo-ds": _rl_rows([2.0, None, 5.0, 1.5]), "rl-stare-O1": _rl_rows([None] * 4, gate=[0, 1, 1, 1])}
    timings = {"sft": 2.0}
    summary = quickstart.make_summary(config, runs, {}, timings, {}, [], "stare-O1")
    text = quickstart.summary_markdown(summary)
    assert summary["rl"]["rl-grpo-ds"]["regimes"] == {"rising": 0, "needs_w": 3, "no_w_helps": 1, "undefined": 0}
    # the median W* is over the 3 defined steps; W = 3 exceeds two of them
    assert "| 2.00 (3/4) |" in text and "| 0 | 3 | 1 | 0 |" in text
    assert "defined (Gamma > 0, Lambda >= 0) on 3 of 4 steps: 1.50-5.00 (median 2.00 over 3 steps)" in text
    assert "W = 3.0 exceeds it on 2 of them" in text
    assert "needs_w 3, no_w_helps 1" in text and "0.50-0.80 (median 0.65 over 4 steps)" in text
    assert "GRPO-ds entropy 0.200 at step 1 and 0.140 over its last 1 of 4 steps" in text and "gate on" in text
    assert "(mean of stare/gate over steps) 0.75" in text
    assert "P = 0.02, W = 3.0" in text

    runs["rl-grpo-ds"][1]["theory/critical_weight"] = 8.0
    changed = quickstart.summary_markdown(quickstart.make_summary(config, runs, {}, timings, {}, [], "stare-O1"))
    assert "| 3.50 (4/4) |" in changed and "on 4 of 4 steps: 1.50-8.00 (median 3.50 over 4 steps)" in changed


@pytest.mark.slow
def test_a_small_quickstart_runs_end_to_end_and_plot_redraws(tmp_path):
    overrides = [f"run.output_dir={tmp_path}", "run.name=qs", *TINY_QUICKSTART, "eval.k=1"]
    run_dir = quickstart.run(load_config(QuickstartConfig, None, overrides))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["rl"]) == {"rl-grpo-ds", "rl-stare-O1"} and set(summary["eval"]) == {
        "sft",
        "grpo-ds",
        "stare-O1",
    }
    for name in ("entropy", "reward", "accuracy", "response_length", "tool_calls", "void_turns", "entropy_reasoning"):
        assert (run_dir / "plots" / f"{name}.png").stat().st_size > 0
    assert "The STARE settings, measured on this run" in (run_dir / "summary.md").read_text()
    for result in summary["eval"].values():  # the evaluation's own noise, next to each avg@k
        low, high = result["avg@k_ci95"]
        assert low <= result["avg@k"] <= high
    assert "avg@k [95% bootstrap interval over problems]" in (run_dir / "summary.md").read_text()
    for stage in ("sft", "rl-grpo-ds", "rl-stare-O1", "eval-sft", "eval-grpo-ds", "eval-stare-O1"):
        assert (run_dir / stage / "config.yaml").exists()
    for arm in ("grpo-ds", "stare-O1"):  # side by side: each arm in its own process, one thread, its own log
        assert "rl: trained 2 of 2 steps" in (run_dir / f"rl-{arm}.log").read_text()
        assert yaml.safe_load((run_dir / f"rl-{arm}" / "config.yaml").read_text())["run"]["threads"] == 1
    assert "arms, side by side (wall)" in summary["timings_s"]
    (run_dir / "plots" / "entropy.png").unlink()
    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "plots" / "entropy.png").exists()


def test_the_summary_says_what_the_run_can_and_cannot_show():
    def summary(first, last, intervals):
        rl = {
            "rl-grpo-ds": {"entropy_first5_mean": first, "entropy_final_window_mean": last, "final_window_steps": 10}
        }
        return {"rl": rl, "eval": {name: {"avg@k_ci95": ci} for name, ci in intervals.items()}}

    fell = quickstart.what_it_shows(summary(0.20, 0.15, {"sft": [0.2, 0.3], "grpo-ds": [0.25, 0.35]}))
    assert fell[0].startswith("- GRPO-ds's entropy fell by over a tenth: 0.200 nats") and "to act on" in fell[0]
    assert "does not rank" in fell[1] and "cannot show" in fell[2] and "over seeds" in fell[2]
    flat = quickstart.what_it_shows(summary(0.12, 0.15, {"sft": [0.2, 0.3], "grpo-ds": [0.4, 0.5]}))
    assert "did not fall by a tenth" in flat[0] and "mechanics" in flat[0]
    assert "do not overlap" in flat[1]


def test_plot_draws_entropy_by_token_class_and_skips_what_no_run_logged(tmp_path):
    from stare_agent.lab.plots import plot_runs

    rows = [
        {"step": s, "stare/entropy_mean": 1.0, "entropy/code": 0.5 + s / 10, "rollout/reward": 0.5} for s in (1, 2)
    ]
    written = {path.name for path in plot_runs({"a": rows}, tmp_path)}
    assert {"entropy.png", "entropy_code.png", "reward.png"} <= written
    assert "entropy_answer.png" not in written and "void_turns.png" not in written
