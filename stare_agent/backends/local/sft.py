"""`stare-agent sft`: masked next-token loss on tool-use transcripts, in one process (CPU or one GPU).

Only tokens the model writes are trained on: prompt and interpreter tokens (tags included) have
loss mask 0 (data.load_sft). The loss is a token-level mean over all micro-batches of an optimizer
step. Data order: the examples are read as one stream of per-epoch permutations (seeded by run.seed
and the epoch), and step s takes stream items [s*S, (s+1)*S) with S = micro_batch_size * grad_accum,
so the position in the data is a function of the step and resuming is exact.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from stare_agent.backends.local.common import (
    MetricsLog,
    clip_and_step,
    load_model,
    load_trainer_state,
    make_optimizer,
    next_token_logits,
    progress,
    resolve_resume,
    rng_state,
    save_checkpoint,
    seed_everything,
    set_rng_state,
    stream_indices,
)
from stare_agent.config import SFTConfig, run_path, save_config
from stare_agent.data import DataError, SFTExample, load_sft
from stare_agent.theory import token_logprobs


def _split(examples: list[SFTExample], fraction: float, seed: int) -> tuple[list[SFTExample], list[SFTExample]]:
    if fraction <= 0 or len(examples) < 2:
        return examples, []
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = min(max(1, round(fraction * len(examples))), len(examples) - 1)
    held = set(order[:n_eval])
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


def collate(examples: list[SFTExample], pad_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(input_ids, attention_mask, loss_mask), right-padded to the longest; (B, T) each."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width), dtype=torch.float32)  # 1 = written by the model: trained on
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        attention[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(e.loss_mask, dtype=torch.float32)
    return ids.to(device), attention.to(device), loss_mask.to(device)


def token_loss_sum(model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, loss_mask: torch.Tensor):
    """Sum of next-token cross-entropy over the positions whose target has loss mask 1, and their count.

    Computed chunk by chunk over the logits (theory.token_logprobs), as the RL update does.
    """
    logits, targets = next_token_logits(model, ids, attention)
    nll = -token_logprobs(logits, targets)[:, :-1]
    weight = loss_mask[:, 1:]
    return (nll * weight).sum(), weight.sum()


@torch.no_grad()
def eval_loss(model, examples: list[SFTExample], batch_size: int, pad_id: int, device: torch.device) -> float:
    was_training = model.training
    model.eval()
    total, count = 0.0, 0.0
    for i in range(0, len(examples), batch_size):
        s, n = token_loss_sum(model, *collate(examples[i : i + batch_size], pad_id, device))
        total, count = total + float(s), count + float(n)
    model.train(was_training)
    return total / max(count, 1.0)


def run(config: SFTConfig) -> Path:
    """Train; returns the final checkpoint folder (a Hugging Face model folder)."""
    run_dir = run_path(config.run, "sft")
    seed_everything(config.run.seed)
    checkpoint = resolve_resume(config.resume, run_dir)
    model, tokenizer = load_model(config.model, checkpoint)
    device = next(model.parameters()).device

    data = config.data
    examples, report = load_sft(
        data.train_file,
        tokenizer,
        max_tokens=data.max_tokens,
        truncation=data.truncation,
        messages_field=data.messages_field,
    )
    if data.eval_file:
        train = examples
        held, _ = load_sft(data.eval_file, tokenizer, max_tokens=data.max_tokens, messages_field=data.messages_field)
    else:
        train, held = _split(examples, data.eval_fraction, config.run.seed)
    if not train:
        raise DataError(f"no training examples left in {data.train_file} ({len(report.dropped)} dropped)")
    print(
        f"sft: {report.rows} rows from {data.train_file}: {len(train)} train, {len(held)} eval, "
        f"{report.truncated} truncated to {data.max_tokens} tokens, {len(report.dropped)} dropped"
    )
    for line in report.dropped[:5]:
        print(f"  dropped: {line}")

    per_step = config.micro_batch_size * config.grad_accum
    total_steps = config.max_steps or config.epochs * math.ceil(len(train) / per_step)
    optimizer, scheduler = make_optimizer(model, config.optim, total_steps)
    step = 0
    if checkpoint is not None:
        state = load_trainer_state(checkpoint)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        step = state["step"]
        print(f"sft: resumed from {checkpoint} at step {step}")
    save_config(config, run_dir)  # the run starts here: model, data and resume point all checked out
    log = MetricsLog(run_dir, resume_step=step if checkpoint is not None else None)
    pad_id = tokenizer.pad_token_id

    def save() -> Path:
        state = {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
        }
        return save_checkpoint(run_dir, step, model, tokenizer, state)

    model.train()
    bar = progress(total_steps, "sft", initial=step)
    last = checkpoint
    tokens, started = 0, time.perf_counter()
    while step < total_steps:
        picked = [train[i] for i in stream_indices(len(train), config.run.seed, step * per_step, per_step)]
        micro = [picked[i : i + config.micro_batch_size] for i in range(0, per_step, config.micro_batch_size)]
        n_trained = sum(sum(e.loss_mask[1:]) for e in picked)  # targets with mask 1, as token_loss_sum counts
        loss_total = 0.0
        for chunk in micro:
            batch = collate(chunk, pad_id, device)
            loss_sum, _ = token_loss_sum(model, *batch)
            (loss_sum / max(n_trained, 1)).backward()
            loss_total += float(loss_sum.detach())
            tokens += int(batch[1].sum())
        grad_norm = clip_and_step(model, optimizer, scheduler, config.optim.max_grad_norm, f"sft step {step + 1}: ")
        step += 1
        bar.update(1)
        metrics = {"train/loss": loss_total / max(n_trained, 1), "train/grad_norm": grad_norm}
        metrics["train/lr"] = scheduler.get_last_lr()[0]
        metrics["train/epoch"] = step * per_step / len(train)
        if held and ((config.eval_every and step % config.eval_every == 0) or step == total_steps):
            metrics["eval/loss"] = eval_loss(model, held, config.micro_batch_size, pad_id, device)
        if step % config.log_every == 0 or "eval/loss" in metrics or step == total_steps:
            metrics["perf/tokens_per_s"] = tokens / (time.perf_counter() - started)
            log.write(step, metrics)
            shown = {"loss": f"{metrics['train/loss']:.3f}"}
            if "eval/loss" in metrics:
                shown["eval"] = f"{metrics['eval/loss']:.3f}"
            bar.set_postfix(shown, refresh=False)
        if (config.save_every and step % config.save_every == 0) or step == total_steps:
            last = save()
    bar.close()
    log.close()
    if last is None:  # resumed at or past the end: nothing trained, the checkpoint is the result
        last = save()
    print(f"sft: done; model and state in {last}")
    return last
