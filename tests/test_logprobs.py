"""The chunked log-prob passes against a plain float64 log_softmax: theory.sampling_stats (reference pass:
log-probs, entropy and S2 of softmax(logits / T) in one pass) and theory.token_logprobs (the update: the same
log-probs, differentiable, with a chunked backward)."""

from __future__ import annotations

import pytest
import torch

from stare_agent import theory
from stare_agent.theory import token_logprobs

F64 = torch.float64


def _naive(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """log-prob of each target, H and S2 of softmax(logits / T), from one full float64 log_softmax."""
    logp = torch.log_softmax(logits.to(F64) / temperature, dim=-1)
    p = logp.exp()
    h = -(p * logp).sum(-1)
    s2 = (p * p * (logp + h[..., None])).sum(-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), h, s2


def _batch(seed: int, shape=(3, 7), vocab=50, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(*shape, vocab, generator=g)).to(dtype)
    targets = torch.randint(0, vocab, shape, generator=g)
    return logits, targets


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("chunk_size", [1, 4, None, 1000])
def test_sampling_stats_match_naive_float64(temperature, chunk_size):
    logits, targets = _batch(int(temperature * 10))
    logprobs, h, s2 = theory.sampling_stats(logits, targets, temperature=temperature, chunk_size=chunk_size)
    ref = _naive(logits, targets, temperature)
    assert logprobs.shape == h.shape == s2.shape == targets.shape and logprobs.dtype == torch.float32
    for got, want in zip((logprobs, h, s2), ref, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)


def test_sampling_stats_at_temperature_is_not_the_raw_distribution():
    logits, targets = _batch(0)
    scaled = theory.sampling_stats(logits, targets, temperature=0.6)
    raw = theory.sampling_stats(logits, targets)
    assert all((a - b).abs().max() > 1e-2 for a, b in zip(scaled, raw, strict=True))
    # the entropy and S2 of softmax(z / T) are those entropy_and_s2 gives for z / T
    h, s2 = theory.entropy_and_s2(logits / 0.6)
    torch.testing.assert_close(scaled[1], h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scaled[2], s2, rtol=1e-5, atol=1e-6)


def test_sampling_stats_checks_its_arguments():
    logits, targets = _batch(1)
    with pytest.raises(ValueError, match="targets must have the shape"):
        theory.sampling_stats(logits, targets[:, :-1])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        theory.sampling_stats(logits, targets, temperature=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 5, None])
def test_token_logprobs_value_and_gradient_match_naive(dtype, temperature, chunk_size):
    """Forward and gradient equal those of a plain float64 log_softmax + gather; the gradient keeps the dtype."""
    logits, targets = _batch(3, dtype=dtype)
    logits.requires_grad_(True)
    upstream = torch.randn(targets.shape, generator=torch.Generator().manual_seed(9))
    got = token_logprobs(logits, targets, temperature=temperature, chunk_size=chunk_size)
    (grad,) = torch.autograd.grad((got * upstream).sum(), logits)

    reference = logits.detach().to(F64).requires_grad_(True)
    want = _naive(reference, targets, temperature)[0]
    (want_grad,) = torch.autograd.grad((want * upstream.to(F64)).sum(), reference)
    assert got.dtype == torch.float32 and grad.dtype == dtype and grad.shape == logits.shape
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=2e-6)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(grad.double(), want_grad, rtol=tolerance, atol=tolerance)


def test_token_logprobs_on_a_non_contiguous_view():
    """A slice such as logits[:, :-1] cannot be viewed flat; the result is still right (through one copy)."""
    logits, targets = _batch(4, shape=(3, 8))
    logits.requires_grad_(True)
    view = logits[:, :-1]
    got = token_logprobs(view, targets[:, :-1], temperature=0.8, chunk_size=3)
    got.sum().backward()
    reference = logits.detach().to(F64).requires_grad_(True)
    _naive(reference[:, :-1], targets[:, :-1], 0.8)[0].sum().backward()
    torch.testing.assert_close(
        got.double(), _naive(logits.detach()[:, :-1], targets[:, :-1], 0.8)[0], rtol=1e-5, atol=2e-6
    )
    torch.testing.assert_close(logits.grad.double(), reference.grad, rtol=1e-6, atol=1e-6)


def test_token_logprobs_with_masked_logits():
    """-inf logits (a vocabulary mask) get probability 0 and a zero gradient, not NaN."""
    logits, targets = _batch(5)
    logits[..., :10] = float("-inf")
    targets = targets.clamp(min=10)
    logits.requires_grad_(True)
    got = token_logprobs(logits, targets, chunk_size=4)
    got.sum().backward()
    assert torch.isfinite(got).all() and torch.isfinite(logits.grad).all()
    assert (logits.grad[..., :10] == 0).all()


def test_token_logprobs_checks_its_arguments():
    logits, targets = _batch(6)
    with pytest.raises(ValueError, match="targets must have the shape"):
        token_logprobs(logits, targets[:, :-1])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(logits, targets, temperature=-1.0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        token_logprobs(logits, targets, chunk_size=0)


def test_logprob_mismatch_is_over_action_tokens_only():
    from stare_agent.loss import logprob_mismatch

    rollout = torch.tensor([[-1.0, -0.5, 50.0], [-2.0, 9.0, -0.1]])
    trainer = torch.tensor([[-1.5, -0.5, 0.0], [-1.0, -9.0, -0.1]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])  # the unmasked 50 and 9 vs -9 must not count
    got = logprob_mismatch(rollout, trainer, mask)
    assert got["rollout_logprob_abs_diff"] == pytest.approx((0.5 + 0.0 + 1.0 + 0.0) / 4)
    assert got["rollout_logprob_abs_diff_max"] == pytest.approx(1.0)
    assert logprob_mismatch(rollout, trainer, torch.zeros_like(mask)) == {
        "rollout_logprob_abs_diff": 0.0,
        "rollout_logprob_abs_diff_max": 0.0,
    }
