"""STARE: surprisal-guided token-level advantage reweighting (DESIGN section 3).

Pure torch. One optimizer step sees one rollout batch; over the whole batch the action tokens
with a positive advantage (T+) and with a negative advantage (T-) are each split by surprisal
into a "high" and a "low" set of ceil(P * |T±|) tokens. An operation multiplies the advantages
of some of those quadrants by W > 1 (amplify) or M < 1 (attenuate), and a gate switches the
reweighting on only while the policy's entropy is below a target.

First-order effect of a GRPO step on entropy, per quadrant: high+ raises it, low+ lowers it,
low- raises it, high- lowers it. So O1 (amplify high+) and O2 (attenuate high-) both push
entropy up; C2 = O1 + O2 is the two-sided variant.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, Union, get_args

import torch
from torch import Tensor

Quadrant = Literal["high+", "high-", "low+", "low-"]
Op = Literal["O1", "O2", "O3", "O4", "C1", "C2", "C3", "C4"]
Gate = Literal["batch", "sample", "token", "off"]
Schedule = Literal["fixed", "adaptive"]

QUADRANTS: tuple[Quadrant, ...] = get_args(Quadrant)
OPS: tuple[Op, ...] = get_args(Op)
GATES: tuple[Gate, ...] = get_args(Gate)
SCHEDULES: tuple[Schedule, ...] = get_args(Schedule)

# Which multiplier each preset puts on which quadrant: "W" amplifies, "M" attenuates.
# O1 and C2 are the paper's; O2-O4 and C1, C3, C4 are our reading of its naming (DESIGN section 3).
PRESETS: dict[Op, dict[Quadrant, Literal["W", "M"]]] = {
    "O1": {"high+": "W"},
    "O2": {"high-": "M"},
    "O3": {"low-": "W"},
    "O4": {"low+": "M"},
    "C1": {"high+": "W", "low-": "W"},
    "C2": {"high+": "W", "high-": "M"},
    "C3": {"low-": "W", "low+": "M"},
    "C4": {"high-": "M", "low+": "M"},
}

# Metric keys for the selected fraction of each quadrant ("+"/"-" are not safe in every logger's tag names).
QUADRANT_METRIC = {"high+": "high_pos", "high-": "high_neg", "low+": "low_pos", "low-": "low_neg"}


def ceil_count(ratio: float, n: int) -> int:
    """ceil(ratio * n) on the decimal value of `ratio`: 0.1 of 30 is 3, where float arithmetic gives 4."""
    return math.ceil(Fraction(repr(float(ratio))) * n)


def quadrant_multipliers(op: Op | Mapping[str, float], w: float, m: float) -> dict[Quadrant, float]:
    """Resolve a preset name, or an explicit {quadrant: multiplier} map, to multipliers per quadrant."""
    if isinstance(op, Mapping):
        unknown = sorted(set(op) - set(QUADRANTS))
        if unknown:
            raise ValueError(f"op map keys must be among {', '.join(QUADRANTS)}; got {', '.join(map(repr, unknown))}")
        out: dict[Quadrant, float] = {}
        for quadrant, mult in op.items():
            if not (math.isfinite(float(mult)) and float(mult) > 0):
                raise ValueError(f"op map multiplier for {quadrant!r} must be a finite number > 0; got {mult!r}")
            out[quadrant] = float(mult)
        return out
    if op not in PRESETS:
        raise ValueError(f"op must be one of {', '.join(OPS)} or a map from quadrant to multiplier; got {op!r}")
    if not (w > 0 and m > 0):
        raise ValueError(f"multipliers must be > 0 so every weight stays positive; got w={w}, m={m}")
    return {q: (w if kind == "W" else m) for q, kind in PRESETS[op].items()}


def _take_k(values: Tensor, member: Tensor, k: int, largest: bool) -> Tensor:
    """(B, T) bool: exactly k members with the largest (or smallest) values.

    Ties at the threshold value go to the lowest row-major flat index, so the result is
    deterministic and has exactly k tokens whatever the data.
    """
    if k == 0:
        return torch.zeros_like(member)
    candidates = values[member]
    n = candidates.numel()
    # kthvalue is a selection (no sort) and accepts any size, unlike torch.quantile (DESIGN section 3).
    threshold = torch.kthvalue(candidates, n - k + 1 if largest else k).values
    beyond = member & ((values > threshold) if largest else (values < threshold))
    at = member & (values == threshold)
    still_needed = k - beyond.sum()
    first_ties = at & (torch.cumsum(at.flatten(), 0).view_as(at) <= still_needed)
    return beyond | first_ties


def select_quadrants(
    surprisal: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    top_ratio: float,
    quadrants: tuple[Quadrant, ...] | list[Quadrant] = QUADRANTS,
) -> dict[Quadrant, Tensor]:
    """Partition the batch's action tokens into the requested quadrants.

    surprisal: (B, T) float; advantages: (B,) or (B, T); action_mask: (B, T), 1 = sampled by the policy.
    Returns {quadrant: (B, T) bool}, each with exactly ceil(top_ratio * |T±|) tokens. Tokens with a
    zero advantage are never selected. With top_ratio > 0.5 a high and a low set can share tokens.
    """
    if not 0.0 < top_ratio <= 1.0:
        raise ValueError(f"top_ratio must be in (0, 1]; got {top_ratio}")
    mask = action_mask.bool()
    adv = _broadcast_advantages(advantages, surprisal)
    members = {"+": mask & (adv > 0), "-": mask & (adv < 0)}
    signs = sorted({q[-1] for q in quadrants})
    # One host sync for both counts: k must be a Python int for kthvalue.
    counts = dict(zip(signs, torch.stack([members[s].sum() for s in signs]).tolist(), strict=True)) if signs else {}
    values = surprisal.float()
    return {
        q: _take_k(values, members[q[-1]], ceil_count(top_ratio, counts[q[-1]]), largest=q.startswith("high"))
        for q in quadrants
    }


def _broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        return advantages[:, None].expand_as(like)
    if advantages.shape == like.shape:
        return advantages
    raise ValueError(f"advantages must have shape (B,) or (B, T) = {tuple(like.shape)}; got {tuple(advantages.shape)}")


def _masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over mask (NaN where the mask is empty). `where`, not a product: padding may hold NaN."""
    kept = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return kept.sum() / mask.sum()
    return kept.sum(dim) / mask.sum(dim)


def token_weights(
    surprisal: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    entropy: Tensor,
    *,
    op: Op | Mapping[str, float] = "O1",
    top_ratio: float = 0.1,
    w: float = 1.1,
    m: float = 0.9,
    target_entropy: float = 0.3,
    gate: Gate = "batch",
) -> tuple[Tensor, dict[str, Tensor]]:
    """STARE weights omega for one batch (DESIGN section 3).

    surprisal: (B, T) -log pi_old of the sampled token, detached.
    advantages: (B,) per trajectory, or (B, T).
    action_mask: (B, T); 1 = sampled by the policy (0 for prompt, tool output, padding).
    entropy: (B, T) exact entropy of pi_old at each position.
    Returns weights (B, T) float32 -- exactly 1.0 outside the action mask and outside the selected
    quadrants -- and metric tensors under "stare/". A token in two selected quadrants (possible only
    with top_ratio > 0.5) gets the product of their multipliers.
    """
    if surprisal.dim() != 2 or action_mask.shape != surprisal.shape or entropy.shape != surprisal.shape:
        raise ValueError(
            "surprisal, action_mask and entropy must all have shape (B, T); got "
            f"{tuple(surprisal.shape)}, {tuple(action_mask.shape)}, {tuple(entropy.shape)}"
        )
    if gate not in GATES:
        raise ValueError(f"gate must be one of {', '.join(GATES)}; got {gate!r}")
    multipliers = quadrant_multipliers(op, w, m)
    mask = action_mask.bool()
    sets = select_quadrants(surprisal, advantages, mask, top_ratio, tuple(multipliers))

    h = entropy.float()
    h_bar = _masked_mean(h, mask)
    # g in {0, 1}: 1 where the policy is below the target entropy and reweighting is on.
    if gate == "batch":
        g = (h_bar < target_entropy).float()
        gate_mean = g
    elif gate == "sample":
        row_mean = _masked_mean(h, mask, dim=1)
        g = (row_mean < target_entropy).float()[:, None]
        gate_mean = _masked_mean(g.squeeze(1), mask.any(dim=1))
    elif gate == "token":
        g = (h < target_entropy).float()
        gate_mean = _masked_mean(g, mask)
    else:
        g = torch.ones((), device=h.device)
        gate_mean = g

    weights = torch.ones(surprisal.shape, dtype=torch.float32, device=surprisal.device)
    for quadrant, mult in multipliers.items():
        weights = torch.where(sets[quadrant], weights * (1.0 + g * (mult - 1.0)), weights)

    n_action = mask.sum().clamp_min(1)
    metrics = {
        "stare/gate": gate_mean,
        "stare/entropy_mean": h_bar,
        "stare/surprisal_mean": _masked_mean(surprisal.float(), mask),
        "stare/weight_mean": _masked_mean(weights, mask),
        "stare/w": torch.tensor(float(w)),
        "stare/m": torch.tensor(float(m)),
    }
    for quadrant, selected in sets.items():
        metrics[f"stare/frac_{QUADRANT_METRIC[quadrant]}"] = selected.sum() / n_action
    return weights, metrics


@dataclass
class StareConfig:
    """STARE settings. The defaults are the paper's for 7B models (DESIGN section 3)."""

    enabled: bool = True
    """False runs plain GRPO(-ds): every weight is 1."""
    op: Union[Op, dict[Quadrant, float]] = "O1"
    """A preset (O1-O4 single, C1-C4 combined) or an explicit map from quadrant to multiplier."""
    top_ratio: float = 0.1
    """P: fraction of T+ (and of T-) taken as each high or low set, in (0, 1]."""
    w: float = 1.1
    """W >= 1: multiplier on amplified quadrants (start value when the schedule is adaptive)."""
    m: float = 0.9
    """M in (0, 1]: multiplier on attenuated quadrants (start value when the schedule is adaptive)."""
    target_entropy: float = 0.3
    """H_tgt in nats: the gate reweights only while entropy is below it."""
    gate: Gate = "batch"
    """batch: batch mean entropy; sample: per trajectory; token: per position; off: always on (open loop)."""
    schedule: Schedule = "fixed"
    """fixed: W and M stay; adaptive: each step W += alpha*sgn(H_tgt - Hbar), M -= the same, clipped."""
    alpha: float = 0.01
    """Adaptive step size for W and M."""
    w_max: float = 1.5
    """Upper bound for adaptive W."""
    m_min: float = 0.5
    """Lower bound for adaptive M."""

    def __post_init__(self) -> None:
        if isinstance(self.op, Mapping):
            quadrant_multipliers(self.op, 1.0, 1.0)
        elif self.op not in OPS:
            raise ValueError(
                f"op must be one of {', '.join(OPS)} or a map from quadrant to multiplier; got {self.op!r}"
            )
        if self.gate not in GATES:
            raise ValueError(f"gate must be one of {', '.join(GATES)}; got {self.gate!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}")
        if not 0.0 < self.top_ratio <= 1.0:
            raise ValueError(f"top_ratio must be in (0, 1]; got {self.top_ratio}")
        if self.w_max < 1.0:
            raise ValueError(f"w_max must be >= 1; got {self.w_max}")
        if not 0.0 < self.m_min <= 1.0:
            raise ValueError(f"m_min must be in (0, 1]; got {self.m_min}")
        adaptive = self.schedule == "adaptive"
        if not 1.0 <= self.w <= (self.w_max if adaptive else math.inf):
            raise ValueError(f"w must be >= 1 (and <= w_max={self.w_max} when adaptive); got {self.w}")
        if not (0.0 < self.m <= 1.0 and (not adaptive or self.m >= self.m_min)):
            raise ValueError(f"m must be in (0, 1] (and >= m_min={self.m_min} when adaptive); got {self.m}")
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0; got {self.alpha}")
        if self.target_entropy < 0:
            raise ValueError(f"target_entropy must be >= 0 nats; got {self.target_entropy}")


class StareController:
    """Per-step STARE state: the weight schedule and the last gate, saved with checkpoints.

    Call it once per optimizer step with the whole batch (all data-parallel ranks gathered).
    With the adaptive schedule, W and M move first from this step's mean entropy, then apply.
    """

    def __init__(self, config: StareConfig):
        self.config = config
        self.w = config.w
        self.m = config.m
        self.last_gate = float("nan")
        self.step = 0

    def __call__(
        self, surprisal: Tensor, advantages: Tensor, action_mask: Tensor, entropy: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        cfg = self.config
        if not cfg.enabled:  # plain GRPO: weights 1, but the same entropy metrics for comparison
            mask = action_mask.bool()
            metrics = {
                "stare/entropy_mean": _masked_mean(entropy.float(), mask),
                "stare/surprisal_mean": _masked_mean(surprisal.float(), mask),
            }
            return torch.ones(surprisal.shape, dtype=torch.float32, device=surprisal.device), metrics
        if cfg.schedule == "adaptive":
            # One host sync per step (not per micro-batch): the schedule is plain Python state.
            h_bar = float(_masked_mean(entropy.float(), action_mask.bool()))
            direction = float(h_bar < cfg.target_entropy) - float(h_bar > cfg.target_entropy)  # sgn; 0 if NaN
            self.w = min(max(self.w + cfg.alpha * direction, 1.0), cfg.w_max)
            self.m = min(max(self.m - cfg.alpha * direction, cfg.m_min), 1.0)
        weights, metrics = token_weights(
            surprisal,
            advantages,
            action_mask,
            entropy,
            op=cfg.op,
            top_ratio=cfg.top_ratio,
            w=self.w,
            m=self.m,
            target_entropy=cfg.target_entropy,
            gate=cfg.gate,
        )
        self.last_gate = float(metrics["stare/gate"])
        self.step += 1
        return weights, metrics

    def state_dict(self) -> dict[str, float | int]:
        return {"w": self.w, "m": self.m, "last_gate": self.last_gate, "step": self.step}

    def load_state_dict(self, state: Mapping[str, float | int]) -> None:
        missing = {"w", "m", "last_gate", "step"} - set(state)
        if missing:
            raise KeyError(f"STARE controller state is missing {', '.join(sorted(missing))}; got keys {sorted(state)}")
        self.w, self.m = float(state["w"]), float(state["m"])
        self.last_gate, self.step = float(state["last_gate"]), int(state["step"])
