"""One step of entropy control over the whole rollout batch, called by both backends: STARE's weights, the
first-order diagnostics and the step's metrics, one schema.

A backend hands the step's batch over as one MicroBatch (the local backend) or as the micro-batches its framework
made, each right-padded to its own width (OpenRLHF's experience maker). The paper's token selection (top P of the
positive- or negative-advantage tokens by surprisal) and its gate are defined over the whole batch, so the parts
are padded to one width, the controller runs once, and each part gets back its own slice of the weights. Scaling
a token's advantage by its weight is exact for a clipped loss (it is positively homogeneous in the advantage).
Metrics: the controller's stare/*, stare/w and stare/m, theory/* of theory.batch_diagnostics, and the regime as
theory/regime_<name> (1.0 for the step's regime, 0.0 for the others), numbers a TensorBoard log can hold.
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
    advantages: the token's advantage, (b, t), or (b,) for one advantage per row (GRPO's); action_mask: 1 = sampled
    by the policy (prompt, observations and padding 0); entropy, s2: of the sampling policy at each position.
    """

    action_log_probs: Tensor
    advantages: Tensor
    action_mask: Tensor
    entropy: Tensor
    s2: Tensor


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
    advantages = _pad([_per_token(p.advantages, p.action_mask).float() for p in parts], width, 0.0)
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
