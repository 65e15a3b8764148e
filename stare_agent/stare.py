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
from typing import ClassVar, Literal, Union, get_args

import torch
from torch import Tensor

Quadrant = Literal["high+", "high-", "low+", "low-"]
Op = Literal["O1", "O2", "O3", "O4", "C1", "C2", "C3", "C4"]
Gate = Literal["batch", "sample", "token", "off"]
WMode = Literal["fixed", "adaptive", "critical"]

QUADRANTS: tuple[Quadrant, ...] = get_args(Quadrant)
OPS: tuple[Op, ...] = get_args(Op)
GATES: tuple[Gate, ...] = get_args(Gate)
W_MODES: tuple[WMode, ...] = get_args(WMode)

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
    """(n,) bool: exactly k members with the largest (or smallest) values.

    values, member: (n,), in row-major flat order of the batch. Ties at the threshold value go to
    the lowest position, so the result is deterministic and has exactly k tokens whatever the data.
    """
    if k == 0:
        return torch.zeros_like(member)
    candidates = values[member]
    # kthvalue is a selection (no sort) and accepts any size, unlike torch.quantile (DESIGN section 3).
    threshold = torch.kthvalue(candidates, candidates.numel() - k + 1 if largest else k).values
    beyond = member & ((values > threshold) if largest else (values < threshold))
    at = member & (values == threshold)
    still_needed = k - beyond.count_nonzero()
    return beyond | (at & (torch.cumsum(at, 0, dtype=torch.int32) <= still_needed))


class _ActionTokens:
    """The batch's action tokens packed into 1-D tensors, in row-major flat order.

    Everything STARE computes is over action tokens only; packing them once saves a pass over the
    padding (often half of a (B, T) batch) in every later operation.
    """

    def __init__(self, surprisal: Tensor, advantages: Tensor, action_mask: Tensor):
        if surprisal.dim() != 2 or action_mask.shape != surprisal.shape:
            raise ValueError(
                "surprisal and action_mask must have shape (B, T); got "
                f"{tuple(surprisal.shape)}, {tuple(action_mask.shape)}"
            )
        self.shape = surprisal.shape
        self.index = action_mask.reshape(-1).nonzero().squeeze(1)  # (n,) flat positions, ascending
        self.row = torch.div(self.index, self.shape[1], rounding_mode="floor")
        self.surprisal = surprisal.reshape(-1)[self.index].float()
        if advantages.dim() == 1 and advantages.shape[0] == self.shape[0]:
            self.advantages = advantages[self.row]
        elif advantages.shape == self.shape:
            self.advantages = advantages.reshape(-1)[self.index]
        else:
            raise ValueError(
                f"advantages must have shape (B,) or (B, T) = {tuple(self.shape)}; got {tuple(advantages.shape)}"
            )

    def select(
        self, top_ratio: float, quadrants: tuple[Quadrant, ...], surprisal_threshold: float | None = None
    ) -> dict[Quadrant, Tensor]:
        """{quadrant: (n,) bool} for the requested quadrants: the top (bottom) ceil(top_ratio * |T+-|) by surprisal,
        or, with `surprisal_threshold`, the tokens of T+- above it (high) and the rest of T+- (low)."""
        members = {"+": self.advantages > 0, "-": self.advantages < 0}
        if surprisal_threshold is not None:
            above = self.surprisal > surprisal_threshold
            return {q: members[q[-1]] & (above if q.startswith("high") else ~above) for q in quadrants}
        if not 0.0 < top_ratio <= 1.0:
            raise ValueError(f"top_ratio must be in (0, 1]; got {top_ratio}")
        signs = sorted({q[-1] for q in quadrants})
        # One host sync for both counts: k must be a Python int for kthvalue.
        counts = torch.stack([members[sign].count_nonzero() for sign in signs]).tolist() if signs else []
        k = {sign: ceil_count(top_ratio, n) for sign, n in zip(signs, counts, strict=True)}
        return {q: _take_k(self.surprisal, members[q[-1]], k[q[-1]], largest=q.startswith("high")) for q in quadrants}

    def unpack(self, packed: Tensor, fill: float | bool) -> Tensor:
        """(n,) -> (B, T), with `fill` outside the action mask."""
        out = torch.full((self.shape.numel(),), fill, dtype=packed.dtype, device=packed.device)
        return out.index_copy_(0, self.index, packed).view(self.shape)


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
    tokens = _ActionTokens(surprisal, advantages, action_mask)
    return {q: tokens.unpack(sel, False) for q, sel in tokens.select(top_ratio, tuple(quadrants)).items()}


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask (NaN where the mask is empty). `where`, not a product: padding may hold NaN."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / mask.sum()


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
    prob_threshold: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """STARE weights omega for one batch (DESIGN section 3).

    surprisal: (B, T) -log pi_old of the sampled token, detached.
    advantages: (B,) per trajectory, or (B, T).
    action_mask: (B, T); 1 = sampled by the policy (0 for prompt, tool output, padding).
    entropy: (B, T) exact entropy of pi_old at each position.
    prob_threshold: None = the quadrants by the batch quantile (top_ratio); tau in (0, 1) = a fixed threshold
    instead (low_prob_reweight): high = sampled with probability below tau, low = the rest of T+ or T-.
    Returns weights (B, T) float32 -- exactly 1.0 outside the action mask and outside the selected
    quadrants -- and metric tensors under "stare/". A token in two selected quadrants (possible only
    with top_ratio > 0.5) gets the product of their multipliers.
    """
    if entropy.shape != surprisal.shape:
        raise ValueError(
            f"entropy must have the shape of surprisal {tuple(surprisal.shape)}; got {tuple(entropy.shape)}"
        )
    if gate not in GATES:
        raise ValueError(f"gate must be one of {', '.join(GATES)}; got {gate!r}")
    multipliers = quadrant_multipliers(op, w, m)
    tokens = _ActionTokens(surprisal, advantages, action_mask)
    threshold = None if prob_threshold is None else -math.log(prob_threshold)
    sets = tokens.select(top_ratio, tuple(multipliers), threshold)
    h = entropy.reshape(-1)[tokens.index].float()  # (n,)
    h_bar = h.mean()  # NaN when nothing is an action token

    # g in {0, 1}: 1 where the policy is below the target entropy and reweighting is on.
    if gate == "batch":
        g = (h_bar < target_entropy).float()
        gate_mean = g
    elif gate == "sample":
        batch = tokens.shape[0]
        per_row = torch.bincount(tokens.row, minlength=batch)
        row_mean = torch.bincount(tokens.row, weights=h.double(), minlength=batch) / per_row
        row_gate = (row_mean < target_entropy).float()
        g = row_gate[tokens.row]
        gate_mean = _masked_mean(row_gate, per_row > 0)
    elif gate == "token":
        g = (h < target_entropy).float()
        gate_mean = g.mean()
    else:
        g = torch.ones((), device=h.device)
        gate_mean = g

    packed = torch.ones_like(h)
    for quadrant, mult in multipliers.items():
        packed = torch.where(sets[quadrant], packed * (1.0 + g * (mult - 1.0)), packed)
    weights = tokens.unpack(packed, 1.0)

    n_action = max(h.numel(), 1)
    metrics = {
        "stare/gate": gate_mean,
        "stare/entropy_mean": h_bar,
        "stare/surprisal_mean": tokens.surprisal.mean(),
        "stare/weight_mean": packed.mean(),
        "stare/w": torch.tensor(float(w)),
        "stare/m": torch.tensor(float(m)),
    }
    for quadrant, selected in sets.items():
        metrics[f"stare/frac_{QUADRANT_METRIC[quadrant]}"] = selected.count_nonzero() / n_action
    return weights, metrics


@dataclass
class StareConfig:
    """STARE settings. The defaults are the paper's for 7B models (DESIGN section 3)."""

    RENAMED_KEYS: ClassVar[dict[str, str]] = {"schedule": "w_mode"}
    """Config keys of earlier versions: a config that still uses one gets an error naming the new key."""
    REPLACED_KEYS: ClassVar[dict[str, str]] = {
        "enabled": "an RL run's entropy_control.method picks the method (stare for STARE, none for GRPO-ds); "
        "the simulator always runs its GRPO arm beside STARE's",
    }
    op: Union[Op, dict[Quadrant, float]] = "O1"
    """A preset (O1-O4 single, C1-C4 combined) or an explicit map from quadrant to multiplier."""
    top_ratio: float = 0.1
    """P: fraction of T+ (and of T-) taken as each high or low set, in (0, 1]."""
    w: float = 1.1
    """W >= 1: multiplier on amplified quadrants (the start value when adaptive, the fallback when critical)."""
    m: float = 0.9
    """M in (0, 1]: multiplier on attenuated quadrants (the start value when w_mode is adaptive)."""
    target_entropy: float = 0.3
    """H_tgt in nats: the gate reweights only while entropy is below it."""
    gate: Gate = "batch"
    """batch: batch mean entropy; sample: per trajectory; token: per position; off: always on (open loop)."""
    w_mode: WMode = "fixed"
    """How W (and M) move. fixed: they stay. adaptive: each step W += alpha*sgn(H_tgt - Hbar), M -= the same,
    clipped to [1, w_max] and [m_min, 1]. critical: W follows the smoothed live critical weight W* (see
    StareController), with the margin w_margin, capped at w_max; M stays."""
    alpha: float = 0.01
    """Adaptive step size for W and M."""
    w_max: float = 1.5
    """Upper bound for W when w_mode is adaptive or critical."""
    m_min: float = 0.5
    """Lower bound for adaptive M."""
    w_margin: float = 0.1
    """Critical mode: W = 1 + (1 + w_margin) * (W*_smoothed - 1), a relative margin over the threshold's excess."""
    w_smoothing: float = 0.5
    """Critical mode: the moving average's weight on the previous estimate, in [0, 1); 0 = this step's W* alone."""

    def __post_init__(self) -> None:
        if isinstance(self.op, Mapping):
            quadrant_multipliers(self.op, 1.0, 1.0)
        elif self.op not in OPS:
            raise ValueError(
                f"op must be one of {', '.join(OPS)} or a map from quadrant to multiplier; got {self.op!r}"
            )
        if self.gate not in GATES:
            raise ValueError(f"gate must be one of {', '.join(GATES)}; got {self.gate!r}")
        if self.w_mode not in W_MODES:
            raise ValueError(f"w_mode must be one of {', '.join(W_MODES)}; got {self.w_mode!r}")
        if not 0.0 < self.top_ratio <= 1.0:
            raise ValueError(f"top_ratio must be in (0, 1]; got {self.top_ratio}")
        if self.w_max < 1.0:
            raise ValueError(f"w_max must be >= 1; got {self.w_max}")
        if not 0.0 < self.m_min <= 1.0:
            raise ValueError(f"m_min must be in (0, 1]; got {self.m_min}")
        adaptive = self.w_mode == "adaptive"
        capped = self.w_mode != "fixed"
        if not 1.0 <= self.w <= (self.w_max if capped else math.inf):
            cap = f" and <= w_max={self.w_max} when w_mode is {self.w_mode}" if capped else ""
            raise ValueError(f"w must be >= 1{cap}; got {self.w}")
        if not (0.0 < self.m <= 1.0 and (not adaptive or self.m >= self.m_min)):
            raise ValueError(f"m must be in (0, 1] (and >= m_min={self.m_min} when adaptive); got {self.m}")
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0; got {self.alpha}")
        if self.target_entropy < 0:
            raise ValueError(f"target_entropy must be >= 0 nats; got {self.target_entropy}")
        if not (math.isfinite(self.w_margin) and self.w_margin >= 0):
            raise ValueError(f"w_margin must be a finite number >= 0; got {self.w_margin}")
        if not 0.0 <= self.w_smoothing < 1.0:
            raise ValueError(f"w_smoothing must be in [0, 1); got {self.w_smoothing}")


class StareController:
    """Per-step STARE state: W, M, the critical-weight estimate and the last gate, saved with checkpoints.

    Call it once per optimizer step with the whole batch (all data-parallel ranks gathered). W and M
    move first (adaptive or critical w_mode), then apply to this batch:

    - adaptive: W and M step by alpha toward more entropy while this batch's mean entropy is below
      H_tgt, and back while above (the paper's schedule).
    - critical: the first-order theory says amplifying the high+ set raises entropy only when
      W > W* = 1 + Lambda/Gamma (theory.batch_diagnostics), and W* is measured on every batch. The
      caller passes this batch's W* (`critical_weight`, NaN where it is undefined: the rising,
      no_w_helps and undefined regimes). Each defined W*, capped at w_max, enters an exponential
      moving average (w_smoothing is the weight on the previous estimate); on such a step
      W = 1 + (1 + w_margin) * (estimate - 1), capped at w_max. On a step whose W* is undefined W is
      the fixed `w`: either entropy rises without help or no W > 1 raises it. M stays at `m`; for
      C2 this is conservative, since attenuating the high- set pushes entropy up too.
    """

    def __init__(self, config: StareConfig, prob_threshold: float | None = None):
        self.config = config
        self.prob_threshold = prob_threshold
        """None: STARE's quadrants by the batch quantile; tau: by a fixed probability threshold (token_weights)."""
        self.w = config.w
        self.m = config.m
        self.w_star = float("nan")  # critical mode: the smoothed W*; NaN until a defined W* is seen
        self.last_gate = float("nan")
        self.step = 0

    def __call__(
        self,
        surprisal: Tensor,
        advantages: Tensor,
        action_mask: Tensor,
        entropy: Tensor,
        critical_weight: float | Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """STARE weights (B, T) and "stare/" metrics; critical mode needs `critical_weight`, this batch's W*."""
        cfg = self.config
        if cfg.w_mode == "adaptive":
            # One host sync per step (not per micro-batch): the schedule is plain Python state.
            h_bar = float(_masked_mean(entropy.float(), action_mask.bool()))
            direction = float(h_bar < cfg.target_entropy) - float(h_bar > cfg.target_entropy)  # sgn; 0 if NaN
            self.w = min(max(self.w + cfg.alpha * direction, 1.0), cfg.w_max)
            self.m = min(max(self.m - cfg.alpha * direction, cfg.m_min), 1.0)
        elif cfg.w_mode == "critical":
            self.w = self._critical_w(critical_weight)
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
            prob_threshold=self.prob_threshold,
        )
        if cfg.w_mode == "critical":
            metrics["stare/w_star_smoothed"] = torch.tensor(self.w_star)
        self.last_gate = float(metrics["stare/gate"])
        self.step += 1
        return weights, metrics

    def _critical_w(self, critical_weight: float | Tensor | None) -> float:
        cfg = self.config
        if critical_weight is None:
            raise ValueError(
                "stare.w_mode=critical needs this batch's critical weight W* (theory.batch_diagnostics' "
                "theory/critical_weight, NaN where undefined) as the controller's critical_weight argument"
            )
        observed = float(critical_weight)
        if math.isnan(observed):
            return cfg.w
        if observed < 1.0:
            raise ValueError(f"critical_weight must be >= 1 where defined (W* = 1 + Lambda/Gamma); got {observed}")
        observed = min(observed, cfg.w_max)  # W never exceeds w_max, so a larger W* says nothing more
        if math.isnan(self.w_star):
            self.w_star = observed
        else:
            self.w_star = cfg.w_smoothing * self.w_star + (1.0 - cfg.w_smoothing) * observed
        return min(1.0 + (1.0 + cfg.w_margin) * (self.w_star - 1.0), cfg.w_max)

    def state_dict(self) -> dict[str, float | int]:
        return {"w": self.w, "m": self.m, "w_star": self.w_star, "last_gate": self.last_gate, "step": self.step}

    def load_state_dict(self, state: Mapping[str, float | int]) -> None:
        """Restore a state_dict(); a state saved before the critical mode existed (no "w_star") loads with none."""
        missing = {"w", "m", "last_gate", "step"} - set(state)
        if missing:
            raise KeyError(f"STARE controller state is missing {', '.join(sorted(missing))}; got keys {sorted(state)}")
        self.w, self.m = float(state["w"]), float(state["m"])
        self.w_star = float(state.get("w_star", float("nan")))
        self.last_gate, self.step = float(state["last_gate"]), int(state["step"])
