"""Benchmark one client spreading calls over several sandbox servers, against the same load on one server.

Starts --servers real servers (`python -m stare_sandbox serve`, small pools) on free loopback ports, each with its
own kernel directory, and stops them (with every process they started) at the end. Then, for each load, the
same calls go through one AsyncSandboxClient made with server 0 alone ("1 server") and with the whole list
("N servers"), in the same run:
    stateless  --code in a fresh state per call, POST /v1/execute;
    session    one session per concurrent task (created first, untimed), --code in it each call.
Each cell is warmed up, then timed for --calls calls or --max-s seconds. Columns: calls/s = good calls / wall
time, p50/p99 latency on the client side (ms), bad calls (raised, status not ok, or wrong output), and each
server's share of the timed calls, counted by the servers themselves (/metrics) and by the client. `others`
is how many cores processes not ours kept busy meanwhile.

Several servers on one machine share its cores: on a 2-core machine this checks that the spreading works
and what it costs, not how throughput scales. Measure scaling where the servers have cores of their own.

Run: .venv/bin/python benchmarks/bench_sandbox_multi.py [--help]
     tiny check: --servers 2 --concurrency 2 --calls 8 --warmup 2 --json /tmp/multi.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
from bench_sandbox import cpu_snapshot, free_port, others_cpu_s, stop_server  # same directory: run as a script
from prometheus_client.parser import text_string_to_metric_families

from stare_sandbox.client import AsyncSandboxClient, SandboxUnavailable

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- the servers


@contextlib.contextmanager
def servers(count: int, flags: list[str], workdir: Path) -> Iterator[list[str]]:
    """`count` servers with these flags, each answering /healthz: their URLs. Stopped on leaving, kernels too."""
    workdir.chmod(0o711)  # kernels may run as other uids and must reach their scratch dirs below it
    started: list[tuple[subprocess.Popen, Path]] = []
    urls: list[str] = []
    try:
        for i in range(count):
            root = workdir / f"server{i}"
            root.mkdir()
            root.chmod(0o711)
            config = root / "server.yaml"
            config.write_text(json.dumps({"pool": {"scratch_root": str(root / "kernels")}}))  # JSON is YAML
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            cmd = [sys.executable, "-m", "stare_sandbox", "serve", f"--port={port}", f"--config={config}", *flags]
            with open(root / "server.log", "w") as log:
                proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            started.append((proc, root))
        for (proc, root), url in zip(started, urls, strict=True):
            deadline = time.monotonic() + 120
            while True:
                if proc.poll() is not None:
                    log = (root / "server.log").read_text()[-3000:]
                    raise SystemExit(f"server {url} exited with {proc.returncode}:\n{log}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/healthz", timeout=1.0).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise SystemExit(f"server {url} did not answer /healthz within 120 s")
                time.sleep(0.1)
        yield urls
    finally:
        for proc, root in started:
            left = stop_server(proc, str(root / "kernels"))
            if left:
                print(f"warning: {len(left)} processes of {root.name} were left behind and killed")


def server_runs(url: str) -> collections.Counter:
    """Finished calls by kind (stateless, session, ...) from the server's /metrics."""
    counts: collections.Counter = collections.Counter()
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "sandbox_runs_total":
                counts[sample.labels["kind"]] += sample.value
    return counts


async def wait_pools(client: AsyncSandboxClient, pool_size: int, timeout_s: float = 120) -> None:
    """Until every server of the client has its warm kernels back (so cells do not inherit each other's refills)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = await client.health()
        each = health.get("servers", [health])
        if all((entry.get("pool_ready") or 0) >= pool_size for entry in each):
            return
        await asyncio.sleep(0.2)


# ---------------------------------------------------------------- one cell


async def run_calls(
    client: AsyncSandboxClient, sessions: list[str] | None, args: argparse.Namespace, count: int
) -> tuple[list[float], collections.Counter, float]:
    """`count` calls by --concurrency tasks (or fewer, at --max-s): (latencies of good calls in ms, bad calls
    by reason, wall seconds)."""
    latencies: list[float] = []
    bad: collections.Counter = collections.Counter()
    tickets = count
    deadline = time.perf_counter() + args.max_s

    async def worker(i: int) -> None:
        nonlocal tickets
        session = sessions[i] if sessions else None
        while tickets > 0 and time.perf_counter() < deadline:
            tickets -= 1
            started = time.perf_counter()
            try:
                run = await client.execute(args.code, session)
            except SandboxUnavailable as exc:
                problem = str(exc)[:80]
            else:
                problem = run.status if run.status != "ok" else None if run.stdout == args.expect else "output"
            if problem:
                bad[problem] += 1
            else:
                latencies.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
    return latencies, bad, time.perf_counter() - started


async def cell(urls: list[str], setup: str, load: str, args: argparse.Namespace) -> dict:
    async with AsyncSandboxClient(urls, timeout_s=120.0) as client:
        await client.start()
        sessions = None
        if load == "session":
            sessions = []
            while len(sessions) < args.concurrency:  # a few at a time: kernels start slowly on few cores
                batch = min(4, args.concurrency - len(sessions))
                sessions += await asyncio.gather(*(client.create_session() for _ in range(batch)))
        await wait_pools(client, args.pool_size)
        await run_calls(client, sessions, args, args.warmup)
        runs_before = [server_runs(url)[load] for url in urls]
        calls_before = [s["calls"] for s in client.server_stats()]
        # ours: this process, the servers it started and their kernels (their command lines name args.tmp)
        machine = cpu_snapshot(None, args.tmp)
        latencies, bad, wall_s = await run_calls(client, sessions, args, args.calls)
        end = cpu_snapshot(None, args.tmp)
        others = others_cpu_s(machine, end) / (end.wall - machine.wall)
        runs = [server_runs(url)[load] - before for url, before in zip(urls, runs_before, strict=True)]
        calls = [s["calls"] - before for s, before in zip(client.server_stats(), calls_before, strict=True)]
        if sessions:
            await asyncio.gather(*(client.close_session(s) for s in sessions))
    total = sum(runs) or 1.0
    return {
        "setup": setup,
        "load": load,
        "servers": urls,
        "concurrency": args.concurrency,
        "n": len(latencies),
        "bad": dict(bad),
        "calls_per_s": len(latencies) / wall_s if wall_s else float("nan"),
        "p50_ms": float(np.percentile(latencies, 50)) if latencies else float("nan"),
        "p99_ms": float(np.percentile(latencies, 99)) if latencies else float("nan"),
        "server_runs": dict(zip(urls, runs, strict=True)),
        "server_shares": {url: run / total for url, run in zip(urls, runs, strict=True)},
        "client_calls": dict(zip(urls, calls, strict=True)),
        "others_cores": others,
    }


# ---------------------------------------------------------------- report


def print_table(rows: list[dict], all_urls: list[str]) -> None:
    head = (
        f"{'setup':10s} {'load':9s} {'c':>3s} {'n':>5s} {'bad':>4s} {'calls/s':>8s} {'p50 ms':>8s} "
        f"{'p99 ms':>8s} {'others':>6s}  shares (server 0..{len(all_urls) - 1})"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        shares = " ".join(f"{100 * r['server_shares'].get(url, 0.0):3.0f}%" for url in all_urls)
        others = "-" if r["others_cores"] is None else f"{r['others_cores']:.2f}"
        print(
            f"{r['setup']:10s} {r['load']:9s} {r['concurrency']:3d} {r['n']:5d} {sum(r['bad'].values()):4d} "
            f"{r['calls_per_s']:8.1f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {others:>6s}  {shares}"
        )
        if r["bad"]:
            print(f"    bad: {r['bad']}")


def ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per load: the cell with every server over the one with server 0 alone, for calls/s, p50 and p99."""
    out = {}
    for load in dict.fromkeys(r["load"] for r in rows):
        cells = sorted((r for r in rows if r["load"] == load), key=lambda r: len(r["servers"]))
        one, many = cells[0], cells[-1]
        if len(cells) > 1 and one["n"] and many["n"]:
            out[load] = {key: many[key] / one[key] for key in ("calls_per_s", "p50_ms", "p99_ms")}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=3, help="servers to start (default 3)")
    parser.add_argument("--concurrency", type=int, default=6, help="concurrent tasks, one session each (default 6)")
    parser.add_argument("--calls", type=int, default=120, help="timed calls per cell (default 120)")
    parser.add_argument("--warmup", type=int, default=12, help="untimed calls first (default 12)")
    parser.add_argument("--max-s", type=float, default=60.0, help="time limit of one timed part (default 60)")
    parser.add_argument("--loads", nargs="+", choices=["stateless", "session"], default=["stateless", "session"])
    parser.add_argument("--code", default="print(sum(range(1000)))", help="what every call runs")
    parser.add_argument("--expect", default="499500\n", help="what --code must print")
    parser.add_argument("--pool-size", type=int, default=1, help="each server's warm kernels (default 1)")
    parser.add_argument("--max-running", type=int, default=8, help="each server's --max-running (default 8)")
    parser.add_argument("--max-kernels", type=int, default=0, help="each server's; 0: 2 x concurrency + pool + 4")
    parser.add_argument("--isolation", choices=["auto", "namespaces", "process"], default="auto")
    parser.add_argument("--json", type=Path, help="also write all numbers here")
    args = parser.parse_args(argv)
    if args.servers < 2 or args.concurrency < 1 or args.calls < 1 or args.warmup < 0:
        parser.error("--servers must be >= 2, --concurrency and --calls >= 1, --warmup >= 0")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the servers
    flags = [
        f"--pool-size={args.pool_size}",
        f"--max-running={args.max_running}",
        f"--max-kernels={args.max_kernels or 2 * args.concurrency + args.pool_size + 4}",
        f"--max-sessions={args.concurrency + 8}",
        f"--isolation={args.isolation}",
    ]
    t0 = time.perf_counter()
    rows: list[dict] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-sandbox-multi-") as tmp,
        servers(args.servers, flags, Path(tmp)) as urls,
    ):
        print(f"servers: {' '.join(urls)}\n  flags: {' '.join(flags)}", flush=True)
        args.tmp = tmp
        for load in args.loads:
            for setup, listed in (("1 server", urls[:1]), (f"{len(urls)} servers", urls)):
                row = asyncio.run(cell(listed, setup, load, args))
                rows.append(row)
                rate, p50 = row["calls_per_s"], row["p50_ms"]
                print(f"  {setup:10s} {load:9s} n={row['n']:<5d} {rate:7.1f}/s  p50={p50:.2f} ms", flush=True)
    print()
    print_table(rows, urls)
    found = ratios(rows)
    for load, values in found.items():
        print(
            f"{load}: {len(urls)} servers / 1 server: calls/s x{values['calls_per_s']:.2f}, "
            f"p50 x{values['p50_ms']:.2f}, p99 x{values['p99_ms']:.2f}"
        )
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        data = {"flags": flags, "args": {k: str(v) for k, v in vars(args).items()}, "results": rows, "ratios": found}
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
