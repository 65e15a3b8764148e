"""What a masked position holds never reaches the loss or its gradient (stare_agent/loss.py).

Masked positions are prompt, tool-output and padding tokens: the model's log-probs there are never trained, and a
padded row can hold anything (an overflowing log-ratio, a NaN from a row of -inf logits). Each test fills them with
inf, -inf and NaN and compares the loss and its gradient with the same batch holding ordinary values there.
"""

from __future__ import annotations

import pytest
import torch

from stare_agent.loss import entropy_bonus_loss, on_actions, policy_loss

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
