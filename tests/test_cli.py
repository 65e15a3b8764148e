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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_line(out: subprocess.CompletedProcess) -> str:
    """The failure message: exactly one line on stderr, no traceback."""
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().count("\n") == 0, out.stderr
    return out.stderr


def test_expected_failures_print_one_line_and_leave_no_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where runs/ would appear
    unreachable = f"http://127.0.0.1:{free_port()}"
    out = run_cli("data", "make-sft", "--n", "2", "--out", "x.jsonl", "--sandbox-url", unreachable)
    assert out.returncode == 3 and f"cannot reach {unreachable}" in one_line(out)
    out = run_cli("sft", "run.threads=1")
    assert out.returncode == 2 and "model.path is not set" in one_line(out)
    out = run_cli("rl", "sandbox.url=localhost:8765")
    assert out.returncode == 2 and "sandbox.url" in one_line(out) and "'http://localhost:8765'" in out.stderr
    out = run_cli("rl", f"model.path={tmp_path}")
    assert out.returncode == 2 and "is not a Hugging Face model folder" in one_line(out)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "x.jsonl").exists()


def test_a_run_stopped_by_a_non_finite_gradient_exits_6_with_its_message():
    from stare_agent.cli import _expected_failure
    from stare_agent.runtime import NonFiniteGradient

    assert _expected_failure(NonFiniteGradient("rl step 3, update 1: the gradient norm is nan")) == (
        6,
        "rl step 3, update 1: the gradient norm is nan",
    )


def test_bad_arguments_are_usage_errors():
    out = run_cli("data", "make-sft", "--n", "2", "--out", "x.jsonl", "--error-fraction", "1.5")
    assert out.returncode == 2 and "expected a number in [0, 1], got '1.5'" in out.stderr
    out = run_cli("data", "make-sft", "--n", "2", "--out", "x.jsonl", "--sandbox-url", "localhost:8765")
    assert out.returncode == 2 and "must be http(s)://HOST[:PORT]" in out.stderr
    assert "Traceback" not in out.stderr


def test_debug_shows_the_traceback(monkeypatch):
    out = run_cli("--debug", "simulate", "stare.gate=btach")
    assert out.returncode != 0 and "Traceback" in out.stderr and "ConfigError" in out.stderr
    monkeypatch.setenv("STARE_AGENT_DEBUG", "1")
    assert "Traceback" in run_cli("simulate", "stare.gate=btach").stderr


def test_a_wrong_sandbox_token_is_one_line_before_any_work(tmp_path):
    import os
    import time

    import httpx

    port = free_port()
    env = {**os.environ, "SANDBOX_TOKEN": "right"}
    server = subprocess.Popen(
        [sys.executable, "-m", "stare_sandbox", "serve", "--port", str(port), "--pool-size", "0"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        url = f"http://127.0.0.1:{port}"
        out = run_cli("data", "make-sft", "--n", "2", "--out", str(tmp_path / "x.jsonl"), "--sandbox-url", url)
        assert out.returncode == 3 and "refuses no access token" in one_line(out)
        out = run_cli(
            "data", "make-sft", "--n", "2", "--out", str(tmp_path / "x.jsonl"), "--sandbox-url", url,
            "--sandbox-token", "wrong",
        )  # fmt: skip
        assert out.returncode == 3 and "refuses a wrong access token" in one_line(out)
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_help_of_a_config_command_lists_its_keys():
    out = run_cli("rl", "--help")
    assert out.returncode == 0
    assert "stare.: op, top_ratio, w," in out.stdout and "entropy_control.: method" in out.stdout
    assert "stare-agent config rl" in out.stdout
    assert "top level: steps, save_every, resume" in out.stdout
    assert run_cli("sandbox", "--help").stdout.startswith("usage: stare-agent sandbox")
    serve = run_cli("sandbox", "serve", "--help").stdout
    assert "--pool-size POOL_SIZE" in serve and "(default: 4)" in serve and "pool_size: 4" in serve


def test_dry_run_starts_nothing(tmp_path, monkeypatch):
    import importlib.util

    monkeypatch.chdir(tmp_path)
    out = run_cli("rl", "--dry-run", "steps=7")
    assert out.returncode == 0 and yaml.safe_load(out.stdout)["steps"] == 7 and "backend local" in out.stdout
    out = run_cli(
        "rl", "backend=openrlhf", "model.path=/m", "model.dtype=bfloat16", "data.train_file=/d.jsonl", "--dry-run"
    )
    if importlib.util.find_spec("openrlhf") is None:
        assert out.returncode == 2 and "needs openrlhf==0.11.2" in one_line(out)
    else:
        assert out.returncode == 0 and "--algo.advantage.estimator group_norm" in out.stdout
    assert not (tmp_path / "runs").exists()
