"""Stateless calls and session starts on the pool with forked workers, against the pool before them, in one run.

Two in-process kernel pools with the same settings but `clean_state` (stare_sandbox.pool):
    fork   user code runs in a process forked from a clean template in the kernel (the default);
    reset  user code runs in the kernel, which wipes its namespace after a stateless run and retires after a
           session (the pool before forked workers).
and, as the floor every clean design is compared with, a fresh `python -c` process per call.

Cases (kernels all warm before timing):
    stateless     --calls calls of SNIPPET (sympy, as an agent's tool call) on each pool, at concurrency 1 and
                  --concurrency, in --rounds batches alternating between the two pools (both alive, so both see
                  the same load); latency p50/p99 in ms and calls/s.
    session       each pool in turn, at --concurrency and at --sessions tasks at once (the paper's episodes per
                  engine: 64) on a pool of as many warm kernels: each task --session-rounds times opens a session,
                  runs `x = 1` and `x + 1` in it and closes it. "ready" = from asking for the session to the answer
                  of its first call (the reset pool starts a kernel for every session it retires); also "opened"
                  (the create alone) and the second call, which any call in an open session costs under the same
                  load: ready minus it is what starting a session adds.
    kernel start  --starts times, one at a time: a call on a pool with no ready kernel (pool_size 0) waits for
                  the kernel the pool starts for it; the time is that wait (process start, ipykernel, warm-up).
    fresh process `sys.executable -c SNIPPET` per call, --calls / 4 calls, at the same concurrencies.
Ratios, the targets of the issue that asked for forked workers: stateless p50 fork / reset (at most 2), and
session-ready p50 fork / the kernel start p50 (at most 0.1). CPU ms per call or session (CpuMeter) come with each
case: unlike latency, they hardly depend on what else the machine runs.

Run: .venv/bin/python benchmarks/bench_clean_state.py [--json OUT]   (~4 min on 2 cores with the defaults)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from stare_sandbox.pool import KernelPool, PoolSettings
from stare_sandbox.sessions import SessionStore, run_stateless

SNIPPET = "import sympy\nx = sympy.symbols('x')\nprint(sympy.factor(x**2 - 1))\n"
EXPECTED = "(x - 1)*(x + 1)\n"


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "p50": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
    }


class CpuMeter:
    """CPU time spent while its `with` blocks run: this process's (the pool's side: client, event loop) and the
    pool's kernels' (with their templates and workers, from the pool's cgroups; absent without cgroups). Unlike
    latency, CPU per call hardly depends on what else the machine runs."""

    def __init__(self, pool: KernelPool):
        self.pool = pool
        self.server = self.kernels = 0.0
        self.has_kernels = pool.kernels_cpu_seconds() is not None

    def __enter__(self) -> None:
        self.began = (time.process_time(), self.pool.kernels_cpu_seconds() or 0.0)

    def __exit__(self, *_: object) -> None:
        self.server += time.process_time() - self.began[0]
        self.kernels += (self.pool.kernels_cpu_seconds() or 0.0) - self.began[1]

    def per(self, count: int) -> dict[str, float]:
        """CPU ms per call (or session): the pool's side, and the kernels' where measured."""
        out = {"server_cpu_ms": 1000 * self.server / count}
        if self.has_kernels:
            out["kernel_cpu_ms"] = 1000 * self.kernels / count
        return out


async def warm_pool(settings: PoolSettings) -> KernelPool:
    pool = KernelPool(settings)
    await pool.start()
    deadline = time.monotonic() + 600
    while pool.ready_count < settings.pool_size:
        if time.monotonic() > deadline:
            raise SystemExit(f"the pool did not warm up: {pool.ready_count} of {settings.pool_size} kernels ready")
        await asyncio.sleep(0.2)
    return pool


async def stateless(pools: dict[str, KernelPool], calls: int, concurrency: int, rounds: int) -> dict[str, dict]:
    """`calls` calls on each pool, in `rounds` interleaved batches (so both see the same load drift)."""
    latencies: dict[str, list[float]] = {mode: [] for mode in pools}
    bad = dict.fromkeys(pools, 0)
    wall = dict.fromkeys(pools, 0.0)
    cpu = {mode: CpuMeter(pools[mode]) for mode in pools}

    async def batch(mode: str, count: int) -> None:
        todo = iter(range(count))

        async def task() -> None:
            for _ in todo:
                began = time.perf_counter()
                result = await run_stateless(pools[mode], SNIPPET, 30)
                latencies[mode].append((time.perf_counter() - began) * 1000)
                bad[mode] += result.status != "ok" or result.stdout != EXPECTED

        began = time.perf_counter()
        with cpu[mode]:
            await asyncio.gather(*(task() for _ in range(concurrency)))
        wall[mode] += time.perf_counter() - began

    for mode in pools:  # warm-up
        for _ in range(3):
            await run_stateless(pools[mode], SNIPPET, 30)
    for _ in range(rounds):
        for mode in pools:
            await batch(mode, calls // rounds)
    return {
        mode: {
            **quantiles(latencies[mode]),
            "calls_per_s": len(latencies[mode]) / wall[mode],
            **cpu[mode].per(len(latencies[mode])),
            "bad": bad[mode],
        }
        for mode in pools
    }


async def sessions(pool: KernelPool, tasks: int, rounds: int) -> dict:
    """Each of `tasks` tasks opens, uses and closes `rounds` sessions in turn; latencies in ms of: opening
    (create), ready (create + the first call), and the session's second call (what any call in an open session
    costs under the same load: ready minus it is what starting a session adds)."""
    store = SessionStore(pool, max_sessions=tasks, idle_s=600)
    opened: list[float] = []
    ready: list[float] = []
    later: list[float] = []
    bad = 0

    async def task() -> None:
        nonlocal bad
        for _ in range(rounds):
            began = time.perf_counter()
            session = await store.create(wait_s=120)
            opened.append((time.perf_counter() - began) * 1000)
            first = await store.execute(session, "x = 1", 30)
            ready.append((time.perf_counter() - began) * 1000)
            second_began = time.perf_counter()
            second = await store.execute(session, "x + 1", 30)
            later.append((time.perf_counter() - second_began) * 1000)
            bad += first.status != "ok" or second.stdout != "2\n"
            await store.close(session)

    began = time.perf_counter()
    cpu = CpuMeter(pool)
    with cpu:
        await asyncio.gather(*(task() for _ in range(tasks)))
    wall = time.perf_counter() - began
    return {
        **quantiles(ready),
        "open": quantiles(opened),
        "second_call": quantiles(later),
        "sessions_per_s": tasks * rounds / wall,
        **cpu.per(tasks * rounds),
        "bad": bad,
    }


async def kernel_starts(settings: PoolSettings, starts: int) -> dict:
    pool = KernelPool(dataclasses.replace(settings, pool_size=0, max_kernels=2))
    await pool.start()
    waits = []
    try:
        for _ in range(starts):
            began = time.perf_counter()
            kernel = await pool.acquire(wait_s=120)
            waits.append((time.perf_counter() - began) * 1000)
            await pool.discard(kernel)
    finally:
        await pool.close()
    return quantiles(waits)


def fresh_processes(calls: int, concurrency: int) -> dict:
    def one(_: int) -> tuple[float, bool]:
        began = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True)
        return (time.perf_counter() - began) * 1000, done.stdout == EXPECTED

    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as executor:
        results = list(executor.map(one, range(calls)))
    wall = time.perf_counter() - began
    return {
        **quantiles([ms for ms, _ in results]),
        "calls_per_s": calls / wall,
        "bad": sum(not ok for _, ok in results),
    }


async def bench(args: argparse.Namespace) -> dict:
    out: dict = {"snippet": SNIPPET, "args": {k: str(v) for k, v in vars(args).items()}, "pools": {}}
    modes = ("reset", "fork")

    def settings(mode: str, size: int) -> PoolSettings:
        return PoolSettings(pool_size=size, max_kernels=size + 8, clean_state=mode, isolation=args.isolation)

    rows: dict[str, dict] = {mode: {"load_before": os.getloadavg()[0]} for mode in modes}
    for mode in modes:
        rows[mode]["kernel_start"] = await kernel_starts(settings(mode, 0), args.starts)
    pools = {mode: await warm_pool(settings(mode, args.concurrency)) for mode in modes}
    try:
        for concurrency in (1, args.concurrency):
            for mode, result in (await stateless(pools, args.calls, concurrency, args.rounds)).items():
                rows[mode][f"stateless_c{concurrency}"] = result
    finally:
        for pool in pools.values():
            await pool.close()
    for mode in modes:
        for tasks in (args.concurrency, args.sessions):
            pool = await warm_pool(settings(mode, tasks))
            try:
                rows[mode][f"session_c{tasks}"] = await sessions(pool, tasks, args.session_rounds)
                rows[mode][f"kernels_started_c{tasks}"] = pool.kernels_started
            finally:
                await pool.close()
        rows[mode]["load_after"] = os.getloadavg()[0]
        print(mode, json.dumps(rows[mode]), flush=True)
    out["pools"] = rows
    fresh: dict = {}
    for concurrency in (1, args.concurrency):
        fresh[f"c{concurrency}"] = fresh_processes(max(args.calls // 4, 8), concurrency)
    out["fresh_process"] = fresh
    fork, reset = rows["fork"], rows["reset"]
    out["ratios"] = {
        "stateless_p50_fork_over_reset_c1": fork["stateless_c1"]["p50"] / reset["stateless_c1"]["p50"],
        f"stateless_p50_fork_over_reset_c{args.concurrency}": fork[f"stateless_c{args.concurrency}"]["p50"]
        / reset[f"stateless_c{args.concurrency}"]["p50"],
    }
    for mode, row in rows.items():
        for tasks in (args.concurrency, args.sessions):
            case = row[f"session_c{tasks}"]
            start = row["kernel_start"]["p50"]
            out["ratios"][f"session_ready_p50_{mode}_over_kernel_start_c{tasks}"] = case["p50"] / start
            out["ratios"][f"session_open_p50_{mode}_over_kernel_start_c{tasks}"] = case["open"]["p50"] / start
    return out


def report(out: dict, args: argparse.Namespace) -> None:
    c, s = args.concurrency, args.sessions
    print("\n| case | reset pool | forked workers | fresh process |")
    print("|---|---:|---:|---:|")
    fork, reset, fresh = out["pools"]["fork"], out["pools"]["reset"], out["fresh_process"]
    for key, label in (("stateless_c1", "stateless, 1 at a time"), (f"stateless_c{c}", f"stateless, {c} at once")):
        cells = [f"{p[key]['p50']:.1f} / {p[key]['p99']:.1f} ms, {p[key]['calls_per_s']:.0f}/s" for p in (reset, fork)]
        f = fresh[key.replace("stateless_", "")]
        print(f"| {label} (p50 / p99, calls/s) | {cells[0]} | {cells[1]} | {f['p50']:.1f} / {f['p99']:.1f} ms, "
              f"{f['calls_per_s']:.0f}/s |")  # fmt: skip
    for tasks in (c, s):
        key = f"session_c{tasks}"
        for part, label in (
            (None, "ready (asked for -> first call answered; p50 / p99, sessions/s)"),
            ("open", "opened (p50 / p99)"),
            ("second_call", "its second call (p50 / p99)"),
        ):
            cells = []
            for p in (reset, fork):
                q = p[key] if part is None else p[key][part]
                rate = f", {p[key]['sessions_per_s']:.1f}/s" if part is None else ""
                cells.append(f"{q['p50']:.1f} / {q['p99']:.1f} ms{rate}")
            print(f"| session {label}, {tasks} at once | {cells[0]} | {cells[1]} | |")
    cells = [f"{p['kernel_start']['p50']:.0f} / {p['kernel_start']['p99']:.0f} ms" for p in (reset, fork)]
    print(f"| kernel start (p50 / p99) | {cells[0]} | {cells[1]} | |")
    for tasks in (c, s):
        print(f"| kernels started for the sessions, {tasks} at once | {reset[f'kernels_started_c{tasks}']} | "
              f"{fork[f'kernels_started_c{tasks}']} | |")  # fmt: skip
    print("\nCPU ms per call or session, the pool's side (this process) + the kernels' (their cgroups):")
    for key in ("stateless_c1", f"stateless_c{c}", f"session_c{c}", f"session_c{s}"):
        cells = [f"{p[key]['server_cpu_ms']:.1f} + {p[key].get('kernel_cpu_ms', math.nan):.1f}" for p in (reset, fork)]
        print(f"  {key}: reset {cells[0]}, fork {cells[1]}")
    bad = sum(p[k]["bad"] for p in (reset, fork) for k in p if isinstance(p[k], dict) and "bad" in p[k])
    print(f"\nbad calls (not ok, or wrong output): {bad + sum(f['bad'] for f in fresh.values())}")
    print(
        "1-minute load average before / after each pool (its own kernels included): "
        f"reset {reset['load_before']:.2f} / {reset['load_after']:.2f}, fork {fork['load_before']:.2f} / "
        f"{fork['load_after']:.2f}"
    )
    for name, value in out["ratios"].items():
        print(f"{name}: {value:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="stateless calls per case")
    parser.add_argument("--concurrency", type=int, default=8, help="the second stateless concurrency")
    parser.add_argument("--sessions", type=int, default=64, help="sessions opened at once (and warm kernels)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved batches the stateless calls come in")
    parser.add_argument("--session-rounds", type=int, default=3, help="sessions each task opens in turn")
    parser.add_argument("--starts", type=int, default=8, help="kernel starts timed")
    parser.add_argument("--isolation", default="auto", choices=["auto", "namespaces", "process"])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    out = asyncio.run(bench(args))
    report(out, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
