"""Our RL config -> OpenRLHF's command line: the mapping, conflicts and refusals; with openrlhf installed, its
real parser checks the result (skipped where openrlhf is absent)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from stare_agent.backends.openrlhf.launch import check_block, resolve_rl, rl_flags, to_argv
from stare_agent.config import ConfigError, RLConfig, load_config

needs_openrlhf = pytest.mark.skipif(importlib.util.find_spec("openrlhf") is None, reason="openrlhf not installed")


def config(*overrides: str) -> RLConfig:
    base = ["backend=openrlhf", "model.path=/models/sft", "data.train_file=/data/prompts.jsonl"]
    return load_config(RLConfig, None, [*base, *overrides])


def test_our_keys_become_openrlhf_flags():
    cfg = config(
        "rollout.prompts_per_step=64", "rollout.group_size=8", "steps=300", "optim.lr=1e-6", "loss.eps_high=0.3",
        "loss.dual_clip=3.0", "agent.max_total_tokens=8192", "optim.warmup_steps=30",
    )  # fmt: skip
    flags = {k: v for k, (v, _) in rl_flags(cfg, Path("/runs/x"), "/pkg/agent_executor.py").items()}
    assert flags["rollout.batch_size"] == 64 and flags["rollout.n_samples_per_prompt"] == 8
    assert flags["train.batch_size"] == 512  # one on-policy update per rollout batch
    assert flags["data.max_samples"] == 300 * 64  # OpenRLHF's schedule then has exactly 300 steps
    assert flags["actor.eps_clip_low_high"] == [0.2, 0.3] and flags["actor.dual_clip"] == 3.0
    assert flags["data.max_len"] == 8192 and flags["actor.lr_warmup_ratio"] == pytest.approx(0.1)
    assert (flags["algo.advantage.estimator"], flags["algo.kl.init_coef"]) == ("group_norm", 0.0)
    assert flags["actor.loss_agg_mode"] == "token-mean" and flags["algo.dynamic_filtering_enable"] is True
    assert flags["ckpt.path"] == "/runs/x/checkpoints"


def test_argv_spelling():
    argv = to_argv({"a.b": True, "c": False, "d": None, "e": [0.2, 0.28], "f": 3})
    assert argv == ["--a.b", "--e", "0.2", "0.28", "--f", "3"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("openrlhf.rollout.temperature=0.5", "set by our rollout.temperature; set it there instead"),
        ("openrlhf.actor.adam.lr=1e-5", "set by our optim.lr"),
        ("openrlhf.train.async_enable=true", "not supported: STARE and the on-policy ratio assume synchronous"),
        ("openrlhf.ds.ring_attn_size=2", "does not gather ring-attention shards"),
        ("openrlhf.ckpt.disable_ds=true", "controller's state is saved in the DeepSpeed checkpoint"),
        ("openrlhf.actor.entropy_coef=0.0", "an entropy bonus changes the loss"),
        ("rollout.dynamic_sampling=false", "a group with a sandbox failure is dropped through OpenRLHF's dynamic"),
        ("resume=/elsewhere", "resumes from its own checkpoints"),
    ],
)
def test_conflicts_and_unsupported_combinations_are_refused(override, message):
    cfg = config(override)
    with pytest.raises(ConfigError, match=message):
        check_block(cfg, rl_flags(cfg, Path("/runs/x"), "agent.py"))


def test_allowed_passthrough_is_kept():
    cfg = config("openrlhf.vllm.num_engines=8", "openrlhf.train.async_enable=false")
    check_block(cfg, rl_flags(cfg, Path("/runs/x"), "agent.py"))  # no error


@needs_openrlhf
def test_openrlhf_parser_accepts_the_resolved_command(tmp_path):
    cfg = config("openrlhf.vllm.num_engines=8", "openrlhf.actor.num_gpus_per_node=8", "loss.dual_clip=3.0")
    argv, ns = resolve_rl(cfg, tmp_path / "run")
    assert ns.__dict__["vllm.num_engines"] == 8 and ns.__dict__["rollout.n_samples_per_prompt"] == 8
    assert ns.__dict__["actor.eps_clip_low_high"] == [0.2, 0.28] and ns.__dict__["algo.dynamic_filtering_enable"]
    assert ns.__dict__["train.agent_func_path"].endswith("agent_executor.py")


@needs_openrlhf
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("openrlhf.vllm.num_engine=2", r"no flag --vllm.num_engine \(did you mean 'vllm.num_engines'\?\)"),
        ("openrlhf.vllm.num_engines=two", "argument --vllm.num_engines: invalid int value: 'two'"),
    ],
)
def test_openrlhf_parser_refusals_are_one_clear_error(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        resolve_rl(config(override), tmp_path / "run")


def sft_config(*overrides: str):
    from stare_agent.config import SFTConfig

    base = ["backend=openrlhf", "model.path=/models/base", "model.dtype=bfloat16", "data.eval_fraction=0"]
    return load_config(SFTConfig, None, [*base, *overrides])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("openrlhf.data.multiturn=true", "the masks come from our transcript segments"),
        ("openrlhf.adam.lr=1e-5", "set by our optim.lr"),
        ("openrlhf.lr_warmup_ratio=0.1", "set by our optim.warmup_steps|warm-up is optim.warmup_steps"),
    ],
)
def test_sft_block_conflicts_are_refused(override, message):
    from stare_agent.backends.openrlhf import sft
    from stare_agent.backends.openrlhf.launch import SFT_REFUSED, _refuse

    cfg = sft_config(override)
    with pytest.raises(ConfigError, match=message):
        _refuse(cfg.openrlhf, sft.sft_flags(cfg, Path("/runs/s")), SFT_REFUSED)


@needs_openrlhf
def test_sft_command_runs_our_entry_module_with_checked_flags(tmp_path):
    from stare_agent.backends.openrlhf.launch import resolve_sft

    command, ns = resolve_sft(sft_config("openrlhf.ds.zero_stage=3"), tmp_path / "run")
    assert command[:3] == ["deepspeed", "--module", "stare_agent.backends.openrlhf.sft"]
    assert "--stare.warmup_steps" in command and ns.__dict__["ds.zero_stage"] == 3
