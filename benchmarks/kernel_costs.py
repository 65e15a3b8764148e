"""What a warm kernel costs: its memory when idle, and the time of the reset a stateless kernel gets between calls.

Memory of idle warm kernels (numpy and sympy loaded by the pool's warm-up), for each `--clean-state` (fork: the
kernel with its template and spare worker; reset: the kernel alone), after --calls stateless calls on the pool:
RSS, PSS and USS per kernel, summed over each kernel's processes (namespace kernels have an unshare and a launcher
process above the kernel).

USS (private pages) is what each further kernel adds; RSS counts pages shared with the other kernels again.
Read from /proc/PID/smaps_rollup (Linux 4.14+). Namespace mode needs root and util-linux unshare; it is skipped
where the probe says it is unavailable.

Reset: on one process-mode kernel, --resets times a `print(1+1)` call and then the pool's reset (RESET_CODE plus
the warm-up, as KernelPool runs it after a stateless call), each timed around the pool's own Kernel.execute (no HTTP).

Run: .venv/bin/python benchmarks/kernel_costs.py [--kernels 3] [--resets 30]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bench_clean_state import EXPECTED, SNIPPET  # same directory: run as a script
from bench_sandbox import descendants

from stare_sandbox.isolation import detect_isolation
from stare_sandbox.pool import RESET_CODE, KernelPool, PoolSettings
from stare_sandbox.sessions import run_stateless


def memory_kib(pid: int) -> dict[str, int]:
    """Rss, Pss and Uss (Private_Clean + Private_Dirty) of one process, in KiB; zeros if it is gone."""
    found = {"rss": 0, "pss": 0, "uss": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, value = line.partition(":")
                kib = int(value.split()[0]) if value.split() else 0
                if key == "Rss":
                    found["rss"] = kib
                elif key == "Pss":
                    found["pss"] = kib
                elif key in ("Private_Clean", "Private_Dirty"):
                    found["uss"] += kib
    except (OSError, ValueError, IndexError):
        pass
    return found


async def measure(mode: str, kernels: int, clean_state: str = "fork", calls: int = 0) -> list[dict[str, float]]:
    settings = PoolSettings(pool_size=kernels, max_kernels=kernels + 1, isolation=mode, clean_state=clean_state)
    pool = KernelPool(settings)
    await pool.start()
    try:
        while pool.ready_count < kernels:
            await asyncio.sleep(0.2)
        for _ in range(calls):
            if (await run_stateless(pool, SNIPPET, 30)).stdout != EXPECTED:
                raise RuntimeError("a stateless call failed")
        while pool.ready_count < kernels:  # back from their last call (reset, or cleaned up after)
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # let the warm-up's allocations settle
        rows = []
        for kernel in list(pool._ready):
            pid = kernel.manager.provisioner.process.pid
            procs = [pid, *descendants(pid)]
            totals = {"rss": 0, "pss": 0, "uss": 0}
            for pid in procs:
                for key, kib in memory_kib(pid).items():
                    totals[key] += kib
            rows.append({"processes": len(procs), **{key: kib / 1024 for key, kib in totals.items()}})
        return rows
    finally:
        await pool.close()


async def reset_times(resets: int) -> tuple[list[float], list[float]]:
    """Seconds of `print(1+1)` and of the reset after it, `resets` times on one kernel."""
    settings = PoolSettings(pool_size=1, max_kernels=2, isolation="process")
    pool = KernelPool(settings)
    await pool.start()
    try:
        kernel = await pool.acquire()
        calls, resets_s = [], []
        for _ in range(resets):
            began = time.perf_counter()
            call = await kernel.execute("print(1+1)", 10.0, settings)
            calls.append(time.perf_counter() - began)
            began = time.perf_counter()
            reset = await kernel.execute(RESET_CODE + settings.warmup_code, 30.0, settings, user=False)
            resets_s.append(time.perf_counter() - began)
            if call.status != "ok" or reset.status != "ok":
                raise RuntimeError(f"a call or reset failed: {call.status}, {reset.status}")
        pool.give_back_later(kernel)
        return calls, resets_s
    finally:
        await pool.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=3, help="warm kernels per mode (default 3)")
    parser.add_argument("--resets", type=int, default=30, help="timed call + reset pairs (default 30; 0: none)")
    parser.add_argument("--clean-state", default="fork,reset", help="pool.clean_state values, comma-separated")
    parser.add_argument("--calls", type=int, default=8, help="stateless calls on each pool before its memory is read")
    args = parser.parse_args(argv)
    print("| isolation | clean_state | kernels | processes each | RSS MB | PSS MB | USS MB (median [min-max]) |")
    print("|---|---|---:|---:|---:|---:|---|")
    for mode in ("process", "namespaces"):
        if mode == "namespaces" and detect_isolation("auto").mode != "namespaces":
            print(f"| {mode} | - | - | - | - | - | not available here |")
            continue
        for clean_state in args.clean_state.split(","):
            rows = asyncio.run(measure(mode, args.kernels, clean_state, args.calls))
            med = {key: statistics.median(r[key] for r in rows) for key in ("rss", "pss", "uss")}
            uss = [r["uss"] for r in rows]
            print(
                f"| {mode} | {clean_state} | {len(rows)} | {rows[0]['processes']} | {med['rss']:.0f} | "
                f"{med['pss']:.0f} | {med['uss']:.0f} [{min(uss):.0f}-{max(uss):.0f}] |"
            )
    if args.resets:
        calls, resets = asyncio.run(reset_times(args.resets))
        for name, times in (("print(1+1)", calls), ("reset + warm-up", resets)):
            ms = sorted(1000 * t for t in times)
            print(f"{name}: median {statistics.median(ms):.1f} ms [{ms[0]:.1f}-{ms[-1]:.1f}] over {len(ms)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
