"""Benchmark stare.token_weights against one torch.topk over the same batch's action tokens.

Batch (defaults): B=512 trajectories x T=8192 positions (4M tokens). Each row has a response
length drawn uniformly from [0, T]; positions before it are action tokens, the rest padding,
so about half the tokens are masked out. Advantages are per trajectory (B,), GRPO style:
groups of --group rollouts with 0/1 rewards, normalized within the group; groups whose rewards
all agree get advantage 0. Surprisal ~ Exponential(mean 0.5), entropy ~ U(0, 2 * --entropy-mean),
both float32.

Baseline: torch.topk(values, k) with values = surprisal[mask] (all action tokens, gathered once
beforehand) and k = ceil(--top-ratio * n). The gather alone, topk(sorted=False) and kthvalue are
reference lines. Timing is interleaved: --warmup untimed rounds, then --repeats rounds that each
call every case once, so load drift and allocator state are shared. Reported per case: median,
min and max wall time, median minor page faults per call (fresh 4 KiB pages touched), and the
ratio of the median to the baseline's; and how many cores other processes kept busy meanwhile.

Run: .venv/bin/python benchmarks/bench_token_weights.py [--help]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable

import torch
from _machine import cpu_snapshot, other_cores
from torch import Tensor

from stare_agent.stare import token_weights

BASELINE = "BASELINE torch.topk(surprisal[mask], k)"


def make_batch(
    batch: int, length: int, group: int, entropy_mean: float, seed: int, mask_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """surprisal (B, T), advantages (B,), action_mask (B, T), entropy (B, T); see the module docstring."""
    if batch % group:
        raise ValueError(f"--batch ({batch}) must be a multiple of --group ({group})")
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    action_mask = (torch.arange(length)[None, :] < lengths[:, None]).to(mask_dtype)
    success = torch.rand(batch // group, 1, generator=gen)
    rewards = (torch.rand(batch // group, group, generator=gen) < success).float()
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
    surprisal = -0.5 * torch.log1p(-torch.rand(batch, length, generator=gen))  # Exponential, mean 0.5
    entropy = 2.0 * entropy_mean * torch.rand(batch, length, generator=gen)
    return surprisal, advantages, action_mask, entropy


def timed(fn: Callable[[], object]) -> tuple[float, int]:
    """(seconds, minor page faults) of one call."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int) -> dict[str, list[tuple[float, int]]]:
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    out: dict[str, list[tuple[float, int]]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            out[name].append(timed(fn))
    return out


def other_load(start: tuple[float, float, float] | None) -> str:
    """Average number of cores other processes kept busy since `start` (they distort the timings)."""
    others = other_cores(start)
    return "unknown" if others is None else f"{others:.2f} of {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=512, help="B, trajectories (default 512)")
    parser.add_argument("--length", type=int, default=8192, help="T, positions per trajectory (default 8192)")
    parser.add_argument("--group", type=int, default=8, help="rollouts per prompt for the advantages (default 8)")
    parser.add_argument("--top-ratio", type=float, default=0.1, help="P, and k = ceil(P * n) for topk (default 0.1)")
    parser.add_argument("--entropy-mean", type=float, default=0.25, help="mean entropy; < 0.3 opens the gate")
    parser.add_argument("--mask-dtype", choices=["bool", "float32"], default="bool", help="action_mask dtype")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds; the median is reported (default 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before timing (default 2)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads; 0 keeps the default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="also print torch.profiler's op table for O1")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    mask_dtype = torch.bool if args.mask_dtype == "bool" else torch.float32
    surprisal, advantages, action_mask, entropy = make_batch(
        args.batch, args.length, args.group, args.entropy_mean, args.seed, mask_dtype
    )
    mask = action_mask.bool()
    n = int(mask.count_nonzero())
    k = math.ceil(args.top_ratio * n)
    n_pos = int((mask & (advantages[:, None] > 0)).count_nonzero())
    n_neg = int((mask & (advantages[:, None] < 0)).count_nonzero())
    cpu = platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs ({cpu})")
    print(
        f"B={args.batch} T={args.length} tokens={mask.numel():,} action={n:,} ({n / mask.numel():.1%}) "
        f"T+={n_pos:,} T-={n_neg:,} zero-advantage trajectories={int((advantages == 0).sum())}/{args.batch} "
        f"entropy mean={float(entropy[mask].mean()):.3f} k={k:,} mask dtype={args.mask_dtype}"
    )

    values = surprisal[mask]
    batch_args = (surprisal, advantages, action_mask, entropy)
    hot = (surprisal, advantages, action_mask, entropy + 0.6)  # entropy mean > 0.3: batch gate closed
    fns: dict[str, Callable[[], object]] = {
        "gather surprisal[mask] (2-D bool index)": lambda: surprisal[mask],
        "gather surprisal.view(-1)[mask.view(-1)]": lambda: surprisal.view(-1)[mask.view(-1)],
        BASELINE: lambda: torch.topk(values, k),
        "torch.topk(..., sorted=False)": lambda: torch.topk(values, k, sorted=False),
        "torch.kthvalue(..., n - k + 1)": lambda: torch.kthvalue(values, n - k + 1),
    }
    cases = [
        ("O1 gate=batch (open)", batch_args, "O1", "batch"),
        ("O1 gate=batch (closed)", hot, "O1", "batch"),
        ("O1 gate=off", batch_args, "O1", "off"),
        ("O1 gate=token", batch_args, "O1", "token"),
        ("O1 gate=sample", batch_args, "O1", "sample"),
        ("C2 gate=batch (open)", batch_args, "C2", "batch"),
    ]
    for name, case_args, op, gate in cases:
        kw = {"top_ratio": args.top_ratio, "op": op, "gate": gate}
        fns[f"token_weights {name}"] = lambda a=case_args, kw=kw: token_weights(*a, **kw)

    print(f"\ninterleaved: {args.warmup} warm-up rounds, then {args.repeats} timed rounds calling every case once")
    start = cpu_snapshot()
    results = interleaved(fns, args.repeats, args.warmup)
    load = other_load(start)
    med = {name: statistics.median(t for t, _ in r) for name, r in results.items()}
    print(f"{'case':44s} {'median':>9s} {'min':>7s} {'max':>7s} {'faults':>7s} {'/topk':>6s}")
    for name, r in results.items():
        times = [t for t, _ in r]
        faults = statistics.median(f for _, f in r)
        print(
            f"{name:44s} {med[name] * 1e3:6.1f} ms {min(times) * 1e3:7.1f} {max(times) * 1e3:7.1f} "
            f"{faults:7.0f} {med[name] / med[BASELINE]:6.2f}"
        )
    print(f"other processes kept busy meanwhile: {load}")

    o1 = [med[f"token_weights {name}"] / med[BASELINE] for name, _, op, _ in cases if op == "O1"]
    c2 = med["token_weights C2 gate=batch (open)"] / med[BASELINE]
    verdict = "met" if max(o1) <= 3 else "NOT met"
    print(f"token_weights / topk: O1 {min(o1):.2f}-{max(o1):.2f} (target <= 3: {verdict}), C2 {c2:.2f}")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.repeats):
                token_weights(*batch_args, top_ratio=args.top_ratio, op="O1")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
