"""First-order entropy theory behind STARE (DESIGN section 3). Pure torch.

For one position with distribution pi, entropy H and sampled token a with p = pi_a:
    S2     = sum_v pi_v^2 (ln pi_v + H)
    Phi(p) = p (ln p + H) - S2
The GRPO logit update z <- z + eta * A * (e_a - pi) changes entropy at rate dH/deta = -A * Phi(p).
E_{a~pi}[Phi(pi_a)] = 0, and Phi has one root p* in (e^-H, 1): tokens with surprisal above
s* = -ln p* raise entropy when reinforced. Over a batch,
    Lambda = sum_{action tokens} A Phi,    Gamma = -sum_{high+} A Phi,
and amplifying high+ by W (op O1) makes the first-order batch entropy rise iff W > W* = 1 + Lambda/Gamma.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Elements per (chunk, V) block when no chunk size is given: 2**21 float32 = 8 MiB. On CPU small blocks
# stay in cache and in the allocator's heap (docs/benchmarks.md: ~4x faster than 32 MiB blocks at
# V = 32k); on a GPU a larger chunk_size (fewer kernel launches) is likely better, and can be passed.
DEFAULT_CHUNK_ELEMENTS = 2**21


@torch.no_grad()
def entropy_and_s2(logits: Tensor, chunk_size: int | None = None) -> tuple[Tensor, Tensor]:
    """Entropy H and S2 of softmax(logits) over the last dim, in float32 and detached.

    logits: (..., V). Returns H, S2 with shape (...). Rows are processed `chunk_size` at a time in
    three (chunk_size, V) float32 blocks allocated once per call: that is all the extra memory.
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    rows = flat.shape[0]
    if chunk_size is None:
        chunk_size = max(1, DEFAULT_CHUNK_ELEMENTS // vocab)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    chunk_size = min(chunk_size, max(rows, 1))
    blocks = torch.empty(3, chunk_size, vocab, dtype=torch.float32, device=logits.device)
    entropy = torch.empty(rows, dtype=torch.float32, device=logits.device)
    s2 = torch.empty(rows, dtype=torch.float32, device=logits.device)
    for start in range(0, rows, chunk_size):
        stop = min(start + chunk_size, rows)
        n = stop - start
        logp = torch.log_softmax(flat[start:stop].float(), dim=-1, out=blocks[0, :n])
        p = torch.exp(logp, out=blocks[1, :n])
        # Masked (-inf) logits have p = 0; a finite floor keeps 0 * log 0 at 0 instead of NaN.
        logp.clamp_(min=torch.finfo(logp.dtype).min)
        h = -torch.mul(p, logp, out=blocks[2, :n]).sum(-1)
        # In place from here on: logp becomes p^2 (ln p + H).
        s2[start:stop] = logp.add_(h[:, None]).mul_(p).mul_(p).sum(-1)
        entropy[start:stop] = h
    return entropy.view(logits.shape[:-1]), s2.view(logits.shape[:-1])


def phi(p: Tensor, entropy: Tensor, s2: Tensor) -> Tensor:
    """Phi(p) = p (ln p + H) - S2, elementwise (p = 0 gives -S2)."""
    return torch.xlogy(p, p) + p * entropy - s2


def critical_surprisal(entropy: Tensor, s2: Tensor, max_iter: int = 60, tol: float = 1e-12) -> Tensor:
    """s* = -ln p*, where p* is the root of Phi in [e^-H, 1]; elementwise, same shape as `entropy`.

    Phi is convex in p, equals -S2 <= 0 at e^-H and H - S2 >= 0 at 1, with slope ln p + 1 + H >= 1
    on that interval, so Newton's method started at p = 1 decreases monotonically onto the root.
    Runs in float64; the result is in [0, H] (0 for a one-hot distribution, H for a uniform one).
    """
    h = entropy.double()
    q = s2.double()
    p = torch.ones_like(h)
    for i in range(max_iter):
        p = p - phi(p, h, q) / (torch.log(p) + 1.0 + h)
        p = torch.maximum(p, torch.exp(-h))  # rounding can not carry it past the left end
        if i % 4 == 3 and bool((phi(p, h, q).abs() <= tol).all()):
            break
    return (-torch.log(p)).to(entropy.dtype)


def batch_diagnostics(
    surprisal: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    entropy: Tensor,
    s2: Tensor,
    high_pos: Tensor,
) -> dict[str, Tensor]:
    """Lambda, Gamma, the critical weight W* and the proxy precision of one batch.

    surprisal, action_mask, entropy, s2, high_pos: (B, T); action_mask 1 = sampled by the policy;
    high_pos: (B, T) bool, the high+ set (stare.select_quadrants). advantages: (B,) or (B, T).
    proxy_precision = fraction of high+ tokens whose surprisal exceeds their own s* (the tokens
    that truly raise entropy when reinforced). Values are NaN where undefined (no high+ tokens).
    """
    mask = action_mask.bool()
    adv = advantages[:, None].expand_as(surprisal) if advantages.dim() == 1 else advantages
    s = surprisal.double()
    a_phi = adv.double() * phi(torch.exp(-s), entropy.double(), s2.double())
    zero = torch.zeros((), dtype=a_phi.dtype, device=a_phi.device)
    lam = torch.where(mask, a_phi, zero).sum()  # where, not a product: masked positions may hold NaN
    gam = -torch.where(high_pos, a_phi, zero).sum()
    critical_weight = torch.where(high_pos.any(), 1.0 + lam / gam, torch.full_like(lam, float("nan")))
    s_star = critical_surprisal(entropy[high_pos], s2[high_pos])
    precision = (surprisal[high_pos] > s_star).double().mean()
    return {
        "theory/lambda": lam.float(),
        "theory/gamma": gam.float(),
        "theory/critical_weight": critical_weight.float(),
        "theory/proxy_precision": precision.float(),
        "theory/critical_surprisal_mean": s_star.double().mean().float(),
    }
