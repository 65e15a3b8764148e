"""Benchmark theory.entropy_and_s2 (row-chunked) against a naive full-width version.

For each vocabulary size V, logits (R, V) float32 ~ N(0, --scale^2) are made from a fixed seed,
and each variant runs in a fresh subprocess (this script re-invoked with a hidden flag):
    naive:   logp = log_softmax(logits) over the whole (R, V); p = exp(logp);
             H = -(p * logp).sum(-1); S2 = (p * p * (logp + H[:, None])).sum(-1)
    chunked: theory.entropy_and_s2(logits, chunk_size) for the default chunk and the --chunk-mib sizes.
The subprocess creates the logits, calls the variant once on 2 rows (to load library code and
start the thread pool), resets the peak resident set (writes 5 to /proc/self/clear_refs; where
that fails, the peak so far is the baseline), runs the variant once and reports
peak extra memory = VmHWM - baseline. It then times --repeats more calls (median) and counts
their minor page faults (fresh memory being touched).
The parent checks max |H - H_naive| and max |S2 - S2_naive| <= --tol and prints one table per V.

Run: .venv/bin/python benchmarks/bench_entropy.py [--help]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import torch
from _machine import cpu_snapshot, other_cores, proc_status_kib, reset_peak_rss, run_worker, sizes
from torch import Tensor

from stare_agent.theory import DEFAULT_CHUNK_ELEMENTS, entropy_and_s2

MIB = 2**20


@torch.no_grad()
def naive_entropy_and_s2(logits: Tensor) -> tuple[Tensor, Tensor]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    h = -(p * logp).sum(-1)
    s2 = (p * p * (logp + h[:, None])).sum(-1)
    return h, s2


def worker(spec: dict, out_path: str) -> None:
    """Run one variant on fresh logits; write H and S2 to out_path and print one JSON line of measurements."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    logits = torch.randn(spec["rows"], spec["vocab"]).mul_(spec["scale"])
    chunk = spec["chunk"]  # None: naive; 0: the default chunk; else rows per chunk
    if chunk is None:
        fn = naive_entropy_and_s2
    else:
        chunk_size = None if chunk == 0 else chunk

        def fn(x: Tensor) -> tuple[Tensor, Tensor]:
            return entropy_and_s2(x, chunk_size)

    fn(logits[:2].clone())  # first use faults in library code pages and starts the thread pool: not data memory
    reset = reset_peak_rss()
    base_kib = proc_status_kib("VmRSS") if reset else proc_status_kib("VmHWM")
    start = time.perf_counter()
    h, s2 = fn(logits)
    first = time.perf_counter() - start
    peak_kib = proc_status_kib("VmHWM")
    torch.save({"h": h, "s2": s2}, out_path)
    del h, s2
    load = cpu_snapshot()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        fn(logits)
        times.append(time.perf_counter() - start)
    result = {
        "extra_mib": None if peak_kib is None or base_kib is None else (peak_kib - base_kib) / 1024,
        "peak_reset": reset,
        "first_s": first,
        "median_s": statistics.median(times) if times else first,
        "times_s": times,
        "other_cores": other_cores(load),
        "faults_per_call": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / max(spec["repeats"], 1),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", default="32768,151936", help="comma-separated V values")
    parser.add_argument("--rows", default="8192,2048", help="comma-separated R, one per V (or one for all)")
    parser.add_argument(
        "--chunk-mib",
        default="2,32",
        help="more chunk sizes for entropy_and_s2, as the MiB of one (chunk, V) float32 block, beside the default "
        f"({DEFAULT_CHUNK_ELEMENTS * 4 // MIB} MiB); rows = MiB * 2**20 / (4 V)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed calls after the first (memory) call")
    parser.add_argument("--scale", type=float, default=4.0, help="logits ~ N(0, scale^2)")
    parser.add_argument("--tol", type=float, default=1e-5, help="max abs difference allowed in H and S2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in the workers; 0: default")
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    parser.add_argument("--_out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._worker:
        worker(json.loads(args._worker), args._out)
        return

    pairs = sizes(args.vocab, args.rows)
    chunk_mib = [float(x) for x in args.chunk_mib.split(",") if x.strip()]
    threads = args.threads or torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, {os.cpu_count()} CPUs")
    print(f"each variant in a fresh process: 1 call for memory, then the median of {args.repeats} timed calls")

    failed = False
    for vocab, n_rows in pairs:
        logits_mib = n_rows * vocab * 4 / MIB
        default_rows = max(1, DEFAULT_CHUNK_ELEMENTS // vocab)

        def rows_for(mib: float, vocab: int = vocab, n_rows: int = n_rows) -> int:
            return min(max(1, int(mib * MIB / (4 * vocab))), n_rows)

        chunks: list[tuple[str, int | None, int]] = [
            ("naive", None, n_rows),
            ("chunked default", 0, min(default_rows, n_rows)),
        ]
        chunks += [(f"chunked {m:g} MiB", rows_for(m), rows_for(m)) for m in chunk_mib]
        print(f"\nV={vocab} R={n_rows}: logits {logits_mib:.0f} MiB float32")
        header = (
            f"{'variant':16s} {'rows':>5s} {'block MiB':>9s} {'extra MiB':>9s} {'x block':>7s} {'x logits':>8s} "
            f"{'median s':>8s} {'vs naive':>8s} {'faults':>7s} {'max|dH|':>8s} {'max|dS2|':>8s} {'others':>6s}"
        )
        print(header)
        ref: dict[str, Tensor] | None = None
        naive_s = None
        for name, chunk, chunk_rows in chunks:
            spec = {"vocab": vocab, "rows": n_rows, "chunk": chunk, "repeats": args.repeats}
            spec.update(seed=args.seed, scale=args.scale, threads=args.threads)
            result, out = run_worker(__file__, spec)
            if ref is None:
                ref, naive_s = out, result["median_s"]
            d_h = float((out["h"] - ref["h"]).abs().max())
            d_s2 = float((out["s2"] - ref["s2"]).abs().max())
            ok = d_h <= args.tol and d_s2 <= args.tol
            failed |= not ok
            block_mib = chunk_rows * vocab * 4 / MIB
            extra = result["extra_mib"]
            extra_s = "n/a" if extra is None else f"{extra:.0f}"
            x_block = "n/a" if extra is None else f"{extra / block_mib:.2f}"
            x_logits = "n/a" if extra is None else f"{extra / logits_mib:.2f}"
            others = "n/a" if result["other_cores"] is None else f"{result['other_cores']:.2f}"
            print(
                f"{name:16s} {chunk_rows:5d} {block_mib:9.1f} {extra_s:>9s} {x_block:>7s} {x_logits:>8s} "
                f"{result['median_s']:8.3f} {result['median_s'] / naive_s:8.2f} {result['faults_per_call']:7.0f} "
                f"{d_h:8.1e} {d_s2:8.1e} "
                f"{others:>6s}{'' if ok else '  FAIL: difference above --tol'}",
                flush=True,
            )
            if not result["peak_reset"]:
                print("  (could not reset the peak RSS; the baseline was the peak after creating the logits)")
    print(
        "\nblock = one (rows, V) float32 chunk; extra = VmHWM - RSS after creating the logits; "
        "faults = minor page faults per timed call; others = cores kept busy by other processes while timing"
    )
    print(f"H and S2 within {args.tol:g} of naive: {'no' if failed else 'yes'}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
