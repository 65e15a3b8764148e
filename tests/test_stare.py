"""STARE weights: the vectorized implementation against a plain loop, edge cases, controller, fold identity."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from stare_agent.loss import group_advantages, policy_loss
from stare_agent.stare import (
    GATES,
    OPS,
    PRESETS,
    QUADRANTS,
    StareConfig,
    StareController,
    ceil_count,
    select_quadrants,
    token_weights,
)


def slow_token_weights(surprisal, advantages, mask, entropy, *, op, top_ratio, w, m, target_entropy, gate):
    """The specification, one token at a time with Python lists."""
    b, t = surprisal.shape
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand(b, t)
    s = surprisal.tolist()
    a = adv.tolist()
    msk = mask.tolist()
    h = entropy.tolist()
    mult = {q: (w if kind == "W" else m) for q, kind in PRESETS[op].items()} if isinstance(op, str) else dict(op)

    selected = {}
    for sign in "+-":
        members = [
            (s[i][j], i * t + j)
            for i in range(b)
            for j in range(t)
            if msk[i][j] and ((a[i][j] > 0) if sign == "+" else (a[i][j] < 0))
        ]
        k = math.ceil(round(top_ratio * len(members), 9))
        high = sorted(members, key=lambda x: (-x[0], x[1]))[:k]
        low = sorted(members, key=lambda x: (x[0], x[1]))[:k]
        selected["high" + sign] = {idx for _, idx in high}
        selected["low" + sign] = {idx for _, idx in low}

    action = [(i, j) for i in range(b) for j in range(t) if msk[i][j]]
    h_bar = sum(h[i][j] for i, j in action) / len(action) if action else float("nan")
    out = [[1.0] * t for _ in range(b)]
    for i in range(b):
        row = [h[i][j] for j in range(t) if msk[i][j]]
        for j in range(t):
            if gate == "batch":
                g = h_bar < target_entropy
            elif gate == "sample":
                g = bool(row) and sum(row) / len(row) < target_entropy
            elif gate == "token":
                g = h[i][j] < target_entropy
            else:
                g = True
            for q, mu in mult.items():
                if i * t + j in selected[q] and g:
                    out[i][j] *= mu
    return torch.tensor(out)


def random_batch(seed: int, b: int = 6, t: int = 13, ties: bool = False, adv_per_token: bool = False):
    gen = torch.Generator().manual_seed(seed)
    surprisal = torch.rand(b, t, generator=gen) * 4
    if ties:  # few distinct values, so the flat-index tie-break decides
        surprisal = (surprisal * 2).floor() / 2
    mask = (torch.rand(b, t, generator=gen) < 0.7).float()
    shape = (b, t) if adv_per_token else (b,)
    advantages = torch.randn(shape, generator=gen).round(decimals=1)
    advantages[0] = 0.0  # zero advantages are never selected
    entropy = torch.rand(b, t, generator=gen) * 0.6
    return surprisal, advantages, mask, entropy


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("seed", range(4))
def test_matches_slow_loop(op, gate, seed):
    batch = random_batch(seed, ties=seed % 2 == 1, adv_per_token=seed == 2)
    kw = dict(op=op, top_ratio=0.3, w=1.7, m=0.6, target_entropy=0.3, gate=gate)
    fast, _ = token_weights(*batch, **kw)
    assert fast.dtype == torch.float32
    torch.testing.assert_close(fast, slow_token_weights(*batch, **kw), rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_explicit_map_matches_slow_loop_and_preset(seed):
    batch = random_batch(seed, ties=True)
    op = {"high+": 1.3, "low-": 1.2, "low+": 0.8, "high-": 0.7}
    kw = dict(top_ratio=0.6, w=1.5, m=0.5, target_entropy=0.3, gate="token")  # 0.6: high and low sets overlap
    fast, _ = token_weights(*batch, op=op, **kw)
    torch.testing.assert_close(fast, slow_token_weights(*batch, op=op, **kw), rtol=0, atol=1e-6)
    c2, _ = token_weights(*batch, op="C2", **kw)
    as_map, _ = token_weights(*batch, op={"high+": 1.5, "high-": 0.5}, **kw)
    assert torch.equal(c2, as_map)


def test_ceil_count_is_exact_on_decimal_ratios():
    assert math.ceil(0.07 * 100) == 8 and math.ceil(0.55 * 100) == 56  # the float traps this guards against
    assert ceil_count(0.07, 100) == 7
    assert ceil_count(0.55, 100) == 55
    assert ceil_count(0.1, 30) == 3
    assert ceil_count(0.1, 31) == 4
    assert ceil_count(0.1, 0) == 0
    assert ceil_count(0.3, 10) == 3
    assert ceil_count(1.0, 7) == 7
    assert ceil_count(0.1, 4_194_304) == 419_431


def test_exactly_k_selected_with_ties_by_flat_index():
    surprisal = torch.ones(3, 10)  # all tied
    advantages = torch.tensor([1.0, 1.0, 1.0])
    mask = torch.ones(3, 10)
    sets = select_quadrants(surprisal, advantages, mask, 0.1, QUADRANTS)
    assert int(sets["high+"].sum()) == 3  # ceil(0.1 * 30) = 3, not 4
    assert sets["high+"].flatten().nonzero().flatten().tolist() == [0, 1, 2]
    assert sets["low+"].flatten().nonzero().flatten().tolist() == [0, 1, 2]
    assert not sets["high-"].any() and not sets["low-"].any()


def test_high_and_low_pick_the_extremes():
    surprisal = torch.tensor([[0.1, 5.0, 2.0, 3.0, 0.05, 4.0, 1.0, 0.2, 6.0, 0.3]])
    sets = select_quadrants(surprisal, torch.tensor([2.0]), torch.ones(1, 10), 0.2)
    assert sets["high+"][0].nonzero().flatten().tolist() == [1, 8]  # 5.0 and 6.0
    assert sets["low+"][0].nonzero().flatten().tolist() == [0, 4]


def test_no_positive_advantages_gives_all_ones_for_o1():
    s, _, mask, h = random_batch(0)
    weights, metrics = token_weights(s, -torch.rand(s.shape[0]) - 0.1, mask, h, op="O1", w=2.0)
    assert torch.equal(weights, torch.ones_like(weights))
    assert float(metrics["stare/frac_high_pos"]) == 0.0


def test_everything_masked():
    s, a, _, h = random_batch(1)
    weights, metrics = token_weights(s, a, torch.zeros_like(s), h, op="C2", w=2.0, m=0.5)
    assert torch.equal(weights, torch.ones_like(weights))
    assert math.isnan(float(metrics["stare/entropy_mean"]))


@pytest.mark.parametrize("gate", ["batch", "sample", "token"])
def test_entropy_above_target_gives_all_ones(gate):
    s, a, mask, _ = random_batch(2)
    weights, metrics = token_weights(s, a, mask, torch.full_like(s, 0.5), op="C2", w=3.0, m=0.2, gate=gate)
    assert torch.equal(weights, torch.ones_like(weights))
    assert float(metrics["stare/gate"]) == 0.0


def test_gate_off_reweights_regardless_of_entropy_and_ones_outside_mask():
    s, a, mask, _ = random_batch(3)
    weights, _ = token_weights(s, a, mask, torch.full_like(s, 5.0), op="O1", w=2.0, gate="off")
    assert (weights == 2.0).any()
    assert torch.equal(weights[mask == 0], torch.ones_like(weights[mask == 0]))
    assert set(weights.unique().tolist()) <= {1.0, 2.0}


def test_single_trajectory():
    s = torch.tensor([[3.0, 1.0, 2.0, 0.5]])
    weights, _ = token_weights(s, torch.tensor([1.0]), torch.ones(1, 4), torch.zeros(1, 4), op="O1", w=1.5)
    assert weights.tolist() == [[1.5, 1.0, 1.0, 1.0]]


def test_metrics_are_tensors_and_fractions_are_right():
    s, a, mask, h = random_batch(4, b=8, t=50)
    _, metrics = token_weights(s, a, mask, h, op="C2", top_ratio=0.1, gate="off")
    assert all(isinstance(v, torch.Tensor) for v in metrics.values())
    n_pos = int((mask.bool() & (a[:, None] > 0)).sum())
    assert float(metrics["stare/frac_high_pos"]) == pytest.approx(ceil_count(0.1, n_pos) / float(mask.sum()))
    assert float(metrics["stare/entropy_mean"]) == pytest.approx(float((h * mask).sum() / mask.sum()), rel=1e-6)


def test_bad_arguments_name_the_allowed_values():
    s, a, mask, h = random_batch(0)
    with pytest.raises(ValueError, match="gate must be one of batch, sample, token, off; got 'btach'"):
        token_weights(s, a, mask, h, gate="btach")
    with pytest.raises(ValueError, match="op must be one of O1, O2"):
        token_weights(s, a, mask, h, op="O5")
    with pytest.raises(ValueError, match="op map keys must be among"):
        token_weights(s, a, mask, h, op={"high": 2.0})
    with pytest.raises(ValueError, match="top_ratio"):
        token_weights(s, a, mask, h, top_ratio=0.0)
    with pytest.raises(ValueError, match=r"advantages must have shape \(B,\)"):
        token_weights(s, a[:-1], mask, h)


def test_signature_defaults_are_the_config_defaults():
    params = inspect.signature(token_weights).parameters
    config = StareConfig()
    for name in ("op", "top_ratio", "w", "m", "target_entropy", "gate"):
        assert params[name].default == getattr(config, name), name


def test_adaptive_schedule_moves_and_clips():
    config = StareConfig(w_mode="adaptive", alpha=0.2, w=1.1, m=0.9, w_max=1.5, m_min=0.5, target_entropy=0.3)
    controller = StareController(config)
    s, a, mask, _ = random_batch(6)
    low, high = torch.full_like(s, 0.1), torch.full_like(s, 0.9)
    weights, _ = controller(s, a, mask, low)
    assert (controller.w, controller.m) == pytest.approx((1.3, 0.7))
    # W moves first, from this step's entropy, and the moved W is applied to this same step (docs/stare.md)
    assert float(weights.max()) == pytest.approx(1.3)
    for _ in range(5):
        controller(s, a, mask, low)
    assert (controller.w, controller.m) == pytest.approx((1.5, 0.5))  # clipped at w_max, m_min
    weights, metrics = controller(s, a, mask, low)
    assert float(metrics["stare/w"]) == pytest.approx(1.5) and float(weights.max()) == pytest.approx(1.5)
    for _ in range(10):
        controller(s, a, mask, high)
    assert (controller.w, controller.m) == pytest.approx((1.0, 1.0))  # back down, clipped at 1
    assert controller.step == 17 and controller.last_gate == 0.0


def test_controller_state_round_trip_resumes_identically():
    config = StareConfig(w_mode="adaptive", alpha=0.05)
    batches = [random_batch(seed) for seed in range(6)]
    straight = StareController(config)
    outputs = [straight(*batch)[0] for batch in batches]
    first = StareController(config)
    for batch in batches[:3]:
        first(*batch)
    resumed = StareController(config)
    resumed.load_state_dict(dict(first.state_dict()))
    for batch, expected in zip(batches[3:], outputs[3:], strict=True):
        assert torch.equal(resumed(*batch)[0], expected)
    assert resumed.state_dict() == pytest.approx(straight.state_dict(), nan_ok=True)
    with pytest.raises(KeyError, match="missing"):
        resumed.load_state_dict({"w": 1.0})


def high_pos_weight(controller, batch, critical_weight):
    """The W the controller applies this step: the largest weight (O1 multiplies only the high+ set by W)."""
    weights, metrics = controller(*batch, critical_weight=critical_weight)
    assert float(metrics["stare/gate"]) == 1.0
    return float(weights.max()), metrics


def test_critical_mode_follows_the_smoothed_live_critical_weight():
    config = StareConfig(w_mode="critical", w=1.2, w_max=6.0, w_margin=0.1, w_smoothing=0.5, target_entropy=100.0)
    controller = StareController(config)
    batch = random_batch(7)
    nan = float("nan")
    # (W* of the batch, the W applied): the first defined W* is the estimate; an undefined one leaves the estimate
    # and falls back to the fixed w; later ones enter the moving average; W* beyond w_max counts as w_max.
    expected = [(3.0, 1 + 1.1 * 2.0), (nan, 1.2), (5.0, 1 + 1.1 * 3.0), (50.0, 1 + 1.1 * 4.0), (1.0, 1 + 1.1 * 2.0)]
    estimates = [3.0, 3.0, 4.0, 5.0, 3.0]
    for (w_star, w_applied), estimate in zip(expected, estimates, strict=True):
        applied, metrics = high_pos_weight(controller, batch, torch.tensor(w_star))
        assert applied == pytest.approx(w_applied) and controller.w == pytest.approx(w_applied)
        assert controller.w_star == pytest.approx(estimate)
        assert float(metrics["stare/w_star_smoothed"]) == pytest.approx(estimate)
        assert float(metrics["stare/w"]) == pytest.approx(w_applied)


def test_critical_mode_without_smoothing_tracks_each_batch_and_keeps_m():
    config = StareConfig(
        op="C2", w_mode="critical", m=0.8, w_max=10.0, w_margin=0.0, w_smoothing=0.0, target_entropy=100.0
    )
    controller = StareController(config)
    batch = random_batch(8)
    for w_star, w_applied in ((2.0, 2.0), (7.5, 7.5), (1.5, 1.5), (12.0, 10.0)):  # capped at w_max
        weights, _ = controller(*batch, critical_weight=w_star)
        assert float(weights.max()) == pytest.approx(w_applied) and float(weights.min()) == pytest.approx(0.8)
    assert controller.m == 0.8


def test_critical_mode_needs_the_batch_critical_weight():
    controller = StareController(StareConfig(w_mode="critical", w_max=3.0))
    with pytest.raises(ValueError, match="w_mode=critical needs this batch's critical weight"):
        controller(*random_batch(9))
    with pytest.raises(ValueError, match="critical_weight must be >= 1"):
        controller(*random_batch(9), critical_weight=0.5)
    fixed = StareController(StareConfig(w_mode="fixed", w=1.3, target_entropy=100.0))
    assert high_pos_weight(fixed, random_batch(9), 5.0)[0] == pytest.approx(1.3)  # only critical mode reads it


def test_critical_state_round_trip_resumes_identically():
    config = StareConfig(w_mode="critical", w_max=8.0, target_entropy=100.0)
    batches = [random_batch(seed) for seed in range(6)]
    w_stars = [2.5, float("nan"), 4.0, 3.0, float("nan"), 6.0]
    straight = StareController(config)
    outputs = [straight(*b, critical_weight=c)[0] for b, c in zip(batches, w_stars, strict=True)]
    first = StareController(config)
    for b, c in zip(batches[:3], w_stars[:3], strict=True):
        first(*b, critical_weight=c)
    resumed = StareController(config)
    resumed.load_state_dict(dict(first.state_dict()))
    assert resumed.w_star == pytest.approx(first.w_star) and not math.isnan(resumed.w_star)
    for b, c, expected in zip(batches[3:], w_stars[3:], outputs[3:], strict=True):
        assert torch.equal(resumed(*b, critical_weight=c)[0], expected)
    old = {k: v for k, v in first.state_dict().items() if k != "w_star"}  # saved before the critical mode
    resumed.load_state_dict(old)
    assert math.isnan(resumed.w_star)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(w_mode="critical", w=2.0, w_max=1.5), "w_max"),
        (dict(w_mode="target"), "w_mode must be one of fixed, adaptive, critical"),
        (dict(w_margin=-0.1), "w_margin must be a finite number >= 0"),
        (dict(w_smoothing=1.0), r"w_smoothing must be in \[0, 1\)"),
        (dict(gate="btach"), "gate must be one of batch, sample, token, off"),
        (dict(op="X"), "op must be one of O1"),
        (dict(w=0.9), "w must be >= 1"),
        (dict(m=1.2), "m must be in"),
        (dict(w_mode="adaptive", w=2.0, w_max=1.5), "w_max"),
        (dict(top_ratio=1.5), "top_ratio"),
    ],
)
def test_config_validation(change, message):
    with pytest.raises(ValueError, match=message):
        StareConfig(**change)


# --- the fold identity: weighting the per-token loss == scaling the advantages ------------------


@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("seed", range(3))
def test_fold_identity_loss_and_gradient(dual_clip, seed):
    gen = torch.Generator().manual_seed(seed)
    b, t = 5, 11
    old = -torch.rand(b, t, generator=gen) * 3
    # ratios far from 1 so that clip-low, clip-high and the dual clip all bind somewhere
    logprobs = (old + torch.randn(b, t, generator=gen) * 0.8).requires_grad_()
    advantages = torch.randn(b, generator=gen)
    mask = (torch.rand(b, t, generator=gen) < 0.8).float()
    entropy = torch.rand(b, t, generator=gen) * 0.2
    weights, _ = token_weights(-old, advantages, mask, entropy, op="C2", top_ratio=0.3, w=1.6, m=0.4, gate="off")
    assert (weights != 1).any()
    kw = dict(eps_low=0.2, eps_high=0.28, dual_clip=dual_clip)

    weighted, _ = policy_loss(logprobs, old, advantages, mask, weights=weights, **kw)
    (grad_weighted,) = torch.autograd.grad(weighted, logprobs)
    folded, _ = policy_loss(logprobs, old, advantages[:, None] * weights, mask, **kw)
    (grad_folded,) = torch.autograd.grad(folded, logprobs)
    torch.testing.assert_close(weighted, folded, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_weighted, grad_folded, rtol=1e-6, atol=1e-8)

    ratio = (logprobs - old).exp().detach()
    assert ((ratio > 1.28) & (advantages[:, None] > 0)).any() and ((ratio < 0.8) & (advantages[:, None] < 0)).any()


def test_policy_loss_against_loop():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 4, generator=gen)
    new = old + torch.randn(3, 4, generator=gen) * 0.5
    adv = torch.tensor([1.0, -2.0, 0.5])
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 0]]).float()
    loss, _ = policy_loss(new, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    total, n = 0.0, 0
    for i in range(3):
        for j in range(4):
            if mask[i, j]:
                r = math.exp(float(new[i, j] - old[i, j]))
                a = float(adv[i])
                term = max(-a * r, -a * min(max(r, 0.8), 1.28))
                if a < 0:
                    term = min(term, -3.0 * a)
                total, n = total + term, n + 1
    assert float(loss) == pytest.approx(total / n, rel=1e-6)


def test_group_advantages_against_loop():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    adv = group_advantages(rewards, 4)
    for g in range(3):
        group = rewards[4 * g : 4 * g + 4].tolist()
        mean = sum(group) / 4
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / 3)
        for j in range(4):
            assert float(adv[4 * g + j]) == pytest.approx((group[j] - mean) / (std + 1e-6), abs=1e-5)
    assert torch.equal(adv[4:8], torch.zeros(4))
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(rewards, 5)


def test_nan_outside_the_mask_does_not_leak():
    s, a, mask, h = random_batch(7)
    clean, clean_metrics = token_weights(s, a, mask, h, op="C2", gate="sample")
    s_dirty, h_dirty = s.clone(), h.clone()
    s_dirty[mask == 0] = float("nan")
    h_dirty[mask == 0] = float("nan")
    dirty, dirty_metrics = token_weights(s_dirty, a, mask, h_dirty, op="C2", gate="sample")
    assert torch.equal(clean, dirty)
    for key, value in clean_metrics.items():
        assert torch.equal(value, dirty_metrics[key]), key
