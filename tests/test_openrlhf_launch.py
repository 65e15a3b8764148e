"""Our RL config -> OpenRLHF's command line: the mapping, conflicts and refusals; with openrlhf installed, its
real parser checks the result (skipped where openrlhf is absent)."""

from __future__ import annotations

import argparse
import importlib.util
import socket
from pathlib import Path

import pytest

from stare_agent.backends.openrlhf.launch import check_block, even_split_problems, resolve_rl, rl_flags, to_argv
from stare_agent.config import ConfigError, RLConfig, load_config

needs_openrlhf = pytest.mark.skipif(importlib.util.find_spec("openrlhf") is None, reason="openrlhf not installed")


def config(*overrides: str) -> RLConfig:
    base = [
        "backend=openrlhf",
        "model.path=/models/sft",
        "data.train_file=/data/prompts.jsonl",
        "model.dtype=bfloat16",
    ]
    return load_config(RLConfig, None, [*base, *overrides])


def test_our_keys_become_openrlhf_flags():
    cfg = config(
        "rollout.prompts_per_step=64", "rollout.group_size=8", "steps=300", "optim.lr=1e-6", "loss.eps_high=0.3",
        "loss.dual_clip=3.0", "agent.max_total_tokens=8192", "optim.warmup_steps=30",
    )  # fmt: skip
    flags = {k: v for k, (v, _) in rl_flags(cfg, Path("/runs/x"), "/pkg/agent_executor.py").items()}
    assert flags["rollout.batch_size"] == 64 and flags["rollout.n_samples_per_prompt"] == 8
    assert flags["train.batch_size"] == 512  # one on-policy update per rollout batch
    # no prompt budget: the hooks draw prompts in passes until `steps` full batches are trained
    assert "data.max_samples" not in flags and flags["train.num_episodes"] == 1
    assert flags["actor.eps_clip_low_high"] == [0.2, 0.3] and flags["actor.dual_clip"] == 3.0
    assert flags["data.max_len"] == 8192 and flags["actor.lr_warmup_ratio"] == pytest.approx(0.1)
    assert (flags["algo.advantage.estimator"], flags["algo.kl.init_coef"]) == ("group_norm", 0.0)
    assert flags["actor.loss_agg_mode"] == "token-mean" and flags["algo.dynamic_filtering_enable"] is True
    assert flags["ckpt.path"] == "/runs/x/checkpoints"
    assert flags["train.micro_batch_size"] == 16 and flags["ds.param_dtype"] == "bf16"


def test_argv_spelling():
    argv = to_argv({"a.b": True, "c": False, "d": None, "e": [0.2, 0.28], "f": 3})
    assert argv == ["--a.b", "--e", "0.2", "0.28", "--f", "3"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("openrlhf.rollout.temperature=0.5", "set by our rollout.temperature; set it there instead"),
        ("openrlhf.actor.adam.lr=1e-5", "set by our optim.lr"),
        ("openrlhf.ds.ring_attn_size=2", "ring attention needs flash-attention kernels"),
        ("openrlhf.ckpt.disable_ds=true", "controller's state is saved in the DeepSpeed checkpoint"),
        ("openrlhf.actor.entropy_coef=0.0", "the adaptive one is entropy_control.method=entropy_bonus"),
        ("resume=/elsewhere", "resumes from its own checkpoints"),
        ("openrlhf.train.dynamic_batch_enable=true", "set by our loss.max_tokens_per_micro_batch"),
        ("openrlhf.train.max_tokens_per_gpu=4096", "set by our loss.max_tokens_per_micro_batch"),
        ("openrlhf.train.micro_batch_size=2", "set by our loss.micro_batch_size"),
        ("openrlhf.ds.param_dtype=fp16", "set by our model.dtype"),
        ("model.dtype=float32", "OpenRLHF trains in bf16 or fp16"),
        ("model.dtype=float16", "vLLM engines run in bfloat16"),
        ("model.device=cpu", "DeepSpeed places each rank on its own GPU"),
        ("run.threads=4", "local backend's CPU loop"),
        ("loss.max_tokens_per_micro_batch=4096", "DeepSpeed 0.19.6 accumulates them only under ZeRO-3"),
        (
            ["loss.max_tokens_per_micro_batch=4096", "openrlhf.ds.zero_stage=2"],
            "openrlhf.ds.zero_stage=2: OpenRLHF's token-budget",
        ),
        (
            ["loss.max_tokens_per_micro_batch=4096", "openrlhf.ds.zero_stage=3", "openrlhf.ds.packing_samples=true"],
            "set by our loss.max_tokens",
        ),
        ("openrlhf.eval.dataset=/data/aime.jsonl", "evaluate the saved checkpoints with `stare-agent eval`"),
    ],
)
def test_conflicts_and_unsupported_combinations_are_refused(override, message):
    cfg = config(*override) if isinstance(override, list) else config(override)
    with pytest.raises(ConfigError, match=message):
        check_block(cfg, rl_flags(cfg, Path("/runs/x"), "agent.py"))


def test_clip_cov_and_kl_cov_accept_openrlhfs_mismatch_correction():
    # Clip-Cov and KL-Cov too: MethodLoss applies the correction (tests/test_openrlhf_correction.py)
    for method, level, mode in (("clip_cov", "token", "clip"), ("kl_cov", "seq", "mask")):
        cfg = config(
            f"entropy_control.method={method}", f"openrlhf.algo.advantage.is_correction_level={level}",
            f"openrlhf.algo.advantage.is_correction_mode={mode}",
        )  # fmt: skip
        check_block(cfg, rl_flags(cfg, Path("/runs/x"), "agent.py"))  # accepted
    for method in ("clip_cov", "kl_cov", "entropy_bonus", "forking_tokens", "low_prob_reweight"):
        cfg = config(f"entropy_control.method={method}", "optim.updates_per_batch=4")
        flags = {k: v for k, (v, _) in rl_flags(cfg, Path("/runs/x"), "agent.py").items()}
        check_block(cfg, rl_flags(cfg, Path("/runs/x"), "agent.py"))  # accepted
        episodes = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        assert flags["train.batch_size"] == episodes // 4 and flags["train.max_epochs"] == 1  # 4 optimizer updates


def test_token_budget_micro_batches_turn_on_openrlhfs_packed_dynamic_batches_under_zero_3():
    cfg = config("loss.max_tokens_per_micro_batch=8192", "openrlhf.ds.zero_stage=3")
    ours = rl_flags(cfg, Path("/runs/x"), "agent.py")
    check_block(cfg, ours)  # accepted
    flags = {k: v for k, (v, _) in ours.items()}
    assert flags["train.dynamic_batch_enable"] is True and flags["ds.packing_samples"] is True
    assert flags["train.max_tokens_per_gpu"] == flags["rollout.max_tokens_per_gpu"] == 8192
    plain = {k: v for k, (v, _) in rl_flags(config(), Path("/runs/x"), "agent.py").items()}
    assert plain["train.dynamic_batch_enable"] is False and "ds.packing_samples" not in plain
    packed_only = config("openrlhf.ds.packing_samples=true")
    check_block(packed_only, rl_flags(packed_only, Path("/runs/x"), "agent.py"))  # packing alone: accepted


ACCUMULATION_PROBE = """
import os, sys, torch, deepspeed
from deepspeed.utils import safe_get_full_fp32_param
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
def updated(batches):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": int(sys.argv[1])}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    for part in (x[:2], x[2:]) if batches == 2 else (x,):
        engine.backward(engine(part).pow(2).sum())
    engine.step()
    return torch.cat([safe_get_full_fp32_param(p).flatten() for p in engine.module.parameters()])
print("DIFF", (updated(1) - updated(2)).abs().max().item())
"""


@needs_openrlhf
@pytest.mark.parametrize(("stage", "accumulates"), [(2, False), (3, True)])
def test_deepspeed_accumulates_backward_passes_without_gradient_accumulation_steps_only_under_zero_3(
    stage, accumulates, tmp_path
):
    """Why loss.max_tokens_per_micro_batch needs ds.zero_stage 3 with backend openrlhf: OpenRLHF's token-budget
    micro-batches set DeepSpeed's gradient_accumulation_steps to 1 and call backward once per micro-batch before one
    step. Here (DeepSpeed 0.19.6 on the CPU, one rank) two backward passes over halves of a batch then a step must
    update the weights as one backward over the whole batch does: under ZeRO-3 they do, under ZeRO-2 they do not.
    Should DeepSpeed change, this test says the refusal can go."""
    import os
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(ACCUMULATION_PROBE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, str(script), str(stage), str(port)], capture_output=True, text=True,
                         env=env, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    diff = float(next(line for line in out.stdout.splitlines() if line.startswith("DIFF")).split()[1])
    assert (diff < 1e-6) == accumulates, diff


def test_allowed_passthrough_is_kept():
    cfg = config("openrlhf.vllm.num_engines=8", "openrlhf.train.async_enable=false", "rollout.dynamic_sampling=false")
    check_block(cfg, rl_flags(cfg, Path("/runs/x"), "agent.py"))  # no error


def placement(ranks=8, nodes=1, forward=2, update=1, dynamic=False):
    """What even_split_problems reads of OpenRLHF's parsed flags (dotted names, as its parser leaves them)."""
    return argparse.Namespace(
        **{
            "actor.num_nodes": nodes,
            "actor.num_gpus_per_node": ranks // nodes,
            "rollout.micro_batch_size": forward,
            "train.micro_batch_size": update,
            "train.dynamic_batch_enable": dynamic,
        }
    )


@pytest.mark.parametrize(
    ("prompts", "group", "where", "message"),
    [
        (64, 8, placement(), None),  # the paper's shape: 256 micro-batches of 2, 32 per rank; 64 samples per rank
        (64, 8, placement(ranks=16, nodes=2), None),
        (
            31,
            8,
            placement(forward=16),
            "do not split into whole micro-batches of openrlhf.rollout.micro_batch_size=16",
        ),
        (7, 8, placement(), "shared evenly by 8 training ranks"),  # 28 micro-batches over 8 ranks: 4,4,...,4,0
        (2, 2, placement(), "in the experience pass"),  # 2 micro-batches, fewer than the ranks
        (64, 8, placement(update=3), "micro-batches of loss.micro_batch_size=3 shared evenly by 8 training ranks"),
        # token-budget micro-batches: OpenRLHF evens out the micro-batch counts; the samples must split over ranks
        (31, 8, placement(forward=16, update=3, dynamic=True), None),
        (2, 2, placement(dynamic=True), "with token-budget micro-batches a rank's extra samples would not be trained"),
    ],
)
def test_a_step_that_does_not_split_evenly_over_the_ranks_is_refused(prompts, group, where, message):
    cfg = config(f"rollout.prompts_per_step={prompts}", f"rollout.group_size={group}")
    problems = even_split_problems(cfg, where)
    if message is None:
        assert problems == []
    else:
        assert any(message in problem for problem in problems), problems


@needs_openrlhf
def test_the_launcher_refuses_an_uneven_split_with_openrlhfs_defaults_filled_in(tmp_path, capsys):
    """OpenRLHF's parser supplies what the config leaves out (8 GPUs per node): 2 x 4 samples in micro-batches of
    2 are 4, fewer than 8 ranks. `stare-agent rl --dry-run` refuses it the same way, in one line."""
    from stare_agent import cli

    cfg = config("rollout.prompts_per_step=2", "rollout.group_size=4", "openrlhf.rollout.micro_batch_size=2")
    with pytest.raises(ConfigError, match="shared evenly by 8 training ranks .* in the experience pass"):
        resolve_rl(cfg, tmp_path / "run")
    overrides = ["backend=openrlhf", "model.path=/models/sft", "data.train_file=/data/p.jsonl", "model.dtype=bfloat16"]
    small = ["rollout.prompts_per_step=2", "rollout.group_size=4", "openrlhf.rollout.micro_batch_size=2"]
    code = cli.main(["rl", "--dry-run", *overrides, *small])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "in the experience pass" in err[0]
    even = ("rollout.prompts_per_step=4", "rollout.group_size=8", "openrlhf.rollout.micro_batch_size=4")
    resolve_rl(config(*even, "loss.micro_batch_size=4"), tmp_path / "run")  # 8 micro-batches, 1 per rank


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


@needs_openrlhf
def test_async_training_and_partial_rollouts_are_accepted(tmp_path):
    even = ("openrlhf.vllm.num_engines=8", "openrlhf.actor.num_gpus_per_node=8")
    on = ("openrlhf.train.async_enable=true", "openrlhf.train.partial_rollout_enable=true")
    _, ns = resolve_rl(config(*even, *on, "openrlhf.train.async_queue_size=2"), tmp_path / "run")
    assert ns.__dict__["train.async_enable"] and ns.__dict__["train.partial_rollout_enable"]
    assert ns.__dict__["train.async_queue_size"] == 2
    # over-sampling at exactly one batch is no over-sampling
    size = ("rollout.prompts_per_step=64", "openrlhf.rollout.vllm_generate_batch_size=64")
    resolve_rl(config(*even, *on, *size), tmp_path / "run")


@needs_openrlhf
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["openrlhf.train.partial_rollout_enable=true"], "partial_rollout_enable needs openrlhf.train.async_enable"),
        (
            ["openrlhf.train.async_enable=true", "openrlhf.vllm.enable_sleep=true", "openrlhf.ds.enable_sleep=true"],
            "async engines generate while the ranks train, so they cannot sleep",
        ),
        (["openrlhf.train.async_enable=true", "openrlhf.train.async_queue_size=0"], "async_queue_size=0: at least 1"),
        (
            ["openrlhf.train.async_enable=true", "openrlhf.rollout.vllm_generate_batch_size=128"],
            "over-sampling buffer is not saved in checkpoints, so a resume would skip its prompts",
        ),
    ],
)
def test_what_async_mode_cannot_run_with_is_refused_before_anything_starts(tmp_path, overrides, message):
    even = ("openrlhf.vllm.num_engines=8", "openrlhf.actor.num_gpus_per_node=8")
    with pytest.raises(ConfigError, match=message):
        resolve_rl(config(*even, *overrides), tmp_path / "run")


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


# --- the shipped configs (configs/*.yaml with backend: openrlhf) ------------------------------------------------

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
# what a user must give on the command line; the shipped configs leave both empty (tested below)
REQUIRED = ["model.path=/shared/models/qwen", "data.train_file=/shared/data/train.parquet"]
GPUS_PER_NODE = 8  # the node the paper configs are written for; the SFT command uses all GPUs of the node


def shipped_openrlhf_configs() -> list[tuple[Path, type]]:
    """(file, the command's config class) for every configs/*.yaml with `backend: openrlhf`. The command is
    the one class the file loads as: each has keys the other refuses (`epochs` vs `rollout`, `stare`)."""
    import yaml

    from stare_agent.config import SFTConfig

    found = []
    for path in sorted(CONFIGS_DIR.glob("*.yaml")):
        if (yaml.safe_load(path.read_text()) or {}).get("backend") != "openrlhf":
            continue
        loads = []
        for cls in (SFTConfig, RLConfig):
            try:
                load_config(cls, path, REQUIRED)
                loads.append(cls)
            except ConfigError:
                pass
        assert len(loads) == 1, f"{path.name} loads as {[c.__name__ for c in loads]}; it must be one command's"
        found.append((path, loads[0]))
    return found


SHIPPED = shipped_openrlhf_configs()
PAPER_RL = {p.stem: p for p, cls in SHIPPED if p.stem.startswith("rl_paper_") and not p.stem.endswith("_async")}
"""The three configs the paper compares, colocated and synchronous (rl_paper_stare_c2_async is C2's async shape)."""


def test_the_paper_configs_are_shipped():
    names = {p.stem for p, _ in SHIPPED}
    assert {"sft_paper_qwen2.5_7b", "rl_paper_grpo_ds", "rl_paper_stare_o1", "rl_paper_stare_c2"} <= names


@pytest.mark.parametrize(("path", "cls"), SHIPPED, ids=[p.stem for p, _ in SHIPPED])
def test_shipped_config_requires_model_and_data_paths(path, cls):
    """model.path and data.train_file are empty in the file, so a run cannot start on a placeholder or on the
    repository's sample data; without them the launcher stops before anything else with the key to set."""
    from stare_agent.backends.openrlhf.launch import resolve_sft

    cfg = load_config(cls, path)
    assert cfg.model.path == "" and cfg.data.train_file == ""
    resolve = resolve_rl if cls is RLConfig else resolve_sft
    with pytest.raises(ConfigError, match="needs model.path"):
        resolve(cfg, Path("/runs/x"))


def test_shipped_sft_config_refuses_an_empty_train_file():
    from stare_agent.backends.openrlhf.launch import resolve_sft
    from stare_agent.config import SFTConfig

    cfg = load_config(SFTConfig, CONFIGS_DIR / "sft_paper_qwen2.5_7b.yaml", ["model.path=/shared/models/qwen"])
    with pytest.raises(ConfigError, match="data.train_file"):
        resolve_sft(cfg, Path("/runs/x"))


def _rl_placement_fits(ns: dict) -> None:
    """OpenRLHF 0.11.2's checks of the placement that run after its parser (cli/train_ppo_ray.py, train() and the
    block after parse_args), restated, plus DeepSpeed's batch arithmetic, so that a shipped config which its
    parser accepts cannot still fail on the cluster at start-up."""
    actor_gpus = ns["actor.num_nodes"] * ns["actor.num_gpus_per_node"]
    engines = ns["vllm.num_engines"] or 0
    assert engines > 0, "rollouts need vLLM engines (vllm.num_engines)"
    if ns["train.colocate_all"]:
        assert actor_gpus == engines * ns["vllm.tensor_parallel_size"], "colocate_all: one engine GPU per actor GPU"
    if ns["vllm.enable_sleep"] or ns["ds.enable_sleep"]:
        assert ns["train.colocate_all"], "sleep modes only act with train.colocate_all"
    rollouts = ns["rollout.batch_size"] * ns["rollout.n_samples_per_prompt"]
    assert rollouts // ns["rollout.micro_batch_size"] >= actor_gpus, "fewer experience micro-batches than ranks"
    # DeepSpeed: global batch = micro-batch x gradient accumulation x data-parallel ranks
    assert ns["train.batch_size"] % (ns["train.micro_batch_size"] * actor_gpus) == 0
    if ns["ds.packing_samples"]:
        assert "flash_attention" in ns["ds.attn_implementation"], "packing needs flash attention"


@needs_openrlhf
@pytest.mark.parametrize(("path", "cls"), SHIPPED, ids=[p.stem for p, _ in SHIPPED])
def test_shipped_config_resolves_to_a_command_openrlhfs_parser_accepts(path, cls, tmp_path):
    """The launcher's resolved command for the file, parsed by OpenRLHF 0.11.2's real parser (an unknown flag or
    a bad value in the `openrlhf:` block fails here), carries the config's values."""
    from stare_agent.backends.openrlhf import upstream
    from stare_agent.backends.openrlhf.launch import resolve_sft

    cfg = load_config(cls, path, REQUIRED)
    if cls is RLConfig:
        argv, namespace = resolve_rl(cfg, tmp_path / "run")
        cli = upstream.RL_CLI
    else:
        command, namespace = resolve_sft(cfg, tmp_path / "run")
        assert command[:3] == ["deepspeed", "--module", "stare_agent.backends.openrlhf.sft"]
        argv = command[command.index("--model.model_name_or_path") :]
        cli = upstream.SFT_CLI
    # parse the printed words again, independently of the launcher's own parse
    ns = vars(upstream.capture_parser(cli).parse_args(argv))
    assert ns == vars(namespace)
    for key, value in cfg.openrlhf.items():  # the block reaches OpenRLHF unchanged
        assert ns[key] == value, key

    if cls is RLConfig:
        r = cfg.rollout
        assert ns["actor.model_name_or_path"] == "/shared/models/qwen"
        assert ns["data.prompt_dataset"] == "/shared/data/train.parquet"
        assert ns["actor.adam.lr"] == cfg.optim.lr
        assert (ns["rollout.batch_size"], ns["rollout.n_samples_per_prompt"]) == (r.prompts_per_step, r.group_size)
        assert ns["train.batch_size"] == r.prompts_per_step * r.group_size and ns["train.max_epochs"] == 1
        assert ns["data.max_len"] == cfg.agent.max_total_tokens
        assert (ns["rollout.temperature"], ns["rollout.top_p"]) == (r.temperature, r.top_p)
        assert ns["algo.advantage.estimator"] == "group_norm"
        assert ns["actor.eps_clip_low_high"] == [cfg.loss.eps_low, cfg.loss.eps_high]
        assert ns["algo.dynamic_filtering_enable"] is True and ns["algo.dynamic_filtering_range"] == [0.0, 1.0]
        assert ns["algo.kl.init_coef"] == 0.0 and not ns["algo.kl.use_loss"]
        assert ns["actor.loss_agg_mode"] == "token-mean" and ns["actor.policy_loss_type"] == "ppo"
        assert ns["train.agent_func_path"].endswith("agent_executor.py")
        _rl_placement_fits(ns)
    else:
        assert ns["model.model_name_or_path"] == "/shared/models/qwen"
        assert ns["data.dataset"] == "/shared/data/train.parquet"
        assert ns["adam.lr"] == cfg.optim.lr and ns["data.max_len"] == cfg.data.max_tokens
        assert ns["train.batch_size"] == cfg.micro_batch_size * cfg.grad_accum
        assert ns["train.micro_batch_size"] == cfg.micro_batch_size and ns["train.max_epochs"] == cfg.epochs
        assert ns["ds.param_dtype"] == "bf16"
        assert ns["train.batch_size"] % (ns["train.micro_batch_size"] * GPUS_PER_NODE) == 0  # DeepSpeed's split


STARE_O1 = {"op": "O1", "top_ratio": 0.1, "w": 1.1, "target_entropy": 0.3}  # W 1.1, P 10%, H_tgt 0.3


@pytest.mark.parametrize(
    ("name", "method", "stare"),
    [
        ("rl_paper_grpo_ds", "none", {}),
        ("rl_paper_stare_o1", "stare", STARE_O1),
        ("rl_paper_stare_c2", "stare", {**STARE_O1, "op": "C2", "m": 0.9}),
    ],
)
def test_paper_rl_configs_hold_the_papers_settings(name, method, stare):
    cfg = load_config(RLConfig, PAPER_RL[name], REQUIRED)
    assert cfg.backend == "openrlhf"
    assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (64, 8)
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.optim.lr) == (1.0, 1.0, 1e-6)
    assert cfg.agent.max_total_tokens == 8192
    assert (cfg.loss.eps_low, cfg.loss.eps_high, cfg.rollout.dynamic_sampling) == (0.2, 0.28, True)
    assert cfg.entropy_control.method == method
    for key, value in stare.items():
        assert getattr(cfg.stare, key) == value, f"stare.{key}"
    if method == "stare":
        assert (cfg.stare.gate, cfg.stare.w_mode) == ("batch", "fixed")


def test_paper_rl_configs_differ_only_in_the_method_stare_and_run_name():
    """GRPO-ds, STARE-O1 and STARE-C2 are compared at equal settings: the three files must not drift apart."""
    from stare_agent.config import to_dict

    def comparable(cfg: RLConfig) -> dict:
        d = to_dict(cfg)
        d.pop("stare")
        d.pop("entropy_control")
        d["run"].pop("name")
        return d

    cfgs = {name: load_config(RLConfig, path) for name, path in PAPER_RL.items()}
    assert len(cfgs) == 3 and len({c.run.name for c in cfgs.values()}) == 3
    first, *rest = cfgs.values()
    for other in rest:
        assert comparable(other) == comparable(first)


@needs_openrlhf
def test_the_async_paper_shape_is_c2_with_engines_and_ranks_apart(tmp_path):
    """rl_paper_stare_c2_async: C2's settings exactly, outside run.name and the placement; engines and ranks on GPUs
    of their own (async mode cannot sleep), one batch ahead, the token-level mask correction, and no partial
    rollouts, which the GPU pin's vLLM 0.29.0 cannot record versions for (hooks.version_stamp_problem)."""
    from stare_agent.config import to_dict

    sync = to_dict(load_config(RLConfig, PAPER_RL["rl_paper_stare_c2"]))
    shape = to_dict(load_config(RLConfig, CONFIGS_DIR / "rl_paper_stare_c2_async.yaml"))
    for cfg in (sync, shape):
        cfg["run"].pop("name")
    block = shape.pop("openrlhf")
    sync.pop("openrlhf")
    assert shape == sync
    cfg = load_config(RLConfig, CONFIGS_DIR / "rl_paper_stare_c2_async.yaml", REQUIRED)
    _, namespace = resolve_rl(cfg, tmp_path / "run")
    ns = vars(namespace)
    assert ns["train.async_enable"] and not ns["train.partial_rollout_enable"] and ns["train.async_queue_size"] == 1
    assert not (ns["train.colocate_all"] or ns["vllm.enable_sleep"] or ns["ds.enable_sleep"])
    assert ns["vllm.num_engines"] == ns["actor.num_gpus_per_node"] == 8  # 16 GPUs: two nodes
    assert ns["algo.advantage.is_correction_level"] == "token" and block["algo.advantage.is_correction_mode"] == "mask"


# --- reruns over a run folder (resume.py) ---------------------------------------------------------------------------


def actor_checkpoint(run_dir: Path, step: int, ranks: int = 1, *, complete: bool = True) -> Path:
    """A DeepSpeed ZeRO checkpoint folder as OpenRLHF lays it out (file names only; the contents are not read)."""
    from stare_agent.backends.openrlhf import resume

    folder = resume.actor_dir(run_dir) / f"global_step{step}"
    folder.mkdir(parents=True)
    for rank in range(ranks):
        (folder / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"x")
        (folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"x")
    if complete:
        resume.mark_complete(run_dir / "checkpoints", step)
    return folder


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("none", "global_step4"),  # `latest` names the last complete one: left alone
        ("killed_mid_save", "global_step4"),  # global_step6 half written, `latest` still names 4
        ("pointer_emptied", "global_step4"),  # a full disk while DeepSpeed rewrote `latest`
        ("pointer_missing", "global_step4"),
    ],
)
def test_a_rerun_continues_from_the_last_complete_checkpoint(tmp_path, capsys, fault, expected):
    from stare_agent.backends.openrlhf import resume

    run_dir = tmp_path / "run"
    actor_checkpoint(run_dir, 2)
    actor_checkpoint(run_dir, 4)
    latest = resume.actor_dir(run_dir) / "latest"
    latest.write_text("global_step4")
    if fault != "none":
        actor_checkpoint(run_dir, 6, complete=False)
    if fault == "pointer_emptied":
        latest.write_text("")
    elif fault == "pointer_missing":
        latest.unlink()
    capsys.readouterr()
    assert resume.prepare(run_dir).name == expected
    assert latest.read_text().strip() == expected  # what DeepSpeed loads
    said = capsys.readouterr().out
    assert ("continuing from global_step4, the last complete checkpoint" in said) == (
        fault not in ("none", "killed_mid_save")
    )
    assert (resume.actor_dir(run_dir) / "global_step6").exists() == (fault != "none")  # nothing deleted


def test_a_first_save_that_did_not_finish_starts_the_run_at_step_0(tmp_path, capsys):
    from stare_agent.backends.openrlhf import resume

    run_dir = tmp_path / "run"
    actor_checkpoint(run_dir, 1, complete=False)
    latest = resume.actor_dir(run_dir) / "latest"
    latest.write_text("")
    assert resume.prepare(run_dir) is None
    assert not latest.exists() and (latest.with_name("latest.incomplete")).exists()
    assert "holds no complete checkpoint" in capsys.readouterr().out
    assert resume.prepare(run_dir) is None  # and again: nothing left to set aside, nothing said


@needs_openrlhf
def test_a_checkpoint_saved_by_another_number_of_ranks_is_refused_with_the_conversion(tmp_path):
    from stare_agent.backends.openrlhf import resume

    run_dir = tmp_path / "run"
    checkpoint = actor_checkpoint(run_dir, 3, ranks=4)
    (resume.actor_dir(run_dir) / "latest").write_text("global_step3")
    cfg = config("rollout.prompts_per_step=2", "rollout.group_size=4", "loss.micro_batch_size=1",
                 "openrlhf.actor.num_gpus_per_node=2", "openrlhf.rollout.micro_batch_size=1")  # fmt: skip
    with pytest.raises(ConfigError, match=r"saved by 4 training ranks and this run has 2.*ds_to_universal") as err:
        resolve_rl(cfg, run_dir)
    assert f"--input_folder {checkpoint} " in str(err.value) and "use_universal_ckpt: true" in str(err.value)
    resolve_rl(load_config(RLConfig, None, [*cfg_overrides(cfg), "openrlhf.ds.use_universal_ckpt=true"]), run_dir)
    for name in list(checkpoint.iterdir()):  # the same count: accepted
        if "rank_2" in name.name or "rank_3" in name.name:
            name.unlink()
    resolve_rl(cfg, run_dir)


def cfg_overrides(cfg: RLConfig) -> list[str]:
    return ["backend=openrlhf", "model.path=/models/sft", "data.train_file=/data/prompts.jsonl",
            "model.dtype=bfloat16", "rollout.prompts_per_step=2", "rollout.group_size=4", "loss.micro_batch_size=1",
            "openrlhf.actor.num_gpus_per_node=2", "openrlhf.rollout.micro_batch_size=1"]  # fmt: skip


@needs_openrlhf
def test_a_fresh_start_over_a_checkpoint_and_a_single_kept_checkpoint_are_refused(tmp_path):
    run_dir = tmp_path / "run"
    resolve_rl(config("resume="), run_dir)  # nothing there yet: a fresh start is fine
    actor_checkpoint(run_dir, 2, ranks=8)  # the default placement's 8 ranks
    with pytest.raises(ConfigError, match=r"resume='' starts the run over, but .* holds a complete checkpoint"):
        resolve_rl(config("resume="), run_dir)
    resolve_rl(config(), run_dir)  # the default continues it
    with pytest.raises(ConfigError, match="ckpt.max_num=1: OpenRLHF deletes the oldest checkpoints before"):
        resolve_rl(config("openrlhf.ckpt.max_num=1"), run_dir)
