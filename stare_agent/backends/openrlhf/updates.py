"""The entropy-control methods that act at each update, inside OpenRLHF 0.11.2's actor ranks (docs/entropy_control.md).

The experience maker (experience.py) runs `step.control_step` once per step on the driver; what the update needs from
it (the method, its settings, the step, the entropy bonus's alpha) reaches every policy rank through
`StarePolicyModelActor.set_update_control` before OpenRLHF calls the ranks' `fit`. There, on each rank:

- **Clip-Cov, KL-Cov: a selection per optimizer update, over the whole update.** OpenRLHF's `ppo_train` groups the
  rank's micro-batches into gradient-accumulation windows (`iter_grad_accum_global_norm`), one window per optimizer
  update on every rank. `selecting_windows` takes its place: before a window trains, it computes the current
  policy's log-probs of the window's micro-batches (the sampling policy's at the first update of a step: the
  weights have not moved), gathers every rank's window, and runs `step.update_selection` on all of it, the same
  call the local backend makes; each micro-batch keeps its own slice. With token-budget micro-batches
  (train.dynamic_batch_enable) OpenRLHF makes no windows; the update's micro-batches are then the ones up to the
  replay buffer's next optimizer step (`select_dynamic_window`), selected the same way.
- **The loss.** `MethodLoss` stands in for the rank's `actor_loss_fn` (OpenRLHF's PolicyLoss). For Clip-Cov and
  KL-Cov it is `loss.token_losses` with the update's selection, aggregated by OpenRLHF's own `aggregate_loss` (the
  same global token mean); for every other method it is OpenRLHF's PolicyLoss unchanged (the advantage methods
  already scaled the advantages). Either way the log-probs and advantages are set to 0 outside the action mask first
  (loss.on_actions), so a masked position cannot turn the loss or its gradient NaN. For every method it adds the
  update's ratio statistics to the micro-batch's `info`, which OpenRLHF averages over tokens and logs
  (`train/clip_frac_high`, ...).
- **The rollout-trainer mismatch correction** (`algo.advantage.is_correction_*`, docs/entropy_control.md). For the
  other methods OpenRLHF's PolicyLoss applies it. For Clip-Cov and KL-Cov `MethodLoss` applies the same correction,
  read from the rank's PolicyLoss: each token's loss times `loss.mismatch_correction`'s coef before
  `aggregate_loss`, and OpenRLHF's `vllm_kl` and `is_filter_ratio` returned for its logs. As in OpenRLHF, the whole
  per-token loss is weighted, so KL-Cov's penalty k|log pi - log pi_old| on its selected tokens is weighted too
  (like the surrogate, it averages over tokens the engine sampled); OpenRLHF's entropy term is not.
- **Non-finite gradients.** An optimizer update whose gradients are NaN or infinite stops the run (exit code 6),
  as in the local backend, where DeepSpeed would skip it silently or, under ZeRO-3 with bf16, apply it
  (upstream.checking_updates, put in place of the strategy's optimizer_step).
- **The entropy bonus.** OpenRLHF's training step subtracts `actor.entropy_coef` times the current policy's token
  mean entropy (the same normalisation as the policy loss). The rank sets that coefficient to this step's alpha
  (None when 0 or another method: no entropy pass); a user's own `actor.entropy_coef` is refused by the launcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from stare_agent import protocol
from stare_agent.backends.openrlhf import upstream
from stare_agent.entropy_control import UPDATE_METHODS, EntropyControl, selection_loss_terms
from stare_agent.loss import mismatch_correction, on_actions, ratio_stats, token_losses
from stare_agent.step import UpdatePart, class_masks, update_selection

_actor_module = upstream.import_openrlhf("openrlhf.trainer.ray.ppo_actor")
_loss_utils = upstream.import_openrlhf("openrlhf.utils.loss_utils")
_strategy_module = upstream.import_openrlhf("openrlhf.utils.deepspeed.deepspeed")

ORIGINAL_WINDOWS = _loss_utils.iter_grad_accum_global_norm
"""OpenRLHF's window grouping, which `selecting_windows` wraps."""

SELECTED = "stare_selected"
"""The attribute of an Experience that holds its (b, t) bool selection for the current update."""


@dataclass
class UpdateControl:
    """One rank's entropy-control state for the step being trained (set_update_control)."""

    control: EntropyControl
    alpha: float = 0.0
    """The entropy bonus's coefficient for this step."""
    update: int = 0
    """Optimizer updates done in this step's fit (numbers Clip-Cov's draw)."""
    current: Any = None
    """The micro-batch (Experience) the training step is on."""
    selections: dict[int, Tensor] = field(default_factory=dict)
    """train.dynamic_batch_enable: the selection of each micro-batch (by its index in the fit) of the current
    update, made at the update's first micro-batch (select_dynamic_window)."""


_active: dict[str, Any] = {}
"""{"rank": the policy rank whose fit runs in this process}: one rank per Ray actor process."""


def selecting_windows(data_iter: Any, strategy: Any, accumulated_gradient: int, mask_fn: Any) -> Any:
    """OpenRLHF's iter_grad_accum_global_norm, with each window's update selection attached first (Clip-Cov, KL-Cov
    on the rank whose fit is running); exactly OpenRLHF's otherwise."""
    rank = _active.get("rank")
    if rank is None or rank.update_control.control.method not in UPDATE_METHODS:
        return ORIGINAL_WINDOWS(data_iter, strategy, accumulated_gradient, mask_fn)
    selected = _with_selection(rank, data_iter, max(int(accumulated_gradient), 1))
    return ORIGINAL_WINDOWS(selected, strategy, accumulated_gradient, mask_fn)


def _with_selection(rank: Any, data_iter: Any, gas: int) -> Any:
    window: list = []
    for item in data_iter:
        window.append(item)
        if len(window) == gas:
            select_window(rank, window)
            yield from window
            window = []
    if window:
        select_window(rank, window)
        yield from window


def select_dynamic_window(rank: Any, step: int) -> Tensor:
    """The selection of micro-batch `step` of the rank's fit under train.dynamic_batch_enable.

    There OpenRLHF feeds the micro-batches one at a time (no windows) and steps the optimizer after each one its
    replay buffer marks (`dynamic_optimizer_step`, the same count on every rank: setup_dynamic_batch takes the
    maximum over the ranks). At an update's first micro-batch, the update's micro-batches are taken from the buffer
    as its loader collates them, and the selection is made over all of them and every rank's (select_window)."""
    state: UpdateControl = rank.update_control
    if step not in state.selections:
        buffer = rank.trainer.replay_buffer
        ends = buffer.dynamic_optimizer_step
        last = step
        while not ends[last]:
            last += 1
        window = [buffer.collate_fn([buffer[i]]) for i in range(step, last + 1)]
        select_window(rank, window)
        state.selections = {i: getattr(exp, SELECTED) for i, exp in zip(range(step, last + 1), window, strict=True)}
    return state.selections.pop(step)


def select_window(rank: Any, window: list) -> None:
    """Attach to each micro-batch of one optimizer update its slice of the update's selection, made over every
    data-parallel rank's micro-batches of that update (gathered in rank order)."""
    state: UpdateControl = rank.update_control
    parts = []
    for exp in window:
        if state.update == 0:  # the weights have not moved since the experience pass
            current = exp.action_log_probs
        else:
            with torch.no_grad():
                current = rank.actor(
                    exp.sequences.to(_device(rank)), exp.action_mask.to(_device(rank)),
                    attention_mask=exp.attention_mask.to(_device(rank)),
                )  # fmt: skip
        parts.append(
            UpdatePart(current.float().cpu(), exp.action_log_probs.float().cpu(), exp.advantages.float().cpu(),
                       exp.action_mask.cpu())
        )  # fmt: skip
    gathered, mine = _gather(rank.strategy, parts)
    selected = update_selection(state.control, gathered, state.update)
    for exp, sel in zip(window, selected[mine : mine + len(window)], strict=True):
        setattr(exp, SELECTED, sel.to(exp.action_mask.device))
    state.update += 1


def _device(rank: Any) -> torch.device:
    for param in rank.actor.parameters():
        return param.device
    return torch.device("cpu")


def _gather(strategy: Any, parts: list[UpdatePart]) -> tuple[list[UpdatePart], int]:
    """Every data-parallel rank's parts, in rank order, and where this rank's start."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return parts, 0
    group = _loss_utils._get_dp_group(strategy)
    everyone: list[Any] = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(everyone, parts, group=group)
    me = dist.get_rank(group=group)
    return [p for rank_parts in everyone for p in rank_parts], sum(len(everyone[r]) for r in range(me))


def experience_classes(tokenizer: Any, exp: Any) -> Tensor:
    """(B, S - 1) int8 protocol.token_classes of a micro-batch's predicted tokens, aligned with its action mask
    (right-padded sequences; padding is PROMPT, outside every class metric)."""
    mask = exp.action_mask.cpu()
    out = torch.full(mask.shape, protocol.PROMPT, dtype=torch.int8)
    for row, (ids, attention) in enumerate(zip(exp.sequences.cpu(), exp.attention_mask.cpu(), strict=True)):
        n = int(attention.sum())
        sampled = [0, *mask[row, : n - 1].tolist()]
        out[row, : n - 1] = torch.tensor(protocol.token_classes(tokenizer, ids[:n].tolist(), sampled)[1:])
    return out


def class_shares(selected: Tensor, mask: Tensor, classes: Tensor) -> dict[str, Tensor]:
    """For one micro-batch: `_selected_<name>` (the selected tokens of each class_masks set) and `_tokens_<name>`
    (the set's tokens), both over the micro-batch's action tokens. OpenRLHF averages info over tokens, so the
    step's means are the sums' ratios to all action tokens; StarePPOTrainer divides one by the other."""
    tokens = mask.sum().clamp_min(1)
    out = {}
    for name, members in class_masks(mask, classes.long()).items():
        out[f"_selected_{name}"] = ((selected & members).sum() / tokens).float()
        out[f"_tokens_{name}"] = (members.sum() / tokens).float()
    return out


class MethodLoss:
    """A rank's `actor_loss_fn`: the method's loss where it changes the loss at the update, OpenRLHF's PolicyLoss
    otherwise; the update's ratio statistics go into the micro-batch's info either way. Called as PolicyLoss is."""

    def __init__(self, rank: Any, original: Any):
        self.rank, self.original = rank, original

    def __call__(
        self,
        log_probs: Tensor,
        old_log_probs: Tensor,
        advantages: Tensor,
        action_mask: Tensor | None = None,
        rollout_log_probs: Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens: Any = None,
        global_batch_size: Any = None,
    ) -> tuple:
        state: UpdateControl = self.rank.update_control
        exp, config = state.current, state.control.config
        if action_mask is not None:  # what a masked position holds must not reach the loss or its gradient
            log_probs, old_log_probs, advantages = (
                on_actions(action_mask, t) for t in (log_probs, old_log_probs, advantages)
            )
            if rollout_log_probs is not None:
                rollout_log_probs = on_actions(action_mask, rollout_log_probs)
        method = state.control.method
        if method in UPDATE_METHODS:
            selected = getattr(exp, SELECTED)
            loss, clipped = token_losses(
                log_probs, old_log_probs, advantages, eps_low=config.loss.eps_low, eps_high=config.loss.eps_high,
                dual_clip=self.original.dual_clip, **selection_loss_terms(method, selected, config.kl_cov.coef),
            )  # fmt: skip
            vllm_kl = is_filter_ratio = None
            if self.original.is_correction_level != "off":
                loss, vllm_kl, is_filter_ratio = self._corrected(loss, old_log_probs, rollout_log_probs, action_mask)
            total = _loss_module().aggregate_loss(
                loss, action_mask, token_level_loss=True, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                global_batch_size=global_batch_size,
            )  # fmt: skip
            mask = action_mask.bool()
            tokens = mask.sum().clamp_min(1)
            clip_ratio = (clipped & mask).sum() / tokens
            ppo_kl = (-(log_probs - old_log_probs).detach()).masked_fill(~mask, 0).sum() / tokens
            share = ((selected & mask).sum() / tokens).float()
            exp.info["control/selected_share"] = share
            tokenizer = getattr(self.rank.trainer, "tokenizer", None)
            if tokenizer is not None:
                exp.info.update(class_shares(selected, mask, experience_classes(tokenizer, exp).to(mask.device)))
            exp.info["control/weight_mean"] = 1.0 - share if method == "clip_cov" else torch.ones(())
            out = (total, clip_ratio.float(), ppo_kl, vllm_kl, is_filter_ratio)
        else:
            out = self.original(
                log_probs, old_log_probs, advantages, action_mask=action_mask, rollout_log_probs=rollout_log_probs,
                dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
            )  # fmt: skip
        stats = ratio_stats(
            log_probs.detach(), old_log_probs, advantages, action_mask, eps_low=config.loss.eps_low,
            eps_high=config.loss.eps_high,
        )  # fmt: skip
        tokens = stats["tokens"].clamp_min(1)
        exp.info["clip_frac_high"] = stats["clip_high"] / tokens
        exp.info["clip_frac_low"] = stats["clip_low"] / tokens
        exp.info["ratio_abs_dev"] = stats["ratio_dev"] / tokens
        exp.info["approx_kl"] = stats["approx_kl"] / tokens
        return out

    def _corrected(
        self, loss: Tensor, old_log_probs: Tensor, rollout_log_probs: Tensor | None, action_mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The per-token loss times the mismatch correction's coef, with OpenRLHF's vllm_kl (the masked mean of
        log pi_rollout - log pi_old) and is_filter_ratio, from the settings of the rank's PolicyLoss."""
        if rollout_log_probs is None:
            raise RuntimeError(
                f"openrlhf.algo.advantage.is_correction_level={self.original.is_correction_level} needs the engine's "
                "log-probs of the sampled tokens, and this micro-batch has none (experience.rollout_log_probs); our "
                "agent executor returns them (episodes.py): is it in use?"
            )
        low, high = self.original.is_correction_threshold
        coef, is_filter_ratio = mismatch_correction(
            old_log_probs, rollout_log_probs, action_mask, level=self.original.is_correction_level,
            mode=self.original.is_correction_mode, gating=self.original.is_correction_gating, low=low, high=high,
        )  # fmt: skip
        mask = action_mask.bool()
        vllm_kl = (rollout_log_probs - old_log_probs).masked_fill(~mask, 0).sum() / mask.sum().clamp_min(1)
        return coef.to(loss.dtype) * loss, vllm_kl.detach(), is_filter_ratio


def _loss_module() -> Any:
    return upstream.import_openrlhf("openrlhf.models.loss")


def prepare_fit(rank: Any) -> None:
    """Before a rank's fit: the step's entropy coefficient in OpenRLHF's args, our loss, window grouping and update
    check in place (once per process), the update count reset, and the rank marked as the one training."""
    state: UpdateControl | None = getattr(rank, "update_control", None)
    if state is None:
        raise RuntimeError(
            "STARE hooks: the policy rank got no set_update_control before fit (the experience maker sends it every "
            "step; is StareExperienceMaker in use?)"
        )
    state.update, state.selections = 0, {}
    bonus = state.control.method == "entropy_bonus" and state.alpha > 0
    rank.strategy.args.actor.entropy_coef = state.alpha if bonus else None
    trainer = rank.trainer
    if not isinstance(trainer.actor_loss_fn, MethodLoss):
        trainer.actor_loss_fn = MethodLoss(rank, trainer.actor_loss_fn)
        step = trainer.training_step

        def training_step(experience: Any, kl_ctl: Any, index: int, *args: Any, **kwargs: Any) -> Any:
            state: UpdateControl = rank.update_control
            state.current = experience
            if rank.strategy.args.train.dynamic_batch_enable and state.control.method in UPDATE_METHODS:
                setattr(experience, SELECTED, select_dynamic_window(rank, index).to(experience.action_mask.device))
            return step(experience, kl_ctl, index, *args, **kwargs)

        trainer.training_step = training_step
    _actor_module.iter_grad_accum_global_norm = selecting_windows
    strategy = _strategy_module.DeepspeedStrategy
    strategy.optimizer_step = upstream.checking_updates(strategy.optimizer_step, _strategy_module.Actor, _rl_step)
    _active["rank"] = rank


def _rl_step(engine: Any) -> str:
    rank = _active.get("rank")
    return f"rl step {rank.update_control.control.step}" if rank else f"optimizer update {engine.global_steps + 1}"


def finish_fit() -> None:
    _active.pop("rank", None)
