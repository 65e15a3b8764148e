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
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level clipped surrogate, to minimize: -(1/N) sum omega * min(rho A, clip(rho, 1-eps_low, 1+eps_high) A).

    logprobs, old_logprobs, action_mask: (B, T); action_mask 1 = sampled by the policy.
    advantages: (B,) or (B, T). weights: optional (B, T) STARE omega > 0 (None = all ones).
    dual_clip: c > 1 bounds the loss of negative-advantage tokens at -c * A (None = off).
    num_tokens: N, the action tokens of the whole batch; pass it when this call sees one
    micro-batch of several, so the token-level mean is over the batch (default: this mask's sum).
    """
    adv = advantages[:, None].expand_as(logprobs) if advantages.dim() == 1 else advantages
    mask = action_mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)
    pg_loss1 = -adv * ratio
    pg_loss2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(pg_loss1, pg_loss2)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1; got {dual_clip}")
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    if weights is not None:
        loss = loss * weights
    n = mask.sum() if num_tokens is None else num_tokens
    total = (loss * mask).sum() / n
    with torch.no_grad():
        clipped = (pg_loss2 > pg_loss1).to(mask.dtype)
        metrics = {"policy/clip_frac": (clipped * mask).sum() / mask.sum().clamp_min(1)}
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
