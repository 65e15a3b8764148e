"""Hugging Face snapshots of a training run (stare_agent/snapshots.py): the rotation rule, the local backend's real
save path keeping exactly the last N plus the pinned ones, and `stare-agent eval snapshots=RUN` naming the best
snapshot on a validation file. The openrlhf backend's save path is tested in test_openrlhf_hooks.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stare_agent import snapshots
from stare_agent.eval import BenchmarkReport, SnapshotScore, best_snapshot

# --- the rule ------------------------------------------------------------------------------------------------------


def test_the_last_n_the_pinned_and_the_resumable_one_are_kept():
    steps = [1, 2, 3, 4, 5]
    assert snapshots.kept_steps(steps, keep=2, pinned=[2]) == {2, 4, 5}
    assert snapshots.kept_steps(steps, keep=2, pinned=[2], protected=[3]) == {2, 3, 4, 5}
    assert snapshots.kept_steps(steps, keep=0) == set(steps)  # 0: no rotation
    assert snapshots.kept_steps(steps, keep=9, pinned=[7]) == set(steps)  # a pin of a step never saved keeps nothing
    assert snapshots.kept_steps([5, 1, 3], keep=1) == {5}  # by step, not by listing order


def make_snapshot(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("layout", ["local", "openrlhf"])
def test_rotate_reads_both_layouts_and_never_deletes_the_latest_resumable_checkpoint(tmp_path, layout):
    """local: checkpoints/step-NNNNNN + `latest`; openrlhf: checkpoints/global_stepN_hf + DeepSpeed's _actor/latest
    (its own checkpoints under _actor/ are not snapshots and are left to OpenRLHF's ckpt.max_num)."""
    root = tmp_path / "run" / "checkpoints"
    name = "step-{:06d}" if layout == "local" else "global_step{}_hf"
    for step in range(1, 6):
        make_snapshot(root / name.format(step))
    (root / ".partial-step-000006-123").mkdir()  # a save in progress is not a snapshot
    if layout == "local":
        (root / "latest").write_text("step-000003\n")  # resumed from step 3: steps 4 and 5 are a run abandoned
    else:
        make_snapshot(root / "_actor" / "global_step3")
        (root / "_actor" / "latest").write_text("global_step3")
    (root / name.format(1) / snapshots.PIN_FILE).touch()

    deleted = snapshots.rotate(root, keep=1, pinned=[])
    assert sorted(p.name for p in deleted) == [name.format(2), name.format(4)]
    assert [step for step, _ in snapshots.find(tmp_path / "run")] == [1, 3, 5]  # pinned, latest, last
    assert (root / ".partial-step-000006-123").is_dir()
    assert layout == "local" or (root / "_actor" / "global_step3").is_dir()


# --- the local backend's save path ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    from stare_agent.data import write_records
    from stare_agent.lab.tasks import generate_tasks

    problems = generate_tasks(8, seed=0, difficulty=1)
    path = tmp_path_factory.mktemp("snapshots") / "prompts.jsonl"
    return write_records(path, [{"id": p.id, "problem": p.problem, "answer": p.answer} for p in problems])


def rl_config(tmp_path, model_dir, prompts, *overrides):
    from stare_agent.config import RLConfig, load_config

    return load_config(
        RLConfig,
        None,
        [
            f"run.output_dir={tmp_path}",
            "run.name=rl",
            f"model.path={model_dir}",
            f"data.train_file={prompts}",
            "rollout.prompts_per_step=1",
            "rollout.group_size=2",
            "rollout.dynamic_sampling=false",
            "rollout.max_turn_tokens=8",
            "agent.max_total_tokens=160",
            "agent.system_prompt=null",
            "agent.tool_mode=stateless",
            "sandbox.pool_size=1",
            *overrides,
        ],
    )


def saved_steps(run_dir: Path) -> list[int]:
    return [step for step, _ in snapshots.find(run_dir)]


def test_a_local_run_keeps_the_last_n_and_the_pinned_snapshots(tmp_path, tiny_model_dir, prompts):
    """Five RL steps saved at each, keep 2, step 2 pinned in the config: exactly steps 2, 4 and 5 remain, the last
    of them the final model that `latest` names."""
    from stare_agent.backends.local import rl

    config = rl_config(
        tmp_path, tiny_model_dir, prompts, "steps=5", "save_every=1", "keep_snapshots=2", "pin_snapshots=[2]"
    )
    final = rl.run(config)
    assert saved_steps(tmp_path / "rl") == [2, 4, 5]
    assert (
        final.name == "step-000005" and (tmp_path / "rl" / "checkpoints" / "latest").read_text().strip() == final.name
    )


def test_a_keep_file_pins_a_local_snapshot_and_the_resumable_one_survives_a_save_below_it(
    tmp_path, tiny_model_dir, prompts
):
    """The trainer's real save (Trainer.save: save_checkpoint, then rotation) at steps 1..5 with keep 2, step 2
    pinned by a KEEP file put in its folder after it was saved; then a save at step 3, as a run resumed from an
    earlier step makes: `latest` names it, so it stays although 4 and 5 are higher."""
    from stare_agent.backends.local import rl

    trainer = rl.Trainer(rl_config(tmp_path, tiny_model_dir, prompts, "steps=5", "save_every=1", "keep_snapshots=2"))
    for step in range(1, 6):
        trainer.step = step
        saved = trainer.save()
        if step == 2:
            (saved / snapshots.PIN_FILE).touch()
    assert saved_steps(tmp_path / "rl") == [2, 4, 5]
    trainer.step = 3
    trainer.save()
    assert saved_steps(tmp_path / "rl") == [2, 3, 4, 5]


def test_pins_of_steps_that_are_never_saved_are_refused(tmp_path, tiny_model_dir, prompts):
    from stare_agent.config import ConfigError

    with pytest.raises(ConfigError, match=r"pin_snapshots \[3, 11\].*multiples of save_every=2"):
        rl_config(tmp_path, tiny_model_dir, prompts, "steps=10", "save_every=2", "pin_snapshots=[3,4,11]")
    with pytest.raises(ConfigError, match="keep_snapshots must be >= 0"):
        rl_config(tmp_path, tiny_model_dir, prompts, "keep_snapshots=-1")


# --- choosing a snapshot: `stare-agent eval snapshots=RUN` ---------------------------------------------------------


def report(avg: float, pass_2: float | None, problems: int = 3, unscored: int = 0) -> BenchmarkReport:
    return BenchmarkReport(
        name="val",
        problems=problems,
        samples_per_problem=2,
        avg_at_k=avg,
        pass_at={} if pass_2 is None else {1: avg, 2: pass_2},
        mean_response_length=0.0,
        mean_tool_calls=0.0,
        finish_reasons={},
        sandbox_errors=0,
        unscored_problems=unscored,
    )


def test_the_best_snapshot_is_the_argmax_of_the_named_metric_ties_to_the_earliest():
    scores = [
        SnapshotScore(10, "a", report(0.5, 0.9)),
        SnapshotScore(20, "b", report(0.7, 0.2)),
        SnapshotScore(30, "c", report(0.7, None)),
        SnapshotScore(40, "d", report(0.0, None, unscored=3)),  # nothing scored: no avg@k at all
    ]
    assert best_snapshot(scores, "avg@k").step == 20
    assert best_snapshot(scores, "pass@k").step == 10
    assert best_snapshot(scores[3:], "avg@k") is None


@pytest.fixture(scope="module")
def answering_20(tiny_qwen_dir, qwen_script, qwen_tokenizer, tmp_path_factory):
    """The forced Qwen script (tests/forced.py) with \\boxed{20} as its answer instead of \\boxed{21}."""
    from forced import chains_to_successors, write_forced_model

    from stare_agent import protocol

    s = qwen_script
    answer = protocol.encode_segment(qwen_tokenizer, "\\boxed{20}</answer>.")
    successors = chains_to_successors([[s["start"], *s["call"]], [s["observation"][-1], *answer]])
    return write_forced_model(tiny_qwen_dir, tmp_path_factory.mktemp("answering_20"), successors)


def test_eval_of_every_snapshot_tables_plots_and_names_the_argmax(
    tmp_path, monkeypatch, tiny_qwen_dir, forced_qwen_dir, answering_20
):
    """A run folder whose snapshots score 1/3 (step 1: answers 20), 2/3 (step 2: answers 21) and 0 (step 3: a
    random model) on three problems with gold answers 21, 21, 20, through the real command and sandbox kernels:
    one row per snapshot by step, per-snapshot results, the plot, and step 2 named best, neither the first nor the
    last. An incomplete snapshot (no config.json) is left out."""
    from stare_agent.cli import main
    from stare_agent.data import write_records

    checkpoints = tmp_path / "rl" / "checkpoints"
    checkpoints.mkdir(parents=True)
    for step, model in ((1, answering_20), (2, forced_qwen_dir), (3, tiny_qwen_dir)):
        (checkpoints / f"step-{step:06d}").symlink_to(Path(model).absolute(), target_is_directory=True)
    (checkpoints / "step-000004").mkdir()  # being written
    rows = [{"problem": "What is 7 times 3?", "answer": answer} for answer in ("21", "21", "20")]
    validation = write_records(tmp_path / "validation.jsonl", rows)
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "eval",
            f"snapshots={tmp_path / 'rl'}",
            f"files=[{validation}]",
            "select=avg@k",
            f"run.output_dir={tmp_path}",
            "run.name=sweep",
            "k=1",
            "temperature=0",
            "max_turn_tokens=40",
            "agent.max_total_tokens=700",
            "agent.tool_mode=stateless",
            "generator=hf",
            "sandbox.pool_size=1",
        ]
    )
    assert code == 0
    out = tmp_path / "sweep"
    record = json.loads((out / "snapshots.json").read_text())
    assert [row["step"] for row in record["snapshots"]] == [1, 2, 3]
    assert [row["avg@k"] for row in record["snapshots"]] == pytest.approx([1 / 3, 2 / 3, 0.0])
    values = {row["step"]: row["avg@k"] for row in record["snapshots"]}
    assert record["best"]["step"] == max(values, key=values.get) == 2
    assert record["best"]["path"] == str(checkpoints / "step-000002")
    table = [
        line for line in (out / "snapshots.md").read_text().splitlines() if line.startswith("| ") and "---" not in line
    ]
    assert [line.split("|")[1].strip() for line in table[1:]] == ["1", "2", "3"]
    assert [line.rstrip(" |").endswith("best") for line in table[1:]] == [False, True, False]
    assert (out / "snapshots.png").stat().st_size > 0
    assert all((out / f"step-00000{step}" / "results.json").exists() for step in (1, 2, 3))
    assert not (out / "step-000004").exists()
