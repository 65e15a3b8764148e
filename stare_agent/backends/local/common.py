"""What the local SFT and RL loops share: model loading, the optimizer and its schedule, checkpoints,
random state, and the metrics log.

Checkpoints are written to a temporary folder and renamed into place, and `latest` is replaced
atomically afterwards, so a process killed mid-save leaves the last good checkpoint intact (the
unfinished folder is removed on the next start).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stare_agent.config import ConfigError, ModelConfig, OptimConfig
from stare_agent.reruns import check_fresh_start
from stare_agent.runtime import NonFiniteGradient

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.pt"


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_model(config: ModelConfig, path: str | Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) from a local Hugging Face folder, or a .gguf file (dequantized by transformers; needs
    the `gguf` and `accelerate` packages), on the configured device and dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path or config.path):
        raise ConfigError(
            "model.path is not set: give a Hugging Face model folder or a .gguf file (model.path=DIR), e.g. "
            "model/ or sft/checkpoints/step-NNNNNN/ in the folder of a `stare-agent quickstart` run"
        )
    target = Path(path or config.path)
    folder, extra, model_extra = target, {}, {}
    if target.suffix == ".gguf" and target.is_file():
        from stare_agent.pretrained import dequantize_option

        # dense weights: a model that keeps transformers' GGUF quantizer cannot save its checkpoints
        folder, extra, model_extra = target.parent, {"gguf_file": target.name}, dequantize_option()
    elif not (target / "config.json").exists():
        raise ConfigError(
            f"model.path {str(target)!r} is not a Hugging Face model folder (no config.json) or a .gguf file; "
            "build one with `stare-agent quickstart` or point it at a local download"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, **extra)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, config.dtype), **extra, **model_extra)
    return model.to(pick_device(config.device)), tokenizer


def next_token_logits(
    model: Any, ids: torch.Tensor, attention: torch.Tensor, packed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of every position, the id each one predicts): (B, T, V) as the model returns them, and (B, T).

    The last position predicts nothing; its target is a placeholder whose result callers drop ([:, :-1]).
    Keeping all T positions lets the chunked passes (theory.token_logprobs, theory.sampling_stats) view the
    logits as (B*T, V) without copying them.

    packed: the rows (right-padded: each row's tokens first) run as one row of their tokens only, each episode's
    positions counted from 0 and no attention mask, which transformers turns into attention within each episode
    (masking_utils.find_packed_sequence_indices; sdpa and eager). No padding goes through the model; the logits come
    back in the (B, T, V) layout, zero at padding, so callers compute the same things either way.
    """
    if not packed:
        logits = model(input_ids=ids, attention_mask=attention).logits
    else:
        real = attention.bool()
        positions = torch.cat([torch.arange(int(n), device=ids.device) for n in real.sum(dim=1)])
        flat = model(input_ids=ids[real][None], position_ids=positions[None], use_cache=False).logits[0]
        logits = flat.new_zeros((*ids.shape, flat.shape[-1])).index_put((real,), flat)
    return logits, torch.cat([ids[:, 1:], ids[:, :1]], dim=1)


def token_budget_micro_batches(lengths: list[int], budget: int) -> list[slice]:
    """Consecutive rows grouped so that each group's tokens sum to at most `budget` (a row longer than the budget
    alone): the micro-batches of loss.max_tokens_per_micro_batch, in row order."""
    starts: list[int] = []
    total = 0
    for row, n in enumerate(lengths):
        if not starts or total + n > budget:
            starts.append(row)
            total = 0
        total += n
    ends = [*starts[1:], len(lengths)] if starts else []
    return [slice(start, end) for start, end in zip(starts, ends, strict=True)]


def progress(total: int, desc: str, initial: int = 0, unit: str = "step") -> Any:
    """A tqdm bar; redrawn at most every 30 s when the output is not a terminal (logs stay readable)."""
    import sys

    from tqdm import tqdm

    interval = 0.2 if sys.stderr.isatty() else 30.0
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, mininterval=interval)


def make_optimizer(model: torch.nn.Module, config: OptimConfig, total_steps: int):
    """AdamW and a LambdaLR: linear warm-up to lr, then cosine/linear decay to min_lr_ratio * lr, or constant."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=config.lr, betas=tuple(config.betas), eps=config.eps, weight_decay=config.weight_decay
    )

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.schedule == "constant":
            return 1.0
        span = max(total_steps - config.warmup_steps, 1)
        progress = min((step - config.warmup_steps) / span, 1.0)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if config.schedule == "cosine" else 1.0 - progress
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * shape

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_and_step(model: torch.nn.Module, optimizer, scheduler, max_grad_norm: float, where: str = "") -> float:
    """Clip (when max_grad_norm > 0), step (and the scheduler, unless None), zero the gradients; returns the
    gradient norm before clipping. Raises NonFiniteGradient, having applied nothing, when that norm is NaN or
    infinite: one such step makes every weight NaN, and every later step and checkpoint with it. `where` starts
    the message (e.g. "rl step 12, update 2: ")."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if not math.isfinite(float(norm)):
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteGradient(
            f"{where}the gradient norm is {float(norm)} ({len(bad)} of {len(params)} parameter tensors have "
            f"non-finite gradients, first {', '.join(bad[:3])}); the update was not applied, so the weights and the "
            "latest checkpoint are those before it (a lower optim.lr, or optim.max_grad_norm, may help)"
        )
    if max_grad_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def stream_indices(n: int, seed: int, start: int, count: int) -> list[int]:
    """Items [start, start+count) of an endless stream of per-epoch permutations of range(n).

    Each epoch's permutation is seeded by (seed, epoch), so a position in the data is one integer and
    resuming from a checkpoint continues with exactly the items an uninterrupted run would take.
    """
    out, perms = [], {}
    for j in range(start, start + count):
        epoch = j // n
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perms[epoch][j % n]))
    return out


# --- checkpoints --------------------------------------------------------------------------------------------------


def save_checkpoint(run_dir: Path, step: int, model: Any, tokenizer: Any, state: dict[str, Any]) -> Path:
    """`run_dir/checkpoints/step-NNNNNN/`: the model and tokenizer in HF format plus trainer_state.pt.

    Written under a temporary name, flushed, then renamed; `checkpoints/latest` (a text file naming the
    folder) is replaced only after that, so it always names a complete checkpoint.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in the middle of ours
    root = run_dir / CHECKPOINTS
    final = root / f"step-{step:06d}"
    partial = root / f".partial-{final.name}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    torch.save(state, partial / TRAINER_STATE)
    for path in partial.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    pointer = root / ".latest.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / "latest")
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The run's last complete checkpoint: the one `checkpoints/latest` names, or, when that pointer is missing or
    names no complete checkpoint (lost, emptied by a full disk, or its folder deleted), the highest-numbered
    complete `step-*` folder, said in one line. None when there is no complete checkpoint.

    A `step-*` folder exists only complete (save_checkpoint renames it into place when it is written). The pointer
    wins over the highest number: a run resumed from an earlier checkpoint of its own leaves later, abandoned ones.
    """
    root = run_dir / CHECKPOINTS
    pointer = root / "latest"
    named = pointer.read_text().strip() if pointer.is_file() else ""
    if named and (root / named / TRAINER_STATE).is_file():
        return root / named
    complete = sorted(p for p in root.glob("step-*") if (p / TRAINER_STATE).is_file())
    if not complete:
        return None
    why = f"names {named!r}, which is not a complete checkpoint" if named else "is missing or empty"
    print(f"checkpoints: {pointer} {why}; continuing from {complete[-1].name}, the last complete one", flush=True)
    return complete[-1]


def clean_partial_checkpoints(run_dir: Path) -> None:
    for leftover in (run_dir / CHECKPOINTS).glob(".partial-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint to resume from: 'auto' = the run's last complete one (none yet is fine), '' = none (refused
    over a run that has one: reruns.check_fresh_start), else a folder. Leftovers of an interrupted save go first."""
    clean_partial_checkpoints(run_dir)
    if not resume:
        check_fresh_start(resume, run_dir, latest_checkpoint(run_dir))
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not (path / TRAINER_STATE).exists():
        raise ConfigError(f"resume={resume!r} is not a checkpoint folder (no {TRAINER_STATE} in it)")
    return path


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint / TRAINER_STATE, weights_only=False)


# --- metrics ------------------------------------------------------------------------------------------------------


class MetricsLog:
    """Per-step metrics to `metrics.jsonl` (one object per step) and to TensorBoard under `tb/`."""

    def __init__(self, run_dir: Path, resume_step: int | None = None):
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():  # drop steps after the checkpoint: they are redone
            kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(f"{line}\n" for line in kept))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=resume_step + 1 if resume_step is not None else None)
        self.file = self.path.open("a")
        self.started = time.time()

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": step, "time": round(time.time() - self.started, 3)}
        row.update({k: _plain(v) for k, v in metrics.items()})
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self.tb.add_scalar(key, value, step)

    def close(self) -> None:
        self.file.close()
        self.tb.close()


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; null means undefined this step
    return value


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
