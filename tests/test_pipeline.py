"""The local evaluation command, the plot command and a whole (very small) quickstart, on CPU."""

from __future__ import annotations

import json

import pytest

from stare_agent.backends.local import evaluate, quickstart
from stare_agent.cli import main
from stare_agent.config import EvalConfig, QuickstartConfig, load_config
from stare_agent.data import write_records
from stare_agent.tasks import generate_tasks


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


def test_eval_without_anything_to_evaluate_says_so(capsys, tiny_model_dir):
    assert main(["eval", f"model.path={tiny_model_dir}"]) == 2
    assert "nothing to evaluate" in capsys.readouterr().err
    assert main(["rl", "model.path=/nonexistent", "data.train_file=x.jsonl"]) == 2


@pytest.mark.slow
def test_a_small_quickstart_runs_end_to_end_and_plot_redraws(tmp_path):
    overrides = [
        f"run.output_dir={tmp_path}",
        "run.name=qs",
        "model.hidden_size=64",
        "model.num_heads=2",
        "model.num_kv_heads=1",
        "model.intermediate_size=128",
        "model.num_layers=1",
        "tasks.sft_examples=16",
        "tasks.rl_prompts=24",
        "tasks.test_problems=3",
        "sft.epochs=1",
        "sft.micro_batch_size=8",
        "rl.steps=2",
        "rl.rollout.prompts_per_step=2",
        "rl.rollout.group_size=2",
        "rl.rollout.max_turn_tokens=24",
        "rl.rollout.max_refill_rounds=0",
        "rl.rollout.dynamic_sampling=false",
        "eval.k=1",
        "eval.max_turn_tokens=24",
    ]
    run_dir = quickstart.run(load_config(QuickstartConfig, None, overrides))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["rl"]) == {"rl-grpo-ds", "rl-stare-O1"} and set(summary["eval"]) == {
        "sft",
        "grpo-ds",
        "stare-O1",
    }
    for name in ("entropy", "reward", "accuracy", "response_length", "tool_calls"):
        assert (run_dir / "plots" / f"{name}.png").stat().st_size > 0
    assert "Why these STARE settings" in (run_dir / "summary.md").read_text()
    for stage in ("sft", "rl-grpo-ds", "rl-stare-O1", "eval-sft"):
        assert (run_dir / stage / "config.yaml").exists()
    (run_dir / "plots" / "entropy.png").unlink()
    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "plots" / "entropy.png").exists()
