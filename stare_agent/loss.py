"""GRPO advantages and the clipped policy-gradient loss. Pure torch, shared by every backend."""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, *, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: each reward normalized within its prompt's group.

    rewards: (B,) with the G = group_size samples of a prompt contiguous. Returns (B,) float32,
    (r - mean) / (std + eps) with the unbiased std; a group with equal rewards gets all zeros.
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be (B,) with B a multiple of group_size={group_size}; got {tuple(rewards.shape)}"
        )
    grouped = rewards.float().view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centered[:, :1])
    return (centered / (std + eps)).view(-1)


def on_actions(action_mask: Tensor, tensor: Tensor) -> Tensor:
    """tensor with every position outside action_mask set to 0, gradient included: whatever a prompt, tool-output
    or padding position holds (inf, NaN), it cannot reach a loss or its gradient. Masking by multiplying does not
    do this (0 * inf is NaN, and a NaN there turns the whole gradient NaN)."""
    action = action_mask.bool()
    if tensor.dim() == 1 and action.dim() == 2:  # per-sample values (advantages) are fine as they are
        return tensor
    return torch.where(action, tensor, torch.zeros((), dtype=tensor.dtype, device=tensor.device))


def token_losses(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
    weights: Tensor | None = None,
    clip: bool = True,
    penalty: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Each token's loss (B, T), to be averaged over the action tokens, and where the clip held it (B, T) bool.

    loss = -omega * min(rho A, clip(rho, 1-eps_low, 1+eps_high) A) (+ penalty * |log pi - log pi_old|);
    policy_loss has the arguments. Both backends build their loss from this.
    """
    adv = advantages[:, None].expand_as(logprobs) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logprobs - old_logprobs)
    pg_loss1 = -adv * ratio
    pg_loss2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(pg_loss1, pg_loss2) if clip else pg_loss1
    if dual_clip is not None:
        if dual_clip <= 1.0 or not clip:
            raise ValueError(f"dual_clip must be > 1 and needs the clipped surrogate; got {dual_clip}, clip={clip}")
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    if weights is not None:
        loss = loss * weights
    if penalty is not None:
        loss = loss + penalty * (logprobs - old_logprobs).abs()
    clipped = (pg_loss2 > pg_loss1).detach() if clip else torch.zeros(loss.shape, dtype=torch.bool, device=loss.device)
    return loss, clipped


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
    weights: Tensor | None = None,
    num_tokens: Tensor | float | None = None,
    clip: bool = True,
    penalty: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level clipped surrogate, to minimize: -(1/N) sum omega * min(rho A, clip(rho, 1-eps_low, 1+eps_high) A).

    logprobs, old_logprobs, action_mask: (B, T); action_mask 1 = sampled by the policy.
    advantages: (B,) or (B, T). weights: optional (B, T) omega >= 0 on each token's loss (None = all ones): STARE's
    and the other advantage methods' weights, 0 where Clip-Cov drops a token.
    dual_clip: c > 1 bounds the loss of negative-advantage tokens at -c * A (None = off).
    num_tokens: N, the action tokens of the whole batch; pass it when this call sees one
    micro-batch of several, so the token-level mean is over the batch (default: this mask's sum).
    clip: False = the unclipped -rho A (KL-Cov). penalty: optional (B, T) coefficient k of a term
    k * |log pi - log pi_old| added to each token's loss (KL-Cov: its coef on the selected tokens, 0 elsewhere).
    Positions outside action_mask change neither the loss nor its gradient, whatever they hold (on_actions); with
    no action token the loss is 0.
    """
    kept = [None if t is None else on_actions(action_mask, t) for t in (weights, penalty)]
    loss, clipped = token_losses(
        on_actions(action_mask, logprobs), on_actions(action_mask, old_logprobs), on_actions(action_mask, advantages),
        eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, weights=kept[0], clip=clip, penalty=kept[1],
    )  # fmt: skip
    mask = action_mask.to(loss.dtype)
    n = mask.sum() if num_tokens is None else num_tokens
    total = on_actions(action_mask, loss).sum() / _at_least_one(n)
    with torch.no_grad():
        metrics = {"policy/clip_frac": (clipped.to(mask.dtype) * mask).sum() / mask.sum().clamp_min(1)}
    return total, metrics


def logprob_mismatch(rollout_logprobs: Tensor, trainer_logprobs: Tensor, action_mask: Tensor) -> dict[str, float]:
    """How far the rollout engine's log-probs of the sampled tokens are from the trainer's, over action tokens.

    Both (B, T) log-probs of the same tokens, aligned with action_mask (1 = sampled by the policy); positions
    outside the mask are ignored, whatever they hold. Returns `rollout_logprob_abs_diff` (mean |rollout - trainer|,
    nats) and `rollout_logprob_abs_diff_max`; 0.0 for both when no token is an action. Near 0 when the update is
    on-policy (same weights, same sampling distribution); a weight sync that did not reach the engine shows as a
    jump after the first step.
    """
    action = action_mask.bool()
    diff = (rollout_logprobs.float() - trainer_logprobs.float()).abs()[action]
    mean, worst = (float(diff.mean()), float(diff.max())) if diff.numel() else (0.0, 0.0)
    return {"rollout_logprob_abs_diff": mean, "rollout_logprob_abs_diff_max": worst}


def entropy_bonus_loss(entropy: Tensor, action_mask: Tensor, alpha: float, num_tokens: Tensor | float) -> Tensor:
    """-(alpha / N) * sum of the current policy's entropy over the action tokens, to add to the loss (the adaptive
    entropy bonus). entropy: (B, T) with grad; N: the action tokens of the whole batch, as policy_loss's. Positions
    outside the mask count for nothing, whatever they hold; 0 when there is no action token."""
    return -alpha * on_actions(action_mask, entropy).sum() / _at_least_one(num_tokens)


def _at_least_one(n: Tensor | float) -> Tensor | float:
    """A token count to divide by: with no action token the sum is 0 and so is the mean (not 0 / 0)."""
    return n.clamp_min(1) if isinstance(n, Tensor) else max(n, 1)


@torch.no_grad()
def ratio_stats(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, action_mask: Tensor, *, eps_low: float, eps_high: float
) -> dict[str, Tensor]:
    """Sums over the action tokens of how far the current policy is from the sampling one, for per-step metrics.

    `clip_high`: tokens with A > 0 and rho > 1 + eps_high (the clip holds them); `clip_low`: A < 0 and
    rho < 1 - eps_low; `ratio_dev`: sum |rho - 1| (`ratio_dev_max`: its largest term); `approx_kl`: sum of
    (rho - 1) - log rho, the nonnegative k3 estimate of KL(pi_old || pi); `tokens`: the action tokens. Divide
    the sums by `tokens` (summed over micro-batches and updates) for the step's means.
    """
    adv = advantages[:, None].expand_as(logprobs) if advantages.dim() == 1 else advantages
    action = action_mask.bool()
    log_ratio = (logprobs.float() - old_logprobs.float()).masked_fill(~action, 0.0)
    ratio = log_ratio.exp()
    return {
        "clip_high": (action & (adv > 0) & (ratio > 1.0 + eps_high)).sum().float(),
        "clip_low": (action & (adv < 0) & (ratio < 1.0 - eps_low)).sum().float(),
        "ratio_dev": (ratio - 1.0).abs().sum(),
        "ratio_dev_max": (ratio - 1.0).abs().max() if ratio.numel() else torch.zeros(()),
        "approx_kl": ((ratio - 1.0) - log_ratio).sum(),
        "tokens": action.sum().float(),
    }
