"""The entropy-control methods STARE is compared against, one switch for all of them (docs/entropy_control.md).

Pure torch. `entropy_control.method` picks one method per run; each method's settings are their own config
section (STARE's stay in `stare`). Every selection is over the action tokens of a whole batch (never one
micro-batch), and prompt, tool-output and padding positions are outside every selection and every mean.

Two kinds of method:
- a per-token scale on the advantages, computed once per rollout batch from the sampling policy (`stare`,
  `low_prob_reweight`, `forking_tokens`): `step.control_step` computes it, the backends multiply it in;
- a change to the loss that needs the current policy (`clip_cov`, `kl_cov`: a selection at each update from
  the current log-probs, `update_selection`; `entropy_bonus`: an entropy term whose coefficient moves once
  per rollout batch, `EntropyBonus`).
`none` is GRPO-ds: every weight 1, the same metrics.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import torch
from torch import Tensor

from stare_agent.stare import StareController, _take_k, ceil_count

Method = Literal["none", "stare", "clip_cov", "kl_cov", "forking_tokens", "low_prob_reweight", "entropy_bonus"]
METHODS: tuple[Method, ...] = get_args(Method)

ADVANTAGE_METHODS: frozenset[str] = frozenset({"stare", "low_prob_reweight", "forking_tokens"})
"""Methods that scale each token's advantage once per rollout batch (from the sampling policy)."""
UPDATE_METHODS: frozenset[str] = frozenset({"clip_cov", "kl_cov"})
"""Methods that select tokens at every update from the current policy."""
SELECTING_METHODS: frozenset[str] = ADVANTAGE_METHODS | UPDATE_METHODS
"""Methods that act on chosen tokens (the ones selected_tokens.jsonl reports on)."""


@dataclass
class EntropyControlConfig:
    """Which entropy-control method a run uses; its settings are in the section of the same name."""

    REPLACED_KEYS: ClassVar[dict[str, str]] = {}

    method: Method = "stare"
    """none: GRPO-ds (every weight 1). stare: the `stare` section. clip_cov, kl_cov, forking_tokens,
    low_prob_reweight, entropy_bonus: the methods of docs/entropy_control.md, each set in its own section."""
    report_every: int = 10
    """Every this many steps, the token strings the method acted on most often since the last report are appended
    to `selected_tokens.jsonl` in the run folder (0 = never)."""
    report_top: int = 50
    """How many token strings a report lists."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.report_every < 0 or self.report_top < 1:
            raise ValueError("report_every must be >= 0 and report_top >= 1")


@dataclass
class ClipCovConfig:
    """Clip-Cov (Cui et al. 2025): at each update, the loss of a random share of the tokens whose centred
    covariance term lies in (lb, ub), and that the clipped surrogate did not clip already, is zeroed."""

    ratio: float = 2e-4
    """Tokens zeroed: max(int(ratio * N), 1) of the update's N action tokens (the reference's 2e-4 is for batches
    of millions of tokens; scale it for small batches)."""
    lb: float = 1.0
    """Lower bound (exclusive) of the covariance term (A - mean A)(log pi - mean log pi) of a candidate."""
    ub: float = 5.0
    """Upper bound (exclusive) of that term."""

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"clip_cov.ratio must be in (0, 1]; got {self.ratio}")
        if not self.lb < self.ub:
            raise ValueError(f"clip_cov.lb must be < clip_cov.ub; got lb={self.lb}, ub={self.ub}")


@dataclass
class KLCovConfig:
    """KL-Cov (Cui et al. 2025): no ratio clipping; at each update the top-k tokens by the centred covariance term
    get coef * |log pi - log pi_old| added to their loss."""

    ratio: float = 2e-4
    """Tokens penalised: max(int(ratio * N), 1) of the update's N action tokens (the reference's default; scale it
    for small batches)."""
    coef: float = 1.0
    """The penalty's coefficient."""

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"kl_cov.ratio must be in (0, 1]; got {self.ratio}")
        if not (math.isfinite(self.coef) and self.coef >= 0):
            raise ValueError(f"kl_cov.coef must be a finite number >= 0; got {self.coef}")


@dataclass
class ForkingTokensConfig:
    """Forking tokens (Wang et al. 2025, "Beyond the 80/20 Rule"): the policy gradient only from the top `top_ratio`
    share of the action tokens by the sampling policy's entropy, over the whole rollout batch."""

    top_ratio: float = 0.2
    """rho: the share of action tokens kept, ceil(rho * N)."""
    normalize: Literal["selected", "all"] = "selected"
    """What the token mean divides by. selected: the kept tokens (the public code: it masks the loss); all: every
    action token (the paper's formula)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.top_ratio <= 1.0:
            raise ValueError(f"forking_tokens.top_ratio must be in (0, 1]; got {self.top_ratio}")
        if self.normalize not in ("selected", "all"):
            raise ValueError(f"forking_tokens.normalize must be 'selected' or 'all'; got {self.normalize!r}")


@dataclass
class LowProbReweightConfig:
    """STARE with a fixed probability threshold instead of the batch quantile: the high sets are the action tokens
    sampled with probability below `threshold` (the low sets the rest); op, W, M, the gate and its target are the
    `stare` section's. With stare.op O1 this is the STARE paper's fixed-threshold baseline."""

    threshold: float = 0.1
    """tau: a token is 'high surprisal' when its sampling probability is below tau (surprisal above -ln tau)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"low_prob_reweight.threshold must be in (0, 1); got {self.threshold}")


@dataclass
class EntropyBonusConfig:
    """Adaptive entropy bonus (Skywork-OR1, He et al. 2025): loss -= alpha * the current policy's mean entropy over
    the action tokens. Each rollout batch the coefficient c moves by `delta` toward the target (up while the
    batch's measured entropy is below `target_entropy`, down otherwise), within [0, max_coef], and
    alpha = c while the measured entropy is below the target, 0 otherwise. The defaults are the public code's
    released training scripts."""

    target_entropy: float = 0.2
    """Target entropy of the action tokens, in nats."""
    delta: float = 1e-4
    """Step of the coefficient per rollout batch."""
    initial_coef: float = 0.0
    """The coefficient before the first step."""
    max_coef: float = 0.005
    """Upper bound of the coefficient."""
    measure: Literal["surprisal", "entropy"] = "surprisal"
    """What is compared with the target. surprisal: the mean -log pi_old of the sampled action tokens (the public
    code's estimate); entropy: the sampling policy's exact mean entropy over the action tokens."""

    def __post_init__(self) -> None:
        if self.target_entropy < 0 or self.delta < 0 or self.max_coef < 0:
            raise ValueError("entropy_bonus.target_entropy, delta and max_coef must be >= 0")
        if not 0.0 <= self.initial_coef <= self.max_coef:
            raise ValueError(
                f"entropy_bonus.initial_coef must be in [0, max_coef={self.max_coef}]; got {self.initial_coef}"
            )
        if self.measure not in ("surprisal", "entropy"):
            raise ValueError(f"entropy_bonus.measure must be 'surprisal' or 'entropy'; got {self.measure!r}")


# --- selections, pure functions ---------------------------------------------------------------------------------


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / mask.sum().clamp_min(1)


def covariance_term(advantages: Tensor, logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """(A - mean A)(log pi - mean log pi) per token, the means over the action tokens; 0 outside the mask.

    advantages: (B, T) (or (B,)); logprobs: (B, T) of the current policy (detached here). Cui et al.'s per-token
    contribution to the covariance that drives the entropy change.
    """
    mask = action_mask.bool()
    adv = advantages[:, None].expand(mask.shape) if advantages.dim() == 1 else advantages
    adv, logp = adv.detach().float(), logprobs.detach().float()
    centred = (adv - _masked_mean(adv, mask)) * (logp - _masked_mean(logp, mask))
    return torch.where(mask, centred, torch.zeros((), dtype=centred.dtype))


def reference_count(ratio: float, n: int) -> int:
    """max(int(ratio * n), 1): how many tokens Clip-Cov and KL-Cov take from n (the reference's rounding)."""
    return max(int(ratio * n), 1)


def clip_cov_select(
    advantages: Tensor,
    logprobs: Tensor,
    old_logprobs: Tensor,
    action_mask: Tensor,
    *,
    ratio: float,
    lb: float,
    ub: float,
    eps_low: float,
    eps_high: float,
    generator: torch.Generator | None = None,
) -> Tensor:
    """(B, T) bool: the tokens whose loss Clip-Cov zeroes at this update.

    Candidates: action tokens with lb < covariance_term < ub that the clipped surrogate (eps_low, eps_high) did
    not clip; of them a uniformly random max(int(ratio * N), 1) (all when fewer), N the action tokens.
    """
    mask = action_mask.bool()
    adv = advantages[:, None].expand(mask.shape) if advantages.dim() == 1 else advantages
    cov = covariance_term(adv, logprobs, mask)
    ratio_pi = torch.exp(logprobs.detach().float() - old_logprobs.float())
    clipped = (-adv * ratio_pi.clamp(1.0 - eps_low, 1.0 + eps_high)) > (-adv * ratio_pi)
    candidates = (mask & ~clipped & (cov > lb) & (cov < ub)).reshape(-1).nonzero().squeeze(1)
    k = min(reference_count(ratio, int(mask.sum())), candidates.numel())
    order = torch.randperm(candidates.numel(), generator=generator, device="cpu").to(candidates.device)
    chosen = candidates[order[:k]]
    out = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    out[chosen] = True
    return out.view(mask.shape)


def kl_cov_select(advantages: Tensor, logprobs: Tensor, action_mask: Tensor, *, ratio: float) -> Tensor:
    """(B, T) bool: the max(int(ratio * N), 1) action tokens with the largest covariance_term (KL-Cov's top-k;
    ties at the threshold go to the lowest position)."""
    mask = action_mask.bool()
    n = int(mask.sum())
    if n == 0:
        return torch.zeros_like(mask)
    cov = covariance_term(advantages, logprobs, mask).reshape(-1)
    return _take_k(cov, mask.reshape(-1), reference_count(ratio, n), largest=True).view(mask.shape)


def forking_weights(entropy: Tensor, action_mask: Tensor, *, top_ratio: float, normalize: str) -> Tensor:
    """(B, T) float32 advantage weights of forking-token training: the ceil(top_ratio * N) action tokens of highest
    entropy get 1 (normalize 'all') or N / k (normalize 'selected': the token mean over the kept tokens), every
    other position 0. entropy: (B, T) of the sampling policy."""
    mask = action_mask.bool()
    n = int(mask.sum())
    k = ceil_count(top_ratio, n)
    if n == 0:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    kept = _take_k(entropy.float().reshape(-1), mask.reshape(-1), k, largest=True).view(mask.shape)
    scale = n / k if normalize == "selected" else 1.0
    return kept.float() * scale


def selection_loss_terms(method: str, selected: Tensor | None, kl_coef: float) -> dict[str, Any]:
    """The keyword arguments of loss.token_losses / policy_loss that apply one update's selection: Clip-Cov's weight
    0 on its tokens, KL-Cov's unclipped surrogate and penalty coef on its tokens; {} for every other method."""
    if method == "clip_cov":
        return {"weights": (~selected).float()}
    if method == "kl_cov":
        return {"clip": False, "penalty": kl_coef * selected.float()}
    return {}


class EntropyBonus:
    """The adaptive entropy bonus's coefficient, moved once per rollout batch and saved with checkpoints."""

    def __init__(self, config: EntropyBonusConfig):
        self.config = config
        self.coef = config.initial_coef
        self.alpha = 0.0
        """The coefficient applied this step: coef while the entropy is below the target, else 0."""

    def step(self, measured: float) -> float:
        """Move the coefficient from this batch's measured entropy (up by delta while below the target, down
        otherwise, within [0, max_coef]); returns alpha, the coefficient applied to this batch (0 unless below)."""
        cfg = self.config
        below = measured < cfg.target_entropy  # False for NaN (no action token): down, and no bonus
        self.coef = min(max(self.coef + (cfg.delta if below else -cfg.delta), 0.0), cfg.max_coef)
        self.alpha = self.coef if below else 0.0
        return self.alpha

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef, "alpha": self.alpha}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.coef, self.alpha = float(state["coef"]), float(state.get("alpha", 0.0))


def clip_cov_generator(seed: int, step: int, update: int) -> torch.Generator:
    """The CPU generator of Clip-Cov's random draw at one update of one step: a function of (seed, step, update),
    so a resumed run draws what an uninterrupted one would."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + update)


SELECTED_TOKENS = "selected_tokens.jsonl"
"""The run folder's file of SelectedTokens reports, one JSON line each."""


def keep_reports_until(path: Path, step: int | None) -> None:
    """At the start of a run: a fresh run (step None) starts a new report file; a resumed one keeps the reports of
    the steps up to its checkpoint (the later ones are made again)."""
    if not path.exists():
        return
    if step is None:
        path.unlink()
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(f"{line}\n" for line in kept))


class SelectedTokens:
    """Counts of the token ids a method acted on, between two reports (the STARE paper's list of the most often
    reweighted tokens)."""

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()
        self.tokens = 0
        """Action tokens seen since the last report."""

    def add(self, ids: Tensor, acted: Tensor, mask: Tensor) -> None:
        """ids, acted, mask: (B, T) aligned: the token at each position, whether the method acted on it, and whether
        it is an action token."""
        self.counts.update(ids[acted & mask].tolist())
        self.tokens += int(mask.sum())

    def report(self, step: int, method: str, tokenizer: Any, top: int) -> dict[str, Any]:
        """The report of the counts since the last one (then reset): the `top` most frequent token strings."""
        listed = [[tokenizer.convert_ids_to_tokens(i), i, n] for i, n in self.counts.most_common(top)]
        out = {"step": step, "method": method, "selected": sum(self.counts.values()), "action_tokens": self.tokens,
               "tokens": listed}  # fmt: skip
        self.counts, self.tokens = Counter(), 0
        return out


class EntropyControl:
    """One run's entropy-control state: the method, STARE's controller (W, M, the gate; used by stare and
    low_prob_reweight), the entropy bonus's coefficient, the step count, and the counts of the tokens it acted on
    since the last report. Saved with checkpoints (the counts are not).

    config: the run's RLConfig; the methods read its entropy_control section, their own sections (stare,
    clip_cov, kl_cov, forking_tokens, low_prob_reweight, entropy_bonus), the clip range (loss.eps_low,
    loss.eps_high: Clip-Cov leaves the tokens the surrogate clipped) and run.seed (Clip-Cov's draw).
    """

    def __init__(self, config: Any):
        self.config = config
        self.method = config.entropy_control.method
        threshold = config.low_prob_reweight.threshold if self.method == "low_prob_reweight" else None
        self.stare = StareController(config.stare, prob_threshold=threshold)
        self.bonus = EntropyBonus(config.entropy_bonus)
        self.step = 0
        """Rollout batches seen (control_step calls)."""
        self.selected = SelectedTokens()

    @property
    def reweights(self) -> bool:
        """Whether the method scales the advantages (the backends skip the multiply when it does not)."""
        return self.method in ADVANTAGE_METHODS

    def state_dict(self) -> dict[str, Any]:
        return {"method": self.method, "stare": self.stare.state_dict(), "bonus": self.bonus.state_dict(),
                "step": self.step}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state_dict(); a bare STARE controller state (checkpoints before this switch) loads as `stare`."""
        if "stare" not in state:
            self.stare.load_state_dict(state)
            self.step = self.stare.step
            return
        if state["method"] != self.method:
            raise ValueError(
                f"the checkpoint was trained with entropy_control.method={state['method']!r}, this run sets "
                f"{self.method!r}; resume with the same method"
            )
        self.stare.load_state_dict(state["stare"])
        self.bonus.load_state_dict(state["bonus"])
        self.step = int(state["step"])
