"""First-order entropy theory behind STARE (DESIGN section 3), and the chunked passes over the logits that
feed it (log-probs, entropy, S2 of the sampling distribution). Pure torch.

For one position with distribution pi, entropy H and sampled token a with p = pi_a:
    S2     = sum_v pi_v^2 (ln pi_v + H)
    Phi(p) = p (ln p + H) - S2
The GRPO logit update z <- z + eta * A * (e_a - pi) changes entropy at rate dH/deta = -A * Phi(p).
E_{a~pi}[Phi(pi_a)] = 0, and Phi has one root p* in (e^-H, 1): tokens with surprisal above
s* = -ln p* raise entropy when reinforced. Over a batch,
    Lambda = sum_{action tokens} A Phi,    Gamma = -sum_{high+} A Phi,
and amplifying high+ by W (op O1) makes the first-order batch entropy rise iff W > W* = 1 + Lambda/Gamma.

Gamma is a signed sum. A high+ token whose surprisal is above its own s* has Phi < 0 and adds A|Phi|;
one below s* (a "false positive" of the surprisal proxy) has Phi > 0 and subtracts. A form that sums
|Phi| over high+ counts every selected token as entropy-raising and so overstates what amplifying the
set can do; the signed Gamma is the exact first-order quantity, and it can be zero or negative when
the proxy's precision is low. Hence three regimes per batch (`REGIMES`, in `batch_diagnostics`):
    rising      Lambda < 0: entropy rises under the plain GRPO step already;
    needs_w     Lambda >= 0, Gamma > 0: O1 makes it rise iff W > W*;
    no_w_helps  Lambda >= 0, Gamma <= 0: no W > 1 makes it rise (a larger W lowers it further);
    undefined   no high+ tokens (no positive advantage in the batch): O1 changes nothing.
W* is reported only in the needs_w regime; elsewhere 1 + Lambda/Gamma is not a threshold on W.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Elements per (chunk, V) block when no chunk size is given: 2**21 float32 = 8 MiB. On CPU small blocks
# stay in cache and in the allocator's heap (docs/benchmarks.md: ~4x faster than 32 MiB blocks at
# V = 32k); on a GPU a larger chunk_size (fewer kernel launches) is likely better, and can be passed.
DEFAULT_CHUNK_ELEMENTS = 2**21

REGIMES = ("rising", "needs_w", "no_w_helps", "undefined")
"""What one batch's first-order entropy change allows (module docstring); `theory/regime` is an index into it."""


def _check_chunk(chunk_size: int | None, rows: int, vocab: int) -> int:
    """The rows per (chunk, V) block: the given chunk_size, or DEFAULT_CHUNK_ELEMENTS // V, at most `rows`."""
    if chunk_size is None:
        chunk_size = max(1, DEFAULT_CHUNK_ELEMENTS // vocab)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    return min(chunk_size, max(rows, 1))


@torch.no_grad()
def entropy_and_s2(logits: Tensor, chunk_size: int | None = None) -> tuple[Tensor, Tensor]:
    """Entropy H and S2 of softmax(logits) over the last dim, in float32 and detached.

    logits: (..., V). Returns H, S2 with shape (...). Rows are processed `chunk_size` at a time in
    three (chunk_size, V) float32 blocks allocated once per call: that is all the extra memory.
    """
    _, entropy, s2 = _chunked_stats(logits, None, 1.0, chunk_size)
    return entropy, s2


def _load(block: Tensor, rows: Tensor, temperature: float) -> Tensor:
    """block[:len(rows)] = rows / temperature in the block's float32; no division pass at temperature 1."""
    z = block[: rows.shape[0]].copy_(rows)
    return z if temperature == 1.0 else z.div_(temperature)


@torch.no_grad()
def sampling_stats(
    logits: Tensor, targets: Tensor, *, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Log-prob of each target, entropy H and S2 of the sampling distribution softmax(logits / temperature).

    logits: (..., V); targets: (...) int ids. Returns three float32 detached tensors of shape (...), from one
    chunked pass over the logits with the memory of `entropy_and_s2` (three (chunk, V) float32 blocks). The
    rollout sampled from the temperature-scaled distribution, so that is the one the ratio's denominator,
    the STARE surprisal and the gate's entropy must come from (DESIGN section 3).
    """
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets must have the shape of logits without its last dim {tuple(logits.shape[:-1])}; "
            f"got {tuple(targets.shape)}"
        )
    return _chunked_stats(logits, targets, temperature, chunk_size)


def _chunked_stats(
    logits: Tensor, targets: Tensor | None, temperature: float, chunk_size: int | None
) -> tuple[Tensor | None, Tensor, Tensor]:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    rows = flat.shape[0]
    chunk_size = _check_chunk(chunk_size, rows, vocab)
    blocks = torch.empty(3, chunk_size, vocab, dtype=torch.float32, device=logits.device)
    entropy = torch.empty(rows, dtype=torch.float32, device=logits.device)
    s2 = torch.empty(rows, dtype=torch.float32, device=logits.device)
    logprobs = None
    if targets is not None:
        flat_targets = targets.reshape(-1, 1)
        logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    for start in range(0, rows, chunk_size):
        stop = min(start + chunk_size, rows)
        n = stop - start
        z = _load(blocks[2], flat[start:stop], temperature)
        # z - logsumexp(z), not torch.log_softmax: on CPU the latter's normaliser is summed with less care, and
        # H and S2 at V = 152k came out ~15x further from float64 (docs/benchmarks.md, section 7)
        logp = torch.sub(z, torch.logsumexp(z, dim=-1, keepdim=True), out=blocks[0, :n])
        if logprobs is not None:
            logprobs[start:stop] = logp.gather(-1, flat_targets[start:stop]).squeeze(-1)
        p = torch.exp(logp, out=blocks[1, :n])
        # Masked (-inf) logits have p = 0; a finite floor keeps 0 * log 0 at 0 instead of NaN.
        logp.clamp_(min=torch.finfo(logp.dtype).min)
        h = -torch.mul(p, logp, out=blocks[2, :n]).sum(-1)
        # In place from here on: logp becomes p^2 (ln p + H).
        s2[start:stop] = logp.add_(h[:, None]).mul_(p).mul_(p).sum(-1)
        entropy[start:stop] = h
    shape = logits.shape[:-1]
    return (None if logprobs is None else logprobs.view(shape)), entropy.view(shape), s2.view(shape)


def token_logprobs(
    logits: Tensor, targets: Tensor, *, temperature: float = 1.0, chunk_size: int | None = None
) -> Tensor:
    """log softmax(logits / temperature)[target] per position, differentiable, in float32.

    logits: (..., V), any float dtype; targets: (...) int ids. Returns (...) float32. Forward and backward
    walk the rows `chunk_size` at a time (default: DEFAULT_CHUNK_ELEMENTS // V rows), so the extra memory is
    one (chunk, V) float32 block and one float per row, beside the gradient of the logits itself (their
    dtype). A plain `gather - logsumexp` holds several (..., V) float32 temporaries instead: about 5 GB
    per 8k-token sequence at V = 152k (docs/benchmarks.md). Needs `logits.reshape(-1, V)` to be a view
    (contiguous logits), otherwise it copies them once.
    """
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets must have the shape of logits without its last dim {tuple(logits.shape[:-1])}; "
            f"got {tuple(targets.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    vocab = logits.shape[-1]
    if chunk_size is None:
        chunk_size = max(1, DEFAULT_CHUNK_ELEMENTS // vocab)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    return _TokenLogProbs.apply(logits, targets, float(temperature), int(chunk_size))


class _TokenLogProbs(torch.autograd.Function):
    """d logp_a / d z = (onehot(a) - softmax(z / T)) / T, rebuilt chunk by chunk from the saved logsumexp."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk_size: int) -> Tensor:
        vocab = logits.shape[-1]
        flat, index = logits.reshape(-1, vocab), targets.reshape(-1, 1)
        rows = flat.shape[0]
        out = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        block = torch.empty(min(chunk_size, max(rows, 1)), vocab, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, chunk_size):
            stop = min(start + chunk_size, rows)
            z = _load(block, flat[start:stop], temperature)
            lse[start:stop] = torch.logsumexp(z, dim=-1)
            out[start:stop] = z.gather(-1, index[start:stop]).squeeze(-1) - lse[start:stop]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out.view(targets.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None, None]:
        logits, targets, lse = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        vocab = logits.shape[-1]
        flat, index = logits.reshape(-1, vocab), targets.reshape(-1, 1)
        grad = grad_out.reshape(-1, 1).float() / temperature  # (rows, 1)
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_flat = grad_logits.view(-1, vocab)
        rows = flat.shape[0]
        block = torch.empty(min(chunk_size, max(rows, 1)), vocab, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, chunk_size):
            stop = min(start + chunk_size, rows)
            z = _load(block, flat[start:stop], temperature)
            # -g * softmax(z), then + g at the target: the gradient of g * (z_a - logsumexp(z)) in z.
            p = z.sub_(lse[start:stop, None]).exp_().mul_(-grad[start:stop])
            p.scatter_add_(-1, index[start:stop], grad[start:stop])
            grad_flat[start:stop] = p
        return grad_logits, None, None, None


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
    that truly raise entropy when reinforced). theory/regime: an int64 index into REGIMES;
    theory/critical_weight is W* = 1 + Lambda/Gamma in the needs_w regime and NaN in every other one
    (module docstring). Precision and mean s* are NaN when there are no high+ tokens.
    """
    mask = action_mask.bool()
    adv = advantages[:, None].expand_as(surprisal) if advantages.dim() == 1 else advantages
    s = surprisal.double()
    a_phi = adv.double() * phi(torch.exp(-s), entropy.double(), s2.double())
    zero = torch.zeros((), dtype=a_phi.dtype, device=a_phi.device)
    lam = torch.where(mask, a_phi, zero).sum()  # where, not a product: masked positions may hold NaN
    gam = -torch.where(high_pos, a_phi, zero).sum()
    regime = regime_codes(lam, gam, high_pos.any())
    defined = regime == REGIMES.index("needs_w")
    critical_weight = torch.where(defined, 1.0 + lam / torch.where(defined, gam, 1.0), float("nan"))
    s_star = critical_surprisal(entropy[high_pos], s2[high_pos])
    precision = (surprisal[high_pos] > s_star).double().mean()
    return {
        "theory/lambda": lam.float(),
        "theory/gamma": gam.float(),
        "theory/critical_weight": critical_weight.float(),
        "theory/regime": regime,
        "theory/proxy_precision": precision.float(),
        "theory/critical_surprisal_mean": s_star.double().mean().float(),
    }


def regime_codes(lam: Tensor, gam: Tensor, has_high_pos: Tensor | bool) -> Tensor:
    """Index into REGIMES of each (Lambda, Gamma) pair (elementwise; int64): see the module docstring."""
    has = torch.as_tensor(has_high_pos, device=lam.device)
    code = torch.where(gam > 0, REGIMES.index("needs_w"), REGIMES.index("no_w_helps"))
    code = torch.where(lam < 0, REGIMES.index("rising"), code)
    return torch.where(has, code, REGIMES.index("undefined"))


def token_entropy(logits: Tensor, *, temperature: float = 1.0, chunk_size: int | None = None) -> Tensor:
    """Entropy of softmax(logits / temperature) per position, differentiable, in float32 (the entropy bonus's term).

    logits: (..., V). Returns (...) float32. Chunked like token_logprobs: one (chunk, V) float32 block and two
    floats per row beside the gradient of the logits; dH/dz_v = -p_v (ln p_v + H) / temperature.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    chunk = _check_chunk(chunk_size, logits.reshape(-1, logits.shape[-1]).shape[0], logits.shape[-1])
    return _TokenEntropy.apply(logits, float(temperature), int(chunk))


class _TokenEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk_size: int) -> Tensor:
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        rows = flat.shape[0]
        entropy = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        block = torch.empty(min(chunk_size, max(rows, 1)), vocab, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, chunk_size):
            stop = min(start + chunk_size, rows)
            z = _load(block, flat[start:stop], temperature)
            lse[start:stop] = torch.logsumexp(z, dim=-1)
            logp = z.sub_(lse[start:stop, None]).clamp_(min=torch.finfo(z.dtype).min)
            entropy[start:stop] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return entropy.view(logits.shape[:-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None]:
        logits, lse, entropy = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        grad = grad_out.reshape(-1, 1).float() / temperature
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_flat = grad_logits.view(-1, vocab)
        rows = flat.shape[0]
        block = torch.empty(min(chunk_size, max(rows, 1)), vocab, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, chunk_size):
            stop = min(start + chunk_size, rows)
            logp = _load(block, flat[start:stop], temperature).sub_(lse[start:stop, None])
            logp.clamp_(min=torch.finfo(logp.dtype).min)
            # -g * p * (ln p + H)
            grad_flat[start:stop] = logp.exp() * (logp + entropy[start:stop, None]) * -grad[start:stop]
        return grad_logits, None, None
