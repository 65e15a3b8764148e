"""STARE once per optimizer step over the whole rollout batch, as OpenRLHF hands it over in micro-batches.

OpenRLHF's experience maker returns the step's rollouts as a list of micro-batch `Experience`s, each
right-padded to its own width: action log-probs, per-token advantages (the group-normalized reward on
every action token), the action mask, and (from our forward) the sampling policy's entropy and S2. The
paper's token selection (top P of the positive- or negative-advantage tokens by surprisal) and its gate
are defined over the whole batch, so the micro-batches are padded to one width, STARE runs once, and
each micro-batch gets back its own slice of the weights. The caller multiplies `advantages` by them,
which is exact for OpenRLHF's clipped loss (the loss is positively homogeneous in the advantage).

Plain torch: no OpenRLHF import, so it runs (and is tested) without a GPU stack.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from stare_agent.stare import StareController, select_quadrants
from stare_agent.theory import REGIMES, batch_diagnostics


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's per-token tensors, all (b, t) for its own b and t; positions past a row's end are padding.

    action_log_probs: log pi_old of each action token under the sampling policy (temperature-scaled logits);
    advantages: the token's advantage; action_mask: 1 = sampled by the policy (prompt, observations and
    padding 0); entropy, s2: of the sampling policy at each position.
    """

    action_log_probs: Tensor
    advantages: Tensor
    action_mask: Tensor
    entropy: Tensor
    s2: Tensor


def _pad(parts: Sequence[Tensor], width: int, value: float) -> Tensor:
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=value) for p in parts])


def stare_step(controller: StareController, parts: Sequence[MicroBatch]) -> tuple[list[Tensor], dict[str, float]]:
    """The STARE weights of every micro-batch (each the shape of its action mask) and the step's metrics.

    Computes the first-order diagnostics of theory.batch_diagnostics on the whole batch (`theory/regime` as
    its name), then calls the controller exactly once with the batch's W* (its adaptive or critical W/M and
    its gate see the whole batch).
    """
    if not parts:
        raise ValueError("stare_step needs at least one micro-batch")
    width = max(p.action_mask.shape[1] for p in parts)
    mask = _pad([p.action_mask.bool() for p in parts], width, False)
    log_probs = _pad([p.action_log_probs.float() for p in parts], width, 0.0)
    advantages = _pad([p.advantages.float() for p in parts], width, 0.0)
    entropy = _pad([p.entropy.float() for p in parts], width, 0.0)
    s2 = _pad([p.s2.float() for p in parts], width, 0.0)
    surprisal = torch.where(mask, -log_probs, torch.zeros_like(log_probs))

    high_pos = select_quadrants(surprisal, advantages, mask, controller.config.top_ratio, ("high+",))["high+"]
    theory = batch_diagnostics(surprisal, advantages, mask, entropy, s2, high_pos)
    weights, stare_metrics = controller(
        surprisal, advantages, mask, entropy, critical_weight=theory["theory/critical_weight"]
    )

    metrics = {k: float(v) for k, v in stare_metrics.items()}
    metrics.update({k: float(v) for k, v in theory.items() if k != "theory/regime"})
    metrics["stare/w"], metrics["stare/m"] = controller.w, controller.m
    regime = REGIMES[int(theory["theory/regime"])]

    out, row = [], 0
    for part in parts:
        b, t = part.action_mask.shape
        out.append(weights[row : row + b, :t])
        row += b
    return out, {**metrics, **{f"theory/regime_{name}": float(name == regime) for name in REGIMES}}
