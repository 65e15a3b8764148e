"""`stare-agent sft` with backend openrlhf: OpenRLHF's SFT trainer (DeepSpeed) on our masked dataset.

OpenRLHF 0.11.2's own `SFTDataset` cannot train on ReTool transcripts: it tokenizes the rendered text in one
piece and masks by chat role, while the interpreter output sits inside the assistant message. So this module
puts `StareSFTDataset` in its place (a module-attribute patch of `openrlhf.datasets.SFTDataset`, read by
`openrlhf.cli.train_sft` at import) and runs that CLI unchanged. Every rank runs this module:
`deepspeed --module stare_agent.backends.openrlhf.sft <entry options> <OpenRLHF flags>`.

The dataset tokenizes each row with `stare_agent.data.tokenize_transcript`, segment by segment as RL builds
sequences, with the local backend's truncation rules, so both backends train on the same ids and the same
target tokens. Only the mask convention differs (see `openrlhf_loss_mask`).

What it does not do: `data.eval_fraction` (OpenRLHF reads eval data only from `--eval.dataset`), a step
limit (`max_steps`), float32 training; `sft_flags` refuses those, naming the key.
"""

from __future__ import annotations

import argparse
import functools
import runpy
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from stare_agent.backends.openrlhf import upstream
from stare_agent.config import ConfigError, ModelConfig, RunConfig, SFTConfig, run_path
from stare_agent.data import DataError, SFTExample, SFTReport, Truncation, sft_example

ENTRY_MODULE = "stare_agent.backends.openrlhf.sft"

# What this module replaces in OpenRLHF 0.11.2 (module attribute -> where it is read), pinned by the tests.
PATCHED = {
    "openrlhf.datasets.SFTDataset": "openrlhf/cli/train_sft.py:5 (from openrlhf.datasets import SFTDataset)",
    "openrlhf.utils.deepspeed.deepspeed.get_scheduler": "DeepspeedStrategy._ds_init_train_model (partial(...))",
    "openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy.optimizer_step": "trainer/sft_trainer.py:192 (each batch)",
}


# --- the mask convention --------------------------------------------------------------------------------------


def openrlhf_loss_mask(loss_mask: Sequence[int]) -> list[int]:
    """Our loss mask in OpenRLHF's convention: shifted one position left, the last position 0.

    Ours (data.tokenize_transcript) marks the target token itself: mask[t] = 1 trains log p(x_t | x_<t).
    OpenRLHF's SFTTrainer trains `loss_mask[:, :-1]` against `log_probs[:, t] = log p(x_{t+1} | x_<=t)`
    (sft_trainer.py:184, models/actor.py rolls the ids by one), so its mask marks the position that
    predicts the target: orl[t] = ours[t + 1]. Position 0 is never a target in either convention, and the
    last position predicts nothing, so it is 0.
    """
    return [*loss_mask[1:], 0]


# --- the dataset ------------------------------------------------------------------------------------------------


class StareSFTDataset(torch.utils.data.Dataset):
    """Drop-in for `openrlhf.datasets.SFTDataset` (same constructor, items and collate_fn) with our masking.

    Rows are read from `strategy.args.data.input_key` (our data.messages_field). `__getitem__` returns
    `(input_ids, attention_mask, loss_mask)`, each (1, L): ids long, attention long (all 1), loss mask float
    in OpenRLHF's convention (`openrlhf_loss_mask`). `collate_fn` right-pads them to (B, L) as OpenRLHF's
    `zero_pad_sequences(..., "right")` does (ids with the pad id, masks with 0).

    OpenRLHF's options that would change what is trained (`pretrain_mode`, `multiturn`, `data.output_key`,
    `data.apply_chat_template`, `data.tokenizer_chat_template`) are refused; `input_template` and
    `num_processors` are accepted and unused (the prompt is rendered by stare_agent.protocol, in this process).
    `truncation` is ours (data.truncation), bound by the entry point.
    """

    def __init__(
        self,
        dataset: Iterable[dict[str, Any]],
        tokenizer: Any,
        max_length: int,
        strategy: Any,
        input_template: str | None = None,
        pretrain_mode: bool = False,
        num_processors: int = 8,
        multiturn: bool = False,
        *,
        truncation: Truncation = "right",
    ) -> None:
        super().__init__()
        data_args = strategy.args.data
        refused = {
            "--model.pretrain_mode_enable": pretrain_mode,
            "--data.multiturn": multiturn,
            "--data.apply_chat_template": getattr(data_args, "apply_chat_template", False),
            "--data.output_key": getattr(data_args, "output_key", None),
            "--data.tokenizer_chat_template": getattr(data_args, "tokenizer_chat_template", None),
        }
        for flag, value in refused.items():
            if value:
                raise ValueError(
                    f"{flag}={value!r} is not supported by stare-agent's SFT dataset: transcripts are read from "
                    "--data.input_key (our data.messages_field) and rendered and masked by stare_agent.protocol"
                )
        if truncation not in ("right", "drop", "error"):
            raise ValueError(f"truncation must be one of right, drop, error; got {truncation!r}")
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no EOS token; SFT sequences end with one")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        messages_field = data_args.input_key
        self.examples: list[SFTExample] = []
        self.report = SFTReport()
        for index, row in enumerate(dataset):
            self.report.rows += 1
            # OpenRLHF hands over an HF Dataset (after --data.max_samples); the file name is not kept in it
            example, why = sft_example(tokenizer, row, f"row {index}", max_length, truncation, messages_field)
            if example is None:
                self.report.dropped.append(why)
                continue
            self.report.truncated += example.truncated
            self.examples.append(example)
        say = getattr(strategy, "print", print)  # rank 0 only, in OpenRLHF's strategy
        say(
            f"stare-agent sft: {self.report.rows} rows: {len(self.examples)} kept, {self.report.truncated} "
            f"truncated to {max_length} tokens, {len(self.report.dropped)} dropped"
        )
        for line in self.report.dropped[:5]:
            say(f"  dropped: {line}")
        if not self.examples:
            raise DataError(
                f"no SFT examples left: all {self.report.rows} rows were dropped (data.truncation={truncation!r}, "
                f"data.max_tokens={max_length})"
            )

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        example = self.examples[index]
        input_ids = torch.tensor([example.input_ids], dtype=torch.long)  # (1, L)
        attention_mask = torch.ones_like(input_ids)  # (1, L); padding is added by collate_fn
        # (1, L); 1 = position t predicts a token the model writes (x_{t+1}), OpenRLHF's convention
        loss_mask = torch.tensor([openrlhf_loss_mask(example.loss_mask)], dtype=torch.float32)
        return input_ids, attention_mask, loss_mask

    def collate_fn(self, items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        """(input_ids, attention_mask, loss_mask), each (B, L_max), right-padded: ids with the pad id, masks with 0."""
        width = max(ids.shape[-1] for ids, _, _ in items)

        def pad(tensors: list[torch.Tensor], value: int) -> torch.Tensor:
            return torch.cat([F.pad(t, (0, width - t.shape[-1]), value=value) for t in tensors], dim=0)

        ids, attention, loss = zip(*items, strict=True)
        return pad(list(ids), self.pad_token_id), pad(list(attention), 0), pad(list(loss), 0)


# --- the entry point every rank runs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EntryOptions:
    """What the entry point needs beyond OpenRLHF's flags; given as `--stare.<name> value` before them."""

    truncation: Truncation
    """data.truncation: what the dataset does with rows longer than --data.max_len."""
    warmup_steps: int
    """optim.warmup_steps: optimizer steps of linear warm-up. OpenRLHF only takes a ratio of a step count it
    computes itself (from the data after filtering and the world size), so the count is applied exactly by
    wrapping the scheduler factory instead."""


def parse_entry_options(argv: Sequence[str]) -> tuple[EntryOptions, list[str]]:
    """Our `--stare.*` options, and the rest of argv (OpenRLHF's flags, DeepSpeed's --local_rank) untouched."""
    parser = argparse.ArgumentParser(prog=f"python -m {ENTRY_MODULE}", add_help=False, allow_abbrev=False)
    parser.add_argument("--stare.truncation", dest="truncation", required=True, choices=("right", "drop", "error"))
    parser.add_argument("--stare.warmup_steps", dest="warmup_steps", required=True, type=int)
    known, rest = parser.parse_known_args(list(argv))
    if known.warmup_steps < 0:
        parser.error(f"--stare.warmup_steps must be >= 0; got {known.warmup_steps}")
    return EntryOptions(known.truncation, known.warmup_steps), rest


def _with_warmup(get_scheduler: Callable[..., Any], warmup_steps: int) -> Callable[..., Any]:
    original = getattr(get_scheduler, "__wrapped__", get_scheduler)  # installing twice wraps once

    @functools.wraps(original)
    def get_scheduler_with_warmup(*args: Any, **kwargs: Any) -> Any:
        kwargs["num_warmup_steps"] = warmup_steps
        return original(*args, **kwargs)

    return get_scheduler_with_warmup


def install(options: EntryOptions) -> None:
    """Put our dataset (and the exact warm-up) in place of OpenRLHF's, for `openrlhf.cli.train_sft` to pick up, and
    stop the run at an update whose gradients are not finite (upstream.checking_updates)."""
    datasets = upstream.import_openrlhf("openrlhf.datasets")
    strategy_module = upstream.import_openrlhf("openrlhf.utils.deepspeed.deepspeed")
    datasets.SFTDataset = functools.partial(StareSFTDataset, truncation=options.truncation)
    strategy_module.get_scheduler = _with_warmup(strategy_module.get_scheduler, options.warmup_steps)
    strategy = strategy_module.DeepspeedStrategy
    strategy.optimizer_step = upstream.checking_updates(strategy.optimizer_step, strategy_module.Actor, _sft_step)


def _sft_step(engine: Any) -> str:
    return f"sft step {engine.global_steps + 1}"  # as OpenRLHF numbers it: DeepSpeed's count of updates


def main(argv: Sequence[str] | None = None) -> None:
    """Run OpenRLHF's SFT CLI with our dataset: `python -m stare_agent.backends.openrlhf.sft --stare.truncation
    right --stare.warmup_steps 10 --model.model_name_or_path ...` (as DeepSpeed's launcher starts each rank)."""
    options, rest = parse_entry_options(sys.argv[1:] if argv is None else argv)
    install(options)
    sys.argv = [sys.argv[0], *rest]  # the CLI's parser reads sys.argv
    runpy.run_module(upstream.SFT_CLI, run_name="__main__", alter_sys=True)


# --- our config -> OpenRLHF's flags ----------------------------------------------------------------------------

SCHEDULES = {"constant": "constant_with_warmup", "cosine": "cosine_with_min_lr", "linear": "linear"}
"""optim.schedule -> OpenRLHF's --lr_scheduler (Hugging Face scheduler names); used by the SFT and RL flags."""
DTYPES = {"bfloat16": "bf16", "float16": "fp16"}
"""model.dtype -> OpenRLHF's --ds.param_dtype (DeepSpeed trains in bf16 or fp16 only)."""


def local_only_problems(model: ModelConfig, run: RunConfig) -> list[str]:
    """What the local backend's model and run settings ask that DeepSpeed cannot do (SFT and RL alike)."""
    problems = []
    if model.dtype not in DTYPES:
        problems.append(
            f"model.dtype={model.dtype}: OpenRLHF trains in bf16 or fp16 (--ds.param_dtype); set model.dtype=bfloat16"
        )
    if model.device != ModelConfig().device:
        problems.append(f"model.device={model.device!r}: DeepSpeed places each rank on its own GPU")
    if run.threads != RunConfig().threads:
        problems.append(f"run.threads={run.threads}: a setting of the local backend's CPU loop")
    return problems


def check_sft(config: SFTConfig) -> None:
    """Refuse what OpenRLHF's SFT trainer cannot do as our config says, naming the key and what to do."""
    problems = []
    if config.max_steps:
        problems.append(
            f"max_steps={config.max_steps}: OpenRLHF's SFT trainer runs whole epochs; use epochs, or "
            "openrlhf.data.max_samples to train on fewer rows"
        )
    if config.data.eval_fraction > 0 and not config.data.eval_file:
        problems.append(
            f"data.eval_fraction={config.data.eval_fraction}: OpenRLHF reads eval data only from a file; set "
            "data.eval_file, or data.eval_fraction=0 for no eval loss"
        )
    if config.eval_every == 0 and config.data.eval_file:
        problems.append("eval_every=0 (only at the end) has no OpenRLHF equivalent; give a step count")
    problems += local_only_problems(config.model, config.run)
    if config.optim.schedule == "linear" and config.optim.min_lr_ratio > 0:
        problems.append(
            f"optim.min_lr_ratio={config.optim.min_lr_ratio} with optim.schedule=linear: OpenRLHF's linear "
            "schedule decays to 0; use schedule=cosine or min_lr_ratio=0"
        )
    if config.resume not in ("", "auto"):
        problems.append(
            f"resume={config.resume!r}: with backend openrlhf a run resumes from its own checkpoints (resume=auto)"
        )
    if problems:
        raise ConfigError("backend openrlhf (sft): " + "; ".join(problems))


def sft_flags(config: SFTConfig, run_dir: Path | None = None) -> dict[str, tuple[Any, str]]:
    """OpenRLHF train_sft flag -> (value, the key of ours it comes from), for everything our config decides.

    `train.batch_size` is the sequences per optimizer step of all ranks together, as in the local backend
    (micro_batch_size x grad_accum); with W GPUs DeepSpeed needs grad_accum to be a multiple of W and each
    rank accumulates grad_accum / W micro-batches. Warm-up is 0 here and applied exactly by the entry point
    (`entry_flags`).
    """
    check_sft(config)
    run_dir = (run_dir or run_path(config.run, "sft")).absolute()
    o, data = config.optim, config.data
    flags: dict[str, tuple[Any, str]] = {
        "model.model_name_or_path": (config.model.path, "model.path"),
        "ds.param_dtype": (DTYPES[config.model.dtype], "model.dtype"),
        "data.dataset": (data.train_file, "data.train_file"),
        "data.input_key": (data.messages_field, "data.messages_field"),
        "data.max_len": (data.max_tokens, "data.max_tokens"),
        "train.max_epochs": (config.epochs, "epochs"),
        "train.micro_batch_size": (config.micro_batch_size, "micro_batch_size"),
        "train.batch_size": (config.micro_batch_size * config.grad_accum, "micro_batch_size x grad_accum"),
        "train.seed": (config.run.seed, "run.seed"),
        "adam.lr": (o.lr, "optim.lr"),
        "adam.betas": (list(o.betas), "optim.betas"),
        "adam.eps": (o.eps, "optim.eps"),
        "adam.weight_decay": (o.weight_decay, "optim.weight_decay"),
        "lr_scheduler": (SCHEDULES[o.schedule], "optim.schedule"),
        "lr_warmup_ratio": (0.0, "optim.warmup_steps (applied by the entry point)"),
        "min_lr_ratio": (o.min_lr_ratio, "optim.min_lr_ratio"),
        "max_norm": (o.max_grad_norm, "optim.max_grad_norm"),
        "logger.logging_steps": (config.log_every, "log_every"),
        "logger.tensorboard_dir": (str(run_dir / "tb"), "run.output_dir / run.name"),
        "ckpt.path": (str(run_dir / "checkpoints"), "run.output_dir / run.name"),
        "ckpt.output_dir": (str(run_dir / "final"), "run.output_dir / run.name"),
        "ckpt.load_enable": (config.resume == "auto", "resume"),
    }
    if data.eval_file:
        flags["eval.dataset"] = (data.eval_file, "data.eval_file")
        flags["eval.steps"] = (config.eval_every, "eval_every")
    if config.save_every:
        flags["ckpt.save_steps"] = (config.save_every, "save_every")
    return flags


def entry_flags(config: SFTConfig) -> dict[str, tuple[Any, str]]:
    """The entry point's own options (`--stare.*`, see EntryOptions), in the shape of `sft_flags`."""
    return {
        "stare.truncation": (config.data.truncation, "data.truncation"),
        "stare.warmup_steps": (config.optim.warmup_steps, "optim.warmup_steps"),
    }


if __name__ == "__main__":
    main()
