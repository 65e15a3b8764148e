"""`stare-agent rl`: multi-turn GRPO with STARE, in one process (CPU or one GPU).

One step:
1. rollouts: prompts from the data stream, `group_size` episodes each, generated in lock step with
   the tool calls of a turn run concurrently (agent.run_batch);
2. dynamic sampling: a group whose rewards are all equal carries no signal and is dropped, and so is
   a group with a sandbox failure (not the model's fault); new prompts refill the batch until it holds
   `prompts_per_step` groups, and every dropped group is counted in the logs. A step that cannot fill its
   batch within `max_prompts_per_step` prompts ends the run: a partial batch is never trained
   (stare_agent/batching.py has the rule, shared with the openrlhf backend);
3. one no-grad forward over the batch gives the old log-probs and, from the same logits, the exact
   per-token entropy and S2, all of the sampling distribution softmax(logits / temperature), in one
   chunked pass (theory.sampling_stats);
4. GRPO group-normalized advantages; the entropy-control method's weights over the whole batch
   (step.control_step: STARE by default);
5. `optim.updates_per_batch` updates (1 = on-policy), each on one mini-batch of the batch's episodes:
   clipped surrogate with clip-higher, token-level mean over the mini-batch, no KL; Clip-Cov and KL-Cov select
   their tokens at each update from the current policy (step.update_selection), the entropy bonus adds its
   term.
GRPO-ds is the same run with entropy_control.method=none (weights 1; the same entropy metrics are logged).

The model runs in eval mode throughout RL (rollouts, reference pass and update): dropout would make the
update's policy differ from the one that sampled, so the ratio would not be 1 on-policy.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stare_agent import protocol, snapshots
from stare_agent.agent import EpisodeResult, run_batch
from stare_agent.audit import MaskAuditError, audit_trained
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
    token_budget_micro_batches,
)
from stare_agent.backends.local.generation import HFGenerator
from stare_agent.batching import BatchFill, NoStepTrained, dispatch_count, end_message, episode_stats
from stare_agent.config import ConfigError, RLConfig, run_path, save_config
from stare_agent.data import DataError, Problem, load_problems
from stare_agent.entropy_control import (
    SELECTED_TOKENS,
    SELECTING_METHODS,
    EntropyControl,
    keep_reports_until,
    selection_loss_terms,
)
from stare_agent.loss import entropy_bonus_loss, group_advantages, logprob_mismatch, policy_loss, ratio_stats
from stare_agent.runtime import make_client, start_client
from stare_agent.step import CLASS_METRICS, MicroBatch, UpdatePart, class_masks, control_step, update_selection
from stare_agent.theory import sampling_stats, token_entropy, token_logprobs


class TimedClient:
    """Wraps a sandbox client and measures wall time with at least one call in flight (tool time per step)."""

    def __init__(self, inner: Any):
        self.inner, self.seconds, self._in_flight, self._since = inner, 0.0, 0, 0.0

    async def _timed(self, coro):
        if self._in_flight == 0:
            self._since = time.perf_counter()
        self._in_flight += 1
        try:
            return await coro
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.seconds += time.perf_counter() - self._since

    async def create_session(self):
        return await self._timed(self.inner.create_session())

    async def execute(self, code, session_id=None, timeout_s=None):
        return await self._timed(self.inner.execute(code, session_id, timeout_s))

    async def close_session(self, session_id):
        return await self._timed(self.inner.close_session(session_id))


@torch.no_grad()
def reference_stats(
    model: Any, ids: torch.Tensor, attention: torch.Tensor, temperature: float, packed: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Old log-probs of the next tokens, entropy and S2 of the sampling distribution: each (B, T-1) float32.
    packed: the rows run as one packed row (common.next_token_logits); the results are laid out the same."""
    logits, targets = next_token_logits(model, ids, attention, packed)
    logprobs, entropy, s2 = sampling_stats(logits, targets, temperature=temperature)
    return logprobs[:, :-1], entropy[:, :-1], s2[:, :-1]


def sequence_logprobs(
    model: Any, ids: torch.Tensor, attention: torch.Tensor, temperature: float, packed: bool = False
) -> torch.Tensor:
    """Log-prob of each next token under softmax(logits / temperature), (B, T-1) float32, differentiable."""
    return policy_outputs(model, ids, attention, temperature, packed=packed)[0]


def policy_outputs(
    model: Any,
    ids: torch.Tensor,
    attention: torch.Tensor,
    temperature: float,
    entropy: bool = False,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each next token and (with `entropy`) the entropy at each position, of softmax(logits /
    temperature) from one forward: (B, T-1) float32 each, differentiable; the entropy is None without it."""
    logits, targets = next_token_logits(model, ids, attention, packed)
    logprobs = token_logprobs(logits, targets, temperature=temperature)[:, :-1]
    return logprobs, (token_entropy(logits, temperature=temperature)[:, :-1] if entropy else None)


def pad_batch(results: Sequence[EpisodeResult], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded tensors of the episodes, aligned to next-token targets (position t predicts id t+1).

    ids, attention: (B, T); action_mask, rollout_logprobs: (B, T-1), action_mask 1 = the target was sampled.
    """
    width = max(len(r.token_ids) for r in results)
    ids = torch.full((len(results), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(results), width), dtype=torch.long)
    mask = torch.zeros((len(results), width), dtype=torch.bool)
    rollout = torch.zeros((len(results), width), dtype=torch.float32)
    for row, r in enumerate(results):
        n = len(r.token_ids)
        ids[row, :n] = torch.tensor(r.token_ids)
        attention[row, :n] = 1
        mask[row, :n] = torch.tensor(r.action_mask, dtype=torch.bool)
        rollout[row, :n] = torch.tensor(r.logprobs)
    return {
        "ids": ids.to(device),
        "attention": attention.to(device),
        "action_mask": mask[:, 1:].to(device),
        "rollout_logprobs": rollout[:, 1:].to(device),
    }


def pad_classes(results: Sequence[EpisodeResult], tokenizer: Any, device: torch.device) -> torch.Tensor:
    """(B, T-1) int8: protocol.token_classes of each episode's predicted tokens, aligned as pad_batch's action mask
    (padding: PROMPT, outside every class metric)."""
    width = max(len(r.token_ids) for r in results)
    out = torch.full((len(results), width), protocol.PROMPT, dtype=torch.int8)
    for row, r in enumerate(results):
        out[row, : len(r.token_ids)] = torch.tensor(protocol.token_classes(tokenizer, r.token_ids, r.action_mask))
    return out[:, 1:].to(device)


@dataclass
class UpdateBatch:
    """One update's inputs, all aligned to next-token targets (position t predicts ids[:, t+1]).

    ids, attention: (B, T); every other tensor (B, T-1) but advantages (B,). action_mask 1 = the target was
    sampled by the policy. old_logprobs, entropy and s2 are of softmax(logits / temperature) under the
    weights that sampled; surprisal = -old_logprobs; weights are the method's advantage weights (STARE's omega;
    1 where it does nothing); entropy_coef is the entropy bonus's alpha for this batch (0 without one).
    """

    ids: torch.Tensor
    attention: torch.Tensor
    action_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    entropy: torch.Tensor
    s2: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    entropy_coef: float = 0.0
    classes: torch.Tensor | None = None

    @property
    def surprisal(self) -> torch.Tensor:
        """-log pi_old of each sampled token (B, T-1): what STARE ranks; high+ = the least likely sampled tokens."""
        return -self.old_logprobs


class Trainer:
    """The RL loop's state; `run()` drives it."""

    def __init__(self, config: RLConfig):
        self.config = config
        self.run_dir = run_path(config.run, "rl")  # made by open_log, once the sandbox answers too
        seed_everything(config.run.seed)
        self.checkpoint = resolve_resume(config.resume, self.run_dir)
        self.model, self.tokenizer = load_model(config.model, self.checkpoint)
        self.model.eval()  # rollouts, reference pass and update are one policy: no dropout anywhere
        dropout = _dropout_settings(self.model)
        if dropout:
            print(f"rl: dropout is off for RL (the model runs in eval mode); the model config has {dropout}")
        self.device = next(self.model.parameters()).device
        self.mismatch_warned = False
        self.problems = self._load_problems()
        self.problem_texts: dict[str, list[str]] = {}
        """problem id -> its texts, for the mask audit (a file may repeat an id)."""
        for p in self.problems:
            self.problem_texts.setdefault(p.id, []).append(p.problem)
        self.optimizer, self.scheduler = make_optimizer(self.model, config.optim, config.steps)
        self.control = EntropyControl(config)
        r = config.rollout
        self.generator = HFGenerator(
            self.model,
            self.tokenizer,
            temperature=r.temperature,
            top_p=r.top_p,
            max_turn_tokens=r.max_turn_tokens,
            max_batch_size=r.batch_size,
            seed=config.run.seed,
        )
        self.step, self.cursor = 0, 0
        self.keep_rate = config.rollout.initial_keep_rate
        """The last step's share of consumed groups with a signal: how many prompts up-front dispatch sends."""
        if self.checkpoint is not None:
            state = load_trainer_state(self.checkpoint)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.control.load_state_dict(state["stare"])
            self.generator.generator.set_state(state["generator_rng"])
            set_rng_state(state["rng"])
            self.step, self.cursor = state["step"], state["cursor"]
            self.keep_rate = state.get("keep_rate", self.keep_rate)  # older checkpoints: the initial rate
            print(f"rl: resumed from {self.checkpoint} at step {self.step}")

    def open_log(self) -> MetricsLog:
        """Create the run directory with config.yaml, and the metrics log in it."""
        save_config(self.config, self.run_dir)
        keep_reports_until(self.run_dir / SELECTED_TOKENS, self.step if self.checkpoint is not None else None)
        return MetricsLog(self.run_dir, resume_step=self.step if self.checkpoint is not None else None)

    def _load_problems(self) -> list[Problem]:
        data, agent = self.config.data, self.config.agent
        if not data.train_file:
            raise ConfigError("data.train_file is required: an RL prompt set with problems and gold answers")
        problems = load_problems(data.train_file, problem_field=data.problem_field, answer_field=data.answer_field)
        kept = []
        for p in problems:
            prompt = protocol.encode_prompt(self.tokenizer, protocol.prompt_messages(p.problem, agent.system_prompt))
            if len(prompt) < agent.max_total_tokens:
                kept.append(p)
        print(
            f"rl: {len(problems)} prompts from {data.train_file}; {len(problems) - len(kept)} left out "
            f"(prompt >= agent.max_total_tokens={agent.max_total_tokens} tokens)"
        )
        if not kept:
            raise DataError(f"no usable prompts in {data.train_file}")
        return kept

    def save(self) -> Path:
        state = {
            "step": self.step,
            "cursor": self.cursor,
            "keep_rate": self.keep_rate,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "stare": self.control.state_dict(),
            "generator_rng": self.generator.generator.get_state(),
            "rng": rng_state(),
        }
        saved = save_checkpoint(self.run_dir, self.step, self.model, self.tokenizer, state)
        # after the save, so `latest` already names the new checkpoint and rotation cannot take the one a resume needs
        snapshots.rotate(saved.parent, self.config.keep_snapshots, self.config.pin_snapshots)
        return saved

    # --- one step -------------------------------------------------------------------------------------------------

    async def rollouts(self, client: TimedClient) -> tuple[list[list[EpisodeResult]], BatchFill, dict[str, float]]:
        """The groups of one full batch (fewer only when the step's prompt budget ran out), its accounting, and
        the rollout metrics. Dropped groups are replaced by new prompts (batching.BatchFill has the rule)."""
        r = self.config.rollout
        fill = BatchFill(r.prompts_per_step, r.prompt_budget, r.max_sandbox_failure_fraction)
        kept: list[list[EpisodeResult]] = []
        while need := fill.room():
            count = dispatch_count(need, r.prompt_budget - fill.consumed, self.keep_rate, r.max_dispatch_factor)
            picked = stream_indices(len(self.problems), self.config.run.seed, self.cursor, count)
            self.cursor += count
            episodes = [self.problems[i] for i in picked for _ in range(r.group_size)]
            results = await run_batch(
                episodes,
                tokenizer=self.tokenizer,
                generate_batch=self.generator,
                client=client,
                config=self.config.agent,
            )
            for g in range(count):
                group = results[g * r.group_size : (g + 1) * r.group_size]
                if fill.add_group([episode_stats(e) for e in group], drop_equal=r.dynamic_sampling) == "kept":
                    kept.append(group)
        self.keep_rate = fill.keep_rate() or self.keep_rate
        return kept, fill, fill.metrics()

    def prepare(self, groups: list[list[EpisodeResult]]) -> tuple[UpdateBatch, dict[str, float]]:
        """Reference pass (no grad), GRPO advantages and the method's weights over the whole batch; their metrics."""
        cfg, timings = self.config, {}
        results = [e for group in groups for e in group]
        padded = pad_batch(results, self.tokenizer.pad_token_id, self.device)
        mask = padded["action_mask"]

        if cfg.rollout.audit_masks:
            started = time.perf_counter()
            self.audit(results, padded)
            timings["time/audit"] = time.perf_counter() - started

        started = time.perf_counter()
        parts = [
            reference_stats(
                self.model, padded["ids"][sl], padded["attention"][sl], cfg.rollout.temperature, self.packed
            )
            for sl in self._micro_batches(padded["attention"])
        ]
        old_logprobs, entropy, s2 = (torch.cat(column) for column in zip(*parts, strict=True))
        timings["time/forward"] = time.perf_counter() - started

        started = time.perf_counter()
        rewards = torch.tensor([e.reward for e in results], dtype=torch.float32, device=self.device)
        advantages = group_advantages(rewards, cfg.rollout.group_size)
        batch = UpdateBatch(
            padded["ids"], padded["attention"], mask, padded["rollout_logprobs"], old_logprobs, entropy, s2,
            advantages, weights=torch.ones_like(old_logprobs),
        )  # fmt: skip
        timings["time/stare"] = time.perf_counter() - started

        started = time.perf_counter()
        batch.classes = pad_classes(results, self.tokenizer, self.device)
        (batch.weights,), step_metrics = control_step(
            self.control, [MicroBatch(old_logprobs, advantages, mask, entropy, s2, batch.classes, batch.ids[:, 1:])]
        )
        batch.entropy_coef = step_metrics.get("control/coef", 0.0) if self.control.method == "entropy_bonus" else 0.0
        timings["time/stare"] += time.perf_counter() - started
        return batch, {**step_metrics, **self._check_mismatch(batch), **timings}

    def audit(self, results: Sequence[EpisodeResult], padded: dict[str, torch.Tensor]) -> None:
        """rollout.audit_masks: each row of the padded batch (what the update trains on) against its ids."""
        for row, r in enumerate(results):
            n = len(r.token_ids)
            errors = []
            for problem in dict.fromkeys(self.problem_texts[r.problem_id]):  # the prompt is one of the id's
                try:
                    audit_trained(
                        self.tokenizer,
                        padded["ids"][row, :n].tolist(),
                        padded["action_mask"][row, : n - 1].tolist(),
                        padded["rollout_logprobs"][row, : n - 1].tolist(),
                        problem,
                        self.config.agent.system_prompt,
                        where=f"rl step {self.step + 1}, sample {row} (problem {r.problem_id})",
                        sampled_tokens=sum(t.sampled_tokens for t in r.turns),
                        observation_tokens=sum(t.observation_tokens for t in r.turns),
                    )
                    break
                except MaskAuditError as exc:
                    errors.append(exc)
            else:
                raise errors[0]

    @property
    def packed(self) -> bool:
        """loss.max_tokens_per_micro_batch: micro-batches by a token budget, each run as one packed row."""
        return self.config.loss.max_tokens_per_micro_batch > 0

    def _micro_batches(self, attention: torch.Tensor) -> list[slice]:
        """The micro-batches of these rows (their attention masks, in order): loss.micro_batch_size rows each, or
        with loss.max_tokens_per_micro_batch consecutive rows of at most that many tokens together."""
        if self.packed:
            lengths = attention.sum(dim=1).tolist()
            return token_budget_micro_batches(lengths, self.config.loss.max_tokens_per_micro_batch)
        rows, micro = len(attention), self.config.loss.micro_batch_size
        return [slice(i, min(i + micro, rows)) for i in range(0, rows, micro)]

    def mini_batches(self, rows: int) -> list[torch.Tensor]:
        """The row indices of each update's mini-batch: one with every row in order when updates_per_batch is 1,
        else a permutation seeded by (run seed, step) cut into updates_per_batch equal parts."""
        updates = self.config.optim.updates_per_batch
        if updates == 1:
            return [torch.arange(rows, device=self.device)]
        order = torch.randperm(
            rows, generator=torch.Generator().manual_seed(self.config.run.seed * 1_000_003 + self.step)
        )
        return [part.to(self.device) for part in order.chunk(updates)]

    def _check_mismatch(self, batch: UpdateBatch) -> dict[str, float]:
        """Rollout vs trainer log-probs of the sampled tokens; warns once per run above rollout.logprob_tolerance."""
        mismatch = logprob_mismatch(batch.rollout_logprobs, batch.old_logprobs, batch.action_mask)
        mean, worst = mismatch["rollout_logprob_abs_diff"], mismatch["rollout_logprob_abs_diff_max"]
        tokens = int(batch.action_mask.bool().sum())
        tolerance = self.config.rollout.logprob_tolerance
        if mean > tolerance and not self.mismatch_warned:
            self.mismatch_warned = True
            print(
                f"rl: warning: at step {self.step + 1} the rollout and trainer log-probs of the sampled tokens differ "
                f"by {mean:.4g} nats on average (max {worst:.4g}) over {tokens} tokens, above "
                f"rollout.logprob_tolerance={tolerance}: the update is not on-policy. Likely causes: the sampler "
                "transforms the distribution in a way the trainer does not score (top-k/top-p, repetition "
                "penalties, a temperature other than rollout.temperature), generation in another dtype or on "
                "another device than training, or nondeterministic kernels. (Shown once per run; the value is "
                "logged every step as train/rollout_logprob_abs_diff.)",
                file=sys.stderr,
            )
        return {f"train/{name}": value for name, value in mismatch.items()}

    def current_logprobs(self, batch: UpdateBatch, rows: torch.Tensor, update: int) -> torch.Tensor:
        """The current policy's log-probs of the mini-batch's sampled tokens, for Clip-Cov's and KL-Cov's selection:
        the sampling policy's at the first update (the weights have not moved yet), a no-grad pass after it."""
        if update == 0:
            return batch.old_logprobs[rows]
        with torch.no_grad():
            return torch.cat(
                [
                    sequence_logprobs(
                        self.model,
                        batch.ids[rows[sl]],
                        batch.attention[rows[sl]],
                        self.config.rollout.temperature,
                        self.packed,
                    )  # fmt: skip
                    for sl in self._micro_batches(batch.attention[rows])
                ]
            )

    def accumulate_gradients(self, batch: UpdateBatch, rows: torch.Tensor, update: int) -> dict[str, torch.Tensor]:
        """One update's loss gradient on the mini-batch `rows`, summed into .grad over micro-batches, and the sums
        behind its metrics (ratio_stats' plus `loss` and `selected`).

        The loss is one token-level mean over the mini-batch's action tokens, whatever the micro-batch size: the
        clipped surrogate weighted by the method's advantage weights (Clip-Cov: 0 on the tokens it selects;
        KL-Cov: unclipped, its penalty on the tokens it selects), minus the entropy bonus's term when it has one.
        """
        cfg, mask = self.config, batch.action_mask[rows]
        n_tokens = mask.sum()
        method = self.control.method
        micro = self._micro_batches(batch.attention[rows])
        selected = update_selection(
            self.control,
            [UpdatePart(self.current_logprobs(batch, rows, update), batch.old_logprobs[rows], batch.advantages[rows],
                        mask)],
            update,
        )  # fmt: skip
        selected = selected[0] if selected is not None else None
        sums: dict[str, torch.Tensor] = {}
        for sl in micro:
            index = rows[sl]
            logprobs, entropy = policy_outputs(
                self.model, batch.ids[index], batch.attention[index], cfg.rollout.temperature,
                entropy=batch.entropy_coef > 0, packed=self.packed,
            )  # fmt: skip
            terms = selection_loss_terms(method, None if selected is None else selected[sl], cfg.kl_cov.coef)
            weights = batch.weights[index] * terms.pop("weights", 1.0)
            loss, _ = policy_loss(
                logprobs,
                batch.old_logprobs[index],
                batch.advantages[index],
                mask[sl],
                eps_low=cfg.loss.eps_low,
                eps_high=cfg.loss.eps_high,
                dual_clip=cfg.loss.dual_clip,
                weights=weights,
                num_tokens=n_tokens,
                **terms,
            )
            if entropy is not None:
                loss = loss + entropy_bonus_loss(entropy, mask[sl], batch.entropy_coef, n_tokens)
            loss.backward()
            stats = ratio_stats(
                logprobs.detach(), batch.old_logprobs[index], batch.advantages[index], mask[sl],
                eps_low=cfg.loss.eps_low, eps_high=cfg.loss.eps_high,
            )  # fmt: skip
            stats["loss"] = loss.detach()
            if selected is not None:
                stats["selected"] = (selected[sl] & mask[sl]).sum().float()
                self.control.selected.add(batch.ids[index][:, 1:], selected[sl], mask[sl])
                if batch.classes is not None:
                    for name, members in class_masks(mask[sl], batch.classes[index].long()).items():
                        stats[f"selected_{name}"] = (selected[sl] & members).sum().float()
                        stats[f"tokens_{name}"] = members.sum().float()
            for key, value in stats.items():
                sums[key] = (
                    torch.maximum(sums[key], value)
                    if key.endswith("_max") and key in sums
                    else (sums.get(key, 0.0) + value)
                )
        return sums

    def train_updates(self, batch: UpdateBatch) -> dict[str, float]:
        """The batch's optimizer updates (optim.updates_per_batch mini-batches) and their metrics: the mean loss and
        gradient norm over updates; the clip fraction on each side, mean |ratio - 1| and approximate KL to the
        sampling policy over every token of every update; Clip-Cov's and KL-Cov's selected share."""
        cfg = self.config
        totals: dict[str, float] = {}
        norms, losses = [], []
        for update, rows in enumerate(self.mini_batches(len(batch.ids))):
            sums = self.accumulate_gradients(batch, rows, update)
            where = f"rl step {self.step + 1}, update {update + 1}: "
            norms.append(clip_and_step(self.model, self.optimizer, None, cfg.optim.max_grad_norm, where))
            losses.append(float(sums.pop("loss")))
            for key, value in sums.items():
                merge = max if key.endswith("_max") else (lambda a, b: a + b)
                totals[key] = merge(totals[key], float(value)) if key in totals else float(value)
        self.scheduler.step()  # one schedule step per rollout batch: the learning rate is a function of the step
        tokens = max(totals["tokens"], 1.0)
        metrics = {
            "train/loss": sum(losses) / len(losses),
            "train/grad_norm": sum(norms) / len(norms),
            "train/clip_frac_high": totals["clip_high"] / tokens,
            "train/clip_frac_low": totals["clip_low"] / tokens,
            "train/clip_frac": (totals["clip_high"] + totals["clip_low"]) / tokens,
            "train/ratio_abs_dev": totals["ratio_dev"] / tokens,
            "train/ratio_abs_dev_max": totals["ratio_dev_max"],
            "train/approx_kl": totals["approx_kl"] / tokens,
        }
        if self.control.method in ("clip_cov", "kl_cov"):
            metrics["control/selected_share"] = totals["selected"] / tokens
            for name in (*CLASS_METRICS, "after_tool"):
                if f"tokens_{name}" in totals:
                    members = totals[f"tokens_{name}"]
                    share = totals[f"selected_{name}"] / members if members else math.nan
                    metrics[f"control/selected_share_{name}"] = share
            metrics["control/weight_mean"] = (
                1.0 - metrics["control/selected_share"] if self.control.method == "clip_cov" else 1.0
            )
        return metrics

    def update(self, groups: list[list[EpisodeResult]]) -> dict[str, float]:
        """Old log-probs, entropy and S2 (no grad), advantages, the method's weights, the batch's updates."""
        batch, metrics = self.prepare(groups)

        started = time.perf_counter()
        metrics.update(self.train_updates(batch))
        metrics["time/backward"] = time.perf_counter() - started
        metrics.update(
            {
                "train/lr": self.scheduler.get_last_lr()[0],
                "train/tokens": float(batch.attention.sum()),
                "train/action_tokens": float(batch.action_mask.sum()),
            }
        )
        return metrics

    def report_selected_tokens(self) -> None:
        """Every entropy_control.report_every steps, the tokens the method acted on most often since the last report,
        as one line of `selected_tokens.jsonl` in the run folder."""
        every = self.config.entropy_control.report_every
        if every and self.step % every == 0 and self.control.method in SELECTING_METHODS:
            line = self.control.selected.report(
                self.step, self.control.method, self.tokenizer, self.config.entropy_control.report_top
            )
            with (self.run_dir / SELECTED_TOKENS).open("a") as out:
                out.write(json.dumps(line) + "\n")

    async def train(self) -> Path:
        cfg = self.config
        # a round's episodes run at once (rollouts), each holding a session in stateful mode
        episodes = cfg.stateful_episodes_in_flight
        client = make_client(cfg.sandbox, episodes)
        try:
            await start_client(client, cfg.sandbox, episodes, RLConfig.IN_FLIGHT_KEYS)
        except BaseException:
            await client.close()
            raise
        log = self.open_log()
        timed = TimedClient(client)
        last = self.checkpoint
        bar = progress(cfg.steps, "rl", initial=self.step)
        self.stop_reason = ""
        try:
            while self.step < cfg.steps:
                step_started = time.perf_counter()
                gen_before, tools_before = self.generator.stats.seconds, timed.seconds
                tokens_before = self.generator.stats.generated_tokens
                groups, fill, metrics = await self.rollouts(timed)
                fill.check_sandbox()
                if not fill.full:  # never train a partial batch: the run ends here
                    self.stop_reason = fill.why_not_full()
                    break
                rollout_time = time.perf_counter() - step_started
                metrics["time/generation"] = self.generator.stats.seconds - gen_before
                metrics["time/tools"] = timed.seconds - tools_before
                metrics["time/rollout"] = rollout_time
                generated = self.generator.stats.generated_tokens - tokens_before
                metrics["perf/generation_tokens_per_s"] = generated / max(metrics["time/generation"], 1e-9)
                update_started = time.perf_counter()
                metrics.update(self.update(groups))
                metrics["perf/train_tokens_per_s"] = metrics["train/tokens"] / (time.perf_counter() - update_started)
                metrics["time/step"] = time.perf_counter() - step_started
                self.step += 1
                log.write(self.step, metrics)
                self.report_selected_tokens()
                bar.update(1)
                bar.set_postfix(
                    acc=f"{metrics['rollout/accuracy']:.2f}",
                    H=f"{metrics.get('stare/entropy_mean', float('nan')):.3f}",
                    W=f"{self.control.stare.w:.2f}",
                    tools=f"{metrics['rollout/tool_calls']:.1f}",
                    refresh=False,
                )
                if (cfg.save_every and self.step % cfg.save_every == 0) or self.step == cfg.steps:
                    last = self.save()
            if last is None or last.name != f"step-{self.step:06d}":
                last = self.save()  # the final model, also when the run ended early
        finally:
            bar.close()
            log.close()
            await client.close()
        return last


def _dropout_settings(model: Any) -> str:
    """The model config's non-zero dropout settings, as text ('' when there are none)."""
    config = getattr(model, "config", None)
    found = {
        key: value
        for key, value in (vars(config).items() if config is not None else ())
        if "dropout" in key and isinstance(value, (int, float)) and value > 0
    }
    found.update({name: m.p for name, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0})
    return ", ".join(f"{k}={v}" for k, v in found.items())


def run(config: RLConfig) -> Path:
    """Train; returns the final checkpoint folder (a Hugging Face model folder).

    Raises NoStepTrained when the run ended (batching's stop rule) before it trained a step, and SandboxFailures
    when a step's sandbox failures stop it; a run that trained fewer steps than asked ends normally, and says so.
    """
    trainer = Trainer(config)
    last = asyncio.run(trainer.train())
    message = end_message(trainer.step, config.steps, trainer.stop_reason)
    print(f"rl: {message}; model and state in {last}; metrics in {trainer.run_dir / 'metrics.jsonl'}")
    if trainer.step == 0:
        raise NoStepTrained(f"rl: {message}")
    return last
