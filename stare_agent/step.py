"""One step of entropy control over the whole rollout batch, called by both backends: the method's token weights,
the first-order diagnostics and the step's metrics, one schema (stare_agent/entropy_control.py has the methods).

A backend hands the step's batch over as one MicroBatch (the local backend) or as the micro-batches its framework
made, each right-padded to its own width (OpenRLHF's experience maker). Every method's selection (STARE's top P of
the positive- or negative-advantage tokens by surprisal and its gate, the fixed-threshold and forking-token sets,
Clip-Cov's and KL-Cov's covariance sets) is defined over the whole batch, so the parts are padded to one width, the
method runs once, and each part gets back its own slice. Scaling a token's advantage by its weight is exact for a
clipped loss (it is positively homogeneous in the advantage).

Metrics: the STARE controller's stare/* (stare/entropy_mean and stare/surprisal_mean for every method), the
method's control/* (control/selected_share: the share of action tokens it acts on; control/weight_mean: the mean
multiplier of the surrogate; control/coef: its coefficient where it has one), theory/* of
theory.batch_diagnostics, and the regime as theory/regime_<name> (1.0 for the step's regime, 0.0 for the others).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from stare_agent.entropy_control import (
    UPDATE_METHODS,
    EntropyControl,
    clip_cov_generator,
    clip_cov_select,
    forking_weights,
    kl_cov_select,
)
from stare_agent.protocol import AFTER_TOOL_TOKENS, ANSWER, CODE, PROMPT, REASONING, TOOL_OUTPUT
from stare_agent.stare import _masked_mean, select_quadrants
from stare_agent.theory import REGIMES, batch_diagnostics


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's per-token tensors, all (b, t) for its own b and t; positions past a row's end are padding.

    action_log_probs: log pi_old of each action token under the sampling policy (temperature-scaled logits);
    advantages: the token's advantage, (b, t), or (b,) for one advantage per row (GRPO's); action_mask: 1 = sampled
    by the policy (prompt, observations and padding 0); entropy, s2: of the sampling policy at each position;
    classes: what each token is (protocol.token_classes), for the per-class metrics.
    """

    action_log_probs: Tensor
    advantages: Tensor
    action_mask: Tensor
    entropy: Tensor
    s2: Tensor
    classes: Tensor | None = None
    """(b, t) int: protocol.TOKEN_CLASSES index of each position's token (None: no per-class metrics)."""
    ids: Tensor | None = None
    """(b, t) int: the token each position predicts (None: the tokens acted on are not counted)."""


def _pad(parts: Sequence[Tensor], width: int, value: float) -> Tensor:
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=value) for p in parts])


def _per_token(advantages: Tensor, mask: Tensor) -> Tensor:
    return advantages[:, None].expand(mask.shape) if advantages.dim() == 1 else advantages


def regime_of(row: dict) -> str | None:
    """The step's regime in a metrics row: from theory/regime_<name>, or the name runs before one schema logged
    as theory/regime; None when the row has neither."""
    for name in REGIMES:
        if row.get(f"theory/regime_{name}") == 1.0:
            return name
    value = row.get("theory/regime")
    return None if value is None else str(value)


def _split(whole: Tensor, parts: Sequence[Any]) -> list[Tensor]:
    """Each part's rows and width of a (sum of rows, width) tensor."""
    out, row = [], 0
    for part in parts:
        b, t = part.action_mask.shape
        out.append(whole[row : row + b, :t])
        row += b
    return out


def control_step(control: EntropyControl, parts: Sequence[MicroBatch]) -> tuple[list[Tensor], dict[str, float]]:
    """The advantage weights of every micro-batch (each the shape of its action mask) and the step's metrics.

    Runs the method once over the whole batch: STARE's controller (stare; low_prob_reweight with its fixed
    threshold), the forking-token selection, or the entropy bonus's coefficient; every other method's weights
    are 1 (clip_cov and kl_cov act at each update: update_selection). Computes the first-order diagnostics of
    theory.batch_diagnostics on the whole batch, with the high+ set the method amplifies (STARE's top-P set
    for methods without one), and hands the controller the batch's W* (its critical W/M and its gate see the
    whole batch).
    """
    if not parts:
        raise ValueError("control_step needs at least one micro-batch")
    width = max(p.action_mask.shape[1] for p in parts)
    mask = _pad([p.action_mask.bool() for p in parts], width, False)
    log_probs = _pad([p.action_log_probs.float() for p in parts], width, 0.0)
    advantages = _pad([_per_token(p.advantages, p.action_mask).float() for p in parts], width, 0.0)
    entropy = _pad([p.entropy.float() for p in parts], width, 0.0)
    s2 = _pad([p.s2.float() for p in parts], width, 0.0)
    surprisal = torch.where(mask, -log_probs, torch.zeros_like(log_probs))
    method, stare = control.method, control.stare

    if method == "low_prob_reweight":
        high_pos = mask & (advantages > 0) & (surprisal > -math.log(stare.prob_threshold))
    else:
        high_pos = select_quadrants(surprisal, advantages, mask, stare.config.top_ratio, ("high+",))["high+"]
    theory = batch_diagnostics(surprisal, advantages, mask, entropy, s2, high_pos)
    n_action = mask.sum().clamp_min(1)
    metrics: dict[str, float] = {
        "stare/entropy_mean": float(_masked_mean(entropy, mask)),
        "stare/surprisal_mean": float(_masked_mean(surprisal, mask)),
    }
    if method in ("stare", "low_prob_reweight"):
        weights, stare_metrics = stare(
            surprisal, advantages, mask, entropy, critical_weight=theory["theory/critical_weight"]
        )
        metrics.update({k: float(v) for k, v in stare_metrics.items()})
        metrics["stare/w"], metrics["stare/m"] = stare.w, stare.m
        metrics["control/selected_share"] = float((mask & (weights != 1.0)).sum() / n_action)
    elif method == "forking_tokens":
        cfg = control.config.forking_tokens
        weights = forking_weights(entropy, mask, top_ratio=cfg.top_ratio, normalize=cfg.normalize)
        metrics["control/selected_share"] = float((mask & (weights > 0)).sum() / n_action)
    else:
        weights = torch.ones(mask.shape, dtype=torch.float32, device=mask.device)
        if method == "entropy_bonus":
            measure = control.config.entropy_bonus.measure
            alpha = control.bonus.step(
                metrics["stare/entropy_mean" if measure == "entropy" else "stare/surprisal_mean"]
            )
            metrics["control/coef"] = alpha
            metrics["control/selected_share"] = float(alpha > 0)
        elif method == "kl_cov":
            metrics["control/coef"] = control.config.kl_cov.coef
    if method not in UPDATE_METHODS:  # Clip-Cov's and KL-Cov's come from their updates
        metrics["control/weight_mean"] = float(_masked_mean(weights, mask))
    acted = None
    if method in ("stare", "low_prob_reweight"):
        acted = mask & (weights != 1.0)
    elif method == "forking_tokens":
        acted = mask & (weights > 0)
    if all(p.classes is not None for p in parts):
        classes = _pad([p.classes.long() for p in parts], width, PROMPT)
        metrics.update(class_metrics(entropy, mask, classes, acted))
    if acted is not None and all(p.ids is not None for p in parts):
        control.selected.add(_pad([p.ids.long() for p in parts], width, 0), acted, mask)
    control.step += 1

    metrics.update({k: float(v) for k, v in theory.items() if k != "theory/regime"})
    regime = REGIMES[int(theory["theory/regime"])]
    metrics.update({f"theory/regime_{name}": float(name == regime) for name in REGIMES})
    return _split(weights, parts), metrics


CLASS_METRICS = {"reasoning": REASONING, "code": CODE, "answer": ANSWER}
"""The token classes with their own entropy and selected-share metrics, beside after_tool."""


def class_masks(mask: Tensor, classes: Tensor) -> dict[str, Tensor]:
    """{name: (B, T) bool} over the action tokens: each class of CLASS_METRICS, and after_tool, the first
    AFTER_TOOL_TOKENS action tokens after each interpreter output of a row."""
    out = {name: mask & (classes == cls) for name, cls in CLASS_METRICS.items()}
    positions = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)
    last_tool = torch.where(classes == TOOL_OUTPUT, positions, -1).cummax(dim=1).values
    sampled = mask.long().cumsum(dim=1)
    before = torch.where(last_tool >= 0, sampled.gather(1, last_tool.clamp_min(0)), 0)
    out["after_tool"] = mask & (last_tool >= 0) & (sampled - before <= AFTER_TOOL_TOKENS)
    return out


def class_metrics(entropy: Tensor, mask: Tensor, classes: Tensor, acted: Tensor | None) -> dict[str, float]:
    """entropy/<name>: the sampling policy's mean entropy over each class_masks set (NaN when empty);
    control/selected_share_<name>: the share of the set the method acts on (`acted`; none when None)."""
    out = {}
    for name, members in class_masks(mask, classes).items():
        out[f"entropy/{name}"] = float(_masked_mean(entropy.float(), members)) if members.any() else math.nan
        if acted is not None:
            share = float((acted & members).sum() / members.sum()) if members.any() else math.nan
            out[f"control/selected_share_{name}"] = share
    return out


@dataclass(frozen=True)
class UpdatePart:
    """One micro-batch of one update, for the methods that select from the current policy (Clip-Cov, KL-Cov).

    logprobs: (b, t) of the current policy (before this update's gradient step); old_logprobs: of the sampling
    policy; advantages: (b, t) or (b,); action_mask: 1 = sampled by the policy."""

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    action_mask: Tensor


def update_selection(control: EntropyControl, parts: Sequence[UpdatePart], update: int) -> list[Tensor] | None:
    """Clip-Cov's or KL-Cov's selection for one update, over all its micro-batches: per part a (b, t) bool
    (Clip-Cov: the tokens whose loss is zeroed; KL-Cov: the tokens penalised). None for the other methods.

    `update` numbers the updates of the current rollout batch (0, 1, ...); with the control's step and seed it
    seeds Clip-Cov's random draw, so a resumed run draws the same tokens.
    """
    method, config = control.method, control.config
    if method not in ("clip_cov", "kl_cov"):
        return None
    if not parts:
        raise ValueError("update_selection needs at least one micro-batch")
    width = max(p.action_mask.shape[1] for p in parts)
    mask = _pad([p.action_mask.bool() for p in parts], width, False)
    logprobs = _pad([p.logprobs.detach().float() for p in parts], width, 0.0)
    old = _pad([p.old_logprobs.float() for p in parts], width, 0.0)
    advantages = _pad([_per_token(p.advantages, p.action_mask).float() for p in parts], width, 0.0)
    if method == "clip_cov":
        cfg = config.clip_cov
        selected = clip_cov_select(
            advantages, logprobs, old, mask, ratio=cfg.ratio, lb=cfg.lb, ub=cfg.ub,
            eps_low=config.loss.eps_low, eps_high=config.loss.eps_high,
            generator=clip_cov_generator(config.run.seed, control.step, update),
        )  # fmt: skip
    else:
        selected = kl_cov_select(advantages, logprobs, mask, ratio=config.kl_cov.ratio)
    return _split(selected, parts)
