"""Benchmark the HTTP client's own cost per call: AsyncSandboxClient with a server's connections in one httpx
pool against the same connections split into pools of `stare_sandbox.client.POOL_CONNECTIONS`, in the same run.

The server is a stand-in, not the sandbox: a FastAPI app under uvicorn in a process of its own that answers
POST /v1/execute with a fixed RunResult after --delay-s (what a kernel would take) and GET /healthz with ok.
So the client's process does nothing but the client's work, and its CPU time per call (process_time over the
timed calls) is the client's cost, which is what grows with the pool. calls/s is bounded by the stand-in and
the machine's cores, and is shown to see what that cost does to throughput on a shared machine.

For each concurrency, the two layouts take turns --repeats times (so a slow spell of the machine hits both);
each cell is warmed up (2 calls per task, which opens the connections), then times --calls calls.
`others` is how many cores processes not ours kept busy meanwhile.

Run: .venv/bin/python benchmarks/bench_client.py [--help]
     tiny check: --concurrency 4 --calls 40 --repeats 1 --json /tmp/client.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import httpx
from _machine import cpu_snapshot, other_cores  # same directory: run as a script
from bench_sandbox import free_port

import stare_sandbox.client as client_module
from stare_sandbox.client import AsyncSandboxClient

STANDIN = """
import asyncio, sys
import uvicorn
from fastapi import FastAPI

app, delay = FastAPI(), float(sys.argv[2])

@app.get("/healthz")
async def healthz():
    return {"status": "ok"}

@app.post("/v1/execute")
async def execute(body: dict):
    await asyncio.sleep(delay)
    return {"status": "ok", "stdout": "2\\n", "stderr": "", "duration_ms": delay * 1000}

# keep-alive above the client's (as the sandbox server's): the server never closes a connection the client reuses
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", backlog=4096, timeout_keep_alive=60)
"""


def start_standin(delay_s: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", STANDIN, str(port), str(delay_s)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the stand-in server on {url} did not come up")
        time.sleep(0.2)


async def cell(url: str, concurrency: int, calls: int, max_connections: int, pool_connections: int) -> dict:
    """Time `calls` stateless calls from `concurrency` tasks through one client whose pools hold at most
    `pool_connections` connections each."""
    saved = client_module.POOL_CONNECTIONS
    client_module.POOL_CONNECTIONS = pool_connections  # read when the client builds its pools
    try:
        client = AsyncSandboxClient(url, retries=0, timeout_s=120, max_connections=max_connections)
    finally:
        client_module.POOL_CONNECTIONS = saved
    bad = 0

    async def worker(count: int) -> None:
        nonlocal bad
        for _ in range(count):
            result = await client.execute("print(1+1)")
            bad += result.status != "ok" or result.stdout != "2\n"

    async with client:
        await asyncio.gather(*(worker(2) for _ in range(concurrency)))
        per_task = max(calls // concurrency, 1)
        machine = cpu_snapshot()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker(per_task) for _ in range(concurrency)))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        others = other_cores(machine)
    timed = per_task * concurrency
    return {
        "pools": len(client._pools[0].clients),
        "calls": timed,
        "bad": bad,
        "client_cpu_ms_per_call": 1000 * cpu / timed,
        "calls_per_s": timed / wall,
        "others_cores": others,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 128, 256])
    parser.add_argument("--calls", type=int, default=1024, help="timed calls per cell (default 1024)")
    parser.add_argument("--repeats", type=int, default=3, help="cells per (layout, concurrency) (default 3)")
    parser.add_argument("--delay-s", type=float, default=0.2, help="the stand-in's time per call (default 0.2)")
    parser.add_argument("--max-connections", type=int, default=256, help="the client's, per server (default 256)")
    parser.add_argument("--json", help="write the cells and medians here")
    args = parser.parse_args(argv)

    layouts = {"one pool": args.max_connections, "split": client_module.POOL_CONNECTIONS}
    proc, url = start_standin(args.delay_s)
    rows = []
    try:
        for concurrency in args.concurrency:
            for repeat in range(args.repeats):
                order = list(layouts.items()) if repeat % 2 == 0 else list(layouts.items())[::-1]
                for name, size in order:
                    row = asyncio.run(cell(url, concurrency, args.calls, args.max_connections, size))
                    rows.append({"layout": name, "concurrency": concurrency, **row})
                    print(
                        f"c={concurrency:<4} {name:<9} ({row['pools']:>2} pools): "
                        f"{row['client_cpu_ms_per_call']:6.2f} ms client CPU/call, {row['calls_per_s']:7.1f} calls/s, "
                        f"bad {row['bad']}, others {row['others_cores'] or 0:.2f} cores",
                        flush=True,
                    )
    finally:
        proc.terminate()
        proc.wait(10)

    print("\nmedians over repeats (client CPU ms/call; calls/s):")
    print("| concurrency | one pool: CPU ms/call | split: CPU ms/call | ratio | one pool: calls/s | split: calls/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    medians = []
    for concurrency in args.concurrency:
        m = {}
        for name in layouts:
            cells = [r for r in rows if r["layout"] == name and r["concurrency"] == concurrency]
            m[name] = (
                statistics.median(r["client_cpu_ms_per_call"] for r in cells),
                statistics.median(r["calls_per_s"] for r in cells),
            )
        one, split = m["one pool"], m["split"]
        medians.append({"concurrency": concurrency, "one_pool": one, "split": split})
        cpu_cells = f"{one[0]:.2f} | {split[0]:.2f} | {one[0] / split[0]:.1f}x"
        print(f"| {concurrency} | {cpu_cells} | {one[1]:.0f} | {split[1]:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cells": rows, "medians": medians}, f, indent=1)
    return 1 if any(r["bad"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
