"""The local RL loop on the tiny model: 2-step runs, exact resume, and one test per behaviour of the update
(STARE weights in the gradient, surprisal ranking, dynamic sampling, token-level mean, clip-higher, group
advantages, masks, temperature scoring, the mismatch guard, no dropout), each of which fails when that
behaviour alone is removed or inverted."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import stare_agent.agent as agent_module
import stare_agent.step as step_module
from stare_agent import protocol
from stare_agent.agent import EpisodeResult, Sample
from stare_agent.backends.local import rl
from stare_agent.config import ConfigError, RLConfig, load_config
from stare_agent.data import load_problems, write_records
from stare_agent.lab.tasks import generate_tasks
from stare_agent.step import regime_of
from stare_agent.theory import REGIMES, batch_diagnostics


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
    return load_config(RLConfig, None, config_overrides(tmp_path, model_dir, prompts, name, *overrides))


def config_overrides(tmp_path, model_dir, prompts, name, *overrides):
    return [
        f"run.output_dir={tmp_path}",
        f"run.name={name}",
        f"model.path={model_dir}",
        f"data.train_file={prompts}",
        "rollout.prompts_per_step=3",
        "rollout.group_size=4",
        "rollout.max_turn_tokens=24",
        "agent.max_total_tokens=160",
        "agent.system_prompt=null",
        "agent.tool_mode=stateless",
        "sandbox.pool_size=1",
        "optim.lr=1e-3",
        "loss.micro_batch_size=5",
        "stare.target_entropy=100",  # far above the tiny model's entropy: the gate is on
        "stare.w=2",
        *overrides,
    ]


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", ["stare", "none"])
def test_two_rl_steps_with_stare_on_and_off(tmp_path, tiny_model_dir, prompts, varied_reward, method):
    enabled = method == "stare"
    overrides = ["steps=2", f"entropy_control.method={method}", "entropy_control.report_every=1"]
    final = rl.run(config(tmp_path, tiny_model_dir, prompts, "run", *overrides))
    assert final.name == "step-000002"
    metrics = rows(tmp_path / "run")
    assert [r["step"] for r in metrics] == [1, 2]
    for r in metrics:
        assert r["rollout/episodes"] >= 12 and r["rollout/groups_kept"] == 3  # a full batch, every step
        assert r["stare/entropy_mean"] > 0 and r["stare/surprisal_mean"] > 0
        assert r["train/rollout_logprob_abs_diff"] < 1e-4  # rollout and training score the same tokens
        assert r["train/clip_frac"] == 0.0  # one on-policy update: the ratio is 1
        for key in ("time/generation", "time/tools", "time/forward", "time/backward", "time/stare"):
            assert r[key] >= 0
        assert r["rollout/prompts_consumed"] == 3 + r["rollout/groups_dropped_equal"]
        assert ("stare/gate" in r) == enabled and ("stare/weight_mean" in r) == enabled
        if enabled:
            assert r["stare/gate"] == 1.0 and r["stare/w"] == 2.0 and r["stare/weight_mean"] > 1.0
        assert "theory/critical_weight" in r and "theory/proxy_precision" in r
    before, after = load_file(str(tiny_model_dir / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    reports = tmp_path / "run" / "selected_tokens.jsonl"
    assert reports.exists() == enabled  # GRPO-ds acts on no token
    if enabled:  # one report a step: the tokens STARE reweighted in it, most frequent first
        lines = [json.loads(line) for line in reports.read_text().splitlines()]
        assert [line["step"] for line in lines] == [1, 2]
        for line, row in zip(lines, metrics, strict=True):
            assert line["selected"] == round(row["control/selected_share"] * line["action_tokens"]) > 0
            counts = [n for _, _, n in line["tokens"]]
            assert counts == sorted(counts, reverse=True) and sum(counts) <= line["selected"]


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


@pytest.mark.parametrize("fault", ["killed_after_a_save", "killed_mid_save", "pointer_emptied", "pointer_lost"])
def test_the_same_command_again_continues_the_run_exactly(
    tmp_path, tiny_model_dir, prompts, varied_reward, fault, capsys
):
    """A requeued job replays its command (resume left at its default): it continues from the last complete
    checkpoint, whatever a crash left behind, and ends as an uninterrupted run, each step logged once."""
    args = (tmp_path, tiny_model_dir, prompts)
    straight = rl.run(config(*args, "straight", "steps=3"))
    rl.run(config(*args, "split", "steps=3", "save_every=1", "entropy_control.report_every=1"))
    split = tmp_path / "split" / "checkpoints"
    shutil.rmtree(split / "step-000003")  # the crash came in step 3: its checkpoint was never written
    (split / "latest").write_text("step-000002\n")
    if fault == "killed_mid_save":  # what a kill inside save_checkpoint leaves: a partial folder, latest unchanged
        partial = split / ".partial-step-000003-4242"
        partial.mkdir()
        (partial / "model.safetensors").write_bytes(b"half a model")
    elif fault == "pointer_emptied":  # a full disk while `latest` was rewritten
        (split / "latest").write_text("")
    elif fault == "pointer_lost":  # `latest` names a checkpoint that is gone
        (split / "latest").write_text("step-000003\n")
    logged = rows(tmp_path / "split")[:2]
    capsys.readouterr()
    resumed = rl.run(config(*args, "split", "steps=3", "save_every=1", "entropy_control.report_every=1"))
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in rows(tmp_path / "split")] == [1, 2, 3]
    assert rows(tmp_path / "split")[:2] == logged  # steps 1 and 2 were not trained again
    assert f"resumed from {split / 'step-000002'} at step 2" in capsys.readouterr().out
    reports = (tmp_path / "split" / "selected_tokens.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in reports] == [1, 2, 3]
    assert not list(split.glob(".partial-*"))
    assert (split / "latest").read_text().strip() == "step-000003"


def test_starting_fresh_over_a_checkpoint_is_refused_and_deletes_nothing(
    tmp_path, tiny_model_dir, prompts, varied_reward
):
    args = (tmp_path, tiny_model_dir, prompts)
    rl.run(config(*args, "run", "steps=1", "entropy_control.report_every=1"))
    run_dir = tmp_path / "run"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != "provenance.jsonl"}
    with pytest.raises(ConfigError, match=r"resume='' starts the run over, but .*run already holds a complete"):
        rl.run(config(*args, "run", "steps=1", "resume="))
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != "provenance.jsonl"}
    assert after == before and any(p.name == "metrics.jsonl" for p in before)
    fresh = rl.run(config(*args, "other", "steps=1", "resume="))  # a new folder starts fresh as asked
    assert fresh.name == "step-000001"


def own_episodes(trainer, *, temperature=1.0, offset=0.0, groups=2, group_size=4, seed=0):
    """Hand-made groups (prompt, a turn, an observation, a turn) whose rollout log-probs are the trainer's model's
    own under softmax(logits / temperature), shifted by `offset`; rewards alternate 0, 1 within each group. Their
    random ids are no protocol episode, so the trainer's mask audit is turned off (test_audit.py tests it)."""
    trainer.config.rollout.audit_masks = False
    model = trainer.model
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(groups):
        group = []
        for i in range(group_size):
            length = 20 + 3 * i + g
            ids = torch.randint(3, 200, (length,), generator=gen)
            mask = [0] * 6 + [1] * 5 + [0] * 3 + [1] * (length - 14)  # prompt, turn, observation, turn
            with torch.no_grad():
                logits = model(input_ids=ids[None]).logits[0, :-1]
            own = (logits / temperature).log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
            logprobs = [0.0] + [float(lp) + offset if m else 0.0 for lp, m in zip(own, mask[1:], strict=True)]
            reward = float(i % 2)
            group.append(EpisodeResult(f"p{g}", ids.tolist(), mask, logprobs, 6, [], None, reward, "eos", None, ""))
        out.append(group)
    return out


def gradient(trainer, batch, rows=None, update=0):
    """The flattened gradient one update on `rows` (default: all) leaves in the model, and its loss and clip fraction
    (grads reset after)."""
    trainer.model.zero_grad(set_to_none=True)
    rows = torch.arange(len(batch.ids)) if rows is None else rows
    sums = trainer.accumulate_gradients(batch, rows, update)
    flat = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    trainer.model.zero_grad(set_to_none=True)
    clipped = float(sums["clip_high"] + sums["clip_low"]) / float(sums["tokens"])
    return flat, {"train/loss": float(sums["loss"]), "train/clip_frac": clipped}


def test_update_aligns_targets_and_applies_stare(tmp_path, tiny_model_dir, prompts):
    """Old log-probs match the rollout's token for token (a shifted alignment would not); STARE's weights reach
    the metrics; the full update runs and reports the regime."""
    trainer = rl.Trainer(config(tmp_path, tiny_model_dir, prompts, "update", "steps=1"))
    groups = own_episodes(trainer)
    metrics = trainer.update(groups)
    assert metrics["train/rollout_logprob_abs_diff"] < 1e-5
    assert metrics["train/action_tokens"] == sum(sum(e.action_mask[1:]) for g in groups for e in g)
    assert metrics["stare/gate"] == 1.0 and metrics["stare/weight_mean"] > 1.0
    assert metrics["stare/frac_high_pos"] > 0
    assert sum(metrics[f"theory/regime_{name}"] for name in REGIMES) == 1.0  # one-hot, as the openrlhf backend logs
    assert regime_of(metrics) in REGIMES
    assert metrics["train/ratio_abs_dev"] < 1e-6 and metrics["train/approx_kl"] < 1e-9  # on-policy: the ratio is 1


def test_stare_weights_reach_the_gradient(tmp_path, tiny_model_dir, prompts):
    """The weighted update's gradient equals the unweighted one on advantages scaled by omega, and differs from
    the plain unweighted gradient."""
    trainer = rl.Trainer(config(tmp_path, tiny_model_dir, prompts, "weights", "steps=1"))
    batch, _ = trainer.prepare(own_episodes(trainer))
    assert (batch.weights != 1).any() and (batch.weights[~batch.action_mask] == 1).all()
    ones = torch.ones_like(batch.weights)
    weighted, _ = gradient(trainer, batch)
    scaled = batch.advantages[:, None] * batch.weights
    folded, _ = gradient(trainer, dataclasses.replace(batch, advantages=scaled, weights=ones))
    plain, _ = gradient(trainer, dataclasses.replace(batch, weights=ones))
    assert torch.allclose(weighted, folded, rtol=1e-5, atol=1e-7)
    assert (weighted - plain).norm() > 1e-2 * plain.norm()


def test_surprisal_ranking_picks_the_least_likely_sampled_tokens(tmp_path, tiny_model_dir, prompts):
    """With O1, the reweighted tokens are exactly the ceil(P |T+|) positive-advantage tokens with the lowest
    log-prob of the sampled token (computed here from the rollout, independently of the trainer)."""
    trainer = rl.Trainer(config(tmp_path, tiny_model_dir, prompts, "rank", "steps=1", "stare.top_ratio=0.25"))
    groups = own_episodes(trainer)
    batch, _ = trainer.prepare(groups)
    candidates = []  # (rollout log-prob, row, position) of every action token with A > 0
    for row, episode in enumerate(e for group in groups for e in group):
        if episode.reward == 1.0:
            for t in range(1, len(episode.token_ids)):
                if episode.action_mask[t]:
                    candidates.append((episode.logprobs[t], row, t - 1))
    k = math.ceil(0.25 * len(candidates))
    expected = {(row, t) for _, row, t in sorted(candidates)[:k]}
    chosen = {tuple(i) for i in (batch.weights > 1).nonzero().tolist()}
    assert chosen == expected


def test_token_mean_is_over_the_whole_batch(tmp_path, tiny_model_dir, prompts):
    """Loss and gradient are the same for micro-batches of 1 sequence and of the whole batch."""
    trainer = rl.Trainer(config(tmp_path, tiny_model_dir, prompts, "mean", "steps=1"))
    batch, _ = trainer.prepare(own_episodes(trainer))
    batch = dataclasses.replace(batch, old_logprobs=batch.old_logprobs - 0.1)  # ratios != 1: a non-trivial loss
    results = {}
    for micro in (1, 3, 64):
        trainer.config = dataclasses.replace(
            trainer.config, loss=dataclasses.replace(trainer.config.loss, micro_batch_size=micro)
        )
        results[micro] = gradient(trainer, batch)
    for micro in (1, 3):
        assert torch.allclose(results[micro][0], results[64][0], rtol=1e-5, atol=1e-7)
        assert results[micro][1]["train/loss"] == pytest.approx(results[64][1]["train/loss"], rel=1e-5)


def test_token_budget_micro_batches_take_consecutive_rows_up_to_the_budget():
    from stare_agent.backends.local.common import token_budget_micro_batches

    got = token_budget_micro_batches([5, 3, 9, 2, 2, 8], 8)
    assert got == [slice(0, 2), slice(2, 3), slice(3, 5), slice(5, 6)]  # 5+3; 9 alone (over the budget); 2+2; 8
    assert token_budget_micro_batches([], 8) == []


def test_a_packed_row_attends_within_each_episode(tmp_path, tiny_model_dir, prompts):
    """The reference pass on one packed row equals the padded pass for every episode in it (float rounding), the
    2nd and later episodes included: were attention to cross the boundaries (the packed row read as one sequence)
    their log-probs would differ by far more."""
    trainer = rl.Trainer(config(tmp_path, tiny_model_dir, prompts, "packed", "steps=1"))
    batch, _ = trainer.prepare(own_episodes(trainer))
    padded = rl.reference_stats(trainer.model, batch.ids, batch.attention, 1.0)
    packed = rl.reference_stats(trainer.model, batch.ids, batch.attention, 1.0, packed=True)
    real = batch.attention[:, 1:].bool() & batch.attention[:, :-1].bool()  # positions that predict a real token
    for mine, theirs in zip(packed, padded, strict=True):
        torch.testing.assert_close(mine[real], theirs[real], rtol=1e-4, atol=2e-5)
    one_sequence = batch.attention.clone()  # the same row without episode boundaries: attention crosses them
    flat = batch.ids[batch.attention.bool()][None]
    wrong = trainer.model(input_ids=flat, use_cache=False).logits[0].log_softmax(-1)
    right = trainer.model(input_ids=batch.ids[:1], attention_mask=one_sequence[:1]).logits[0].log_softmax(-1)
    n = int(batch.attention[0].sum())
    torch.testing.assert_close(wrong[:n], right[:n], rtol=1e-4, atol=2e-5)  # the first episode sees nothing before
    second = int(batch.attention[1].sum())
    theirs = trainer.model(input_ids=batch.ids[1:2, :second]).logits[0].log_softmax(-1)
    assert (wrong[n : n + second] - theirs).abs().max() > 1e-2  # ...the second, read as one sequence, does


@pytest.mark.parametrize("method", ["stare", "clip_cov", "kl_cov", "entropy_bonus"])
def test_token_budget_micro_batches_give_the_padded_update(tmp_path, tiny_model_dir, prompts, method):
    """loss.max_tokens_per_micro_batch: reference pass, selection, weights, loss and gradient of an update equal those
    of padded micro-batches (float rounding) for each way an entropy control reaches the update."""
    overrides = ["steps=1", f"entropy_control.method={method}", "optim.updates_per_batch=2"]
    if method == "entropy_bonus":
        overrides.append("entropy_bonus.target_entropy=100")  # far above the tiny model's: the bonus is on
    results = {}
    for budget in (0, 60):
        trainer = rl.Trainer(
            config(tmp_path, tiny_model_dir, prompts, f"budget{budget}", *overrides,
                   f"loss.max_tokens_per_micro_batch={budget}")
        )  # fmt: skip
        rows = []  # the batch size of every forward: 1 (a packed row) with a token budget
        hook = trainer.model.register_forward_pre_hook(
            lambda module, args, kwargs, seen=rows: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True
        )
        batch, metrics = trainer.prepare(own_episodes(trainer))
        if budget:
            micro = trainer._micro_batches(batch.attention)
            assert 1 < len(micro) < len(batch.ids)  # several packed rows, several episodes in some
        flat, losses = gradient(trainer, dataclasses.replace(batch, old_logprobs=batch.old_logprobs - 0.1), update=1)
        hook.remove()
        assert (set(rows) == {1}) == (budget > 0), rows
        results[budget] = (batch, metrics, flat, losses)
    (batch0, metrics0, flat0, loss0), (batch1, metrics1, flat1, loss1) = results[0], results[60]
    real = batch0.attention[:, 1:].bool() & batch0.attention[:, :-1].bool()  # padding is zero in packed passes
    for name in ("old_logprobs", "entropy", "s2", "weights"):
        torch.testing.assert_close(getattr(batch1, name)[real], getattr(batch0, name)[real], rtol=1e-4, atol=2e-5)
    for key in ("stare/entropy_mean", "stare/surprisal_mean", "control/selected_share"):
        if key in metrics0:
            assert metrics1[key] == pytest.approx(metrics0[key], rel=1e-4, abs=1e-6)
    assert loss1["train/loss"] == pytest.approx(loss0["train/loss"], rel=1e-4)
    torch.testing.assert_close(flat1, flat0, rtol=1e-3, atol=1e-6)


def _surrogate_by_hand(model, batch, temperature, eps_low, eps_high):
    """-(1/N) sum over action tokens of omega * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), token by token;
    the policy is softmax(logits / temperature); no KL term."""
    logits = model(input_ids=batch.ids, attention_mask=batch.attention).logits[:, :-1]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    terms = []
    for i, t in batch.action_mask.nonzero().tolist():
        ratio = torch.exp(logprobs[i, t, batch.ids[i, t + 1]] - batch.old_logprobs[i, t])
        a = float(batch.advantages[i])
        clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
        terms.append(batch.weights[i, t] * torch.minimum(ratio * a, clipped * a))
    return -torch.stack(terms).sum() / len(terms)


def test_update_is_the_clip_higher_surrogate_by_hand(tmp_path, tiny_model_dir, prompts):
    """At temperature 0.7 with ratios of 0.75 ... 1.35, the update's gradient is that of the clip-higher
    surrogate (0.2 / 0.28) written out token by token: not the symmetric 0.2 or 0.28 ones, not at temperature 1,
    and only action tokens count."""
    trainer = rl.Trainer(
        config(tmp_path, tiny_model_dir, prompts, "clip", "steps=1", "rollout.temperature=0.7", "stare.top_ratio=0.3")
    )
    batch, _ = trainer.prepare(own_episodes(trainer, temperature=0.7))
    ratios = torch.tensor([1.25, 0.75, 1.1, 0.9, 1.35, 0.7])
    flat = torch.arange(batch.old_logprobs.numel()).view_as(batch.old_logprobs) % len(ratios)
    batch = dataclasses.replace(batch, old_logprobs=batch.old_logprobs - torch.log(ratios[flat]))
    got, metrics = gradient(trainer, batch)
    assert 0 < metrics["train/clip_frac"] < 1

    def by_hand(temperature, eps_low, eps_high):
        trainer.model.zero_grad(set_to_none=True)
        _surrogate_by_hand(trainer.model, batch, temperature, eps_low, eps_high).backward()
        flat = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
        trainer.model.zero_grad(set_to_none=True)
        return flat

    assert torch.allclose(got, by_hand(0.7, 0.2, 0.28), rtol=1e-4, atol=1e-7)
    for other in (by_hand(0.7, 0.2, 0.2), by_hand(0.7, 0.28, 0.28), by_hand(1.0, 0.2, 0.28)):
        assert (got - other).norm() > 1e-3 * got.norm()


def test_advantages_are_normalized_within_each_group(tmp_path, tiny_model_dir, prompts):
    trainer = rl.Trainer(config(tmp_path, tiny_model_dir, prompts, "adv", "steps=1"))
    groups = own_episodes(trainer, group_size=4)
    groups[1][0].reward = 1.0  # rewards 1 1 0 1 in the second group
    batch, _ = trainer.prepare(groups)
    expected = []
    for group in groups:
        rewards = [e.reward for e in group]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
        expected += [(r - mean) / (std + 1e-6) for r in rewards]
    assert batch.advantages.tolist() == pytest.approx(expected, rel=1e-6)


def test_rl_at_temperature_scores_the_sampled_distribution(tmp_path, tiny_model_dir, prompts, varied_reward):
    """Real rollouts at T = 0.6: the trainer's old log-probs equal the sampler's, so the first update's ratio is 1."""
    rl.run(config(tmp_path, tiny_model_dir, prompts, "temp", "steps=1", "rollout.temperature=0.6"))
    (row,) = rows(tmp_path / "temp")
    assert row["train/rollout_logprob_abs_diff"] < 1e-4
    assert row["train/ratio_abs_dev_max"] < 1e-3 and row["train/clip_frac"] == 0.0


def test_a_rollout_trainer_mismatch_warns_once(tmp_path, tiny_model_dir, prompts, capsys):
    trainer = rl.Trainer(config(tmp_path, tiny_model_dir, prompts, "mismatch", "steps=1"))
    _, metrics = trainer.prepare(own_episodes(trainer))
    assert "warning" not in capsys.readouterr().err and metrics["train/rollout_logprob_abs_diff"] < 1e-5
    for _ in range(2):
        _, metrics = trainer.prepare(own_episodes(trainer, offset=-0.3))
        assert metrics["train/rollout_logprob_abs_diff"] == pytest.approx(0.3, abs=1e-4)
    err = capsys.readouterr().err
    assert err.count("rl: warning") == 1 and "0.3 nats on average" in err and "top-k/top-p" in err


def test_rl_runs_without_dropout_so_the_update_is_on_policy(tmp_path, tiny_model_dir, prompts, capsys):
    """A model whose config has attention dropout 0.5: RL turns it off (and says so), so the ratio is 1."""
    model_dir = tmp_path / "dropout_model"
    shutil.copytree(tiny_model_dir, model_dir)
    settings = json.loads((model_dir / "config.json").read_text())
    settings["attention_dropout"] = 0.5
    (model_dir / "config.json").write_text(json.dumps(settings))
    trainer = rl.Trainer(config(tmp_path, model_dir, prompts, "dropout", "steps=1", f"model.path={model_dir}"))
    assert "dropout is off for RL" in capsys.readouterr().out
    metrics = trainer.update(own_episodes(trainer))
    assert metrics["train/ratio_abs_dev_max"] < 1e-5 and metrics["train/clip_frac"] == 0.0


def test_top_p_below_one_is_refused_in_rl(tmp_path, tiny_model_dir, prompts):
    with pytest.raises(ConfigError, match=r"rollout.*top_p must be 1 in RL"):
        config(tmp_path, tiny_model_dir, prompts, "top_p", "rollout.top_p=0.9")


# --- dynamic sampling -----------------------------------------------------------------------------------------


CRASH = "<code>\n```python\nimport os\nos._exit(1)\n```\n</code>"


class PolicyByProblem:
    """A scripted batch generator (stands in for the model): the answer depends on the problem in the prompt.

    kind "varied": right and wrong in turn (a group with both rewards); "flat": always wrong (equal rewards);
    "broken": code that kills its kernel, so the sandbox fails (a sandbox_error, never a reward). Problem i gets
    kinds[i % len(kinds)]; after `flat_after` calls in all, every problem answers flat.
    """

    def __init__(self, tokenizer, problems, kinds=("varied", "flat", "varied", "broken"), flat_after=None):
        self.tokenizer = tokenizer
        self.kinds = {p.problem: kinds[i % len(kinds)] for i, p in enumerate(problems)}
        self.answers = {p.problem: p.answer for p in problems}
        self.calls: dict[str, int] = {}
        self.flat_after = flat_after
        self.stats = SimpleNamespace(seconds=0.0, generated_tokens=0)
        self.generator = torch.Generator()  # saved in checkpoints like the real generator's

    def __call__(self, prompts, max_new_tokens):
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            problem = next(p for p in self.kinds if p in text)
            count = self.calls[problem] = self.calls.get(problem, 0) + 1
            kind = self.kinds[problem]
            if self.flat_after is not None and sum(self.calls.values()) > self.flat_after:
                kind = "flat"
            if kind == "broken":
                reply = CRASH
            else:
                right = kind == "varied" and count % 2 == 0
                reply = f"<answer>\n\\boxed{{{self.answers[problem] if right else 'no'}}}\n</answer>"
            token_ids = protocol.encode_segment(self.tokenizer, reply)
            out.append(Sample(token_ids, [-1.0] * len(token_ids), "stop"))
        return out


def scripted_rl(monkeypatch, prompts, **policy):
    """rl.run and rl.Trainer generate with a PolicyByProblem(**policy) over the prompt file's problems."""
    problems = load_problems(prompts)
    made = []

    def make(model, tokenizer, **_):
        made.append(PolicyByProblem(tokenizer, problems, **policy))
        return made[-1]

    monkeypatch.setattr(rl, "HFGenerator", make)
    return made


SCRIPTED = ["agent.sandbox_retries=1", "agent.retry_backoff_s=0.01"]


@pytest.mark.parametrize("dynamic", [True, False])
def test_dynamic_sampling_drops_equal_and_sandbox_groups_and_refills(
    tmp_path, tiny_model_dir, prompts, dynamic, monkeypatch
):
    made = scripted_rl(monkeypatch, prompts)
    trainer = rl.Trainer(
        config(tmp_path, tiny_model_dir, prompts, f"dyn-{dynamic}", "steps=1", f"rollout.dynamic_sampling={dynamic}",
               *SCRIPTED)
    )  # fmt: skip
    policy = made[0]

    async def rollouts():
        from stare_sandbox.inprocess import InProcessClient
        from stare_sandbox.pool import PoolSettings

        async with InProcessClient(PoolSettings(pool_size=1, max_kernels=16)) as client:
            return await trainer.rollouts(rl.TimedClient(client))

    import asyncio

    kept, fill, metrics = asyncio.run(rollouts())
    seen = [policy.kinds[p] for p in policy.calls]  # every problem drawn this step, once each
    assert metrics["rollout/episodes"] == 4 * len(seen) == 4 * metrics["rollout/prompts_consumed"]
    assert metrics["rollout/groups_dropped_sandbox"] == seen.count("broken") > 0
    assert metrics["rollout/groups_dropped_prompt_too_long"] == 0
    for group in kept:  # never trained on a sandbox failure
        assert all(e.reward is not None for e in group)
        assert (
            policy.kinds[next(p for p in policy.kinds if p in trainer.tokenizer.decode(group[0].token_ids))]
            != "broken"
        )
    assert len(kept) == 3 == metrics["rollout/groups_kept"] and fill.full  # refilled to a full batch either way
    if dynamic:
        assert metrics["rollout/groups_dropped_equal"] == seen.count("flat") > 0
        assert all(len({e.reward for e in group}) == 2 for group in kept)
    else:
        assert metrics["rollout/groups_dropped_equal"] == 0 and seen.count("flat") > 0
        assert len(seen) == 3 + seen.count("broken")


def test_runs_filtered_at_different_rates_train_the_same_full_batches(tmp_path, tiny_model_dir, prompts, monkeypatch):
    """The full-batch rule: however many groups a run drops, each of its `steps` updates trains 3 groups."""
    consumed = {}
    for name, kinds in (("few-drops", ("varied",) * 5 + ("flat",)), ("many-drops", ("varied", "flat", "flat"))):
        scripted_rl(monkeypatch, prompts, kinds=kinds)
        final = rl.run(config(tmp_path, tiny_model_dir, prompts, name, "steps=3", *SCRIPTED))
        assert final.name == "step-000003"
        metrics = rows(tmp_path / name)
        assert [r["step"] for r in metrics] == [1, 2, 3]
        assert all(r["rollout/groups_kept"] == 3 and r["train/action_tokens"] > 0 for r in metrics)
        consumed[name] = sum(r["rollout/prompts_consumed"] for r in metrics)
    assert consumed["many-drops"] > consumed["few-drops"] >= 9


def test_up_front_dispatch_sends_the_need_over_the_keep_rate_and_counts_the_surplus(
    tmp_path, tiny_model_dir, prompts, monkeypatch
):
    """rollout.max_dispatch_factor: each round sends need / (last step's keep rate) prompts at once (the first step
    at initial_keep_rate); groups kept after the batch is full are counted, not trained; every step trains exactly
    prompts_per_step groups."""
    made = scripted_rl(monkeypatch, prompts, kinds=("varied",))  # every group keeps a signal
    dispatch = ["rollout.max_dispatch_factor=2", "rollout.initial_keep_rate=0.5", *SCRIPTED]
    final = rl.run(config(tmp_path, tiny_model_dir, prompts, "dispatch", "steps=3", *dispatch))
    assert final.name == "step-000003"
    metrics = rows(tmp_path / "dispatch")
    assert [r["rollout/groups_kept"] for r in metrics] == [3, 3, 3]
    # step 1: 3 / 0.5 = 6 prompts in one round, all with a signal: 3 trained, 3 surplus; then the rate is 1
    assert [(r["rollout/prompts_consumed"], r["rollout/groups_surplus"]) for r in metrics] == [(6, 3), (3, 0), (3, 0)]
    calls = sum(made[0].calls.values())
    assert calls == 4 * sum(r["rollout/prompts_consumed"] for r in metrics)  # every dispatched group was generated
    plain = rl.run(config(tmp_path, tiny_model_dir, prompts, "plain", "steps=3", *SCRIPTED))
    assert plain.name == "step-000003" and all(r["rollout/groups_surplus"] == 0 for r in rows(tmp_path / "plain"))


def test_a_resumed_run_dispatches_as_the_uninterrupted_one(tmp_path, tiny_model_dir, prompts, varied_reward):
    """The keep rate that sizes a step's dispatch rides in the checkpoint: resuming from step 1 draws the same
    prompts as the run that went on, and ends with the same weights."""
    args = (tmp_path, tiny_model_dir, prompts)
    dispatch = ["steps=3", "save_every=1", "rollout.max_dispatch_factor=3", "rollout.initial_keep_rate=0.4"]
    straight = rl.run(config(*args, "straight", *dispatch))
    rl.run(config(*args, "split", *dispatch))
    split = tmp_path / "split" / "checkpoints"
    shutil.rmtree(split / "step-000003")
    shutil.rmtree(split / "step-000002")
    (split / "latest").write_text("step-000001\n")
    resumed = rl.run(config(*args, "split", *dispatch))
    consumed = [[r["rollout/prompts_consumed"] for r in rows(tmp_path / name)] for name in ("straight", "split")]
    assert consumed[0] == consumed[1] and consumed[0][0] == 8  # ceil(3 / 0.4) at step 1
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_step_that_cannot_fill_its_batch_ends_the_run_cleanly(
    tmp_path, tiny_model_dir, prompts, monkeypatch, capsys
):
    """Step 2 fills 1 of its 3 groups: the run stops after step 1, saves its final model, and says why."""
    scripted_rl(monkeypatch, prompts, kinds=("varied",), flat_after=4 * 4)  # step 1's 3 groups and 1 more
    final = rl.run(config(tmp_path, tiny_model_dir, prompts, "early", "steps=3", "rollout.max_prompts_per_step=5"))
    assert final.name == "step-000001" and (final / "model.safetensors").exists()
    assert [r["step"] for r in rows(tmp_path / "early")] == [1]  # the partial step 2 is neither trained nor logged
    out = capsys.readouterr().out
    assert "trained 1 of 3 steps; stopped early: the step consumed 5 prompts" in out
    assert "kept 1 of the 3 groups a batch needs (dropped: 4 equal)" in out


def test_a_run_that_trains_no_step_exits_non_zero(tmp_path, tiny_model_dir, prompts, monkeypatch, capsys):
    from stare_agent import cli

    scripted_rl(monkeypatch, prompts, kinds=("flat",))
    code = cli.main(["rl", *config_overrides(tmp_path, tiny_model_dir, prompts, "none", "steps=2")])
    assert code == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("stare-agent rl: rl: trained 0 of 2 steps; stopped early: the step consumed 24 prompts")
    assert (tmp_path / "none" / "checkpoints" / "step-000000").exists()  # the (untrained) final model is written


def test_too_many_sandbox_failures_stop_the_run_with_the_last_checkpoint_intact(
    tmp_path, tiny_model_dir, prompts, monkeypatch, capsys
):
    from stare_agent import cli

    scripted_rl(monkeypatch, prompts, kinds=("varied",))
    args = config_overrides(tmp_path, tiny_model_dir, prompts, "broken", "steps=2", "save_every=1", *SCRIPTED)
    assert cli.main(["rl", *args]) == 0
    # the same run resumed for 2 more steps with a sandbox that fails on every problem
    scripted_rl(monkeypatch, prompts, kinds=("broken",))
    resumed = [*args, "steps=4", "resume=auto", "rollout.max_prompts_per_step=3"]
    assert cli.main(["rl", *resumed]) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("stare-agent rl: 3 of the 3 groups of this step failed in the sandbox, more than ")
    assert "rollout.max_sandbox_failure_fraction=0.5" in err
    checkpoints = sorted(p.name for p in (tmp_path / "broken" / "checkpoints").glob("step-*"))
    assert checkpoints == ["step-000001", "step-000002"]  # nothing written after the failure
    assert [r["step"] for r in rows(tmp_path / "broken")] == [1, 2]


def test_critical_w_mode_sets_w_from_the_logged_critical_weight(
    tmp_path, tiny_model_dir, prompts, varied_reward, monkeypatch
):
    """The loop hands each batch's W* to the controller before weighting, and the logged W follows it.

    A random tiny model's batches are all in the `rising` regime (W* undefined), so the real diagnostics'
    W* is replaced by a fixed sequence; everything else (regime, Lambda, Gamma) is the real one.
    """
    sequence = iter([3.0, float("nan"), 5.0, 2.0])

    def diagnostics(*args):
        out = batch_diagnostics(*args)
        return out | {"theory/critical_weight": torch.tensor(next(sequence))}

    monkeypatch.setattr(step_module, "batch_diagnostics", diagnostics)  # the shared step both backends call
    overrides = ["steps=4", "stare.w_mode=critical", "stare.w=1.05", "stare.w_max=4.5", "stare.w_smoothing=0.5"]
    rl.run(config(tmp_path, tiny_model_dir, prompts, "critical", *overrides, "stare.w_margin=0.2"))
    metrics = rows(tmp_path / "critical")
    # W* 3 -> estimate 3, W 1 + 1.2 * 2; undefined (logged null) -> W 1.05, estimate kept; W* 5 -> counted as 4.5
    # (w_max) -> estimate 3.75, W 4.3; W* 2 -> estimate 2.875, W 3.25
    assert [r["theory/critical_weight"] for r in metrics] == [3.0, None, 5.0, 2.0]
    assert [r["stare/w_star_smoothed"] for r in metrics] == pytest.approx([3.0, 3.0, 3.75, 2.875], rel=1e-6)
    assert [r["stare/w"] for r in metrics] == pytest.approx([3.4, 1.05, 4.3, 3.25], rel=1e-6)


@pytest.mark.parametrize("method", ["clip_cov", "kl_cov", "forking_tokens", "low_prob_reweight", "entropy_bonus"])
def test_every_method_trains_a_step_with_off_policy_updates(tmp_path, tiny_model_dir, prompts, varied_reward, method):
    """One step of 12 episodes in 2 updates: the second update is off-policy (ratio != 1), the method's metrics
    are logged, and the weights move."""
    overrides = ["steps=1", f"entropy_control.method={method}", "optim.updates_per_batch=2", "clip_cov.ratio=0.1",
                 "clip_cov.lb=-100", "kl_cov.ratio=0.1", "low_prob_reweight.threshold=0.5",
                 "entropy_bonus.target_entropy=100", "entropy_bonus.max_coef=0.1",
                 "entropy_bonus.initial_coef=0.01"]  # fmt: skip
    final = rl.run(config(tmp_path, tiny_model_dir, prompts, "run", *overrides))
    (row,) = rows(tmp_path / "run")
    assert row["train/approx_kl"] > 0 and row["train/ratio_abs_dev"] > 0  # the second update saw a moved policy
    assert 0 < row["control/selected_share"] <= 1
    assert row["control/weight_mean"] != 1.0 or method in ("kl_cov", "entropy_bonus")
    assert ("control/coef" in row) == (method in ("kl_cov", "entropy_bonus"))
    assert row["entropy/reasoning"] > 0 and "rollout/void_turns" in row  # the tiny model rarely writes a tag
    assert (row.get("control/selected_share_reasoning") is not None) == (method != "entropy_bonus")
    before, after = load_file(str(tiny_model_dir / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


def _loss_by_hand(trainer, batch, method, selected, alpha):
    """The method's loss at an update, token by token from a fresh forward (the model has not moved): clipped
    surrogate (Clip-Cov: 0 on its tokens; KL-Cov: unclipped, + coef |log-ratio| on its tokens), minus alpha times
    the mean entropy of softmax(logits) over the action tokens."""
    logits = trainer.model(input_ids=batch.ids, attention_mask=batch.attention).logits[:, :-1]
    logprobs = torch.log_softmax(logits, dim=-1)
    terms = []
    for i, t in batch.action_mask.nonzero().tolist():
        log_ratio = logprobs[i, t, batch.ids[i, t + 1]] - batch.old_logprobs[i, t]
        ratio, a = torch.exp(log_ratio), float(batch.advantages[i])
        term = -ratio * a if method == "kl_cov" else -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a)
        if selected is not None and selected[i, t]:
            term = term * 0 if method == "clip_cov" else term + trainer.config.kl_cov.coef * log_ratio.abs()
        entropy = -(logprobs[i, t].exp() * logprobs[i, t]).sum()
        terms.append(term - alpha * entropy)
    return torch.stack(terms).sum() / len(terms)


@pytest.mark.parametrize("method", ["clip_cov", "kl_cov", "entropy_bonus"])
def test_loss_time_methods_are_their_token_loop_on_the_model(tmp_path, tiny_model_dir, prompts, method):
    """A second update's gradient (update 1: the selection comes from a no-grad pass of the current policy) equals
    the token loop's, with the selection recomputed here from the definitions; and differs from plain GRPO's."""
    from stare_agent.entropy_control import clip_cov_generator, clip_cov_select, kl_cov_select

    trainer = rl.Trainer(
        config(tmp_path, tiny_model_dir, prompts, "m", "steps=1", f"entropy_control.method={method}",
               "clip_cov.ratio=0.2", "clip_cov.lb=-100", "clip_cov.ub=100", "kl_cov.ratio=0.2", "kl_cov.coef=3")
    )  # fmt: skip
    batch, _ = trainer.prepare(own_episodes(trainer))
    shift = torch.linspace(-0.3, 0.3, batch.old_logprobs.numel()).view_as(batch.old_logprobs)
    batch = dataclasses.replace(
        batch, old_logprobs=batch.old_logprobs + shift, entropy_coef=0.5 * (method == "entropy_bonus")
    )
    with torch.no_grad():
        current = rl.sequence_logprobs(trainer.model, batch.ids, batch.attention, 1.0)
    mask, adv = batch.action_mask, batch.advantages[:, None].expand_as(current)
    selected = None
    if method == "clip_cov":
        draw = clip_cov_generator(0, trainer.control.step, 1)
        selected = clip_cov_select(adv, current, batch.old_logprobs, mask, ratio=0.2, lb=-100, ub=100, eps_low=0.2,
                                   eps_high=0.28, generator=draw)  # fmt: skip
    elif method == "kl_cov":
        selected = kl_cov_select(adv, current, mask, ratio=0.2)
    assert selected is None or selected.any()
    got, _ = gradient(trainer, batch, update=1)
    trainer.model.zero_grad(set_to_none=True)
    _loss_by_hand(trainer, batch, method, selected, batch.entropy_coef).backward()
    expected = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    trainer.model.zero_grad(set_to_none=True)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-6)
    _loss_by_hand(trainer, batch, "none", None, 0.0).backward()
    plain = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    trainer.model.zero_grad(set_to_none=True)
    assert (got - plain).norm() > 1e-3 * plain.norm()


def test_updates_per_batch_must_split_the_batch_evenly(tmp_path, tiny_model_dir, prompts):
    with pytest.raises(ConfigError, match="updates_per_batch=5 must divide the batch's 12 episodes"):
        config(tmp_path, tiny_model_dir, prompts, "u", "optim.updates_per_batch=5")


@pytest.mark.parametrize("audit", [True, False])
def test_an_unshifted_mask_stops_the_run_naming_the_sample(
    tmp_path, tiny_model_dir, prompts, monkeypatch, capsys, audit
):
    """rollout.audit_masks checks what the update receives: a batch whose action mask was not shifted to the
    predicting position (an off-by-one in padding) stops the run (exit 5) before it trains on it."""
    from stare_agent import cli

    original = rl.pad_batch

    def unshifted(results, pad_id, device):
        out = original(results, pad_id, device)
        full = torch.zeros_like(out["action_mask"][:, :1])
        out["action_mask"] = torch.cat([full, out["action_mask"][:, :-1]], dim=1)  # mask[:, :-1] for mask[:, 1:]
        return out

    monkeypatch.setattr(rl, "pad_batch", unshifted)
    scripted_rl(monkeypatch, prompts, kinds=("varied",))
    overrides = config_overrides(tmp_path, tiny_model_dir, prompts, "audit", "steps=1", f"rollout.audit_masks={audit}")
    code = cli.main(["rl", *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    if audit:
        assert code == 5 and not (tmp_path / "audit" / "checkpoints" / "step-000001").exists()
        assert err[-1].startswith("stare-agent rl: mask audit (rollout.audit_masks): rl step 1, sample 0 (problem ")
        assert "position" in err[-1] and "token" in err[-1]
    else:  # without the audit the off-by-one trains silently
        assert code == 0 and (tmp_path / "audit" / "checkpoints" / "step-000001").exists()
