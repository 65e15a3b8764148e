"""The local RL loop on the tiny model: the update's alignment and STARE wiring, 2-step runs, exact resume."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import stare_agent.agent as agent_module
from stare_agent.agent import EpisodeResult
from stare_agent.backends.local import rl
from stare_agent.config import RLConfig, load_config
from stare_agent.data import write_records
from stare_agent.tasks import generate_tasks


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("rl") / "prompts.jsonl"
    problems = generate_tasks(24, seed=0, difficulty=1)
    return write_records(path, [{"id": p.id, "problem": p.problem, "answer": p.answer} for p in problems])


@pytest.fixture
def varied_reward(monkeypatch):
    """A random tiny model never answers right; a reward from the response length makes groups differ, so
    the update has signal. (The real reward is tested in test_reward.py.)"""
    monkeypatch.setattr(agent_module, "score", lambda text, gold, unit=None: float(len(text) % 3 == 0))


def config(tmp_path, model_dir, prompts, name, *overrides):
    return load_config(
        RLConfig,
        None,
        [
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            f"model.path={model_dir}",
            f"data.train_file={prompts}",
            "rollout.prompts_per_step=3",
            "rollout.group_size=4",
            "rollout.max_turn_tokens=24",
            "rollout.max_refill_rounds=1",
            "agent.max_total_tokens=160",
            "agent.system_prompt=null",
            "agent.tool_mode=stateless",
            "sandbox.pool_size=1",
            "optim.lr=1e-3",
            "loss.micro_batch_size=5",
            "stare.target_entropy=100",  # far above the tiny model's entropy: the gate is on
            "stare.w=2",
            *overrides,
        ],
    )


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("enabled", [True, False])
def test_two_rl_steps_with_stare_on_and_off(tmp_path, tiny_model_dir, prompts, varied_reward, enabled):
    final = rl.run(config(tmp_path, tiny_model_dir, prompts, "run", "steps=2", f"stare.enabled={enabled}"))
    assert final.name == "step-000002"
    metrics = rows(tmp_path / "run")
    assert [r["step"] for r in metrics] == [1, 2]
    for r in metrics:
        assert r["rollout/episodes"] >= 12 and r["train/updated"] == 1.0
        assert r["stare/entropy_mean"] > 0 and r["stare/surprisal_mean"] > 0
        assert r["train/rollout_logprob_abs_diff"] < 1e-4  # rollout and training score the same tokens
        assert r["train/clip_frac"] == 0.0  # one on-policy update: the ratio is 1
        for key in ("time/generation", "time/tools", "time/forward", "time/backward", "time/stare"):
            assert r[key] >= 0
        assert r["rollout/groups_kept"] + r["rollout/groups_dropped_equal"] >= 3
        assert ("stare/gate" in r) == enabled and ("stare/weight_mean" in r) == enabled
        if enabled:
            assert r["stare/gate"] == 1.0 and r["stare/w"] == 2.0 and r["stare/weight_mean"] > 1.0
        assert "theory/critical_weight" in r and "theory/proxy_precision" in r
    before, after = load_file(str(tiny_model_dir / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_rl_resume_is_exact(tmp_path, tiny_model_dir, prompts, varied_reward):
    straight = rl.run(config(tmp_path, tiny_model_dir, prompts, "straight", "steps=3"))
    rl.run(config(tmp_path, tiny_model_dir, prompts, "split", "steps=3", "save_every=1"))
    split = tmp_path / "split" / "checkpoints"
    shutil.rmtree(split / "step-000003")
    shutil.rmtree(split / "step-000002")
    (split / "latest").write_text("step-000001\n")
    resumed = rl.run(config(tmp_path, tiny_model_dir, prompts, "split", "steps=3", "resume=auto"))
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in rows(tmp_path / "split")] == [1, 2, 3]
    assert rows(tmp_path / "split")[-1]["rollout/reward"] == rows(tmp_path / "straight")[-1]["rollout/reward"]
    state = torch.load(resumed / "trainer_state.pt", weights_only=False)
    assert state["stare"]["step"] == 3 and state["cursor"] > 0


def test_update_aligns_targets_and_applies_stare(tmp_path, tiny_model_dir, prompts):
    """Hand-made episodes whose rollout log-probs are the model's own: the update's old log-probs match them
    token for token (a shifted alignment would not), and STARE's weights reach the loss."""
    trainer = rl.Trainer(config(tmp_path, tiny_model_dir, prompts, "update", "steps=1"))
    model, gen = trainer.model, torch.Generator().manual_seed(0)
    groups = []
    for g in range(2):
        group = []
        for i in range(4):
            length = 20 + 3 * i + g
            ids = torch.randint(3, 200, (length,), generator=gen)
            mask = [0] * 6 + [1] * 5 + [0] * 3 + [1] * (length - 14)  # prompt, turn, observation, turn
            with torch.no_grad():
                logits = model(input_ids=ids[None]).logits[0, :-1]
            own = logits.log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
            logprobs = [0.0] + [float(lp) if m else 0.0 for lp, m in zip(own, mask[1:], strict=True)]
            group.append(
                EpisodeResult(f"p{g}", ids.tolist(), mask, logprobs, 6, [], None, float(i % 2), "eos", None, "")
            )
        groups.append(group)
    metrics = trainer.update(groups)
    assert metrics["train/rollout_logprob_abs_diff"] < 1e-5
    assert metrics["train/action_tokens"] == sum(sum(e.action_mask[1:]) for g in groups for e in g)
    assert metrics["stare/gate"] == 1.0 and metrics["stare/weight_mean"] > 1.0
    assert metrics["stare/frac_high_pos"] > 0
    trainer.log.close()
