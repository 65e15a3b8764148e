"""What a masked position holds never reaches the loss or its gradient (stare_agent/loss.py).

Masked positions are prompt, tool-output and padding tokens: the model's log-probs there are never trained, and a
padded row can hold anything (an overflowing log-ratio, a NaN from a row of -inf logits). Each test fills them with
inf, -inf and NaN and compares the loss and its gradient with the same batch holding ordinary values there.
The rollout-trainer mismatch correction (mismatch_correction, correction_stats) is checked here against a loop
written from its definition; tests/test_openrlhf_correction.py holds it to OpenRLHF's PolicyLoss.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from stare_agent.loss import correction_stats, entropy_bonus_loss, mismatch_correction, on_actions, policy_loss

HOSTILE = (float("inf"), float("-inf"), float("nan"))


def batch(seed=0, rows=4, width=10):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for r in range(rows):
        mask[r, 2 : width - r] = True
    mask[:, 5] = False  # a tool output inside the episode
    old = -torch.rand(rows, width, generator=g) * 3
    new = old + torch.randn(rows, width, generator=g) * 0.4
    adv = torch.randn(rows, generator=g)[:, None].expand(rows, width).clone()
    weights = torch.rand(rows, width, generator=g) * 2
    penalty = torch.rand(rows, width, generator=g)
    return new, old, adv, weights, penalty, mask


def poisoned(tensor, mask, seed):
    """tensor with its masked positions set to inf, -inf and NaN in turn."""
    out = tensor.clone()
    where = (~mask).nonzero()
    for i, (r, c) in enumerate(where.tolist()):
        out[r, c] = HOSTILE[(i + seed) % 3]
    return out


METHODS = {
    "clipped": {},
    "dual_clip": {"dual_clip": 3.0},
    "weighted": {"weights": True},
    "kl_cov": {"clip": False, "penalty": True},
}


@pytest.mark.parametrize("method", METHODS)
def test_policy_loss_and_gradient_ignore_whatever_masked_positions_hold(method):
    new, old, adv, weights, penalty, mask = batch()
    kw = dict(METHODS[method])
    if kw.pop("weights", False):
        kw["weights"] = weights
    if kw.pop("penalty", False):
        kw["penalty"] = penalty

    def run(new, old, adv, extra):
        leaf = new.clone().requires_grad_()
        loss, metrics = policy_loss(leaf, old, adv, mask, eps_low=0.2, eps_high=0.28, **extra)
        loss.backward()
        return loss, leaf.grad, metrics

    clean_loss, clean_grad, clean_metrics = run(new, old, adv, kw)
    dirty = {k: poisoned(v, mask, 2) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    loss, grad, metrics = run(poisoned(new, mask, 0), poisoned(old, mask, 1), poisoned(adv, mask, 2), dirty)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, clean_loss)
    torch.testing.assert_close(grad, clean_grad)
    assert (grad[~mask] == 0).all() and (grad[mask] != 0).any()
    torch.testing.assert_close(metrics["policy/clip_frac"], clean_metrics["policy/clip_frac"])


def test_a_batch_without_action_tokens_has_a_zero_loss_and_gradient():
    new, old, adv, *_ = batch()
    empty = torch.zeros_like(new, dtype=torch.bool)
    for n in (None, torch.tensor(0.0), 0):
        leaf = poisoned(new, empty, 0).requires_grad_()
        loss, _ = policy_loss(leaf, poisoned(old, empty, 1), adv, empty, eps_low=0.2, eps_high=0.28, num_tokens=n)
        loss.backward()
        assert loss.item() == 0.0 and (leaf.grad == 0).all()
        entropy = poisoned(torch.rand_like(new), empty, 2).requires_grad_()
        bonus = entropy_bonus_loss(entropy, empty, 0.3, empty.sum() if n is None else n)
        bonus.backward()
        assert bonus.item() == 0.0 and (entropy.grad == 0).all()


def test_the_entropy_bonus_ignores_whatever_masked_positions_hold():
    *_, mask = batch()
    clean = torch.rand(mask.shape, generator=torch.Generator().manual_seed(3))
    got = []
    for values in (clean, poisoned(clean, mask, 0)):
        leaf = values.clone().requires_grad_()
        loss = entropy_bonus_loss(leaf, mask, 0.3, mask.sum())
        loss.backward()
        got.append((loss, leaf.grad))
    torch.testing.assert_close(got[1][0], got[0][0])
    torch.testing.assert_close(got[1][1], got[0][1])
    assert float(got[0][0]) == pytest.approx(-0.3 * float(clean[mask].sum() / mask.sum()))


def test_on_actions_keeps_action_values_and_per_sample_values():
    new, _, adv, _, _, mask = batch()
    out = on_actions(mask, poisoned(new, mask, 0))
    assert torch.equal(out[mask], new[mask]) and (out[~mask] == 0).all()
    per_sample = adv[:, 0]
    assert on_actions(mask, per_sample) is per_sample


# --- the rollout-trainer mismatch correction ----------------------------------------------------------------------

CORRECTIONS = [
    (level, mode, gating, (0.5, 2.0) if gating == "ratio" else (0.0, 0.12))
    for level, mode, gating in itertools.product(("token", "seq"), ("mask", "clip"), ("ratio", "binary_kl", "tv"))
    if mode == "mask" or (level == "token" and gating == "ratio")
]


def looped_correction(old, rollout, mask, level, mode, gating, low, high):
    """mismatch_correction one token at a time, from its definition (float64 Python)."""
    coef = torch.zeros(old.shape, dtype=torch.float64)
    out, rows_out = 0, 0
    for r in range(old.shape[0]):
        tokens = [t for t in range(old.shape[1]) if mask[r, t]]
        stats = {}
        for t in tokens:
            lo, lr = float(old[r, t]), float(rollout[r, t])
            p, q = min(max(math.exp(lr), 1e-6), 1 - 1e-6), min(max(math.exp(lo), 1e-6), 1 - 1e-6)
            stats[t] = {
                "ratio": lo - lr,  # log w; exponentiated below
                "binary_kl": p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q)),
                "tv": abs(p - q),
            }[gating]
        if level == "seq":
            row = sum(stats.values()) / len(tokens) if tokens else float("nan")
            stats = dict.fromkeys(tokens, row)
            rows_out += not (low <= (math.exp(row) if gating == "ratio" else row) <= high)
        for t in tokens:
            s = math.exp(stats[t]) if gating == "ratio" else stats[t]
            kept = low <= s <= high
            out += not kept
            coef[r, t] = min(max(s, low), high) if mode == "clip" else (math.exp(old[r, t] - rollout[r, t]) * kept)
    share = rows_out / old.shape[0] if level == "seq" else out / int(mask.sum())
    return coef, share


def mismatched(seed=0):
    new, old, _, _, _, mask = batch(seed, rows=8, width=12)
    mask[7] = False  # a row without action tokens
    rollout = (new - 0.3 * torch.randn(8, 1, generator=torch.Generator().manual_seed(seed))).clamp(max=-1e-3)
    return old, rollout, mask


@pytest.mark.parametrize(("level", "mode", "gating", "band"), CORRECTIONS)
def test_the_correction_is_its_definition_whatever_masked_positions_hold(level, mode, gating, band):
    old, rollout, mask = mismatched()
    settings = {"level": level, "mode": mode, "gating": gating, "low": band[0], "high": band[1]}
    coef, share = mismatch_correction(old, rollout, mask, **settings)
    expected, expected_share = looped_correction(old, rollout, mask, **settings)
    torch.testing.assert_close(coef[mask].double(), expected[mask], rtol=1e-5, atol=1e-6)
    assert float(share) == pytest.approx(expected_share) and 0 < expected_share < 1
    dirty = mismatch_correction(poisoned(old, mask, 0), poisoned(rollout, mask, 1), mask, **settings)
    assert torch.equal(dirty[0], coef) and torch.equal(dirty[1], share)
    assert not coef.requires_grad


def test_a_band_that_holds_every_weight_changes_nothing_and_an_empty_batch_filters_nothing():
    old, rollout, mask = mismatched()
    for level in ("token", "seq"):
        coef, _ = mismatch_correction(old, rollout, mask, level=level, mode="mask", gating="ratio", low=0, high=1e9)
        torch.testing.assert_close(coef[mask], (old - rollout)[mask].exp())
    empty = torch.zeros_like(mask)
    coef, share = mismatch_correction(old, rollout, empty, level="token", mode="clip", gating="ratio", low=0.5, high=2)
    assert float(share) == 0.0 and torch.isfinite(coef).all()
    stats = correction_stats(old, rollout, empty, level="token", mode="mask", gating="ratio", low=0.5, high=2.0)
    assert {k: float(v) for k, v in stats.items()} == {
        "mismatch/is_weight_mean": 1.0, "mismatch/is_weight_min": 1.0, "mismatch/is_weight_max": 1.0,
        "mismatch/corrected_share": 0.0,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"level": "off"}, "is_correction_level must be token or seq"),
        ({"mode": "truncate"}, "is_correction_mode must be one of mask, clip; got 'truncate'"),
        ({"gating": "kl"}, "is_correction_gating must be one of ratio, binary_kl, tv"),
        ({"level": "seq", "mode": "clip"}, "is_correction_mode=clip needs"),
        ({"gating": "tv", "mode": "clip", "low": 0.0}, "is_correction_mode=clip needs"),
        ({"gating": "binary_kl"}, "is_correction_gating=binary_kl takes an upper bound only"),
    ],
)
def test_the_settings_openrlhf_refuses_are_refused_by_name(settings, message):
    old, rollout, mask = mismatched()
    kw = {"level": "token", "mode": "mask", "gating": "ratio", "low": 0.5, "high": 5.0, **settings}
    with pytest.raises(ValueError, match=message):
        mismatch_correction(old, rollout, mask, **kw)


@pytest.mark.parametrize(("level", "mode", "gating", "band"), CORRECTIONS)
def test_the_correction_stats_are_the_weights_and_the_tokens_the_gate_changed(level, mode, gating, band):
    old, rollout, mask = mismatched()
    settings = {"level": level, "mode": mode, "gating": gating, "low": band[0], "high": band[1]}
    stats = correction_stats(poisoned(old, mask, 0), poisoned(rollout, mask, 1), mask, **settings)
    weights = (old - rollout)[mask].exp()
    assert float(stats["mismatch/is_weight_mean"]) == pytest.approx(float(weights.mean()))
    assert float(stats["mismatch/is_weight_min"]) == pytest.approx(float(weights.min()))
    assert float(stats["mismatch/is_weight_max"]) == pytest.approx(float(weights.max()))
    coef, _ = looped_correction(old, rollout, mask, **settings)
    changed = ~torch.isclose(coef[mask], weights.double())
    assert float(stats["mismatch/corrected_share"]) == pytest.approx(float(changed.double().mean()))
    assert 0 < float(stats["mismatch/corrected_share"]) < 1
