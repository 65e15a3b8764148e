"""The `stare-agent` command: real subprocesses of the installed entry point."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys

import yaml


def run_cli(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("stare-agent")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "stare_agent.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_help_lists_every_command():
    out = run_cli("--help")
    assert out.returncode == 0
    for name in ["simulate", "config", "sandbox", "data", "sft", "rl", "eval", "quickstart", "plot"]:
        assert name in out.stdout


def test_config_command_prints_resolved_yaml():
    out = run_cli("config", "simulate", "--config", "configs/simulate.yaml", "stare.gate=token", "toy.steps=3")
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["stare"]["gate"] == "token" and resolved["toy"]["steps"] == 3


def test_config_errors_exit_2_with_message():
    out = run_cli("simulate", "stare.gate=btach")
    assert out.returncode == 2
    assert "stare.gate" in out.stderr and "'batch', 'sample', 'token' or 'off'" in out.stderr
    assert "Traceback" not in out.stderr


def test_simulate_small_run_writes_everything(tmp_path):
    out = run_cli(
        "simulate",
        f"run.output_dir={tmp_path}",
        "run.name=tiny",
        "toy.steps=6",
        "toy.prompts=8",
        "toy.batch_prompts=4",
        "toy.length=16",
        "open_loop_w=[2]",
        "gated_w=[1.5]",
    )
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / "tiny"
    for name in ["simulate.csv", "summary.json", "config.yaml", "entropy_open_loop.png", "entropy_gated.png"]:
        assert (run_dir / name).stat().st_size > 0, name
    rows = list(csv.DictReader(open(run_dir / "simulate.csv")))
    assert {r["run"] for r in rows} == {"grpo", "O1 open W=2", "O1 batch gate W=1.5"}
    assert len(rows) == 3 * 6
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["toy"]["steps"] == 6
    assert set(json.loads((run_dir / "summary.json").read_text())) == {r["run"] for r in rows}


def test_sandbox_subcommand_is_the_service_cli():
    out = run_cli("sandbox", "serve", "--help")
    assert out.returncode == 0 and "--token" in out.stdout and "--require-isolation" in out.stdout


def test_data_make_tasks_and_make_sft(tmp_path, tiny_tokenizer):
    from stare_agent.data import load_problems, load_sft

    tasks = run_cli("data", "make-tasks", "--out", str(tmp_path / "rl.parquet"), "--n", "6", "--split", "test")
    assert tasks.returncode == 0, tasks.stderr
    problems = load_problems(tmp_path / "rl.parquet")
    assert len(problems) == 6 and all(p.id.startswith("synthetic-test-") for p in problems)

    sft = run_cli("data", "make-sft", "--out", str(tmp_path / "sft.jsonl"), "--n", "4", "--difficulty", "1")
    assert sft.returncode == 0, sft.stderr
    examples, report = load_sft(tmp_path / "sft.jsonl", tiny_tokenizer, max_tokens=4096)
    assert len(examples) == 4 and not report.dropped

    bad = run_cli("data", "make-tasks", "--out", str(tmp_path / "x.jsonl"), "--n", "2", "--families", "gcd,nope")
    assert bad.returncode == 2 and "families must be a non-empty selection of" in bad.stderr
    assert "Traceback" not in bad.stderr
    wrong_suffix = run_cli("data", "make-tasks", "--out", str(tmp_path / "x.csv"), "--n", "2")
    assert wrong_suffix.returncode == 2 and "must end in .jsonl or .parquet" in wrong_suffix.stderr
