"""scripts/gpu_check.py's verdicts on what a run logs and writes, without a run and without a GPU.

The OpenRLHF stage's checks are functions of plain values (judge_*): each test feeds one a passing case and the
failure it is there to catch, so a check that is removed or inverted fails a test here. The settings a run records
are made as the product makes them (the stage's override words, parsed as the command line parses them, saved as
save_config saves them). The last tests write real TensorBoard event files the way OpenRLHF's logger does (torch's
SummaryWriter: one file per start of the trainer) and run the whole verdict on them; they need the tensorboard
package (.venv-openrlhf). The runs themselves are judged in test_openrlhf_e2e.py and test_openrlhf_cluster.py.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest
import yaml

from stare_agent.config import RLConfig, load_config, to_dict

GPU_CHECK = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"

needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None, reason="needs the tensorboard package (.venv-openrlhf)"
)


@pytest.fixture(scope="module")
def gc():
    """scripts/gpu_check.py, loaded by its path (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recorded_config(gc, attention: str, **changes: str) -> dict:
    """The config.yaml a run of the stage's overrides records (`changes`: override words put in their place)."""
    words = {word.partition("=")[0]: word for word in gc.openrlhf_overrides(attention)}
    words.update({key: f"{key}={value}" for key, value in changes.items()})
    config = load_config(RLConfig, overrides=["backend=openrlhf", *words.values()])
    return yaml.safe_load(yaml.safe_dump(to_dict(config), sort_keys=False))


# --- each step trained once -----------------------------------------------------------------------------------------


def test_steps_each_trained_once_pass(gc):
    assert gc.judge_trained([[1, 2], [3]], 3) == ([], [1, 2, 3])
    assert gc.judge_trained([[1, 2, 3]], 3) == ([], [1, 2, 3])


def test_a_step_trained_by_two_runs_fails(gc):
    failures, trained = gc.judge_trained([[1, 2], [2, 3]], 3)
    assert trained == [1, 2, 3]
    assert failures == ["a step was trained more than once (each must appear once in the metrics): step 2 by 2 runs"]
    failures, _ = gc.judge_trained([[1, 2], [1, 2, 3]], 3)  # a second run that started over
    assert len(failures) == 1 and "step 1 by 2 runs, step 2 by 2 runs" in failures[0]


def test_missing_or_other_steps_fail(gc):
    assert gc.judge_trained([[1, 2]], 3)[0] == ["2 of 3 steps trained"]
    assert gc.judge_trained([[], []], 3)[0] == ["no step was trained (no train/policy_loss in its TensorBoard log)"]
    assert gc.judge_trained([[1, 2], [4]], 3)[0] == ["steps [1, 2, 4] trained, not 1 to 3"]


# --- a save at step 2, a resumed run that trains step 3 -------------------------------------------------------------


def test_a_run_resumed_from_the_save_passes(gc):
    failures, lines = gc.judge_resume([[1, 2], [3]], 2, 3, saved=[2])
    assert failures == []
    assert lines == [
        "resume: steps trained by each run [[1, 2], [3]]; asked: [1, 2], a checkpoint at step 2, then [3] resumed "
        "from it (checkpoints of steps [2])"
    ]


def test_a_resumed_run_that_started_over_fails(gc):
    failures, _ = gc.judge_resume([[1, 2], [1, 2, 3]], 2, 3, saved=[2])
    assert failures == [
        "the resumed run trained steps [1, 2, 3], not [3]: it did not resume from the checkpoint of step 2 "
        "(started over)"
    ]


def test_a_run_resumed_from_another_step_fails(gc):
    failures, _ = gc.judge_resume([[1], [2, 3]], 2, 3, saved=[1])
    assert len(failures) == 3
    assert failures[0].startswith("no checkpoint of step 2 (checkpoints/_actor/global_step2)")
    assert failures[1] == "the first run trained steps [1], not [1, 2]"
    assert "[2, 3], not [3]: it did not resume from the checkpoint of step 2 (started at step 2)" in failures[2]


def test_a_save_that_is_missing_fails_the_resume(gc):
    failures, _ = gc.judge_resume([[1, 2], [3]], 2, 3, saved=[])
    assert len(failures) == 1 and failures[0].startswith("no checkpoint of step 2")


def test_one_run_where_two_were_asked_fails(gc):
    # the resumed run trained nothing (or wrote no event file), or the first and the second were one run
    assert gc.judge_resume([[1, 2], []], 2, 3, saved=[2])[0] == [
        "1 runs trained steps ([[1, 2]]), not 2: the first and the resumed one"
    ]
    assert gc.judge_resume([[1, 2, 3]], 2, 3, saved=[2])[0][0].startswith("1 runs trained steps")


def test_exit_codes_of_both_runs_are_judged(gc):
    assert gc.judge_exits(0, None) == [] and gc.judge_exits(0, 0) == []
    assert gc.judge_exits(1, None) == ["the run exited with 1: an error, its traceback in the run's log"]
    assert gc.judge_exits(None, 3) == [
        "the first run exited with 3: the sandbox failed",
        "the resumed run was not started",
    ]
    assert gc.judge_exits(124, 0) == ["the resumed run exited with 124: it ran past gpu_check.sh's time limit"]
    assert gc.judge_exits(7, 0) == ["the resumed run exited with 7: see its log"]


# --- the weight sync, and step 1's absolute gap ---------------------------------------------------------------------


def test_the_absolute_gap_at_step_1_is_printed_next_to_the_bound(gc):
    # the values measured through the CPU shim with the sync working (OPENRLHF_SHAPE's docstring)
    diffs, worst = {1: 0.0014, 2: 0.0062, 3: 0.0005}, {1: 0.12, 2: 0.2, 3: 0.05}
    failures, lines = gc.judge_sync([1, 2, 3], diffs, worst)
    assert failures == []
    assert lines[0] == (
        "step 1, engine and trainer on the same weights: absolute gap 0.0014 nats mean, max 0.1200; "
        "bound for later steps 3 x 0.0014 + 0.02 = 0.0242 nats"
    )
    assert lines[1].endswith("step 1 0.0014, step 2 0.0062, step 3 0.0005 (bound after step 1: 0.0242)")
    # also where the sync cannot be judged (one step): the absolute gap is still what a first GPU run asks for
    failures, lines = gc.judge_sync([1], {1: 0.0014}, {})
    assert failures == ["1 step trained; the sync check needs at least 2"]
    assert lines == [
        "step 1, engine and trainer on the same weights: absolute gap 0.0014 nats mean; "
        "bound for later steps 3 x 0.0014 + 0.02 = 0.0242 nats"
    ]


def test_an_engine_that_missed_the_syncs_fails(gc):
    # the values measured through the CPU shim with the sync dropped: past the bound at step 3
    failures, _ = gc.judge_sync([1, 2, 3], {1: 0.0016, 2: 0.0204, 3: 0.0469}, {})
    assert failures == [
        "the engine's log-probs drifted from the trainer's after step 1 (0.0016 nats, then 0.0469 at step 3): "
        "the weight sync did not reach the engine"
    ]
    failures, _ = gc.judge_sync([1, 2, 3], {1: 0.0016, 3: 0.0469}, {})
    assert failures == ["train/rollout_logprob_abs_diff is not logged for every step: the sync cannot be checked"]
    assert gc.judge_sync([], {}, {}) == ([], [])


# --- the settings the run recorded: attention and gradient checkpointing --------------------------------------------


@pytest.mark.parametrize("attention", ["flash_attention_2", "sdpa"])
def test_the_attention_line_is_what_the_run_recorded(gc, attention):
    config = recorded_config(gc, attention)
    failures, lines = gc.judge_settings(config, gc.stage_settings(attention))
    assert failures == []
    assert lines == [f"attention: {attention}; gradient checkpointing: on (as the run's config.yaml records)"]
    # the line reads the run's file, not what was asked: a run that recorded the other one is reported as such
    other = "sdpa" if attention == "flash_attention_2" else "flash_attention_2"
    failures, lines = gc.judge_settings(recorded_config(gc, other), gc.stage_settings(attention))
    assert lines[0].startswith(f"attention: {other};")
    assert failures == [
        f"the run's config.yaml records openrlhf.ds.attn_implementation={other!r}, not the GPU check's {attention!r}"
    ]


def test_a_run_without_gradient_checkpointing_fails(gc):
    config = recorded_config(gc, "sdpa", **{"openrlhf.actor.gradient_checkpointing_enable": "false"})
    failures, lines = gc.judge_settings(config, gc.stage_settings("sdpa"))
    assert lines == ["attention: sdpa; gradient checkpointing: off (as the run's config.yaml records)"]
    assert failures == [
        "the run's config.yaml records openrlhf.actor.gradient_checkpointing_enable=False, not the GPU check's True"
    ]


def test_every_setting_of_the_stage_is_checked_and_none_without_expectations(gc):
    config = recorded_config(gc, "sdpa", **{"openrlhf.ds.zero_stage": "2", "optim.lr": "1e-5"})
    failures, _ = gc.judge_settings(config, gc.stage_settings("sdpa"))
    assert [f.split("=")[0] for f in failures] == [
        "the run's config.yaml records openrlhf.ds.zero_stage",
        "the run's config.yaml records optim.lr",
    ]
    assert gc.judge_settings(config, None)[0] == []  # the e2e runs are judged without the stage's settings
    assert gc.judge_settings({}, gc.stage_settings("sdpa"))[0] == [
        "the run wrote no config.yaml: what it ran with cannot be checked"
    ]
    assert gc.judge_settings({}, None)[1] == [
        "attention: not set (OpenRLHF's default: flash_attention_2); gradient checkpointing: off "
        "(as the run's config.yaml records)"
    ]


def test_the_overrides_carry_the_steps_the_save_gradient_checkpointing_and_the_attention(gc):
    words = gc.openrlhf_overrides("flash_attention_2")
    assert words[:2] == ["steps=3", "save_every=2"]  # gpu_check.sh reads these two by position
    assert "openrlhf.actor.gradient_checkpointing_enable=true" in words
    assert words[-1] == "openrlhf.ds.attn_implementation=flash_attention_2"
    assert gc.OPENRLHF_SAVED_AT < gc.OPENRLHF_STEPS  # a step is left for the resumed run to train


def test_flash_attention_2_where_flash_attn_imports_else_sdpa(gc, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ImportError
    attention, why = gc.attention_implementation()
    assert attention == "sdpa" and why.startswith("flash_attn does not import (ModuleNotFoundError")
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__="2.8.3"))
    assert gc.attention_implementation() == ("flash_attention_2", "flash_attn 2.8.3 imports")


# --- the in-engine sandbox without root -----------------------------------------------------------------------------


def test_a_run_without_root_that_called_the_sandbox_passes(gc):
    failures, lines = gc.judge_user(1000, 1000, "", {1: 1.25, 2: 0.0})
    assert failures == []
    assert lines == ["in-engine sandbox ran as uid 1000, not root: tool calls per episode step 1 1.25, step 2 0.00"]


def test_a_run_that_was_not_the_user_it_was_started_as_fails(gc):
    failures, _ = gc.judge_user(0, 1000, "", {1: 1.0})
    assert failures == ["the run's files belong to uid 0, not to uid 1000 it was started as"]
    failures, _ = gc.judge_user(None, 1000, "", {1: 1.0})
    assert failures == ["the run wrote no config.yaml: which user it ran as is unknown"]


def test_a_run_without_root_that_never_called_the_sandbox_fails(gc):
    failures, lines = gc.judge_user(1000, 1000, "", {1: 0.0, 2: 0.0})
    assert lines == []
    assert failures == [
        "no episode called the sandbox (tool calls per episode: step 1 0.00, step 2 0.00): it was not checked as "
        "uid 1000"
    ]


def test_a_run_as_root_says_the_check_was_skipped_and_why(gc):
    failures, lines = gc.judge_user(0, 0, "there is no user nobody to run it as", {})
    assert failures == []
    assert lines == [
        "in-engine sandbox without root: SKIPPED, the RL ran as root: there is no user nobody to run it as"
    ]
    assert gc.judge_user(0, 0, "", {1: 1.0})[0] == [
        "the RL ran as root without a reason: the sandbox was not checked without root"
    ]


# --- the whole verdict on the files of a saved and resumed run ------------------------------------------------------


def write_run(
    gc, run: Path, trained: list[list[int]], *, saved: list[int], attention: str = "sdpa", same_folder: bool = False
) -> Path:
    """A run folder as the OpenRLHF stage leaves it: one TensorBoard event file per run (oldest first), the
    DeepSpeed checkpoints of `saved`, the final model's files and the config.yaml the run recorded."""
    from torch.utils.tensorboard import SummaryWriter

    for index, steps in enumerate(trained):
        writer = SummaryWriter(log_dir=str(run / "tb" / ("ppo" if same_folder else f"ppo_{index}")))
        for step in steps:
            walltime = 1_000_000 + 100 * index + step  # the order of the runs, as their clocks give it
            for tag, value in {
                "train/policy_loss": 0.1,
                "train/rollout_logprob_abs_diff": 0.001 * step,
                "train/rollout_logprob_abs_diff_max": 0.1,
                "train/rollout/tool_calls": 1.0,
            }.items():
                writer.add_scalar(tag, value, step, walltime=walltime)
        writer.close()
    for step in saved:
        (run / "checkpoints" / "_actor" / f"global_step{step}").mkdir(parents=True)
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    (run / "final" / "model.safetensors").write_bytes(b"")
    (run / "config.yaml").write_text(yaml.safe_dump(recorded_config(gc, attention), sort_keys=False))
    return run


def judge_words(run: Path, attention: str = "sdpa") -> list[str]:
    """The judge's command line as gpu_check.sh builds it, for this process's uid."""
    uid = os.getuid()
    reason = ["--root-reason", "the tests run as root"] if uid == 0 else []
    return [
        str(run),
        "--openrlhf",
        "3",
        "--resumed-from",
        "2",
        "--first-exit-code",
        "0",
        "--exit-code",
        "0",
        "--attention",
        attention,
        "--run-uid",
        str(uid),
        *reason,
    ]


@needs_tensorboard
@pytest.mark.parametrize("same_folder", [False, True], ids=["a-folder-each", "one-folder"])
def test_the_verdict_passes_a_run_saved_at_step_2_and_resumed_for_step_3(gc, tmp_path, capsys, same_folder):
    # The event files' folder is logger.wandb.run_name: the launcher sets it to run.name, so both runs write into one
    # folder; OpenRLHF's own default names it after the minute a run started, a folder each.
    run = write_run(
        gc, tmp_path / "rl", [[1, 2], [3]], saved=[2], attention="flash_attention_2", same_folder=same_folder
    )
    assert gc.main(judge_words(run, "flash_attention_2")) == 0
    out = capsys.readouterr().out
    assert "  attention: flash_attention_2; gradient checkpointing: on (as the run's config.yaml records)\n" in out
    assert "resume: steps trained by each run [[1, 2], [3]]" in out
    assert "absolute gap 0.0010 nats mean, max 0.1000; bound for later steps 3 x 0.0010 + 0.02 = 0.0230 nats" in out
    if os.getuid() == 0:
        assert "in-engine sandbox without root: SKIPPED, the RL ran as root: the tests run as root" in out
    else:
        assert f"in-engine sandbox ran as uid {os.getuid()}, not root: tool calls per episode step 1 1.00" in out
    assert out.endswith("OpenRLHF run: PASS\n")


@needs_tensorboard
def test_the_verdict_fails_a_run_that_did_not_get_the_stages_settings(gc, tmp_path, capsys):
    run = write_run(gc, tmp_path / "rl", [[1, 2], [3]], saved=[2], attention="sdpa")
    assert gc.main(judge_words(run, "flash_attention_2")) == 1  # flash_attn imported, the run recorded sdpa
    out = capsys.readouterr().out
    assert "  attention: sdpa; gradient checkpointing: on" in out
    assert "FAIL: the run's config.yaml records openrlhf.ds.attn_implementation='sdpa'" in out


@needs_tensorboard
def test_the_verdict_fails_a_resumed_run_that_trained_again_what_was_saved(gc, tmp_path, capsys):
    run = write_run(gc, tmp_path / "rl", [[1, 2], [1, 2, 3]], saved=[2])
    assert gc.main(judge_words(run)) == 1
    out = capsys.readouterr().out
    assert "FAIL: a step was trained more than once (each must appear once in the metrics): step 1 by 2 runs" in out
    assert "FAIL: the resumed run trained steps [1, 2, 3], not [3]" in out
    assert out.endswith("OpenRLHF run: FAIL\n")


@needs_tensorboard
def test_the_verdict_fails_when_the_resumed_run_did_not_start(gc, tmp_path, capsys):
    run = write_run(gc, tmp_path / "rl", [[1, 2]], saved=[2])
    words = judge_words(run)
    del words[words.index("--exit-code") : words.index("--exit-code") + 2]  # gpu_check.sh: the first run failed
    words[words.index("--first-exit-code") + 1] = "1"
    assert gc.main(words) == 1
    out = capsys.readouterr().out
    assert "FAIL: the first run exited with 1" in out and "FAIL: the resumed run was not started" in out
    assert "FAIL: 2 of 3 steps trained" in out


def test_the_judge_asks_for_the_first_runs_exit_code(gc, tmp_path):
    with pytest.raises(SystemExit) as exited:
        gc.main([str(tmp_path), "--openrlhf", "3", "--resumed-from", "2", "--exit-code", "0"])
    assert exited.value.code == 2
