"""GRPO advantages and the clipped policy-gradient loss. Pure torch, shared by every backend."""

from __future__ import annotations

from typing import Literal

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


CorrectionLevel = Literal["token", "seq"]
"""Where the mismatch correction's gate decides: each action token, or each row (sequence) as a whole."""
CorrectionMode = Literal["mask", "clip"]
"""What happens outside the band: mask drops the unit (coefficient 0), clip clamps the token's weight into it."""
CorrectionGating = Literal["ratio", "binary_kl", "tv"]
"""What the gate reads: the importance weight itself, or a divergence between the two sampled-token probabilities."""


def mismatch_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    action_mask: Tensor,
    *,
    level: CorrectionLevel,
    mode: CorrectionMode,
    gating: CorrectionGating,
    low: float,
    high: float,
) -> tuple[Tensor, Tensor]:
    """OpenRLHF 0.11.2's rollout-trainer mismatch correction (PolicyLoss, `algo.advantage.is_correction_*`): the
    coefficient that multiplies each token's policy loss, and the share of units the gate filtered.

    old_logprobs: (B, T) log pi_old of the sampled tokens from the trainer's experience pass; rollout_logprobs: (B, T)
    the engine's log-probs of the same tokens; action_mask: (B, T), 1 = sampled by the policy. Positions outside the
    mask are read as 0 (weight 1) whatever they hold, as loss.on_actions does before the loss.

    w = exp(log pi_old - log pi_rollout) is the importance weight, detached and not clamped. The gate reads a
    statistic s per unit: `ratio`: s = w per token, or at `seq` level the row's geometric mean exp(mean log w);
    `binary_kl` / `tv`: with p = pi_rollout and q = pi_old clamped to [1e-6, 1 - 1e-6], s = p log(p/q) + (1-p)
    log((1-p)/(1-q)) or |p - q| per token, the row's mean of it at `seq` level. `clip` (token level and ratio
    gating only): coef = clamp(s, low, high). `mask`: coef = w where low <= s <= high, 0 elsewhere (survivors keep
    their own per-token w, also at seq level).

    Returns coef (B, T), detached, and OpenRLHF's `is_filter_ratio`: the action tokens' share out of the band
    (token level), or the share of rows out of it (seq level; as in OpenRLHF, a row without action tokens has no
    mean and counts as filtered). With no action token at all the token share is 0 (OpenRLHF's 0/0 is NaN).
    Raises ValueError, naming OpenRLHF's setting, for the combinations OpenRLHF's PolicyLoss refuses.
    """
    coef, in_band, _ = _gate(old_logprobs, rollout_logprobs, action_mask, level, mode, gating, low, high)
    filtered = (~in_band).float()  # (B, T) at token level, (B, 1) at seq level
    if level == "seq":
        return coef, filtered.mean()
    action = action_mask.bool()
    return coef, filtered.masked_fill(~action, 0.0).sum() / action.sum().clamp_min(1)


@torch.no_grad()
def _gate(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    action_mask: Tensor,
    level: str,
    mode: str,
    gating: str,
    low: float,
    high: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """mismatch_correction's coef (B, T), whether each unit is inside the band ((B, T) or, at seq level, (B, 1)
    bool), and the importance weights w (B, T)."""
    _check_correction(level, mode, gating, low)
    action = action_mask.bool()
    old, rollout = on_actions(action, old_logprobs.detach()), on_actions(action, rollout_logprobs.detach())
    log_w = old - rollout
    weight = log_w.exp()
    if gating == "ratio":
        stat = log_w
    else:
        p = rollout.exp().clamp(1e-6, 1 - 1e-6)  # bounded away from 0 and 1: the binary KL's logs stay finite
        q = old.exp().clamp(1e-6, 1 - 1e-6)
        if gating == "binary_kl":
            stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
        else:
            stat = (p - q).abs()
    has_statistic = torch.ones((), dtype=torch.bool, device=action.device)
    if level == "seq":
        counts = action.sum(dim=-1, keepdim=True)
        stat = on_actions(action, stat).sum(dim=-1, keepdim=True) / counts.clamp_min(1)
        # A row without action tokens has no mean: OpenRLHF's 0/0 is NaN there, outside every band.
        has_statistic = counts > 0
    if gating == "ratio":
        stat = stat.exp()  # at seq level, the geometric mean of the row's weights
    in_band = (stat >= low) & (stat <= high) & has_statistic
    coef = stat.clamp(min=low, max=high) if mode == "clip" else torch.where(in_band, weight, 0.0)
    return coef, in_band, weight


def _check_correction(level: str, mode: str, gating: str, low: float) -> None:
    """OpenRLHF's PolicyLoss checks, in our words: each setting's values, and the combinations it refuses."""
    name = "algo.advantage.is_correction"
    if level not in ("token", "seq"):
        raise ValueError(f"{name}_level must be token or seq for the correction to apply (off: none); got {level!r}")
    if mode not in ("mask", "clip"):
        raise ValueError(f"{name}_mode must be one of mask, clip; got {mode!r}")
    if gating not in ("ratio", "binary_kl", "tv"):
        raise ValueError(f"{name}_gating must be one of ratio, binary_kl, tv; got {gating!r}")
    # Only a token's own ratio is a weight that can be clamped; a row's statistic or a divergence can only filter.
    if mode == "clip" and (level != "token" or gating != "ratio"):
        raise ValueError(
            f"{name}_mode=clip needs {name}_level=token and {name}_gating=ratio; got level={level}, gating={gating} "
            "(use mode mask)"
        )
    # A divergence has only an upper bound; OpenRLHF's default band [0.5, 5] would filter every token.
    if gating != "ratio" and low > 0:
        raise ValueError(
            f"{name}_gating={gating} takes an upper bound only: set {name}_threshold to one value, HIGH; got a lower "
            f"bound of {low}"
        )


@torch.no_grad()
def correction_stats(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    action_mask: Tensor,
    *,
    level: CorrectionLevel,
    mode: CorrectionMode,
    gating: CorrectionGating,
    low: float,
    high: float,
) -> dict[str, Tensor]:
    """What the mismatch correction does to one step, over its action tokens, for the step's metrics.

    Arguments as mismatch_correction's; rows of several micro-batches go in as one right-padded batch (each row's
    gate reads only that row). `mismatch/is_weight_mean`, `_min`, `_max`: the importance weights
    w = pi_old / pi_rollout of the action tokens before the gate (1 = the engine and the trainer agree);
    `mismatch/corrected_share`: the share of action tokens whose weight the gate changed, masked to 0 or clipped
    into the band (at seq level every action token of a filtered row). With no action token: 1, 1, 1 and 0.
    """
    _, in_band, weight = _gate(old_logprobs, rollout_logprobs, action_mask, level, mode, gating, low, high)
    action = action_mask.bool()
    corrected = (~in_band).expand_as(action)[action]
    weight = weight[action].float()
    if not weight.numel():
        one = torch.ones((), device=weight.device)
        return {"mismatch/is_weight_mean": one, "mismatch/is_weight_min": one, "mismatch/is_weight_max": one,
                "mismatch/corrected_share": torch.zeros((), device=weight.device)}  # fmt: skip
    return {
        "mismatch/is_weight_mean": weight.mean(),
        "mismatch/is_weight_min": weight.min(),
        "mismatch/is_weight_max": weight.max(),
        "mismatch/corrected_share": corrected.float().mean(),
    }


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
