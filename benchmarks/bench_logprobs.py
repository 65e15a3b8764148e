"""Benchmark the RL log-prob passes (theory.sampling_stats, theory.token_logprobs) against the plain versions.

For each vocabulary size V, float32 logits (T, V) ~ N(0, --scale^2) and random targets are made from a fixed
seed, and each variant runs in a fresh subprocess (this script re-invoked with a hidden flag):

    reference pass (no grad): log-probs of the targets, entropy H and S2 of softmax(logits / temperature)
      naive:   z = logits / T; logp = z.gather - logsumexp(z); then entropy_and_s2(z) (the pass before issue 9:
               a full-width logsumexp, plus the chunked entropy pass)
      chunked: theory.sampling_stats(logits, targets, temperature) (one chunked pass for all three)
    update pass (forward + backward into the logits' gradient):
      naive:   logp = (z.gather - logsumexp(z)) with autograd; (logp * g).sum().backward()
      chunked: theory.token_logprobs(logits, targets, temperature) with the same backward

The subprocess creates the logits (and, for the update, marks them as requiring grad), runs the variant once on
2 rows (library code, thread pool), resets the peak resident set, runs the variant once and reports
peak extra memory = VmHWM - RSS before the call; the update's gradient of the logits (the size of the logits)
is part of every update's extra memory, so "beyond grad" subtracts it. Then the median of --repeats timed calls.
The parent recomputes every output (log-probs, H, S2, the gradient) in float64 from the same seed and reports
each variant's largest absolute error against it; the chunked variant must be within max(--tol, 2 x the naive
variant's error).

Run: .venv/bin/python benchmarks/bench_logprobs.py [--help]     (~3 min on 2 cores with the defaults)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from _machine import cpu_snapshot, other_cores, proc_status_kib, reset_peak_rss, run_worker, sizes

from stare_agent.theory import entropy_and_s2, sampling_stats, token_logprobs

MIB = 2**20


def naive_reference(logits, targets, temperature):
    with torch.no_grad():
        z = logits / temperature
        logp = z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
        h, s2 = entropy_and_s2(z)
    return {"logprobs": logp, "h": h, "s2": s2}


def chunked_reference(logits, targets, temperature):
    logp, h, s2 = sampling_stats(logits, targets, temperature=temperature)
    return {"logprobs": logp, "h": h, "s2": s2}


def naive_update(logits, targets, temperature):
    z = logits / temperature
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return logp


def chunked_update(logits, targets, temperature):
    return token_logprobs(logits, targets, temperature=temperature)


VARIANTS = {
    ("reference", "naive"): naive_reference,
    ("reference", "chunked"): chunked_reference,
    ("update", "naive"): naive_update,
    ("update", "chunked"): chunked_update,
}


def make_inputs(spec: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (T, V), targets (T,) and the upstream gradient (T,) of the update, from the spec's seed."""
    torch.manual_seed(spec["seed"])
    logits = torch.randn(spec["rows"], spec["vocab"]).mul_(spec["scale"])
    return logits, torch.randint(0, spec["vocab"], (spec["rows"],)), torch.randn(spec["rows"])


def exact(spec: dict, block: int = 256) -> dict[str, torch.Tensor]:
    """Every output of both passes in float64, a block of rows at a time: log-probs, H, S2, d(sum g logp)/dz."""
    logits, targets, upstream = make_inputs(spec)
    out = {k: torch.empty(spec["rows"], dtype=torch.float64) for k in ("logprobs", "h", "s2")}
    out["grad"] = torch.empty(logits.shape, dtype=torch.float32)
    for start in range(0, spec["rows"], block):
        rows = slice(start, start + block)
        logp = torch.log_softmax(logits[rows].double() / spec["temperature"], dim=-1)
        p = logp.exp()
        h = -(p * logp).sum(-1)
        out["logprobs"][rows] = logp.gather(-1, targets[rows, None]).squeeze(-1)
        out["h"][rows], out["s2"][rows] = h, (p * p * (logp + h[:, None])).sum(-1)
        grad = -p * upstream[rows, None].double()
        grad.scatter_add_(-1, targets[rows, None], upstream[rows, None].double())
        out["grad"][rows] = grad / spec["temperature"]
    return out


def worker(spec: dict, out_path: str) -> None:
    """Run one variant; save its outputs to out_path and print one JSON line of measurements."""
    logits, targets, upstream = make_inputs(spec)
    fn = VARIANTS[(spec["pass"], spec["variant"])]
    update = spec["pass"] == "update"

    def call(x, t):
        if not update:
            return fn(x, t, spec["temperature"])
        x = x.detach().requires_grad_(True)
        out = fn(x, t, spec["temperature"])
        (out * upstream[: len(t)]).sum().backward()
        return {"logprobs": out.detach(), "grad": x.grad}

    call(logits[:2].clone(), targets[:2])
    if update:
        logits.requires_grad_(True)
    reset = reset_peak_rss()
    base_kib = proc_status_kib("VmRSS") if reset else proc_status_kib("VmHWM")
    start = time.perf_counter()
    out = call(logits, targets)
    first = time.perf_counter() - start
    peak_kib = proc_status_kib("VmHWM")
    torch.save(out, out_path)
    del out
    load = cpu_snapshot()
    times = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        call(logits, targets)
        times.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "extra_mib": None if peak_kib is None or base_kib is None else (peak_kib - base_kib) / 1024,
                "peak_reset": reset,
                "median_s": statistics.median(times) if times else first,
                "other_cores": other_cores(load),
            }
        )
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", default="32768,151936", help="comma-separated V values")
    parser.add_argument("--rows", default="8192,4096", help="comma-separated T (positions), one per V or one for all")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls after the first (memory) call")
    parser.add_argument("--scale", type=float, default=4.0, help="logits ~ N(0, scale^2)")
    parser.add_argument("--tol", type=float, default=1e-5, help="abs error vs float64 always allowed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    parser.add_argument("--_out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._worker:
        worker(json.loads(args._worker), args._out)
        return

    pairs = sizes(args.vocab, args.rows)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; T = {args.temperature}"
    )
    print("| V | positions | logits MiB | pass | variant | extra MiB | beyond grad | x logits | median s | vs naive "
          "| max abs error vs float64 | other cores |")  # fmt: skip
    print("|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    failed = False
    for vocab, n_rows in pairs:
        logits_mib = n_rows * vocab * 4 / MIB
        for which in ("reference", "update"):
            naive_s, naive_error, truth = None, None, None
            for variant in ("naive", "chunked"):
                spec = {"vocab": vocab, "rows": n_rows, "pass": which, "variant": variant, "repeats": args.repeats}
                spec.update(seed=args.seed, scale=args.scale, temperature=args.temperature)
                result, out = run_worker(__file__, spec)
                truth = truth or exact(spec)
                diff = max(float((out[k].double() - truth[k].double()).abs().max()) for k in out)
                if naive_s is None:
                    naive_s, naive_error = result["median_s"], diff
                bad = variant == "chunked" and diff > max(args.tol, 2 * naive_error)
                failed |= bad
                extra = result["extra_mib"]
                grad_mib = logits_mib if which == "update" else 0.0
                cells = [
                    f"{vocab}",
                    f"{n_rows}",
                    f"{logits_mib:.0f}",
                    which,
                    variant,
                    "n/a" if extra is None else f"{extra:.0f}",
                    "n/a" if extra is None else f"{extra - grad_mib:.0f}",
                    "n/a" if extra is None else f"{extra / logits_mib:.2f}",
                    f"{result['median_s']:.2f}",
                    f"{result['median_s'] / naive_s:.2f}",
                    f"{diff:.1e}{' FAIL' if bad else ''}",
                    "n/a" if result["other_cores"] is None else f"{result['other_cores']:.2f}",
                ]
                print("| " + " | ".join(cells) + " |", flush=True)
    print(
        "\nextra = peak RSS during one call minus RSS before it; beyond grad = extra minus the logits' gradient "
        "(update only; every update needs it); x logits = extra / logits size; other cores = cores kept busy by "
        "other processes while timing"
    )
    print(f"chunked errors within max({args.tol:g}, 2 x naive's): {'no' if failed else 'yes'}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
