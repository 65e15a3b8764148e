"""OpenRLHF 0.11.2's rollout-trainer mismatch correction (`algo.advantage.is_correction_*`) with Clip-Cov and KL-Cov.

Ours, `loss.mismatch_correction`, against OpenRLHF's own PolicyLoss for every combination it accepts; then
`updates.MethodLoss` with the correction on in the rank's PolicyLoss: the method's loss times the coef, token by
token, and OpenRLHF's `vllm_kl` and `is_filter_ratio`. Runs in .venv-openrlhf (skipped where openrlhf is not
installed); no rank, model or DeepSpeed is needed: MethodLoss reads only the rank's update control.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace as NS

import pytest
import torch

from stare_agent.config import RLConfig
from stare_agent.entropy_control import (
    ClipCovConfig,
    EntropyControl,
    EntropyControlConfig,
    KLCovConfig,
    selection_loss_terms,
)
from stare_agent.loss import mismatch_correction, token_losses


@pytest.fixture(scope="module")
def updates():
    pytest.importorskip("openrlhf")
    from stare_agent.backends.openrlhf import updates  # first: it stands in for flash_attn (upstream.py)

    return updates


@pytest.fixture(scope="module")
def policy_loss_cls(updates):
    from openrlhf.models.loss import PolicyLoss

    return PolicyLoss


# Every combination OpenRLHF's PolicyLoss accepts, with a band that keeps some units and filters others.
BANDS = {"ratio": (0.5, 2.0), "binary_kl": (0.0, 0.1), "tv": (0.0, 0.15)}
ACCEPTED = [
    (level, mode, gating)
    for level, mode, gating in itertools.product(("token", "seq"), ("mask", "clip"), ("ratio", "binary_kl", "tv"))
    if mode == "mask" or (level == "token" and gating == "ratio")
]


def mismatched(seed=0, rows=12, width=10):
    """(B, T) trainer and engine log-probs of the same tokens, far enough apart that every band above keeps some
    tokens and rows and filters others; a partial action mask (padding, a tool output) and one row without actions."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for r in range(rows):
        mask[r, 1 : width - r % 4] = True
    mask[:, 5] = False  # a tool output
    mask[rows - 1] = False  # a row without action tokens
    old = -torch.rand(rows, width, generator=g) * 2.5 - 0.05
    shift = torch.randn(rows, 1, generator=g) * 0.6 + torch.randn(rows, width, generator=g) * 0.5
    rollout = (old + shift).clamp(max=-1e-3)
    return old, rollout, mask


def correction_loss(policy_loss_cls, level, mode, gating, dual_clip=None):
    low, high = BANDS[gating]
    return policy_loss_cls(
        0.2, 0.28, dual_clip=dual_clip, is_correction_level=level, is_correction_mode=mode,
        is_correction_gating=gating, is_correction_threshold=[low, high],
    )  # fmt: skip


@pytest.mark.parametrize(("level", "mode", "gating"), ACCEPTED)
def test_the_coef_is_openrlhfs_token_by_token(policy_loss_cls, level, mode, gating):
    """With log pi = log pi_old every ratio is 1 and a token's loss is -A (dual clip or not), so PolicyLoss with
    A = -onehot(t) returns coef_t / N: OpenRLHF's coef of each action token, one call per token."""
    old, rollout, mask = mismatched()
    low, high = BANDS[gating]
    coef, share = mismatch_correction(old, rollout, mask, level=level, mode=mode, gating=gating, low=low, high=high)
    fn = correction_loss(policy_loss_cls, level, mode, gating, dual_clip=3.0)
    n = mask.sum()
    theirs = torch.zeros_like(old)
    for r, t in mask.nonzero().tolist():
        onehot = torch.zeros_like(old)
        onehot[r, t] = -1.0
        loss, _, _, vllm_kl, is_filter_ratio = fn(
            old, old, onehot, action_mask=mask.float(), rollout_log_probs=rollout
        )
        theirs[r, t] = loss * n
    torch.testing.assert_close(theirs[mask], coef[mask], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(share, is_filter_ratio, rtol=1e-6, atol=1e-6)
    assert 0 < float(share) < 1  # the band keeps some units and filters others
    expected_kl = ((rollout - old) * mask).sum() / mask.sum()
    torch.testing.assert_close(vllm_kl, expected_kl, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("level", "mode", "gating"), ACCEPTED)
def test_openrlhfs_corrected_loss_is_the_coef_times_its_uncorrected_loss(policy_loss_cls, level, mode, gating):
    """Random ratios and advantages (both clip sides, the dual clip): PolicyLoss with the correction is the token
    mean of coef x its per-token loss without it (recovered one token at a time from the uncorrected loss)."""
    old, rollout, mask = mismatched(seed=1)
    g = torch.Generator().manual_seed(7)
    new = old + torch.randn(old.shape, generator=g) * 0.4
    adv = torch.randn(old.shape[0], 1, generator=g).expand_as(old).clone()
    low, high = BANDS[gating]
    coef, _ = mismatch_correction(old, rollout, mask, level=level, mode=mode, gating=gating, low=low, high=high)
    plain = policy_loss_cls(0.2, 0.28, dual_clip=3.0)
    per_token = torch.zeros_like(old)
    for r, t in mask.nonzero().tolist():
        only = torch.zeros_like(mask)
        only[r, t] = True
        per_token[r, t] = plain(new, old, adv, action_mask=only.float())[0]
    theirs = correction_loss(policy_loss_cls, level, mode, gating, dual_clip=3.0)(
        new, old, adv, action_mask=mask.float(), rollout_log_probs=rollout
    )[0]
    ours = (coef * per_token)[mask].sum() / mask.sum()
    torch.testing.assert_close(theirs, ours, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("level", "mode", "gating", "low"),
    list(itertools.product(("token", "seq"), ("mask", "clip"), ("ratio", "binary_kl", "tv"), (0.0, 0.5))),
)
def test_we_refuse_exactly_the_settings_openrlhf_refuses(policy_loss_cls, level, mode, gating, low):
    old, rollout, mask = mismatched()
    settings = {"level": level, "mode": mode, "gating": gating}
    try:
        policy_loss_cls(**{f"is_correction_{k}": v for k, v in settings.items()}, is_correction_threshold=[low, 5.0])
    except ValueError:
        with pytest.raises(ValueError, match="algo.advantage.is_correction_"):
            mismatch_correction(old, rollout, mask, **settings, low=low, high=5.0)
    else:
        mismatch_correction(old, rollout, mask, **settings, low=low, high=5.0)


# --- Clip-Cov and KL-Cov: updates.MethodLoss with the correction on in the rank's PolicyLoss ----------------------


def method_loss(updates, policy_loss, method, selected):
    config = RLConfig(
        entropy_control=EntropyControlConfig(method), clip_cov=ClipCovConfig(), kl_cov=KLCovConfig(coef=2.5)
    )
    state = updates.UpdateControl(EntropyControl(config), current=NS(info={}, stare_selected=selected))
    return updates.MethodLoss(NS(update_control=state, trainer=NS()), policy_loss)


@pytest.mark.parametrize("method", ["clip_cov", "kl_cov"])
@pytest.mark.parametrize(("level", "mode", "gating"), [("token", "clip", "ratio"), ("token", "mask", "ratio"),
                                                        ("seq", "mask", "binary_kl")])  # fmt: skip
def test_the_update_methods_loss_is_weighted_by_openrlhfs_coef(updates, policy_loss_cls, method, level, mode, gating):
    """MethodLoss with the correction on = coef x its loss without it, token by token (the gradient of a token's
    log-prob: each token's loss reads only its own log-prob), and in total; vllm_kl and is_filter_ratio are
    OpenRLHF's PolicyLoss's on the same inputs. KL-Cov's penalty is weighted with the rest of the token's loss."""
    old, rollout, mask = mismatched(seed=3)
    g = torch.Generator().manual_seed(11)
    logprobs = old + torch.randn(old.shape, generator=g) * 0.3
    adv = torch.randn(old.shape[0], generator=g)[:, None].expand_as(old) * mask
    selected = (torch.rand(old.shape, generator=g) < 0.3) & mask
    low, high = BANDS[gating]
    coef, _ = mismatch_correction(old, rollout, mask, level=level, mode=mode, gating=gating, low=low, high=high)
    assert ((coef != 1) & selected).any() and ((coef != 1) & ~selected & mask).any()
    n = float(mask.sum()) + 13  # the update's action tokens on every rank

    def run(policy_loss):
        leaf = logprobs.clone().requires_grad_()
        fn = method_loss(updates, policy_loss, method, selected)
        out = fn(leaf, old, adv, action_mask=mask.float(), rollout_log_probs=rollout, dp_size=1, batch_num_tokens=n)
        (grad,) = torch.autograd.grad(out[0], leaf)
        return out, grad

    (plain, *plain_rest), plain_grad = run(policy_loss_cls(0.2, 0.28))
    assert plain_rest[2:] == [None, None]  # correction off: OpenRLHF logs neither
    corrected_fn = correction_loss(policy_loss_cls, level, mode, gating)
    (got, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio), grad = run(corrected_fn)
    torch.testing.assert_close(grad, coef * plain_grad, rtol=1e-6, atol=1e-7)
    terms = selection_loss_terms(method, selected, 2.5)
    per_token, _ = token_losses(logprobs, old, adv, eps_low=0.2, eps_high=0.28, **terms)
    torch.testing.assert_close(got, (coef * per_token)[mask].sum() / n, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, plain)  # the coef matters
    _, _, _, their_kl, their_filter = corrected_fn(logprobs, old, adv, action_mask=mask.float(),
                                                   rollout_log_probs=rollout)  # fmt: skip
    torch.testing.assert_close(vllm_kl, their_kl, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(is_filter_ratio, their_filter, rtol=1e-6, atol=1e-6)
    assert (clip_ratio, ppo_kl) == tuple(plain_rest[:2])  # the ratio statistics do not depend on the correction


def test_the_advantage_methods_keep_openrlhfs_corrected_policy_loss(updates, policy_loss_cls):
    old, rollout, mask = mismatched(seed=4)
    logprobs = old + 0.1
    adv = torch.linspace(-1, 1, old.shape[0])[:, None].expand_as(old) * mask
    original = correction_loss(policy_loss_cls, "seq", "mask", "ratio")
    got = method_loss(updates, original, "stare", None)(
        logprobs, old, adv, action_mask=mask.float(), rollout_log_probs=rollout
    )
    theirs = original(logprobs, old, adv, action_mask=mask.float(), rollout_log_probs=rollout)
    assert all(torch.equal(a, b) for a, b in zip(got, theirs, strict=True))


def test_the_correction_without_the_engines_log_probs_says_what_is_missing(updates, policy_loss_cls):
    old, _, mask = mismatched()
    fn = method_loss(updates, correction_loss(policy_loss_cls, "token", "mask", "ratio"), "kl_cov", mask.clone())
    with pytest.raises(RuntimeError, match="is_correction_level=token needs the engine's log-probs"):
        fn(old.clone(), old, torch.zeros_like(old), action_mask=mask.float())
