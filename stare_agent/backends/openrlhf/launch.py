"""Our RL config -> OpenRLHF's train_ppo_ray command line: mapping, conflicts, refusals, and `--dry-run`.

Our keys stay in our sections and are translated here (table in `rl_flags`); the `openrlhf:` block holds
OpenRLHF's own flags, spelled as its CLI spells them, and is passed through verbatim. Both are checked by
OpenRLHF's real parser (`upstream.capture_parser`). A flag of the block that one of our keys already sets is
refused with the key to use instead, and so is every combination the STARE hooks do not support.

Steps: a run trains exactly `steps` full batches of rollout.prompts_per_step groups (stare_agent/batching.py, the
rule the local backend follows too), each one optimizer update (`train.batch_size = rollout.batch_size * n`,
`train.max_epochs 1`). OpenRLHF itself counts steps from the prompt file and trains a partial last batch; the
hooks' StareSamplesGenerator instead draws prompts in endless passes, refills dropped groups until the batch is
full, and ends the run after `steps` batches or when a step's prompt budget runs out; the trainer sizes the LR
schedule for `steps` (hooks.StarePPOTrainer.get_max_steps).

Ranks: OpenRLHF splits a step's samples into micro-batches of rollout.micro_batch_size for the experience pass
and hands them to the training ranks in chunks of ceil(micro-batches / ranks); each rank then trains its share in
micro-batches of train.micro_batch_size. When either split is uneven, ranks run different numbers of forward or
backward passes and block each other's collectives until the distributed timeout, so `even_split_problems`
refuses such configs before anything starts.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from stare_agent.backends.openrlhf import resume
from stare_agent.backends.openrlhf.sft import DTYPES, SCHEDULES, local_only_problems
from stare_agent.config import ConfigError, RLConfig, SFTConfig, run_path, save_config, to_dict
from stare_agent.reruns import check_fresh_start

# OpenRLHF flags we refuse in the openrlhf block: (flag, allowed values or None for "never", why).
REFUSED: list[tuple[str, tuple[Any, ...] | None, str]] = [
    (
        "ds.ring_attn_size",
        (1,),
        "ring attention needs flash-attention kernels (ring_flash_attn), which nothing here can run, so the entropy "
        "pass over its shards is untested; docs/cluster.md gives the longest episode one GPU holds",
    ),
    ("ds.tensor_parallel_size", (1,), "the entropy pass does not gather tensor-parallel logits (untested)"),
    ("ckpt.disable_ds", (False,), "the STARE controller's state is saved in the DeepSpeed checkpoint"),
    (
        "actor.entropy_coef",
        (None,),
        "OpenRLHF's fixed entropy bonus changes the loss of every method; the adaptive one is "
        "entropy_control.method=entropy_bonus",
    ),
    ("data.apply_chat_template", (False,), "prompts are built by stare_agent.protocol (the same as SFT and eval)"),
    ("reward.model_name_or_path", (None,), "the reward is the verifiable answer check of the agent executor"),
    ("reward.remote_url", (None,), "the reward is the verifiable answer check of the agent executor"),
    ("critic.model_name_or_path", (None,), "GRPO uses no critic"),
    (
        "eval.dataset",
        (None,),
        "OpenRLHF's in-training eval would score a sandbox failure as a wrong answer; evaluate the saved "
        "checkpoints with `stare-agent eval` instead (snapshots=RUN_DIR files=[VALIDATION_FILE]: every snapshot, "
        "the best named)",
    ),
]


def rl_flags(config: RLConfig, run_dir: Path, agent_file: str) -> dict[str, tuple[Any, str]]:
    """OpenRLHF flag -> (value, the key of ours it comes from) for everything our config decides."""
    r, o, loss = config.rollout, config.optim, config.loss
    flags: dict[str, tuple[Any, str]] = {
        "actor.model_name_or_path": (config.model.path, "model.path"),
        "data.prompt_dataset": (config.data.train_file, "data.train_file"),
        "data.input_key": (config.data.problem_field, "data.problem_field"),
        "data.label_key": (config.data.answer_field, "data.answer_field"),
        "data.max_len": (config.agent.max_total_tokens, "agent.max_total_tokens"),
        "rollout.batch_size": (r.prompts_per_step, "rollout.prompts_per_step"),
        "rollout.n_samples_per_prompt": (r.group_size, "rollout.group_size"),
        "rollout.temperature": (r.temperature, "rollout.temperature"),
        "rollout.top_p": (r.top_p, "rollout.top_p"),
        "rollout.max_new_tokens": (r.max_turn_tokens, "rollout.max_turn_tokens"),
        "train.batch_size": (
            r.prompts_per_step * r.group_size // o.updates_per_batch,
            "rollout.prompts_per_step x rollout.group_size / optim.updates_per_batch",
        ),
        "train.max_epochs": (1, "each batch's episodes trained once, in optim.updates_per_batch updates (fixed)"),
        "train.num_episodes": (1, "one pass of OpenRLHF's loop: the hooks end it after `steps` full batches (fixed)"),
        "train.seed": (config.run.seed, "run.seed"),
        "train.agent_func_path": (agent_file, "the stare-agent executor (fixed)"),
        "actor.adam.lr": (o.lr, "optim.lr"),
        "actor.adam.betas": (list(o.betas), "optim.betas"),
        "actor.adam.eps": (o.eps, "optim.eps"),
        "actor.adam.weight_decay": (o.weight_decay, "optim.weight_decay"),
        "actor.lr_scheduler": (SCHEDULES[o.schedule], "optim.schedule"),
        "actor.lr_warmup_ratio": (min(o.warmup_steps / config.steps, 1.0), "optim.warmup_steps / steps"),
        "actor.min_lr_ratio": (o.min_lr_ratio, "optim.min_lr_ratio"),
        "actor.max_norm": (o.max_grad_norm, "optim.max_grad_norm"),
        "actor.eps_clip_low_high": ([loss.eps_low, loss.eps_high], "loss.eps_low, loss.eps_high"),
        "train.micro_batch_size": (loss.micro_batch_size, "loss.micro_batch_size"),
        "ds.param_dtype": (DTYPES.get(config.model.dtype), "model.dtype"),
        "actor.loss_agg_mode": ("token-mean", "the token-level mean of DESIGN (fixed)"),
        "actor.policy_loss_type": ("ppo", "the clipped surrogate (fixed)"),
        "algo.advantage.estimator": ("group_norm", "GRPO group-normalized advantages (fixed)"),
        "algo.dynamic_filtering_enable": (r.dynamic_sampling, "rollout.dynamic_sampling"),
        "algo.dynamic_filtering_range": ([0.0, 1.0], "dynamic sampling drops all-equal groups (fixed)"),
        "algo.kl.init_coef": (0.0, "no KL, no reference model (fixed)"),
        "ckpt.path": (str(run_dir / "checkpoints"), "run.output_dir / run.name"),
        "ckpt.output_dir": (str(run_dir / "final"), "run.output_dir / run.name"),
        "ckpt.load_enable": (bool(config.resume), "resume"),
        "ckpt.save_hf": (True, "a Hugging Face model at every checkpoint, for `stare-agent eval` (fixed)"),
        "logger.tensorboard_dir": (str(run_dir / "tb"), "run.output_dir / run.name"),
        # OpenRLHF writes TensorBoard under tb/<this name> (a time stamp by default): fixed, a rerun continues it
        "logger.wandb.run_name": (run_dir.name, "run.name"),
    }
    budget = loss.max_tokens_per_micro_batch
    why = "loss.max_tokens_per_micro_batch (0 = micro-batches of loss.micro_batch_size rows)"
    flags["train.dynamic_batch_enable"] = (budget > 0, why)
    flags["train.max_tokens_per_gpu"] = (budget or None, why)
    flags["rollout.max_tokens_per_gpu"] = (budget or None, why)
    if budget:
        flags["ds.packing_samples"] = (True, why)  # OpenRLHF packs whenever it batches by tokens
    if config.save_every:
        flags["ckpt.save_steps"] = (config.save_every, "save_every")
    if loss.dual_clip is not None:
        flags["actor.dual_clip"] = (loss.dual_clip, "loss.dual_clip")
    return flags


def check_block(config: RLConfig, ours: dict[str, tuple[Any, str]]) -> None:
    """Refuse a flag of the openrlhf block that our config sets, or that the STARE hooks do not support."""
    if config.resume not in ("", "auto"):
        raise ConfigError(
            f"resume={config.resume!r}: with backend openrlhf a run resumes from its own checkpoints "
            "(resume=auto); OpenRLHF has no option to resume from another folder"
        )
    problems = local_only_problems(config.model, config.run)
    zero_stage = config.openrlhf.get("ds.zero_stage", 2)  # 2: OpenRLHF's default (--ds.zero_stage)
    if config.loss.max_tokens_per_micro_batch and zero_stage != 3:
        problems.append(
            f"loss.max_tokens_per_micro_batch={config.loss.max_tokens_per_micro_batch} with openrlhf.ds.zero_stage="
            f"{zero_stage}: OpenRLHF's token-budget micro-batches run several backward passes per optimizer step with "
            "DeepSpeed's gradient accumulation set to 1, and DeepSpeed 0.19.6 accumulates them only under ZeRO-3 "
            "(under ZeRO-1/2 an update would keep part of its gradient: tests/test_openrlhf_launch.py); use "
            "ds.zero_stage 3"
        )
    if config.model.dtype == "float16":
        problems.append(
            "model.dtype=float16: OpenRLHF 0.11.2's vLLM engines run in bfloat16 (vllm_engine.py) and refuse weights "
            "of another dtype at the first weight sync; use bfloat16"
        )
    if problems:
        raise ConfigError("backend openrlhf (rl): " + "; ".join(problems))
    _refuse(config.openrlhf, ours, REFUSED)


def even_split_problems(config: RLConfig, namespace: Any) -> list[str]:
    """Why a step's samples would not split evenly over the training ranks (OpenRLHF's parsed flags); [] if they do.

    Experience pass: samples -> micro-batches of rollout.micro_batch_size -> chunks of ceil(count / ranks), one per
    rank. Update: each rank's samples -> micro-batches of train.micro_batch_size (OpenRLHF drops a remainder).
    Every rank must get the same number of whole micro-batches in both, or the ranks' collectives never match up.
    """
    r = config.rollout
    samples = r.prompts_per_step * r.group_size
    flags = vars(namespace)  # OpenRLHF's parser keeps the dotted names as they are
    ranks = flags["actor.num_nodes"] * flags["actor.num_gpus_per_node"]
    forward, update = flags["rollout.micro_batch_size"], flags["train.micro_batch_size"]
    what = f"a step's {samples} samples (rollout.prompts_per_step x rollout.group_size = {r.prompts_per_step} x "
    what += f"{r.group_size})"
    where = f"{ranks} training ranks (openrlhf.actor.num_nodes x openrlhf.actor.num_gpus_per_node)"
    per_update = samples // config.optim.updates_per_batch
    if flags["train.dynamic_batch_enable"]:
        # Token-budget micro-batches: OpenRLHF makes the experience pass's count a multiple of the ranks and gives
        # each rank as many (experience_maker.split_rollout_samples), deals the samples out to the ranks one by one
        # (balance_experiences), and gives every rank the largest count of micro-batches any rank needs for an
        # update (replay_buffer.setup_dynamic_batch). Each rank then trains its first train.batch_size / ranks
        # samples per update; a rank holding more would leave the rest untrained.
        if per_update % ranks:
            return [
                f"{what}, {per_update} per optimizer update (optim.updates_per_batch={config.optim.updates_per_batch}"
                f"), do not split evenly over {where}: with token-budget micro-batches a rank's extra samples would "
                "not be trained"
            ]
        return []
    problems = []
    if samples % forward or (samples // forward) % ranks:
        problems.append(
            f"{what} do not split into whole micro-batches of openrlhf.rollout.micro_batch_size={forward} shared "
            f"evenly by {where} in the experience pass"
        )
    if per_update % (ranks * update):
        problems.append(
            f"{what}, {per_update} per optimizer update (optim.updates_per_batch={config.optim.updates_per_batch}), "
            f"do not split into whole micro-batches of loss.micro_batch_size={update} shared evenly by {where} in "
            "the update"
        )
    return problems


def gpus_needed(namespace: Any) -> tuple[int, str]:
    """The GPUs OpenRLHF's placement asks Ray for (cli/train_ppo_ray.py), and how they add up: one per actor rank,
    and the engines' (num_engines x tensor_parallel_size) on the ranks' GPUs only when colocated in sync mode; in
    async mode OpenRLHF colocates the DeepSpeed models alone and the engines take GPUs of their own."""
    flags = vars(namespace)
    ranks = flags["actor.num_nodes"] * flags["actor.num_gpus_per_node"]
    engines = (flags["vllm.num_engines"] or 0) * flags["vllm.tensor_parallel_size"]
    if flags["train.colocate_all"] and not flags["train.async_enable"]:
        return max(ranks, engines), f"{ranks} actor ranks sharing their GPUs with {engines} engine GPUs"
    why = "async mode: engines apart" if flags["train.async_enable"] else "not colocated"
    return ranks + engines, f"{ranks} actor ranks + {engines} engine GPUs ({why})"


def async_problems(namespace: Any) -> list[str]:
    """What OpenRLHF's async mode (train.async_enable, train.partial_rollout_enable) cannot run with here; [] if fine.

    Over-sampling (rollout.vllm_generate_batch_size above rollout.batch_size) is refused: OpenRLHF keeps the extra
    samples in a buffer that a checkpoint does not save while the prompt loader's position has moved past them, so a
    resume skips those prompts; the sample generator over-samples inside each batch instead
    (rollout.max_dispatch_factor), and a resume draws again every prompt of a batch not yet trained.
    """
    flags = vars(namespace)
    problems = []
    on = flags["train.async_enable"]
    if flags["train.partial_rollout_enable"] and not on:
        problems.append("openrlhf.train.partial_rollout_enable needs openrlhf.train.async_enable")
    if on and flags["vllm.enable_sleep"]:
        problems.append(
            "openrlhf.vllm.enable_sleep with openrlhf.train.async_enable: async engines generate while the ranks "
            "train, so they cannot sleep; give engines and training ranks GPUs of their own (docs/cluster.md)"
        )
    if on and flags["train.async_queue_size"] < 1:
        problems.append(f"openrlhf.train.async_queue_size={flags['train.async_queue_size']}: at least 1 batch")
    generate = flags["rollout.vllm_generate_batch_size"]
    if generate and generate != flags["rollout.batch_size"]:
        problems.append(
            f"openrlhf.rollout.vllm_generate_batch_size={generate}: OpenRLHF's over-sampling buffer is not saved in "
            "checkpoints, so a resume would skip its prompts; over-sample within each batch with "
            "rollout.max_dispatch_factor instead"
        )
    return problems


def to_argv(flags: dict[str, Any]) -> list[str]:
    """Flags (name without dashes -> value) as command-line words: True = the bare flag, False/None = left out."""
    argv: list[str] = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        argv.append(f"--{name}")
        if value is True:
            continue
        argv += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return argv


def resolve_rl(config: RLConfig, run_dir: Path | None = None) -> tuple[list[str], Any]:
    """The argv for openrlhf.cli.train_ppo_ray and the namespace its parser makes of it, after every check."""
    from stare_agent.backends.openrlhf import upstream

    if not config.model.path or not config.data.train_file:
        raise ConfigError("backend openrlhf needs model.path and data.train_file")
    run_dir = run_dir or run_path(config.run, "rl")
    agent_file = str(Path(__file__).with_name("agent_executor.py"))
    ours = rl_flags(config, run_dir.absolute(), agent_file)
    check_block(config, ours)
    argv, namespace = _checked_by_openrlhf(upstream.RL_CLI, ours, config.openrlhf)
    problems = async_problems(namespace)
    if problems:
        raise ConfigError("backend openrlhf: " + "; ".join(problems))
    uneven = even_split_problems(config, namespace)
    if uneven:
        raise ConfigError(
            "backend openrlhf: " + "; ".join(uneven) + ": ranks with different numbers of micro-batches wait for "
            "each other until the distributed timeout; change the batch or the micro-batch sizes"
        )
    rerun_problems(config, namespace, run_dir)
    return argv, namespace


def rerun_problems(config: RLConfig, namespace: Any, run_dir: Path) -> None:
    """ConfigError when this run could lose or fail to load the run folder's checkpoints (resume.py)."""
    flags = vars(namespace)
    if flags["ckpt.max_num"] < 2:
        raise ConfigError(
            f"openrlhf.ckpt.max_num={flags['ckpt.max_num']}: OpenRLHF deletes the oldest checkpoints before it writes "
            "a new one, so with fewer than 2 a crash during a save leaves no checkpoint; keep at least 2"
        )
    newest = resume.newest_complete(run_dir)
    check_fresh_start(config.resume, run_dir, newest)
    ranks = flags["actor.num_nodes"] * flags["actor.num_gpus_per_node"]
    problem = resume.world_size_problem(newest, ranks, flags["ds.use_universal_ckpt"])
    if problem:
        raise ConfigError(f"resume=auto: {problem}")


def _checked_by_openrlhf(cli: str, ours: dict[str, tuple[Any, str]], block: dict[str, Any]) -> tuple[list[str], Any]:
    """Our flags then the block's, as argv, parsed by the real parser of OpenRLHF's `cli`; ConfigError if refused."""
    from stare_agent.backends.openrlhf import upstream

    try:
        parser = upstream.capture_parser(cli)
    except upstream.OpenRLHFMissing as exc:
        raise ConfigError(str(exc)) from None
    known = upstream.option_names(parser)
    for flag in block:
        if flag not in known:
            close = difflib.get_close_matches(flag, list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"openrlhf.{flag}: OpenRLHF {upstream.VERSION} has no flag --{flag}{hint}")
    argv = to_argv({name: value for name, (value, _) in ours.items()}) + to_argv(dict(block))
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            namespace = parser.parse_args(argv)
    except SystemExit:
        lines = errors.getvalue().strip().splitlines() or ["error: invalid arguments"]
        message = lines[-1].split("error: ", 1)[-1]
        raise ConfigError(f"OpenRLHF's parser refuses the resolved flags: {message}") from None
    return argv, namespace


def _refuse(block: dict[str, Any], ours: dict[str, tuple[Any, str]], refused: list) -> None:
    for flag in block:
        if flag in ours:
            raise ConfigError(f"openrlhf.{flag}: set by our {ours[flag][1]}; set it there instead")
    for flag, allowed, why in refused:
        if flag in block and block[flag] not in allowed:
            raise ConfigError(f"openrlhf.{flag}={block[flag]!r} is not supported: {why}")


def _show(config: Any, what: str, words: list[str]) -> None:
    """--dry-run's output: our resolved config, then the checked command line."""
    print("# our config (resolved)")
    print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
    print(f"# {what}:")
    print(shlex.join(words))


def run_rl(config: RLConfig, dry_run: bool = False) -> None:
    run_dir = run_path(config.run, "rl")
    argv, namespace = resolve_rl(config, run_dir)
    if dry_run:
        _show(config, "python -m openrlhf.cli.train_ppo_ray, with the STARE hooks in place, and these flags", argv)
        return
    from stare_agent.backends.openrlhf import train

    if config.resume:
        resume.prepare(run_dir)
    train.run(config, argv, run_dir, gpus=gpus_needed(namespace))


# train_sft flags the masked dataset cannot honour: (flag, allowed values, why).
SFT_REFUSED: list[tuple[str, tuple[Any, ...] | None, str]] = [
    ("data.apply_chat_template", (False,), "prompts are rendered by stare_agent.protocol, segment by segment"),
    ("data.multiturn", (False,), "the masks come from our transcript segments, not chat roles"),
    ("model.pretrain_mode_enable", (False,), "pretrain mode trains the prompt too"),
    ("data.output_key", (None,), "transcripts are read from data.messages_field"),
    ("data.tokenizer_chat_template", (None,), "the tokenizer's own chat template renders the prompt"),
    ("lr_warmup_ratio", (0, 0.0), "warm-up is optim.warmup_steps, applied exactly in steps"),
]


def resolve_sft(config: SFTConfig, run_dir: Path | None = None) -> tuple[list[str], Any]:
    """The command that starts OpenRLHF's SFT on every rank with our dataset, and the namespace of its flags."""
    from stare_agent.backends.openrlhf import sft, upstream

    if not config.model.path or not config.data.train_file:
        raise ConfigError("backend openrlhf needs model.path and data.train_file")
    ours = sft.sft_flags(config, run_dir)
    _refuse(config.openrlhf, ours, SFT_REFUSED)
    if run_dir is not None:  # OpenRLHF's SFT keeps DeepSpeed's checkpoints and `latest` in ckpt.path itself
        named = resume.latest_named(run_dir / "checkpoints")
        check_fresh_start(config.resume, run_dir, run_dir / "checkpoints" / named if named else None)
    argv, namespace = _checked_by_openrlhf(upstream.SFT_CLI, ours, config.openrlhf)
    entry = to_argv({name: value for name, (value, _) in sft.entry_flags(config).items()})
    return ["deepspeed", "--module", sft.ENTRY_MODULE, *entry, *argv], namespace


def run_sft(config: SFTConfig, dry_run: bool = False) -> None:
    run_dir = run_path(config.run, "sft")
    command, _ = resolve_sft(config, run_dir)
    if dry_run:
        _show(config, "the command (DeepSpeed starts OpenRLHF's SFT on every rank with our dataset)", command)
        return
    if shutil.which("deepspeed") is None:
        raise ConfigError(
            "backend openrlhf: the `deepspeed` launcher is not on PATH (scripts/install_gpu.sh installs it)"
        )
    save_config(config, run_dir)
    done = subprocess.run(command, check=False)
    if done.returncode != 0:
        raise SystemExit(done.returncode)


def run(command: str, config: Any, dry_run: bool = False) -> None:
    """`stare-agent sft|rl` with backend openrlhf."""
    if command == "sft":
        run_sft(config, dry_run)
    elif command == "rl":
        run_rl(config, dry_run)
    else:
        raise ConfigError(f"backend openrlhf is for sft and rl; `{command}` runs locally")
