"""Benchmark the passes over the logits (log-probs, entropy, S2, SFT loss, entropy bonus) against the plain versions.

For each (V, T), logits (T, V) ~ N(0, --scale^2) and random targets are made from a fixed seed, and each variant
runs in a fresh subprocess (this script re-invoked with a hidden flag). The passes (--passes):

    reference  (no grad) log-probs of the targets, entropy H and S2 of softmax(logits / temperature): the local
               backend's reference pass
      naive:   z = logits / T; logp = z.gather - logsumexp(z); then entropy_and_s2(z) (the pass before issue 9)
      chunked: theory.sampling_stats(logits, targets, temperature)
    update     forward + backward into the logits' gradient: the RL update's log-probs
      naive:   logp = (z.gather - logsumexp(z)) with autograd; (logp * g).sum().backward()
      chunked: theory.token_logprobs(logits, targets, temperature) with the same backward
    sft        the SFT loss (mean next-token cross-entropy at temperature 1), forward + backward
      naive:   torch.nn.functional.cross_entropy(logits, targets), as a Hugging Face model's own loss
      chunked: -theory.token_logprobs(logits, targets).mean(), as backends/local/sft.py
    entropy    the entropy bonus's term, forward + backward of (H * g).sum()
      naive:   H = -(softmax(z) * log_softmax(z)).sum(-1) with autograd
      chunked: theory.token_entropy(logits, temperature)
    stats      (no grad) H and S2 of float32 logits: the pass the openrlhf backend adds to OpenRLHF's experience
               forward (StarePolicyModelActor.forward_with_stats). OpenRLHF's Actor.forward has already made a
               float32 copy of the model's output and divided it by the temperature in place, so these logits
               are float32 at temperature 1; the model's own bfloat16 logits are not counted here
      naive:   lse = logsumexp(z); logp = z - lse; p = exp(logp); H and S2 over the whole (T, V)
      chunked: theory.entropy_and_s2(logits)

The subprocess creates the logits (and, for a pass with a backward, marks them as requiring grad), runs the
variant once on 2 rows (library code, thread pool), resets the peak resident set, runs the variant once and
reports peak extra memory = VmHWM - RSS before the call; a backward's gradient of the logits (the size of the
logits) is part of its extra memory, so "beyond grad" subtracts it. Then the median of --repeats timed calls.
The parent recomputes the first --check-rows rows of every output (log-probs, H, S2, losses, gradients) in
float64 from the same inputs and reports each variant's largest absolute error against it; the chunked variant
must be within max(--tol, 2 x the naive variant's error). Where the naive variant was not run, its error at the
same vocabulary and the largest smaller row count of this run stands in (sizes run smallest first; the logits'
checked rows are the same rows at every row count, from the same seed), else 16 float32 epsilons x the largest
exact value. A naive variant whose expected peak (PLAIN_PEAK x the
float32 logits) would not fit in this machine's available memory is not run; its row says so, and the
chunked variant is still run and checked.

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

from stare_agent.theory import entropy_and_s2, sampling_stats, token_entropy, token_logprobs

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
    return z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


def chunked_update(logits, targets, temperature):
    return token_logprobs(logits, targets, temperature=temperature)


def naive_sft(logits, targets, temperature):
    return torch.nn.functional.cross_entropy(logits, targets)


def chunked_sft(logits, targets, temperature):
    return -token_logprobs(logits, targets).mean()


def naive_entropy(logits, targets, temperature):
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def chunked_entropy(logits, targets, temperature):
    return token_entropy(logits, temperature=temperature)


def naive_stats(logits, targets, temperature):
    with torch.no_grad():
        logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        p = logp.exp()
        h = -(p * logp).sum(-1)
        s2 = (p * p * (logp + h[:, None])).sum(-1)
    return {"h": h, "s2": s2}


def chunked_stats(logits, targets, temperature):
    h, s2 = entropy_and_s2(logits)
    return {"h": h, "s2": s2}


PASSES = {
    "reference": {"naive": naive_reference, "chunked": chunked_reference, "backward": False},
    "update": {"naive": naive_update, "chunked": chunked_update, "backward": True},
    "sft": {"naive": naive_sft, "chunked": chunked_sft, "backward": True, "temperature": 1.0},
    "entropy": {"naive": naive_entropy, "chunked": chunked_entropy, "backward": True},
    "stats": {"naive": naive_stats, "chunked": chunked_stats, "backward": False, "temperature": 1.0},
}
PLAIN_PEAK = {"reference": 2.0, "update": 4.0, "sft": 3.0, "entropy": 6.0, "stats": 5.0}
"""Extra memory of each naive variant (its "x logits", the gradient included), as measured by this script
(docs/benchmarks.md, sections 4 and 7): with the logits themselves, what a naive run needs free."""


def make_inputs(spec: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (T, V) float32, targets (T,) and the upstream gradient (T,) of a backward, from the spec's seed."""
    torch.manual_seed(spec["seed"])
    logits = torch.randn(spec["rows"], spec["vocab"]).mul_(spec["scale"])
    return logits, torch.randint(0, spec["vocab"], (spec["rows"],)), torch.randn(spec["rows"])


def temperature_of(spec: dict) -> float:
    return PASSES[spec["pass"]].get("temperature", spec["temperature"])


def exact(spec: dict, block: int = 256) -> dict[str, torch.Tensor]:
    """Every output of the pass in float64 for the first check_rows rows, a block of rows at a time."""
    logits, targets, upstream = make_inputs(spec)
    n, rows, which = spec["check_rows"], spec["rows"], spec["pass"]
    temperature = temperature_of(spec)
    out = {k: torch.empty(n, dtype=torch.float64) for k in ("logprobs", "h", "s2")}
    grad_out = torch.empty(n, spec["vocab"], dtype=torch.float64)
    loss = 0.0
    for start in range(0, n, block):
        r = slice(start, min(start + block, n))
        logp = torch.log_softmax(logits[r].double() / temperature, dim=-1)
        p = logp.exp()
        h = -(p * logp).sum(-1)
        out["logprobs"][r] = logp.gather(-1, targets[r, None]).squeeze(-1)
        out["h"][r], out["s2"][r] = h, (p * p * (logp + h[:, None])).sum(-1)
        if which == "entropy":  # d(sum g H)/dz = -g p (ln p + H) / T
            grad_out[r] = -upstream[r, None].double() * p * (logp + h[:, None]) / temperature
        else:  # d(sum g logp)/dz = g (onehot - p) / T; the SFT loss is g = -1 / rows
            g = torch.full((r.stop - r.start, 1), -1.0 / rows, dtype=torch.float64)
            g = g if which == "sft" else upstream[r, None].double()
            grad = -p * g
            grad.scatter_add_(-1, targets[r, None], g)
            grad_out[r] = grad / temperature
    keep = {"reference": ("logprobs", "h", "s2"), "update": ("logprobs",), "entropy": ("h",), "sft": ()}
    result = {k: out[k] for k in keep.get(which, ("h", "s2"))}
    if PASSES[which]["backward"]:
        result["grad"] = grad_out
    if which == "sft":  # the mean over every row, not only the checked ones
        for start in range(0, rows, block):
            r = slice(start, min(start + block, rows))
            loss -= float(torch.log_softmax(logits[r].double(), dim=-1).gather(-1, targets[r, None]).sum()) / rows
        result["loss"] = torch.tensor(loss, dtype=torch.float64)
    return result


def worker(spec: dict, out_path: str) -> None:
    """Run one variant; save the outputs' first check_rows rows to out_path and print one JSON line."""
    logits, targets, upstream = make_inputs(spec)
    fn = PASSES[spec["pass"]][spec["variant"]]
    backward = PASSES[spec["pass"]]["backward"]
    temperature = temperature_of(spec)
    n = spec["check_rows"]

    def call(x, t):
        if not backward:
            return fn(x, t, temperature)
        x = x.detach().requires_grad_(True)
        out = fn(x, t, temperature)
        (out if out.dim() == 0 else out * upstream[: len(t)]).sum().backward()
        name = {"update": "logprobs", "entropy": "h", "sft": "loss"}[spec["pass"]]
        return {name: out.detach(), "grad": x.grad}

    call(logits[:2].clone(), targets[:2])
    if backward:
        logits.requires_grad_(True)
    reset = reset_peak_rss()
    base_kib = proc_status_kib("VmRSS") if reset else proc_status_kib("VmHWM")
    start = time.perf_counter()
    out = call(logits, targets)
    first = time.perf_counter() - start
    peak_kib = proc_status_kib("VmHWM")
    torch.save({k: v[:n].clone() if v.dim() else v for k, v in out.items()}, out_path)
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


def available_mib() -> float | None:
    """MemAvailable of /proc/meminfo in MiB (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", default="32768,151936", help="comma-separated V values")
    parser.add_argument("--rows", default="8192,4096", help="comma-separated T (positions), one per V or one for all")
    parser.add_argument("--passes", default="reference,update", help=f"comma-separated, of {', '.join(PASSES)}")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls after the first (memory) call")
    parser.add_argument("--scale", type=float, default=4.0, help="logits ~ N(0, scale^2)")
    parser.add_argument("--tol", type=float, default=1e-5, help="abs error vs float64 always allowed")
    parser.add_argument("--check-rows", type=int, default=1024, help="rows checked against float64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    parser.add_argument("--_out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._worker:
        worker(json.loads(args._worker), args._out)
        return
    passes = args.passes.split(",")
    unknown = sorted(set(passes) - set(PASSES))
    if unknown:
        raise SystemExit(f"--passes: unknown {unknown}; known: {', '.join(PASSES)}")

    pairs = sorted(sizes(args.vocab, args.rows), key=lambda pair: pair[1])  # smallest first: see the docstring
    naive_errors: dict[tuple[str, int], float] = {}  # (pass, vocab) -> the naive error at the latest row count
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; T = {args.temperature}"
    )
    print("| V | positions | logits MiB | pass | variant | extra MiB | beyond grad | x logits | median s | vs naive "
          "| max abs error vs float64 | other cores |")  # fmt: skip
    print("|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    failed = False
    for vocab, n_rows in pairs:
        for which in passes:
            logits_mib = n_rows * vocab * 4 / MIB
            naive_s, naive_error, truth = None, None, None
            for variant in ("naive", "chunked"):
                spec = {"vocab": vocab, "rows": n_rows, "pass": which, "variant": variant, "repeats": args.repeats}
                spec.update(seed=args.seed, scale=args.scale, temperature=args.temperature)
                spec["check_rows"] = min(args.check_rows, n_rows)
                cells = [f"{vocab}", f"{n_rows}", f"{logits_mib:.0f}", which, variant]
                need = logits_mib * (1 + PLAIN_PEAK[which])  # the logits, and what the naive variant adds
                free = available_mib()
                if variant == "naive" and free is not None and need > 0.9 * free:
                    print("| " + " | ".join(cells) + f" | not run: needs ~{need / 1024:.0f} GiB, "
                          f"{free / 1024:.0f} GiB available | | | | | | |", flush=True)  # fmt: skip
                    continue
                result, out = run_worker(__file__, spec)
                truth = truth or exact(spec)
                diff = max(float((out[k].double() - truth[k]).abs().max()) for k in out)
                if naive_s is None and variant == "naive":
                    naive_s, naive_error = result["median_s"], diff
                    naive_errors[which, vocab] = diff
                if naive_error is None:  # naive not run: its error at fewer rows, else float32 rounding of the largest
                    naive_error = naive_errors.get((which, vocab))
                if naive_error is None:
                    naive_error = (
                        8 * torch.finfo(torch.float32).eps * max(float(v.abs().max()) for v in truth.values())
                    )
                bad = variant == "chunked" and diff > max(args.tol, 2 * naive_error)
                failed |= bad
                extra = result["extra_mib"]
                grad_mib = logits_mib if PASSES[which]["backward"] else 0.0
                cells += [
                    "n/a" if extra is None else f"{extra:.0f}",
                    "n/a" if extra is None else f"{extra - grad_mib:.0f}",
                    "n/a" if extra is None else f"{extra / logits_mib:.2f}",
                    f"{result['median_s']:.2f}",
                    "n/a" if naive_s is None else f"{result['median_s'] / naive_s:.2f}",
                    f"{diff:.1e}{' FAIL' if bad else ''}",
                    "n/a" if result["other_cores"] is None else f"{result['other_cores']:.2f}",
                ]
                print("| " + " | ".join(cells) + " |", flush=True)
    print(
        "\nextra = peak RSS during one call minus RSS before it; beyond grad = extra minus the logits' gradient "
        "(passes with a backward; every update needs it); x logits = extra / logits size; other "
        "cores = cores kept busy by other processes while timing"
    )
    print(f"chunked errors within max({args.tol:g}, 2 x naive's): {'no' if failed else 'yes'}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
