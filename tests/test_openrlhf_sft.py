"""SFT with backend openrlhf: our masked dataset in OpenRLHF's convention, the entry point, and the flags.

The first part runs anywhere (the dataset needs no openrlhf). The tests taking the `orl` fixture run OpenRLHF
0.11.2's own code (its parser, `zero_pad_sequences`, and `SFTTrainer.fit` with its `Actor` on the tiny model)
and are skipped where openrlhf is not installed (it is, with --no-deps, in the side venv of
docs/dev/openrlhf_cpu.md).
"""

from __future__ import annotations

import copy
import json
import math
import sys
from types import SimpleNamespace as NS

import pytest
import torch

from stare_agent.backends.local import common
from stare_agent.backends.local import sft as local_sft
from stare_agent.backends.openrlhf import sft, upstream
from stare_agent.config import ConfigError, SFTConfig, load_config
from stare_agent.data import DataError, load_sft

SAMPLE = "data/retool_sft/sample.jsonl"


def sample_rows() -> list[dict]:
    with open(SAMPLE, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def strategy(**data) -> NS:
    """The part of OpenRLHF's strategy the dataset reads: args.data (input_key = our messages_field)."""
    return NS(args=NS(data=NS(input_key="messages", **data)), print=lambda *args: None)


def make_dataset(tokenizer, max_tokens=4096, truncation="right", rows=None, **data) -> sft.StareSFTDataset:
    rows = sample_rows() if rows is None else rows
    return sft.StareSFTDataset(rows, tokenizer, max_tokens, strategy(**data), truncation=truncation)


def trained_targets_openrlhf(dataset) -> set[tuple[int, int, int]]:
    """(row, position, token id) of every target OpenRLHF's SFTTrainer trains: it pairs `loss_mask[:, :-1]`
    with log p(x_{t+1} | x_<=t) (sft_trainer.py:184, models/actor.py:243,289,293)."""
    targets = set()
    for row in range(len(dataset)):
        ids, _, loss_mask = dataset[row]
        for t in torch.nonzero(loss_mask[0, :-1]).flatten().tolist():
            targets.add((row, t + 1, int(ids[0, t + 1])))
    return targets


def trained_targets_local(examples) -> set[tuple[int, int, int]]:
    """The same for the local backend: token_loss_sum weights the target at t by loss_mask[t], t >= 1."""
    return {
        (row, t, e.input_ids[t])
        for row, e in enumerate(examples)
        for t in range(1, len(e.input_ids))
        if e.loss_mask[t]
    }


# --- the dataset, anywhere ------------------------------------------------------------------------------------


def test_items_are_the_local_ids_with_the_mask_shifted_to_the_predicting_position(tiny_tokenizer):
    examples, _ = load_sft(SAMPLE, tiny_tokenizer, max_tokens=4096)
    dataset = make_dataset(tiny_tokenizer)
    assert len(dataset) == len(examples) == 64
    for row, example in enumerate(examples):
        ids, attention, loss_mask = dataset[row]
        n = len(example.input_ids)
        assert ids.shape == attention.shape == loss_mask.shape == (1, n)
        assert ids.dtype == torch.long and loss_mask.dtype == torch.float32 and bool((attention == 1).all())
        assert ids[0].tolist() == example.input_ids
        assert loss_mask[0, :-1].tolist() == example.loss_mask[1:] and loss_mask[0, -1] == 0
        assert ids[0, -1] == tiny_tokenizer.eos_token_id and loss_mask[0, -2] == 1  # EOS is a trained target


@pytest.mark.parametrize("max_tokens", [4096, 500])  # 500 cuts most rows inside the transcript
def test_trained_targets_equal_the_local_backends(tiny_tokenizer, max_tokens):
    examples, report = load_sft(SAMPLE, tiny_tokenizer, max_tokens=max_tokens)
    dataset = make_dataset(tiny_tokenizer, max_tokens)
    assert (report.truncated > 0) == (max_tokens == 500) and dataset.report.truncated == report.truncated
    targets = trained_targets_openrlhf(dataset)
    assert targets == trained_targets_local(examples) and len(targets) > 1000
    # batched, as both trainers see them: OpenRLHF's loss_mask[:, :-1] is the local weight loss_mask[:, 1:]
    _, _, local_mask = local_sft.collate(examples[:8], tiny_tokenizer.pad_token_id, torch.device("cpu"))
    _, _, orl_mask = dataset.collate_fn([dataset[i] for i in range(8)])
    assert torch.equal(orl_mask[:, :-1], local_mask[:, 1:])


def test_with_qwens_tokenizer_both_backends_train_the_same_targets(qwen_tokenizer):
    """The paper's real tokenizer (conftest.py): every trained target of OpenRLHF's dataset is the local one's,
    and none of them lies in the prompt or an interpreter block (test_qwen.py checks the local mask itself)."""
    examples, _ = load_sft(SAMPLE, qwen_tokenizer, max_tokens=8192)
    dataset = make_dataset(qwen_tokenizer, 8192)
    targets = trained_targets_openrlhf(dataset)
    assert targets == trained_targets_local(examples) and len(targets) > 1000
    for row, example in enumerate(examples):
        ids, _, loss_mask = dataset[row]
        assert ids[0].tolist() == example.input_ids and loss_mask[0, :-1].tolist() == example.loss_mask[1:]


@pytest.mark.parametrize(
    ("max_tokens", "truncation", "cut", "dropped"),
    [(420, "right", True, True), (600, "right", True, False), (600, "drop", False, True)],
)
def test_truncation_follows_load_sft(tiny_tokenizer, max_tokens, truncation, cut, dropped):
    # prompts here are 348-423 tokens and rows 438-777: at 420 some prompts fill the budget (left out under
    # `right` too) and the rest are cut; at 600 rows are cut (`right`) or left out (`drop`)
    examples, report = load_sft(SAMPLE, tiny_tokenizer, max_tokens=max_tokens, truncation=truncation)
    dataset = make_dataset(tiny_tokenizer, max_tokens, truncation)
    assert (report.truncated > 0, len(report.dropped) > 0) == (cut, dropped)
    assert [e.input_ids for e in dataset.examples] == [e.input_ids for e in examples]
    assert [e.loss_mask for e in dataset.examples] == [e.loss_mask for e in examples]
    assert [e.truncated for e in dataset.examples] == [e.truncated for e in examples]
    assert dataset.report.truncated == report.truncated
    assert [d.split(": ", 1)[1] for d in dataset.report.dropped] == [d.split(": ", 1)[1] for d in report.dropped]
    assert all(dataset[i][0].shape[-1] <= max_tokens for i in range(len(dataset)))


def test_truncation_error_and_nothing_left_name_the_row(tiny_tokenizer):
    with pytest.raises(DataError, match=r"^row \d+: \d+ tokens > max_tokens=500 \(truncation='error'\)"):
        make_dataset(tiny_tokenizer, 500, "error")
    with pytest.raises(DataError, match="no SFT examples left: all 64 rows were dropped"):
        make_dataset(tiny_tokenizer, 300)
    with pytest.raises(DataError, match=r"^row 1: missing field 'messages'"):
        make_dataset(tiny_tokenizer, rows=[sample_rows()[0], {"text": "x"}])


def test_the_messages_field_comes_from_input_key(tiny_tokenizer):
    rows = [{"conversation": row["messages"]} for row in sample_rows()[:3]]
    dataset = sft.StareSFTDataset(rows, tiny_tokenizer, 4096, NS(args=NS(data=NS(input_key="conversation"))))
    assert dataset[2][0][0].tolist() == make_dataset(tiny_tokenizer).examples[2].input_ids


def tokenizer_padding_with_eos(tokenizer):
    """A copy whose pad id is not 0, so that padding ids with 0 (like the masks) would show."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.pad_token = tokenizer.eos_token
    assert tokenizer.pad_token_id not in (None, 0)
    return tokenizer


def test_collate_right_pads_ids_with_the_pad_id_and_masks_with_zero(tiny_tokenizer):
    tiny_tokenizer = tokenizer_padding_with_eos(tiny_tokenizer)
    dataset = make_dataset(tiny_tokenizer)
    items = [dataset[i] for i in (0, 5, 6)]
    lengths = [item[0].shape[-1] for item in items]
    assert len(set(lengths)) > 1
    ids, attention, loss_mask = dataset.collate_fn(items)
    assert ids.shape == attention.shape == loss_mask.shape == (3, max(lengths))
    assert ids.dtype == torch.long and loss_mask.dtype == torch.float32
    for row, (item_ids, _, item_mask) in enumerate(items):
        n = lengths[row]
        assert torch.equal(ids[row, :n], item_ids[0]) and torch.equal(loss_mask[row, :n], item_mask[0])
        assert bool((ids[row, n:] == tiny_tokenizer.pad_token_id).all())
        assert attention[row].tolist() == [1] * n + [0] * (max(lengths) - n)
        assert not loss_mask[row, n - 1 :].any()


@pytest.mark.parametrize(
    ("option", "flag"),
    [
        ({"pretrain_mode": True}, "--model.pretrain_mode_enable"),
        ({"multiturn": True}, "--data.multiturn"),
        ({"output_key": "response"}, "--data.output_key"),
        ({"apply_chat_template": True}, "--data.apply_chat_template"),
        ({"tokenizer_chat_template": "{{x}}"}, "--data.tokenizer_chat_template"),
    ],
)
def test_openrlhf_options_that_would_change_training_are_refused(tiny_tokenizer, option, flag):
    data = {k: v for k, v in option.items() if k not in ("pretrain_mode", "multiturn")}
    kwargs = {k: v for k, v in option.items() if k in ("pretrain_mode", "multiturn")}
    with pytest.raises(ValueError, match=f"{flag}=.* is not supported"):
        sft.StareSFTDataset(sample_rows()[:1], tiny_tokenizer, 4096, strategy(**data), **kwargs)


# --- the entry point's options and the flags ------------------------------------------------------------------


def test_entry_options_are_taken_out_and_the_rest_is_left_for_openrlhf():
    argv = ["--local_rank=0", "--stare.truncation", "drop", "--data.max_len", "8", "--stare.warmup_steps", "7"]
    options, rest = sft.parse_entry_options(argv)
    assert options == sft.EntryOptions(truncation="drop", warmup_steps=7)
    assert rest == ["--local_rank=0", "--data.max_len", "8"]
    with pytest.raises(SystemExit):
        sft.parse_entry_options(["--stare.truncation", "left", "--stare.warmup_steps", "0"])
    with pytest.raises(SystemExit):  # required: the launcher always passes both, defaults live in our config
        sft.parse_entry_options(["--stare.truncation", "right"])


def config(*overrides: str) -> SFTConfig:
    base = ["backend=openrlhf", "model.path=/models/qwen", "model.dtype=bfloat16", "data.eval_fraction=0"]
    return load_config(SFTConfig, None, [*base, *overrides])


def test_flags_map_our_keys(tmp_path):
    cfg = config(
        "data.max_tokens=2048", "data.messages_field=conv", "micro_batch_size=4", "grad_accum=8", "epochs=3",
        "optim.lr=2e-5", "optim.schedule=cosine", "optim.min_lr_ratio=0.1", "optim.max_grad_norm=0.5",
        "run.seed=7", "save_every=100", "resume=auto", "data.eval_file=held.jsonl", "eval_every=25",
    )  # fmt: skip
    flags = {name: value for name, (value, _) in sft.sft_flags(cfg, tmp_path / "run").items()}
    assert flags["model.model_name_or_path"] == "/models/qwen" and flags["ds.param_dtype"] == "bf16"
    assert flags["data.dataset"] == cfg.data.train_file and flags["data.input_key"] == "conv"
    assert flags["data.max_len"] == 2048 and flags["train.max_epochs"] == 3
    assert flags["train.micro_batch_size"] == 4 and flags["train.batch_size"] == 32
    assert flags["adam.lr"] == 2e-5 and flags["adam.betas"] == [0.9, 0.999] and flags["max_norm"] == 0.5
    assert flags["lr_scheduler"] == "cosine_with_min_lr" and flags["min_lr_ratio"] == 0.1
    assert flags["lr_warmup_ratio"] == 0.0 and flags["train.seed"] == 7
    assert flags["eval.dataset"] == "held.jsonl" and flags["eval.steps"] == 25 and flags["ckpt.save_steps"] == 100
    assert flags["ckpt.path"] == str((tmp_path / "run" / "checkpoints").absolute()) and flags["ckpt.load_enable"]
    assert sft.entry_flags(cfg) == {
        "stare.truncation": ("right", "data.truncation"),
        "stare.warmup_steps": (10, "optim.warmup_steps"),
    }
    plain = {name: value for name, (value, _) in sft.sft_flags(config(), tmp_path / "run").items()}
    assert "eval.dataset" not in plain and "ckpt.save_steps" not in plain and plain["ckpt.load_enable"] is True
    fresh = {name: value for name, (value, _) in sft.sft_flags(config("resume="), tmp_path / "run").items()}
    assert fresh["ckpt.load_enable"] is False  # resume='' starts at step 0 (refused over a checkpoint: below)


def test_a_fresh_start_over_an_sft_checkpoint_is_refused(tmp_path):
    pytest.importorskip("openrlhf")
    from stare_agent.backends.openrlhf import launch

    run_dir = tmp_path / "run"
    launch.resolve_sft(config("resume="), run_dir)  # nothing there yet
    (run_dir / "checkpoints" / "global_step10").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("global_step10")
    with pytest.raises(ConfigError, match=r"resume='' starts the run over, but .* holds a complete checkpoint"):
        launch.resolve_sft(config("resume="), run_dir)
    launch.resolve_sft(config(), run_dir)  # the default continues it


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["max_steps=5"], "max_steps=5: OpenRLHF's SFT trainer runs whole epochs"),
        (["data.eval_fraction=0.1"], "data.eval_fraction=0.1: OpenRLHF reads eval data only from a file"),
        (["data.eval_file=x.jsonl", "eval_every=0"], "eval_every=0 .* has no OpenRLHF equivalent"),
        (["model.dtype=float32"], "model.dtype=float32: OpenRLHF trains in bf16 or fp16"),
        (["model.device=cpu"], "model.device='cpu'"),
        (["run.threads=4"], "run.threads=4"),
        (["optim.schedule=linear", "optim.min_lr_ratio=0.1"], "optim.min_lr_ratio=0.1 with optim.schedule=linear"),
        (["resume=/elsewhere"], "resume='/elsewhere'"),
    ],
)
def test_keys_without_an_openrlhf_equivalent_are_refused(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        sft.sft_flags(config(*overrides), tmp_path)


# --- OpenRLHF's own code (skipped without openrlhf) -----------------------------------------------------------


@pytest.fixture(scope="module")
def orl():
    pytest.importorskip("openrlhf")
    for name in (upstream.SFT_CLI, "openrlhf.trainer.sft_trainer", "openrlhf.utils.deepspeed.deepspeed"):
        upstream.import_openrlhf(name)  # with stand-ins for flash_attn/vllm where they are missing


def test_openrlhf_parser_accepts_the_flags(orl, tmp_path):
    from openrlhf.utils.config import hierarchize

    from stare_agent.backends.openrlhf.launch import to_argv

    for overrides in ([], ["optim.schedule=constant", "model.dtype=float16"]):
        cfg = config("data.eval_file=held.jsonl", "save_every=10", "resume=auto", *overrides)
        ours = {name: value for name, (value, _) in sft.sft_flags(cfg, tmp_path).items()}
        entry = {name: value for name, (value, _) in sft.entry_flags(cfg).items()}
        argv = to_argv(entry) + to_argv(ours)
        options, rest = sft.parse_entry_options(argv)
        namespace = upstream.capture_parser(upstream.SFT_CLI).parse_args(rest)
        for name, value in ours.items():
            assert getattr(namespace, name) == value, name
        assert hierarchize(namespace).data.input_key == "messages"
        assert options == sft.EntryOptions(cfg.data.truncation, cfg.optim.warmup_steps)


def test_collate_equals_openrlhfs_zero_pad_sequences(orl, tiny_tokenizer):
    from openrlhf.utils.utils import zero_pad_sequences

    tiny_tokenizer = tokenizer_padding_with_eos(tiny_tokenizer)
    dataset = make_dataset(tiny_tokenizer)
    items = [dataset[i] for i in (3, 0, 7)]
    ids, attention, loss_mask = dataset.collate_fn(items)
    assert torch.equal(ids, zero_pad_sequences([i[0] for i in items], "right", tiny_tokenizer.pad_token_id))
    assert torch.equal(attention, zero_pad_sequences([i[1] for i in items], "right"))
    assert torch.equal(loss_mask, zero_pad_sequences([i[2] for i in items], "right"))


class OneProcessStrategy:
    """The DeepspeedStrategy calls SFTTrainer.fit makes, for one CPU process without DeepSpeed. DeepSpeed scales
    each micro-batch's loss by 1/gas before backward (openrlhf/utils/loss_utils.py:60 counts on it) and steps
    the optimizer only at the accumulation boundary; here nothing steps, so the gradients can be read after."""

    ring_attn_group = None

    def __init__(self, args, accumulated_gradient):
        self.args, self.accumulated_gradient = args, accumulated_gradient

    def is_rank_0(self):
        return False  # no progress bars

    def backward(self, loss, model, optimizer):
        (loss / self.accumulated_gradient).backward()

    def optimizer_step(self, optimizer, model, scheduler):
        pass

    def get_grad_norm(self, model):
        return 0.0

    def all_reduce(self, logs):
        return logs

    def print(self, *args):
        pass


@pytest.mark.slow
def test_openrlhfs_sft_trainer_trains_the_local_backends_targets(orl, tiny_model_dir, tiny_tokenizer):
    """One optimizer step of OpenRLHF's real SFTTrainer.fit (its Actor, SFTLoss, mask slicing and step-level
    token normalisation) on our dataset gives the local backend's gradient: the same tokens, the same mean."""
    from openrlhf.models import Actor
    from openrlhf.trainer.sft_trainer import SFTTrainer
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    micro, gas = 2, 2
    dataset = make_dataset(tiny_tokenizer, 500, rows=sample_rows()[: micro * gas])  # rows cut at 500 included
    assert dataset.report.truncated > 0
    args = NS(
        model=NS(aux_loss_coef=0),
        ds=NS(packing_samples=False),
        logger=NS(wandb=NS(key=None), tensorboard_dir=None, logging_steps=1),
        eval=NS(steps=-1),
        ckpt=NS(save_steps=-1),
        train=NS(batch_size=micro * gas),
    )
    actor = Actor(model)
    actor.packing_samples = False  # set only when Actor loads a model by name
    model.global_steps = 1  # what the DeepSpeed engine reports after one step
    loader = torch.utils.data.DataLoader(dataset, batch_size=micro, shuffle=False, collate_fn=dataset.collate_fn)
    scheduler = NS(get_last_lr=lambda: [0.0])
    trainer = SFTTrainer(
        actor, OneProcessStrategy(args, gas), None, loader, None, scheduler, batch_size=micro * gas, max_epochs=1
    )
    trainer.fit(args, 0, None)
    openrlhf_grads = {name: p.grad.clone() for name, p in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    examples, _ = load_sft(SAMPLE, tiny_tokenizer, max_tokens=500)
    examples = examples[: micro * gas]
    n_trained = sum(sum(e.loss_mask[1:]) for e in examples)  # as local_sft.run counts them
    for start in range(0, micro * gas, micro):
        batch = local_sft.collate(examples[start : start + micro], tiny_tokenizer.pad_token_id, torch.device("cpu"))
        loss_sum, _ = local_sft.token_loss_sum(model, *batch)
        (loss_sum / n_trained).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(openrlhf_grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.filterwarnings("ignore:'openrlhf.cli.train_sft' found in sys.modules:RuntimeWarning")  # the fixture
def test_main_runs_train_sft_with_our_dataset_in_its_namespace(orl, monkeypatch):
    """`python -m stare_agent.backends.openrlhf.sft ...`: the CLI runs as __main__ with our dataset bound to its
    `SFTDataset` and our options taken out of its argv (stopped at parse_args, before anything trains)."""
    import argparse
    import importlib

    import openrlhf.utils.deepspeed.deepspeed as strategy_module

    def owner(path):  # a module, or a class of one
        try:
            return importlib.import_module(path)
        except ModuleNotFoundError:
            module, name = path.rsplit(".", 1)
            return getattr(importlib.import_module(module), name)

    originals = {}
    for dotted in sft.PATCHED:
        path, name = dotted.rsplit(".", 1)
        originals[dotted] = getattr(owner(path), name)
        monkeypatch.setattr(owner(path), name, originals[dotted])  # undone after the test
    monkeypatch.setattr(sys, "argv", ["sft.py"])
    seen = {}

    class Stop(Exception):
        pass

    original = argparse.ArgumentParser.parse_args

    def intercept(self, args=None, namespace=None):
        seen["globals"] = sys._getframe(1).f_globals  # the namespace train_sft's code runs in
        seen["args"] = original(self, args, namespace)
        raise Stop

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", intercept)
    with pytest.raises(Stop):
        sft.main(["--stare.truncation", "drop", "--stare.warmup_steps", "3", "--data.input_key", "conv"])
    bound = seen["globals"]["SFTDataset"]
    assert seen["globals"]["__name__"] == "__main__" and bound.func is sft.StareSFTDataset
    assert bound.keywords == {"truncation": "drop"}
    assert getattr(seen["args"], "data.input_key") == "conv"
    # the scheduler factory the strategy builds its partial from, at call time (pinned: its global name)
    assert "get_scheduler" in strategy_module.DeepspeedStrategy._ds_init_train_model.__code__.co_names
    assert strategy_module.get_scheduler.__wrapped__ is originals["openrlhf.utils.deepspeed.deepspeed.get_scheduler"]
    step = "openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy.optimizer_step"  # test_openrlhf_nonfinite.py
    assert strategy_module.DeepspeedStrategy.optimizer_step.__wrapped__ is originals[step]


def test_warmup_steps_are_exact_and_the_cosine_matches_the_local_schedule(orl, monkeypatch):
    import openrlhf.utils.deepspeed.deepspeed as strategy_module

    monkeypatch.setattr(strategy_module, "get_scheduler", strategy_module.get_scheduler)
    strategy = strategy_module.DeepspeedStrategy
    monkeypatch.setattr(strategy, "optimizer_step", strategy.optimizer_step)
    sft.install(sft.EntryOptions(truncation="right", warmup_steps=7))
    cfg, total = config("optim.warmup_steps=7", "optim.schedule=cosine", "optim.min_lr_ratio=0.1"), 40
    flags = {name: value for name, (value, _) in sft.sft_flags(cfg).items()}
    # as DeepspeedStrategy._ds_init_train_model builds it, with our flags
    factory = strategy_module.partial(
        strategy_module.get_scheduler,
        flags["lr_scheduler"],
        num_warmup_steps=math.ceil(total * flags["lr_warmup_ratio"]),
        num_training_steps=total,
        scheduler_specific_kwargs={"min_lr_rate": flags["min_lr_ratio"]},
    )
    param = torch.nn.Parameter(torch.zeros(1))
    theirs = factory(torch.optim.AdamW([param], lr=cfg.optim.lr)).lr_lambdas[0]
    ours = common.make_optimizer(torch.nn.Linear(1, 1), cfg.optim, total)[1].lr_lambdas[0]
    assert [theirs(step) for step in range(8)] == [step / 7 for step in range(8)]  # warm-up from 0, 7 steps
    for step in range(7, total + 1):
        assert theirs(step) == pytest.approx(ours(step), abs=1e-12)
