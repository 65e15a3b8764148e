"""Proofs, by autograd and by slow obvious loops, of the entropy theory behind STARE (DESIGN section 3).

Per position (pi = softmax(z), H its entropy, s_v = -ln pi_v, S2 = sum_v pi_v^2 (ln pi_v + H)):
    dH/dz_v = pi_v (s_v - H);   GRPO step z + eta A (e_a - pi)  =>  dH/deta = -A Phi(pi_a);
    E_{a~pi} Phi(pi_a) = 0;     Phi has one root p* in (e^-H, 1), s* = -ln p*.
Per batch: dHbar/deta = -(1/N) [Lambda - (W - 1) Gamma] for O1 weights, so W* = 1 + Lambda/Gamma.
The identities are checked in float64; the library's float32 outputs are compared with float32 tolerances.
"""

from __future__ import annotations

import math

import pytest
import torch

from stare_agent import stare, theory

F64 = torch.float64


def _entropy(z: torch.Tensor) -> torch.Tensor:
    """Plain entropy of softmax(z) over the last dim, differentiable (the test's own formula)."""
    p = torch.softmax(z, dim=-1)
    return -(p * torch.log(p)).sum(-1)


def _entropy_s2_f64(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive float64 H and S2 from a full log_softmax."""
    logp = torch.log_softmax(z.to(F64), dim=-1)
    p = logp.exp()
    h = -(p * logp).sum(-1)
    return h, (p * p * (logp + h[..., None])).sum(-1)


def _phi_scalar(p: float, h: float, s2: float) -> float:
    """Phi(p) = p (ln p + H) - S2 in plain Python floats."""
    return p * (math.log(p) + h) - s2


def _bisect_critical_surprisal(pi: list[float]) -> float:
    """s* for one distribution by bisection of Phi on [e^-H, 1] (Phi < 0 left of p*, > 0 right of it)."""
    h = -sum(p * math.log(p) for p in pi if p > 0)
    s2 = sum(p * p * (math.log(p) + h) for p in pi if p > 0)
    lo, hi = math.exp(-h), 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _phi_scalar(mid, h, s2) < 0:
            lo = mid
        else:
            hi = mid
    return -math.log(0.5 * (lo + hi))


def _random_logits(seed: int, vocab: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(vocab, generator=g, dtype=F64)


# ---------------------------------------------------------------------------------------------------------------------
# 1-2. Autograd: gradient of the entropy, and entropy rate of one GRPO logit step.


@pytest.mark.parametrize("seed,vocab,scale", [(0, 7, 1.0), (1, 13, 2.0), (2, 50, 3.0), (3, 21, 0.3), (4, 9, 8.0)])
def test_entropy_gradient_is_pi_times_surprisal_minus_entropy(seed, vocab, scale):
    """dH/dz_v = pi_v (s_v - H), by autograd of a plain entropy formula (scale 8 is a peaked pi)."""
    z = _random_logits(seed, vocab, scale).requires_grad_(True)
    h = _entropy(z)
    (grad,) = torch.autograd.grad(h, z)
    with torch.no_grad():
        pi = torch.softmax(z, -1)
        expected = pi * (-torch.log(pi) - h)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12 * float(expected.abs().max()))
    # Not vacuous: the gradient is not ~0 and has both signs (frequent tokens lower H, rare ones raise it).
    assert grad.abs().max() > 1e-4 and (grad > 0).any() and (grad < 0).any()


def _grpo_entropy_rate(z: torch.Tensor, a: int, adv: float) -> torch.Tensor:
    """dH/deta at eta = 0 for z(eta) = z + eta * A * (e_a - pi), pi held fixed (detached)."""
    eta = torch.zeros((), dtype=F64, requires_grad=True)
    pi = torch.softmax(z, -1).detach()
    direction = torch.nn.functional.one_hot(torch.tensor(a), z.shape[-1]).to(F64) - pi
    (rate,) = torch.autograd.grad(_entropy(z + eta * adv * direction), eta)
    return rate


@pytest.mark.parametrize("seed,vocab,scale", [(10, 7, 1.0), (11, 30, 2.0), (12, 50, 4.0), (13, 11, 12.0)])
@pytest.mark.parametrize("adv", [1.3, -0.6])
def test_grpo_step_changes_entropy_at_rate_minus_a_phi(seed, vocab, scale, adv):
    """dH/deta = -A Phi(pi_a) for the most likely, the rarest and a middle token, both signs of A."""
    z = _random_logits(seed, vocab, scale)
    pi = torch.softmax(z, -1)
    order = torch.argsort(pi)
    h64, s2_64 = _entropy_s2_f64(z)
    h32, s2_32 = theory.entropy_and_s2(z)
    rates = []
    for a in (int(order[-1]), int(order[0]), int(order[vocab // 2])):
        rate = _grpo_entropy_rate(z, a, adv)
        p = pi[a]
        torch.testing.assert_close(rate, -adv * theory.phi(p, h64, s2_64), rtol=1e-9, atol=1e-13)
        # The library's float32 H and S2 give the same rate to float32 precision.
        torch.testing.assert_close(rate.float(), -adv * theory.phi(p.float(), h32, s2_32), rtol=1e-4, atol=1e-6)
        rates.append(float(rate))
    # Reinforcing the most likely token lowers entropy, the rarest raises it (for A > 0; reversed for A < 0).
    assert math.copysign(1.0, adv) * rates[0] < 0 < math.copysign(1.0, adv) * rates[1]


# ---------------------------------------------------------------------------------------------------------------------
# 3. E_{a~pi}[Phi(pi_a)] = 0.


@pytest.mark.parametrize("vocab", [2, 7, 50, 300])
def test_phi_has_zero_mean_under_pi(vocab):
    """sum_a pi_a Phi(pi_a) = 0, batched, in float64 (own H, S2) and float32 (entropy_and_s2)."""
    g = torch.Generator().manual_seed(vocab)
    temps = torch.tensor([0.05, 0.3, 1.0, 3.0, 30.0], dtype=F64)[:, None, None]
    z = torch.randn(5, 8, vocab, generator=g, dtype=F64) / temps  # (5 temperatures, 8 rows, V)
    pi = torch.softmax(z, -1)

    h, s2 = _entropy_s2_f64(z)
    phi64 = theory.phi(pi, h[..., None], s2[..., None])
    torch.testing.assert_close((pi * phi64).sum(-1), torch.zeros_like(h), rtol=0, atol=1e-12)

    h32, s2_32 = theory.entropy_and_s2(z.float())
    z32 = z.float()
    pi32 = (z32 - torch.logsumexp(z32, -1, keepdim=True)).exp()  # the float32 pi the pass computes H and S2 from
    phi32 = theory.phi(pi32, h32[..., None], s2_32[..., None])
    torch.testing.assert_close((pi32 * phi32).sum(-1), torch.zeros_like(h32), rtol=0, atol=1e-6)
    # Not vacuous: Phi itself is far from 0 somewhere.
    assert phi64.abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------------------------------
# 4. critical_surprisal: the root of Phi.


def _many_distributions() -> tuple[torch.Tensor, torch.Tensor]:
    """H, S2 (float32, from entropy_and_s2) for rows of several V and temperatures, near-uniform to near-one-hot."""
    g = torch.Generator().manual_seed(123)
    hs, s2s = [], []
    for vocab in (2, 3, 7, 50, 1000):
        for temp in (1e-3, 0.05, 0.3, 1.0, 3.0, 1e3):
            h, s2 = theory.entropy_and_s2(torch.randn(16, vocab, generator=g) / temp)
            hs.append(h)
            s2s.append(s2)
    return torch.cat(hs), torch.cat(s2s)


def test_critical_surprisal_is_the_root_of_phi():
    """|Phi(e^-s*)| is tiny for float32 and float64 inputs, and 0 < s* < H on non-degenerate rows."""
    h32, s2_32 = _many_distributions()
    h, s2 = h32.double(), s2_32.double()
    s_star32 = theory.critical_surprisal(h32, s2_32)
    s_star = theory.critical_surprisal(h, s2)
    assert s_star32.dtype == torch.float32 and s_star.dtype == F64
    assert torch.isfinite(s_star).all() and torch.isfinite(s_star32).all()
    assert theory.phi(torch.exp(-s_star32.double()), h, s2).abs().max() < 1e-6
    # float32 rounding can leave S2 a hair below 0 on near-uniform rows; the root then lies left of e^-H,
    # and s* stays at the end of its interval, s* = H.
    rounded = s2 < 0
    assert rounded.any() and (s2[rounded].abs() < 1e-7).all()
    torch.testing.assert_close(s_star[rounded], h[rounded], rtol=0, atol=1e-12)
    assert theory.phi(torch.exp(-s_star[~rounded]), h[~rounded], s2[~rounded]).abs().max() < 1e-11
    # Non-degenerate: neither (numerically) one-hot nor uniform. These make up most rows.
    nondegenerate = (h > 1e-4) & (s2 > 1e-8)
    assert nondegenerate.sum() > 0.6 * h.numel()
    assert ((s_star > 0) & (s_star < h))[nondegenerate].all()
    assert ((s_star >= 0) & (s_star <= h + 1e-6)).all()


def test_phi_root_is_unique_between_e_minus_h_and_one():
    """Phi < 0 at e^-H and on a grid of (e^-H, p*), Phi > 0 on a grid of (p*, 1]: the root is unique."""
    h32, s2_32 = _many_distributions()
    h, s2 = h32.double(), s2_32.double()
    p_star = torch.exp(-theory.critical_surprisal(h, s2))
    p_left = torch.exp(-h)
    # Rows where the root is separated from both ends by more than the solver's tolerance.
    rows = (p_star - p_left > 1e-7) & (1 - p_star > 1e-7)
    assert rows.sum() > 0.5 * h.numel()
    h, s2, p_star, p_left = h[rows, None], s2[rows, None], p_star[rows, None], p_left[rows, None]
    t = torch.linspace(0.001, 0.999, 199, dtype=F64)
    assert (theory.phi(p_left, h, s2) < 0).all()
    assert (theory.phi(p_left + t * (p_star - p_left), h, s2) < 0).all()
    assert (theory.phi(p_star + t * (1 - p_star), h, s2) > 0).all()
    assert (theory.phi(torch.ones_like(p_star), h, s2) > 0).all()


def test_critical_surprisal_edges_one_hot_and_uniform():
    """One-hot (H = 0) gives s* = 0 without NaN; exactly uniform gives s* = H."""
    one_hot = torch.tensor([[0.0, -1e4, -1e4, -1e4], [5.0, -1e4, -1e4, -1e4]])
    h, s2 = theory.entropy_and_s2(one_hot)
    assert (h == 0).all() and (s2 == 0).all()
    assert (theory.critical_surprisal(h, s2) == 0).all()
    assert (theory.critical_surprisal(torch.zeros(3, dtype=F64), torch.zeros(3, dtype=F64)) == 0).all()

    for vocab in (2, 7, 50, 1000):
        h, s2 = theory.entropy_and_s2(torch.zeros(vocab))
        torch.testing.assert_close(theory.critical_surprisal(h, s2), h, rtol=0, atol=1e-6)
        exact_h = torch.tensor(math.log(vocab), dtype=F64)
        torch.testing.assert_close(
            theory.critical_surprisal(exact_h, torch.zeros((), dtype=F64)), exact_h, rtol=0, atol=1e-12
        )


# ---------------------------------------------------------------------------------------------------------------------
# 5. entropy_and_s2 against a naive float64 computation.


@pytest.mark.parametrize("shape", [(5,), (4, 9), (2, 3, 17), (3, 5, 200)])
@pytest.mark.parametrize("chunk_size", [1, 3, None, 1000])
def test_entropy_and_s2_matches_naive_float64(shape, chunk_size):
    """Same H and S2 as a full float64 log_softmax, for 1-D to 3-D input and any chunking; float32, detached."""
    g = torch.Generator().manual_seed(sum(shape))
    logits = 3.0 * torch.randn(shape, generator=g)
    logits.requires_grad_(True)
    before = logits.detach().clone()
    h, s2 = theory.entropy_and_s2(logits, chunk_size=chunk_size)
    ref_h, ref_s2 = _entropy_s2_f64(logits.detach())
    assert h.shape == s2.shape == shape[:-1]
    assert h.dtype == s2.dtype == torch.float32 and not h.requires_grad and not s2.requires_grad
    torch.testing.assert_close(h.double(), ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s2.double(), ref_s2, rtol=1e-5, atol=1e-6)
    assert torch.equal(logits.detach(), before)  # the in-place arithmetic never touches the input


def test_entropy_and_s2_default_chunking_splits_rows(monkeypatch):
    """With chunk_size=None the rows are split by DEFAULT_CHUNK_ELEMENTS; a small budget gives the same result."""
    logits = torch.randn(7, 5, 11, generator=torch.Generator().manual_seed(5))
    whole = theory.entropy_and_s2(logits)
    monkeypatch.setattr(theory, "DEFAULT_CHUNK_ELEMENTS", 2 * 11)  # 2 rows per chunk, last chunk partial
    chunked = theory.entropy_and_s2(logits)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)


def test_entropy_and_s2_rejects_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        theory.entropy_and_s2(torch.zeros(2, 3), chunk_size=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_entropy_and_s2_upcasts_half_precision(dtype):
    """float16/bfloat16 logits give float32 results that match float64 of the upcast values."""
    logits = (4.0 * torch.randn(6, 40, generator=torch.Generator().manual_seed(6))).to(dtype)
    h, s2 = theory.entropy_and_s2(logits, chunk_size=4)
    assert h.dtype == s2.dtype == torch.float32
    ref_h, ref_s2 = _entropy_s2_f64(logits.double())
    torch.testing.assert_close(h.double(), ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s2.double(), ref_s2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_entropy_and_s2_with_masked_and_large_logits(dtype):
    """-1e4 masked entries count as probability 0 (no NaN); huge logits are handled stably."""
    g = torch.Generator().manual_seed(7)
    live = 2.0 * torch.randn(4, 6, generator=g)
    masked = torch.cat([live, torch.full((4, 10), -1e4)], dim=-1).to(dtype)
    h, s2 = theory.entropy_and_s2(masked)
    ref_h, ref_s2 = _entropy_s2_f64(live.to(dtype).double())  # the same distribution over the live entries
    assert torch.isfinite(h).all() and torch.isfinite(s2).all()
    torch.testing.assert_close(h.double(), ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s2.double(), ref_s2, rtol=1e-5, atol=1e-6)

    big = (live * 1e3).to(dtype)  # |logits| in the thousands: naive exp would overflow
    h, s2 = theory.entropy_and_s2(big)
    ref_h, ref_s2 = _entropy_s2_f64(big.double())
    assert torch.isfinite(h).all() and torch.isfinite(s2).all()
    torch.testing.assert_close(h.double(), ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s2.double(), ref_s2, rtol=1e-5, atol=1e-6)


def test_entropy_and_s2_with_minus_inf_logits():
    """Logits masked with -inf (masked_fill(-inf), allowed-token masks) should mean probability 0, not NaN."""
    live = torch.tensor([[0.5, -1.0, 2.0]])
    masked = torch.cat([live, torch.full((1, 2), -math.inf)], dim=-1)
    h, s2 = theory.entropy_and_s2(masked)
    ref_h, ref_s2 = _entropy_s2_f64(live)
    torch.testing.assert_close(h.double(), ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s2.double(), ref_s2, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# 6-7. The batch identity and the proxy precision, on independent positions.

B, T = 6, 12
ADVANTAGES = torch.tensor([1.2, -0.7, 0.0, 0.5, -1.1, 0.9], dtype=F64)  # per trajectory: mixed signs, one zero


def _independent_batch(seed: int, vocab: int = 6):
    """Each position (i, t) its own logits; a[i,t] ~ pi[i,t]; action mask with zeros (prompt, padding)."""
    g = torch.Generator().manual_seed(seed)
    temps = torch.exp(torch.empty(B, T, 1, dtype=F64).uniform_(-1.5, 1.5, generator=g))
    z = torch.randn(B, T, vocab, generator=g, dtype=F64) / temps  # peaked and flat positions
    pi = torch.softmax(z, -1)
    a = torch.multinomial(pi.view(-1, vocab), 1, generator=g).view(B, T)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, :2] = False  # a "prompt"
    surprisal = -torch.log(pi.gather(-1, a[..., None]).squeeze(-1))
    return z, a, mask, surprisal


def _slow_lambda_gamma(z, a, mask, high_pos) -> tuple[float, float]:
    """Lambda = sum_{action} A Phi, Gamma = -sum_{high+} A Phi, one position at a time in Python floats."""
    lam = gam = 0.0
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            pi = torch.softmax(z[i, t], -1).tolist()
            h = -sum(p * math.log(p) for p in pi)
            s2 = sum(p * p * (math.log(p) + h) for p in pi)
            a_phi = float(ADVANTAGES[i]) * _phi_scalar(pi[a[i, t]], h, s2)
            lam += a_phi
            if high_pos[i, t]:
                gam -= a_phi
    return lam, gam


def _mean_entropy_rate(z, a, mask, omega) -> float:
    """dHbar/deta at 0 for z_it(eta) = z_it + eta omega_it A_i (e_a - pi_it) on action tokens, by autograd."""
    eta = torch.zeros((), dtype=F64, requires_grad=True)
    pi = torch.softmax(z, -1).detach()
    direction = torch.nn.functional.one_hot(a, z.shape[-1]).to(F64) - pi
    coef = omega.to(F64) * ADVANTAGES[:, None] * mask  # 0 off the action mask: those positions do not move
    h = _entropy(z + eta * coef[..., None] * direction)
    h_bar = h[mask].mean()
    (rate,) = torch.autograd.grad(h_bar, eta)
    return float(rate)


@pytest.mark.parametrize("seed", [4, 7, 16])
def test_batch_entropy_rate_and_critical_weight(seed):
    """dHbar/deta = -(1/N)[Lambda - (W-1) Gamma] with O1 weights; it is 0 at W* = 1 + Lambda/Gamma and flips sign."""
    z, a, mask, surprisal = _independent_batch(seed)
    n = int(mask.sum())
    h, s2 = _entropy_s2_f64(z)
    high_pos = stare.select_quadrants(surprisal, ADVANTAGES, mask, 0.25, ("high+",))["high+"]
    diag = theory.batch_diagnostics(surprisal, ADVANTAGES, mask, h, s2, high_pos)
    lam, gam = float(diag["theory/lambda"]), float(diag["theory/gamma"])
    w_star = float(diag["theory/critical_weight"])

    slow_lam, slow_gam = _slow_lambda_gamma(z, a, mask, high_pos)
    assert high_pos.sum() == math.ceil(0.25 * int((mask & (ADVANTAGES[:, None] > 0)).sum()))
    assert lam == pytest.approx(slow_lam, rel=1e-6) and gam == pytest.approx(slow_gam, rel=1e-6)
    assert w_star == pytest.approx(1 + lam / gam, rel=1e-6)
    assert w_star == pytest.approx(1 + slow_lam / slow_gam, rel=1e-6)
    # The batch is chosen so the interesting case holds: entropy falls under plain GRPO and high+ can lift it.
    assert slow_gam > 0 and w_star > 1.3
    assert theory.REGIMES[int(diag["theory/regime"])] == "needs_w"

    scale = (abs(slow_lam) + 4 * abs(slow_gam)) / n
    rates = {}
    for w in (1.0, 1.1, 2.0, w_star - 0.2, w_star, w_star + 0.2, 4.0):
        omega, _ = stare.token_weights(surprisal, ADVANTAGES, mask, h, op="O1", w=w, gate="off", top_ratio=0.25)
        assert torch.equal(omega != 1, high_pos) or w == 1.0  # O1 touches exactly high+
        rates[w] = _mean_entropy_rate(z, a, mask, omega)
        # Exact against the float64 loop (up to float32 omega = w); float32 metrics to float32 precision.
        w32 = float(torch.tensor(w, dtype=torch.float32))
        assert rates[w] == pytest.approx(-(slow_lam - (w32 - 1) * slow_gam) / n, abs=1e-12 * scale)
        assert rates[w] == pytest.approx(-(lam - (w - 1) * gam) / n, abs=1e-5 * scale)
    assert abs(rates[w_star]) < 1e-5 * scale
    assert rates[1.0] < 0 and rates[w_star - 0.2] < 0 < rates[w_star + 0.2]


@pytest.mark.parametrize("seed", [1, 2])
def test_proxy_precision_matches_per_token_bisection(seed):
    """proxy precision = fraction of high+ tokens with s above their own s*, s* found by bisection per token."""
    z, a, mask, _ = _independent_batch(seed, vocab=9)
    # What the trainer passes: float32 surprisal from the old log-probs, float32 H and S2 from entropy_and_s2.
    surprisal32 = -torch.log_softmax(z.float(), -1).gather(-1, a[..., None]).squeeze(-1)
    h32, s2_32 = theory.entropy_and_s2(z)
    high_pos = stare.select_quadrants(surprisal32, ADVANTAGES, mask, 0.5, ("high+",))["high+"]
    diag = theory.batch_diagnostics(surprisal32, ADVANTAGES, mask, h32, s2_32, high_pos)

    above, s_stars = [], []
    for i, t in high_pos.nonzero().tolist():
        pi = torch.softmax(z[i, t], -1).tolist()
        s_star = _bisect_critical_surprisal(pi)
        s = -math.log(pi[a[i, t]])
        assert abs(s - s_star) > 1e-3  # no borderline token, so float32 rounding cannot flip a vote
        above.append(s > s_star)
        s_stars.append(s_star)
    expected = sum(above) / len(above)
    assert 0 < expected < 1  # a mix, so a wrong comparison or a wrong s* would show
    assert float(diag["theory/proxy_precision"]) == pytest.approx(expected, abs=1e-7)
    assert float(diag["theory/critical_surprisal_mean"]) == pytest.approx(sum(s_stars) / len(s_stars), rel=1e-5)


def _batch_without_positive_advantages(advantages: torch.Tensor):
    z, _, mask, surprisal = _independent_batch(0)
    h, s2 = theory.entropy_and_s2(z)
    high_pos = stare.select_quadrants(surprisal, advantages, mask, 0.25, ("high+",))["high+"]
    assert not high_pos.any()
    return theory.batch_diagnostics(surprisal, advantages, mask, h, s2, high_pos)


@pytest.mark.parametrize("advantages", [-ADVANTAGES.abs(), torch.zeros(B, dtype=F64)])
def test_batch_diagnostics_without_positive_advantages_is_nan_not_error(advantages):
    """No positive advantage, so no high+ tokens: precision and mean s* are NaN, Gamma is 0, nothing raises."""
    diag = _batch_without_positive_advantages(advantages)
    assert torch.isnan(diag["theory/proxy_precision"])
    assert torch.isnan(diag["theory/critical_surprisal_mean"])
    assert diag["theory/gamma"] == 0
    assert torch.isfinite(diag["theory/lambda"])


def test_critical_weight_is_nan_without_high_pos():
    """W* is undefined when Gamma is an empty sum; batch_diagnostics documents NaN for undefined values."""
    diag = _batch_without_positive_advantages(-ADVANTAGES.abs())
    assert torch.isnan(diag["theory/critical_weight"])
    assert theory.REGIMES[int(diag["theory/regime"])] == "undefined"


# ---------------------------------------------------------------------------------------------------------------------
# 8. Regimes: W* is reported only where "O1 with W > W*" is the exact first-order condition.


@pytest.mark.parametrize(
    ("lam", "gam", "has_high_pos", "regime"),
    [
        (1.0, 2.0, True, "needs_w"),
        (0.0, 2.0, True, "needs_w"),
        (1.0, 0.0, True, "no_w_helps"),
        (1.0, -2.0, True, "no_w_helps"),
        (-1.0, 2.0, True, "rising"),
        (-1.0, -2.0, True, "rising"),
        (1.0, 0.0, False, "undefined"),
        (-1.0, 0.0, False, "undefined"),
    ],
)
def test_regime_codes(lam, gam, has_high_pos, regime):
    code = theory.regime_codes(torch.tensor(lam, dtype=F64), torch.tensor(gam, dtype=F64), has_high_pos)
    assert theory.REGIMES[int(code)] == regime


def _diagnostics_with(high_pos_from: str, advantages: torch.Tensor, seed: int = 4):
    """batch_diagnostics on the independent batch with high+ taken as the highest ('high+') or, to make Gamma
    negative, the lowest ('low+') surprisal tokens of T+."""
    z, _, mask, surprisal = _independent_batch(seed)
    h, s2 = _entropy_s2_f64(z)
    chosen = stare.select_quadrants(surprisal, advantages, mask, 0.25, (high_pos_from,))[high_pos_from]
    return theory.batch_diagnostics(surprisal, advantages, mask, h, s2, chosen)


def test_critical_weight_is_nan_when_no_w_helps():
    """Gamma < 0 (the 'high+' set is the least surprising tokens: reinforcing them lowers entropy): no W > 1
    raises entropy, so 1 + Lambda/Gamma (a number below 1) is not reported."""
    diag = _diagnostics_with("low+", ADVANTAGES)
    assert float(diag["theory/gamma"]) < 0 <= float(diag["theory/lambda"])
    assert theory.REGIMES[int(diag["theory/regime"])] == "no_w_helps"
    assert torch.isnan(diag["theory/critical_weight"])


def test_critical_weight_is_nan_when_entropy_already_rises():
    """Lambda < 0: the plain step raises entropy; there is no threshold on W to report."""
    for seed in range(40):
        diag = _diagnostics_with("high+", ADVANTAGES, seed)
        if float(diag["theory/lambda"]) < 0:
            break
    else:
        pytest.fail("no seed in 0..39 gave Lambda < 0")
    assert theory.REGIMES[int(diag["theory/regime"])] == "rising"
    assert torch.isnan(diag["theory/critical_weight"])
