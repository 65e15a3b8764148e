"""`stare-agent rl`: multi-turn GRPO with STARE, in one process (CPU or one GPU).

One step:
1. rollouts: prompts from the data stream, `group_size` episodes each, generated in lock step with
   the tool calls of a turn run concurrently (agent.run_batch);
2. dynamic sampling: a group whose rewards are all equal carries no signal and is dropped, and so is
   a group with a sandbox failure (not the model's fault); new prompts refill the batch for up to
   `max_refill_rounds` extra rounds, and every dropped group is counted in the logs;
3. one no-grad forward over the batch gives the old log-probs and, from the same logits, the exact
   per-token entropy and S2 (theory.entropy_and_s2);
4. GRPO group-normalized advantages; STARE weights over the whole batch (stare.StareController);
5. one on-policy update: clipped surrogate with clip-higher, token-level mean over the batch, no KL.
GRPO-ds is the same run with stare.enabled=false (weights 1; the same entropy metrics are logged).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from stare_agent import protocol
from stare_agent.agent import EpisodeResult, run_batch
from stare_agent.backends.local.common import (
    MetricsLog,
    clip_and_step,
    load_model,
    load_trainer_state,
    make_client,
    make_optimizer,
    progress,
    resolve_resume,
    rng_state,
    save_checkpoint,
    seed_everything,
    set_rng_state,
    stream_indices,
)
from stare_agent.backends.local.generation import HFGenerator
from stare_agent.config import ConfigError, RLConfig, make_run_dir, save_config
from stare_agent.data import DataError, Problem, load_problems
from stare_agent.loss import group_advantages, policy_loss
from stare_agent.stare import StareController, select_quadrants
from stare_agent.theory import batch_diagnostics, entropy_and_s2


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


def sequence_logprobs(model: Any, ids: torch.Tensor, attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each next token, the logits that predict it): (B, T-1) and (B, T-1, V)."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    targets = ids[:, 1:]
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return logprobs, logits


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


class Trainer:
    """The RL loop's state; `run()` drives it."""

    def __init__(self, config: RLConfig):
        self.config = config
        self.run_dir = make_run_dir(config.run, "rl")
        save_config(config, self.run_dir)
        seed_everything(config.run.seed)
        self.checkpoint = resolve_resume(config.resume, self.run_dir)
        self.model, self.tokenizer = load_model(config.model, self.checkpoint)
        self.device = next(self.model.parameters()).device
        self.problems = self._load_problems()
        self.optimizer, self.scheduler = make_optimizer(self.model, config.optim, config.steps)
        self.controller = StareController(config.stare)
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
        if self.checkpoint is not None:
            state = load_trainer_state(self.checkpoint)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.controller.load_state_dict(state["stare"])
            self.generator.generator.set_state(state["generator_rng"])
            set_rng_state(state["rng"])
            self.step, self.cursor = state["step"], state["cursor"]
            print(f"rl: resumed from {self.checkpoint} at step {self.step}")
        self.log = MetricsLog(self.run_dir, resume_step=self.step if self.checkpoint is not None else None)

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
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "stare": self.controller.state_dict(),
            "generator_rng": self.generator.generator.get_state(),
            "rng": rng_state(),
        }
        return save_checkpoint(self.run_dir, self.step, self.model, self.tokenizer, state)

    # --- one step -------------------------------------------------------------------------------------------------

    async def rollouts(self, client: TimedClient) -> tuple[list[list[EpisodeResult]], dict[str, float]]:
        """Groups for one update, after dynamic sampling, and the rollout metrics."""
        r = self.config.rollout
        kept: list[list[EpisodeResult]] = []
        all_results: list[EpisodeResult] = []
        dropped = {"equal": 0, "sandbox": 0}
        for _ in range(r.max_refill_rounds + 1):
            need = r.prompts_per_step - len(kept)
            picked = stream_indices(len(self.problems), self.config.run.seed, self.cursor, need)
            self.cursor += need
            episodes = [self.problems[i] for i in picked for _ in range(r.group_size)]
            results = await run_batch(
                episodes,
                tokenizer=self.tokenizer,
                generate_batch=self.generator,
                client=client,
                config=self.config.agent,
            )
            all_results += results
            for g in range(need):
                group = results[g * r.group_size : (g + 1) * r.group_size]
                if any(e.reward is None for e in group):
                    dropped["sandbox"] += 1
                elif r.dynamic_sampling and len({e.reward for e in group}) == 1:
                    dropped["equal"] += 1
                else:
                    kept.append(group)
            if len(kept) == r.prompts_per_step or not r.dynamic_sampling:
                break
        scored = [e for e in all_results if e.reward is not None]
        n = max(len(all_results), 1)
        metrics = {
            "rollout/reward": sum(e.reward for e in scored) / max(len(scored), 1),
            "rollout/accuracy": sum(e.reward == 1.0 for e in scored) / max(len(scored), 1),
            "rollout/response_length": sum(e.response_len for e in all_results) / n,
            "rollout/sampled_tokens": sum(sum(e.action_mask) for e in all_results) / n,
            "rollout/tool_calls": sum(e.tool_calls for e in all_results) / n,
            "rollout/tool_errors": sum(e.tool_errors for e in all_results) / n,
            "rollout/episodes": len(all_results),
            "rollout/groups_kept": len(kept),
            "rollout/groups_dropped_equal": dropped["equal"],
            "rollout/groups_dropped_sandbox": dropped["sandbox"],
        }
        for reason in ("answer", "eos", "length", "tool_limit", "sandbox_error"):
            metrics[f"rollout/finish_{reason}"] = sum(e.finish_reason == reason for e in all_results) / n
        return kept, metrics

    def update(self, groups: list[list[EpisodeResult]]) -> dict[str, float]:
        """Old log-probs, entropy and S2 (no grad), advantages, STARE weights, one clipped update."""
        cfg, timings = self.config, {}
        results = [e for group in groups for e in group]
        batch = pad_batch(results, self.tokenizer.pad_token_id, self.device)
        mask = batch["action_mask"]
        micro = cfg.loss.micro_batch_size
        rows = [slice(i, min(i + micro, len(results))) for i in range(0, len(results), micro)]

        started = time.perf_counter()
        self.model.eval()  # no dropout in the reference pass
        old, entropy, s2 = [], [], []
        with torch.no_grad():
            for sl in rows:
                logprobs, logits = sequence_logprobs(self.model, batch["ids"][sl], batch["attention"][sl])
                h, s = entropy_and_s2(logits)
                old.append(logprobs)
                entropy.append(h)
                s2.append(s)
        old_logprobs, entropy, s2 = torch.cat(old), torch.cat(entropy), torch.cat(s2)
        timings["time/forward"] = time.perf_counter() - started

        started = time.perf_counter()
        rewards = torch.tensor([e.reward for e in results], dtype=torch.float32, device=self.device)
        advantages = group_advantages(rewards, cfg.rollout.group_size)
        surprisal = -old_logprobs
        weights, stare_metrics = self.controller(surprisal, advantages, mask, entropy)
        timings["time/stare"] = time.perf_counter() - started

        started = time.perf_counter()
        high_pos = select_quadrants(surprisal, advantages, mask, cfg.stare.top_ratio, ("high+",))["high+"]
        theory = batch_diagnostics(surprisal, advantages, mask, entropy, s2, high_pos)
        timings["time/theory"] = time.perf_counter() - started

        started = time.perf_counter()
        self.model.train()
        n_tokens = mask.sum()
        loss_total, clip_frac = 0.0, 0.0
        for sl in rows:
            logprobs, _ = sequence_logprobs(self.model, batch["ids"][sl], batch["attention"][sl])
            loss, loss_metrics = policy_loss(
                logprobs,
                old_logprobs[sl],
                advantages[sl],
                mask[sl],
                eps_low=cfg.loss.eps_low,
                eps_high=cfg.loss.eps_high,
                dual_clip=cfg.loss.dual_clip,
                weights=weights[sl],
                num_tokens=n_tokens,
            )
            loss.backward()
            loss_total += float(loss.detach())
            clip_frac += float(loss_metrics["policy/clip_frac"]) * float(mask[sl].sum()) / float(n_tokens)
        grad_norm = clip_and_step(self.model, self.optimizer, self.scheduler, cfg.optim.max_grad_norm)
        timings["time/backward"] = time.perf_counter() - started

        action = mask.bool()
        mismatch = (batch["rollout_logprobs"] - old_logprobs).abs()[action].mean()
        return {
            "train/loss": loss_total,
            "train/grad_norm": grad_norm,
            "train/clip_frac": clip_frac,
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/tokens": float(batch["attention"].sum()),
            "train/action_tokens": float(n_tokens),
            "train/rollout_logprob_abs_diff": float(mismatch),
            **{k: float(v) for k, v in stare_metrics.items()},
            "stare/w": self.controller.w,
            "stare/m": self.controller.m,
            **{k: float(v) for k, v in theory.items()},
            **timings,
        }

    async def train(self) -> Path:
        cfg = self.config
        episodes = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        client = make_client(cfg.sandbox, episodes if cfg.agent.tool_mode == "stateful" else 0)
        if hasattr(client, "start"):
            await client.start()
        timed = TimedClient(client)
        last = self.checkpoint
        bar = progress(cfg.steps, "rl", initial=self.step)
        try:
            while self.step < cfg.steps:
                step_started = time.perf_counter()
                gen_before, tools_before = self.generator.stats.seconds, timed.seconds
                tokens_before = self.generator.stats.generated_tokens
                groups, metrics = await self.rollouts(timed)
                rollout_time = time.perf_counter() - step_started
                metrics["time/generation"] = self.generator.stats.seconds - gen_before
                metrics["time/tools"] = timed.seconds - tools_before
                metrics["time/rollout"] = rollout_time
                generated = self.generator.stats.generated_tokens - tokens_before
                metrics["perf/generation_tokens_per_s"] = generated / max(metrics["time/generation"], 1e-9)
                if groups:
                    update_started = time.perf_counter()
                    metrics.update(self.update(groups))
                    metrics["perf/train_tokens_per_s"] = metrics["train/tokens"] / (
                        time.perf_counter() - update_started
                    )
                metrics["train/updated"] = float(bool(groups))
                metrics["time/step"] = time.perf_counter() - step_started
                self.step += 1
                self.log.write(self.step, metrics)
                bar.update(1)
                bar.set_postfix(
                    acc=f"{metrics['rollout/accuracy']:.2f}",
                    H=f"{metrics.get('stare/entropy_mean', float('nan')):.3f}",
                    W=f"{self.controller.w:.2f}",
                    tools=f"{metrics['rollout/tool_calls']:.1f}",
                    refresh=False,
                )
                if (cfg.save_every and self.step % cfg.save_every == 0) or self.step == cfg.steps:
                    last = self.save()
        finally:
            bar.close()
            self.log.close()
            await client.close()
        if last is None:
            last = self.save()
        return last


def run(config: RLConfig) -> Path:
    """Train; returns the final checkpoint folder (a Hugging Face model folder)."""
    trainer = Trainer(config)
    last = asyncio.run(trainer.train())
    print(f"rl: done; model and state in {last}; metrics in {trainer.run_dir / 'metrics.jsonl'}")
    return last
