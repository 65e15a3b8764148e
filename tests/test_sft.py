"""The local SFT loop on the tiny model: training, exact resume, and checkpoints that survive a killed save."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from stare_agent.backends.local import common, sft
from stare_agent.config import SFTConfig, load_config
from stare_agent.data import SFTExample

SAMPLE = "data/retool_sft/sample.jsonl"


def config(tmp_path, model_dir, name, *overrides):
    return load_config(
        SFTConfig,
        None,
        [
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            f"model.path={model_dir}",
            f"data.train_file={SAMPLE}",
            "data.max_tokens=512",
            "micro_batch_size=4",
            "grad_accum=2",
            "log_every=1",
            "eval_every=2",
            *overrides,
        ],
    )


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


def test_sft_trains_and_writes_a_loadable_checkpoint(tmp_path, tiny_model_dir):
    final = sft.run(config(tmp_path, tiny_model_dir, "two", "max_steps=2"))
    assert final.name == "step-000002" and (final / "config.json").exists() and (final / "trainer_state.pt").exists()
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "eval/loss" in rows[1]
    assert all(r["train/loss"] > 0 and r["train/lr"] > 0 for r in rows)
    assert (tmp_path / "two" / "config.yaml").exists() and any((tmp_path / "two" / "tb").iterdir())
    before, after = weights(tiny_model_dir), weights(final)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(final)
    assert AutoTokenizer.from_pretrained(final)("x")["input_ids"]


def test_loss_decreases_over_a_few_steps(tmp_path, tiny_model_dir):
    sft.run(config(tmp_path, tiny_model_dir, "learn", "max_steps=12", "optim.lr=3e-3", "optim.warmup_steps=0"))
    rows = [json.loads(line) for line in (tmp_path / "learn" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["train/loss"] < 0.8 * rows[0]["train/loss"]


def test_resume_is_exact(tmp_path, tiny_model_dir):
    straight = sft.run(config(tmp_path, tiny_model_dir, "straight", "max_steps=4"))
    sft.run(config(tmp_path, tiny_model_dir, "split", "max_steps=4", "save_every=2"))
    # keep only the step-2 checkpoint, as if the run had been stopped right after saving it
    split_dir = tmp_path / "split"
    shutil.rmtree(split_dir / "checkpoints" / "step-000004")
    (split_dir / "checkpoints" / "latest").write_text("step-000002\n")
    resumed = sft.run(config(tmp_path, tiny_model_dir, "split", "max_steps=4", "resume=auto"))
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(line)["step"] for line in (split_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # steps after the checkpoint were dropped from the log and redone


def test_a_killed_save_leaves_the_last_good_checkpoint(tmp_path, tiny_model_dir, monkeypatch):
    run_dir = tmp_path / "killed"
    sft.run(config(tmp_path, tiny_model_dir, "killed", "max_steps=2", "save_every=1"))
    good = common.latest_checkpoint(run_dir)
    assert good.name == "step-000002"

    def dies(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing trainer_state.pt")

    monkeypatch.setattr(common.torch, "save", dies)
    model, tokenizer = common.load_model(load_config(SFTConfig, None, [f"model.path={good}"]).model)
    with pytest.raises(KeyboardInterrupt):
        common.save_checkpoint(run_dir, 3, model, tokenizer, {"step": 3})
    monkeypatch.undo()
    assert common.latest_checkpoint(run_dir) == good  # still the complete one
    assert list((run_dir / "checkpoints").glob(".partial-*"))
    assert common.resolve_resume("auto", run_dir) == good
    assert not list((run_dir / "checkpoints").glob(".partial-*"))  # cleaned up on the next start
    assert common.load_trainer_state(good)["step"] == 2


def test_a_non_finite_gradient_stops_the_run_and_applies_nothing(tmp_path, tiny_model_dir, monkeypatch):
    """One NaN step would make every weight NaN: the run stops at it with the weights, the optimizer state and the
    latest checkpoint as they were before it."""
    run_dir = tmp_path / "nan"
    sft.run(config(tmp_path, tiny_model_dir, "nan", "max_steps=2", "save_every=2"))
    good = common.latest_checkpoint(run_dir)
    real_loss = sft.token_loss_sum

    def poisoned(*args, **kwargs):
        loss, count = real_loss(*args, **kwargs)
        return loss * torch.tensor(float("nan")), count

    monkeypatch.setattr(sft, "token_loss_sum", poisoned)
    with pytest.raises(common.NonFiniteGradient, match=r"^sft step 3: the gradient norm is nan .*not applied"):
        sft.run(config(tmp_path, tiny_model_dir, "nan", "max_steps=4", "save_every=1", "resume=auto"))
    assert common.latest_checkpoint(run_dir) == good  # step 3 saved nothing


def test_clip_and_step_checks_the_norm_before_it_touches_anything():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    expected = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters()))
    before = [p.detach().clone() for p in model.parameters()]
    assert common.clip_and_step(model, optimizer, None, 1e-3) == pytest.approx(float(expected))  # before clipping
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    model(torch.ones(4, 3)).sum().backward()
    model[1].weight.grad[0, 1] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    with pytest.raises(
        common.NonFiniteGradient, match=r"^here: the gradient norm is inf \(1 of 4 .* first 1\.weight\)"
    ):
        common.clip_and_step(model, optimizer, None, 1.0, "here: ")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(torch.equal(m, optimizer.state[p]["exp_avg"]) for m, p in zip(moments, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_collate_masks_and_loss_counts_only_model_tokens(tiny_tokenizer):
    examples = [SFTExample("a", [5, 6, 7, 8], [0, 0, 1, 1], "x"), SFTExample("b", [5, 6], [0, 1], "y")]
    ids, attention, loss_mask = sft.collate(examples, tiny_tokenizer.pad_token_id, torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7, 8], [5, 6, 0, 0]] and attention.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]

    class Uniform(torch.nn.Module):  # every next token equally likely: the loss is log(V) per counted target
        def forward(self, input_ids, attention_mask):
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 10)})()

    total, count = sft.token_loss_sum(Uniform(), ids, attention, loss_mask)
    assert count == 3 and torch.isclose(total, 3 * torch.log(torch.tensor(10.0)))


def test_stream_is_a_sequence_of_permutations():
    items = common.stream_indices(5, seed=1, start=0, count=15)
    assert [sorted(items[i : i + 5]) for i in (0, 5, 10)] == [list(range(5))] * 3
    assert common.stream_indices(5, seed=1, start=7, count=4) == items[7:11]
