"""Benchmark the sandbox service over HTTP against a fresh `python -c` subprocess per snippet.

The real server (`python -m stare_sandbox serve`) is started as a subprocess on a free loopback port with
the flags below, and stopped (with every process it started) when the script ends. Cases:
    session   `print(1+1)` in a warm stateful session, POST /v1/sessions/{id}/execute
              (one session per concurrent task, all created before timing);
    stateless a sympy snippet, POST /v1/execute (a pooled kernel, its namespace reset after each run);
    subprocess the same two snippets, each in a fresh `sys.executable -c CODE` process (the stateless
              approach of common RL sandboxes); concurrency N = N threads, each spawning processes.
HTTP calls use `AsyncSandboxClient` (one connection pool, N concurrent tasks, retries off so that a
429 is counted instead of hidden). Each (case, concurrency) is warmed up, then timed for --calls calls
or --max-s seconds, whichever comes first (--baseline-calls / --baseline-max-s for subprocesses).
A call is "bad" if it raised (e.g. HTTP 429), had a status other than ok, or printed the wrong text.

Columns: latency p50/p99 (client side, ms), calls/s = n / wall time, srv p50 = the server's own
`duration_ms` (the kernel round trip, queueing and the stateless reset excluded), CPU ms per call of
this client, the server process and the kernels (the rest of the machine's busy time, kernels that
exited included), others = cores kept busy by processes that are not ours, and p50/throughput ratios
against the subprocess baseline at the same concurrency. The profile section (c=1, one call at a
time) splits a call: bare HTTP (GET /healthz), an empty kernel round trip, raw httpx without the
client's validation, the stateless reset code on its own, and a stateless `pass`.

Burst section (last, on the same server, its sessions closed first): the stateless sympy snippet at each
--burst-concurrency (default 8, 32 and 128, more than the warm pool), in that order, each timed from its
first call with no warm-up, so the pool's growth and the kernels it starts are in the numbers. Raw httpx,
no retries: a 429 or 503 is counted, and that task then sleeps Retry-After before its next call, as a client
would; a call without an answer within --burst-http-timeout-s counts as a timeout. Printed: p50/p99 of the
calls that succeeded, ok calls/s, 429s, 503s, timeouts, kernels the server started during the cell, and the
most it had starting at once so far (/healthz), then the p99 and calls/s ratios of each concurrency to the
first (p99 32/8 is the issue's measure of queueing). --compare-max-starting N repeats the burst section on
a second server started with --max-starting N (0 = no bound on concurrent starts, the behaviour before that
setting), after the first is stopped, and prints before/after ratios; --compare-code DIR does the same with
a second server run from another checkout's sandbox package (a code change's before/after, same flags);
--burst-only skips everything else. Each burst row also counts the kernels retired during the cell, by cause
(/healthz kernels_retired_by_cause), and the server's and kernels' CPU per call.

Run: .venv/bin/python benchmarks/bench_sandbox.py [--help]   (about 3 to 5 minutes on 2 idle cores)
  before/after of the kernel-start bound only:
     .venv/bin/python benchmarks/bench_sandbox.py --burst-only --compare-max-starting 0 --json burst.json
  before/after of a code change (the main server runs this checkout, the second the worktree):
     git worktree add /tmp/before COMMIT
     .venv/bin/python benchmarks/bench_sandbox.py --burst-only --compare-code /tmp/before --json burst.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from stare_sandbox.client import KEEPALIVE_S, AsyncSandboxClient, SandboxUnavailable
from stare_sandbox.pool import RESET_CODE, PoolSettings

REPO = Path(__file__).resolve().parent.parent

SNIPPETS = {
    "print": ("print(1+1)", "2\n"),
    "sympy": ("import sympy as sp; print(sp.factorint(2**32+1))", "{641: 1, 6700417: 1}\n"),
}
TICK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- CPU accounting


def _proc_table() -> dict[int, tuple[int, float, float]]:
    """pid -> (ppid, CPU seconds of the process itself, of the process and its reaped children)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
        # fields[1] = ppid; [11..14] = utime, stime, cutime, cstime
        own = (int(fields[11]) + int(fields[12])) / TICK
        table[int(name)] = (int(fields[1]), own, own + (int(fields[13]) + int(fields[14])) / TICK)
    return table


def descendants(pid: int, table: dict[int, tuple[int, float, float]] | None = None) -> list[int]:
    table = _proc_table() if table is None else table
    children = collections.defaultdict(list)
    for child, (ppid, *_) in table.items():
        children[ppid].append(child)
    out, stack = [], list(children[pid])
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children[p])
    return out


@dataclass
class CpuSnap:
    wall: float
    busy: float  # whole machine, CPU seconds
    client: float  # this process and its reaped children (the subprocess baseline)
    server: float  # the server process itself (its threads included, its children not)
    others: dict[int, float]  # every process that is not ours: pid -> CPU seconds with reaped children


def cpu_snapshot(server_pid: int | None, marker: str) -> CpuSnap:
    """Ours: this process, its descendants, and any process whose command line names `marker` (the
    server's kernel directory: a kernel whose launcher was killed first is no longer our descendant).
    The kernels' CPU is what is left: busy - client - server - others (it includes kernels that exited)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    busy = (sum(fields) - fields[3] - fields[4]) / TICK
    table = _proc_table()
    ours = {os.getpid(), *descendants(os.getpid(), table)}
    others = {}
    for pid, (_, _, total) in table.items():
        if pid in ours:
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    continue
        others[pid] = total
    server = table[server_pid][1] if server_pid in table else 0.0
    return CpuSnap(time.perf_counter(), busy, table[os.getpid()][2], server, others)


def others_cpu_s(start: CpuSnap, end: CpuSnap) -> float:
    """CPU seconds that processes not ours used between the two snapshots."""
    return sum(max(total - start.others.get(pid, 0.0), 0.0) for pid, total in end.others.items())


# ---------------------------------------------------------------- measurements


@dataclass
class Result:
    case: str
    concurrency: int
    latencies_ms: list[float] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)
    bad: collections.Counter = field(default_factory=collections.Counter)
    wall_s: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # ms per call: client, server, kernels; others in cores

    @property
    def n(self) -> int:
        return len(self.latencies_ms)

    def pct(self, q: float, values: list[float] | None = None) -> float:
        values = self.latencies_ms if values is None else values
        return float(np.percentile(values, q)) if values else float("nan")

    @property
    def rate(self) -> float:
        return self.n / self.wall_s if self.wall_s else float("nan")

    def finish(self, start: CpuSnap, end: CpuSnap) -> None:
        self.wall_s = end.wall - start.wall
        calls = max(self.n + sum(self.bad.values()), 1)
        client, server = end.client - start.client, end.server - start.server
        others = others_cpu_s(start, end)
        kernels = max(end.busy - start.busy - client - server - others, 0.0)
        self.cpu = {
            "client": client * 1000 / calls,
            "server": server * 1000 / calls,
            "kernels": kernels * 1000 / calls,
            "others": others / self.wall_s,
        }

    def to_json(self) -> dict:
        return {
            "case": self.case,
            "concurrency": self.concurrency,
            "n": self.n,
            "bad": dict(self.bad),
            "p50_ms": self.pct(50),
            "p99_ms": self.pct(99),
            "calls_per_s": self.rate,
            "server_p50_ms": self.pct(50, self.server_ms) if self.server_ms else None,
            "cpu": self.cpu,
        }


def check(stdout: str, status: str, expected: str) -> str | None:
    if status != "ok":
        return status
    return None if stdout == expected else "wrong output"


def measure_subprocess(snippet: str, concurrency: int, calls: int, max_s: float, warmup: int, marker: str) -> Result:
    code, expected = SNIPPETS[snippet]
    result = Result(f"subprocess {snippet}", concurrency)
    lock = threading.Lock()

    def run_many(count: int, deadline: float, record: bool) -> None:
        tickets = [count]

        def worker() -> None:
            while True:
                with lock:
                    if tickets[0] <= 0 or time.perf_counter() >= deadline:
                        return
                    tickets[0] -= 1
                started = time.perf_counter()
                proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
                elapsed = (time.perf_counter() - started) * 1000
                problem = check(proc.stdout, "ok" if proc.returncode == 0 else f"exit {proc.returncode}", expected)
                if record:
                    with lock:
                        if problem:
                            result.bad[problem] += 1
                        else:
                            result.latencies_ms.append(elapsed)

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    run_many(warmup, time.perf_counter() + max_s, record=False)
    start = cpu_snapshot(None, marker)
    run_many(calls, time.perf_counter() + max_s, record=True)
    result.finish(start, cpu_snapshot(None, marker))
    return result


async def measure_http(
    client: AsyncSandboxClient,
    case: str,
    snippet: str,
    sessions: list[str] | None,
    concurrency: int,
    calls: int,
    max_s: float,
    warmup: int,
    server_pid: int,
    marker: str,
) -> Result:
    code, expected = SNIPPETS[snippet]
    result = Result(case, concurrency)

    async def run_many(count: int, deadline: float, record: bool) -> None:
        tickets = count

        async def worker(i: int) -> None:
            nonlocal tickets
            session_id = sessions[i] if sessions else None
            while tickets > 0 and time.perf_counter() < deadline:
                tickets -= 1
                started = time.perf_counter()
                try:
                    run = await client.execute(code, session_id)
                except SandboxUnavailable as exc:
                    refused = next((f"HTTP {c}" for c in (429, 503) if f"HTTP {c}" in str(exc)), None)
                    problem, server_ms = refused or str(exc)[:80], None
                else:
                    problem, server_ms = check(run.stdout, run.status, expected), run.duration_ms
                elapsed = (time.perf_counter() - started) * 1000
                if not record:
                    continue
                if problem:
                    result.bad[problem] += 1
                else:
                    result.latencies_ms.append(elapsed)
                    result.server_ms.append(server_ms)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))

    await run_many(warmup, time.perf_counter() + max_s, record=False)
    start = cpu_snapshot(server_pid, marker)
    await run_many(calls, time.perf_counter() + max_s, record=True)
    result.finish(start, cpu_snapshot(server_pid, marker))
    return result


async def profile(client: AsyncSandboxClient, session_id: str, calls: int) -> dict[str, dict[str, float]]:
    """c=1 breakdown of a call: ms (client side) and, where there is one, the server's duration_ms."""

    async def timed(label: str, call) -> tuple[str, dict[str, float]]:  # call: a coroutine factory
        client_ms, server_ms = [], []
        for i in range(calls + 5):
            started = time.perf_counter()
            server = await call()
            if i >= 5:  # the first 5 are warm-up
                client_ms.append((time.perf_counter() - started) * 1000)
                if server is not None:
                    server_ms.append(server)
        row = {"p50_ms": float(np.percentile(client_ms, 50)), "p99_ms": float(np.percentile(client_ms, 99))}
        if server_ms:
            row["server_p50_ms"] = float(np.percentile(server_ms, 50))
        return label, row

    http = client._http  # the client's own httpx pool: the raw transport without retries or validation

    async def healthz() -> None:
        (await http.get("/healthz")).raise_for_status()

    async def raw_print() -> float:
        response = await http.post(f"/v1/sessions/{session_id}/execute", json={"code": "print(1+1)"})
        return response.json()["duration_ms"]

    async def client_call(code: str, stateless: bool = False) -> float:
        run = await client.execute(code, None if stateless else session_id)
        if run.status != "ok":
            raise RuntimeError(f"profile call failed: {run.status} {run.error}")
        return run.duration_ms

    reset = RESET_CODE + PoolSettings().warmup_code
    rows = [
        await timed("GET /healthz (HTTP stack, no kernel)", healthz),
        await timed("session `pass` (empty kernel round trip)", lambda: client_call("pass")),
        await timed("session print(1+1), raw httpx", raw_print),
        await timed("session print(1+1), AsyncSandboxClient", lambda: client_call("print(1+1)")),
        await timed("session sympy snippet (no reset)", lambda: client_call(SNIPPETS["sympy"][0])),
        await timed("stateless reset code alone (in a session)", lambda: client_call(reset)),
        await timed("stateless `pass` (run + reset)", lambda: client_call("pass", stateless=True)),
    ]
    return dict(rows)


async def measure_burst(
    url: str, label: str, concurrency: int, calls: int, max_s: float, http_timeout_s: float, pid: int, marker: str
) -> Result:
    """Stateless sympy calls from `concurrency` tasks over raw httpx, timed from the first call (no warm-up).

    Each task has its own one-connection httpx client: one pool of `concurrency` connections costs the client
    CPU that grows with the square of its connections (httpcore 1.0.9 walks every connection for each idle one
    on every request; measured at c=128: 15-19 ms of client CPU per call in slow cells, on the cores the server
    needs), so the load generator, not the server, set the c=128 cell's throughput."""
    code, expected = SNIPPETS["sympy"]
    result = Result(label, concurrency)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=KEEPALIVE_S)
    timeout = httpx.Timeout(http_timeout_s, connect=5.0)
    tickets = calls
    deadline = time.perf_counter() + max_s

    async def worker() -> None:
        nonlocal tickets
        # verify=False: plain http on loopback, and it spares each client loading the CA bundle (~0.1 s of CPU)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, verify=False) as http:
            while tickets > 0 and time.perf_counter() < deadline:
                tickets -= 1
                started = time.perf_counter()
                try:
                    response = await http.post("/v1/execute", json={"code": code})
                except httpx.TimeoutException:
                    result.bad["timeout"] += 1
                    continue
                except httpx.TransportError as exc:
                    result.bad[type(exc).__name__] += 1
                    continue
                elapsed = (time.perf_counter() - started) * 1000
                if response.status_code in (429, 503):
                    result.bad[f"HTTP {response.status_code}"] += 1
                    await asyncio.sleep(float(response.headers.get("retry-after", 1)))
                    continue
                if response.status_code != 200:
                    result.bad[f"HTTP {response.status_code}"] += 1
                    continue
                run = response.json()
                problem = check(run["stdout"], run["status"], expected)
                if problem:
                    result.bad[problem] += 1
                else:
                    result.latencies_ms.append(elapsed)
                    result.server_ms.append(run["duration_ms"])

    start = cpu_snapshot(pid, marker)
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.finish(start, cpu_snapshot(pid, marker))
    return result


async def wait_settled(client: AsyncSandboxClient, pool_size: int, timeout_s: float) -> dict:
    """/healthz once the pool is full and no kernel is starting (or after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = await client.health()
        full = health["pool_ready"] >= pool_size and not health.get("kernels_starting")
        if full or time.monotonic() > deadline:
            return health
        await asyncio.sleep(0.2)


async def bench_burst(
    args: argparse.Namespace, client: AsyncSandboxClient, url: str, pid: int, marker: str, label: str | None = None
) -> list[dict]:
    """The burst section on one server: a row (Result and the server's kernel counts) per concurrency."""
    rows = []
    for c in args.burst_concurrency:
        before = await wait_settled(client, args.pool_size, 120)
        label = label or f"max_starting={before.get('max_starting', '?')}"
        res = await measure_burst(
            url, label, c, args.burst_calls, args.burst_max_s, args.burst_http_timeout_s, pid, marker
        )
        after = await client.health()
        counts = {
            "kernel_starts": after.get("kernels_started", 0) - before.get("kernels_started", 0),
            "starting_peak": after.get("kernels_starting_peak"),
            "start_failures": after["kernel_start_failures"] - before["kernel_start_failures"],
            # by cause (absent from servers older than these counts): why the kernels started meanwhile were needed
            "retired": {
                cause: n - before.get("kernels_retired_by_cause", {}).get(cause, 0)
                for cause, n in after.get("kernels_retired_by_cause", {}).items()
            },
        }
        rows.append({"result": res, **counts})
        print(
            f"  burst {label:15s} c={c:<3d} n={res.n:<4d} p99={res.pct(99):8.1f} ms  {res.rate:7.1f}/s  "
            f"refused {res.bad['HTTP 429'] + res.bad['HTTP 503']}  timeouts {res.bad['timeout']}",
            flush=True,
        )
    return rows


# ---------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_flags(args: argparse.Namespace) -> list[str]:
    # a burst runs at most max_running calls at once; each holds a kernel, and as many may be resetting
    busiest = max([*args.concurrency, *(min(c, args.max_running) for c in args.burst_concurrency)])
    max_kernels = args.max_kernels or 2 * busiest + args.pool_size + 8
    flags = [
        f"--pool-size={args.pool_size}",
        f"--max-running={args.max_running}",
        f"--max-waiting={args.max_waiting}",
        f"--max-kernels={max_kernels}",
        f"--max-sessions={max(args.concurrency) + 8}",
        f"--isolation={args.isolation}",
    ]
    if args.max_starting is not None:
        flags.append(f"--max-starting={args.max_starting}")
    return flags


async def wait_pool(client: AsyncSandboxClient, pool_size: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        health = await client.health()
        if health["pool_ready"] >= pool_size or time.monotonic() > deadline:
            return health
        await asyncio.sleep(0.2)


def stop_server(proc: subprocess.Popen, marker: str) -> list[int]:
    """Graceful stop (closes sessions and kernels), then kill whatever it started that is still alive:
    its descendants, and any process whose command line names `marker` (our kernels' directory)."""
    started = set(descendants(proc.pid))
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if name.isdigit() and marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                started.add(int(name))
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    deadline = time.monotonic() + 10  # kernels may take a moment to exit after the server
    while (left := [pid for pid in started if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(OSError):
            print(f"warning: killing {pid}, left behind: {Path(f'/proc/{pid}/cmdline').read_text()[:150]}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def bench_http(
    args: argparse.Namespace, url: str, server_pid: int, marker: str, main_cases: bool, label: str | None = None
) -> dict:
    """The session and stateless cases and the profile (when main_cases), then the burst section (its rows named
    `label`, default: the server's max_starting)."""
    out: dict = {"results": []}
    async with AsyncSandboxClient(url, retries=0, timeout_s=120.0, max_connections=256) as client:
        health = await wait_pool(client, args.pool_size, 180)
        out["isolation"] = health["isolation"]
        print(f"isolation: {json.dumps(health['isolation'])}", flush=True)
        if main_cases:
            await bench_main_cases(args, client, server_pid, marker, out)
        out["burst"] = await bench_burst(args, client, url, server_pid, marker, label)
        final = await client.health()
        out["kernel_start_failures"] = final["kernel_start_failures"]
        metrics = (await client._http.get("/metrics")).text
        out["rejected_429"] = sum(
            float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("sandbox_rejected_total")
        )
    return out


async def bench_main_cases(
    args: argparse.Namespace, client: AsyncSandboxClient, server_pid: int, marker: str, out: dict
) -> None:
    """Session and stateless cases at each --concurrency, then the profile; their sessions are closed after."""
    sessions: list[str] = []
    while len(sessions) < max(args.concurrency):  # in batches of 4: 2 cores start kernels slowly
        batch = min(4, max(args.concurrency) - len(sessions))
        sessions += await asyncio.gather(*(client.create_session() for _ in range(batch)))
    profile_session = await client.create_session()
    print(f"{len(sessions)} sessions created", flush=True)

    for case, snippet, session_ids in (("session print", "print", sessions), ("stateless sympy", "sympy", None)):
        for c in args.concurrency:
            await wait_pool(client, args.pool_size, 120)
            warmup = max(args.warmup, 2 * c)
            res = await measure_http(
                client, case, snippet, session_ids, c, args.calls, args.max_s, warmup, server_pid, marker
            )
            out["results"].append(res)
            print(f"  {case:16s} c={c:<3d} n={res.n:<4d} p50={res.pct(50):8.2f} ms  {res.rate:7.1f}/s", flush=True)

    if args.profile_calls:
        out["profile"] = await profile(client, profile_session, args.profile_calls)
    await asyncio.gather(*(client.close_session(s) for s in [*sessions, profile_session]))


# ---------------------------------------------------------------- report


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def print_table(results: list[Result]) -> None:
    base = {(r.case.split()[-1], r.concurrency): r for r in results if r.case.startswith("subprocess")}
    head = (
        f"{'case':17s} {'c':>3s} {'n':>4s} {'bad':>4s} {'p50 ms':>8s} {'p99 ms':>8s} {'calls/s':>8s} "
        f"{'srv p50':>8s} {'cpu ms/call cli/srv/krn':>24s} {'others':>6s} {'p50 x':>6s} {'rate x':>6s}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        ref = base.get((r.case.split()[-1], r.concurrency)) if not r.case.startswith("subprocess") else None
        cpu = f"{r.cpu['client']:.1f}/{r.cpu['server']:.1f}/{r.cpu['kernels']:.1f}"
        print(
            f"{r.case:17s} {r.concurrency:3d} {r.n:4d} {sum(r.bad.values()):4d} {fmt(r.pct(50), 2):>8s} "
            f"{fmt(r.pct(99), 2):>8s} {fmt(r.rate):>8s} "
            f"{fmt(r.pct(50, r.server_ms) if r.server_ms else None, 2):>8s} {cpu:>24s} {r.cpu['others']:6.2f} "
            f"{fmt(ref.pct(50) / r.pct(50) if ref else None):>6s} {fmt(r.rate / ref.rate if ref else None):>6s}"
        )
        if r.bad:
            print(f"    bad: {dict(r.bad)}")
    print(
        "p50 x / rate x: subprocess p50 / this p50, this calls/s / subprocess calls/s (same snippet and c); "
        "srv p50: the server's duration_ms; others: cores used by processes not ours"
    )


def verdicts(results: list[Result]) -> list[str]:
    by = {(r.case, r.concurrency): r for r in results}
    lines = []
    checks = [
        ("warm session p50 <= 10 ms (c=1)", ("session print", 1), lambda r: r.pct(50), 10.0, "ms", True),
        ("stateless sympy p50 <= 30 ms (c=1)", ("stateless sympy", 1), lambda r: r.pct(50), 30.0, "ms", True),
        (">= 100 calls/s, warm session, c=8", ("session print", 8), lambda r: r.rate, 100.0, "calls/s", False),
    ]
    for label, key, value, limit, unit, at_most in checks:
        r = by.get(key)
        if r is None or not r.n:
            lines.append(f"{label}: not measured")
            continue
        v = value(r)
        met = v <= limit if at_most else v >= limit
        lines.append(f"{label}: {v:.2f} {unit} -> {'MET' if met else 'MISSED'}")
    return lines


def sandbox_package(repo: Path) -> tuple[Path, str]:
    """Where `repo`'s sandbox package is imported from and its name: sandbox/stare_sandbox, or, in a checkout from
    before that name, sandbox/ itself as `sandbox`, so that --compare-code also takes code from then."""
    if (repo / "sandbox" / "stare_sandbox").is_dir():
        return repo / "sandbox", "stare_sandbox"
    return repo, "sandbox"


def code_version(repo: Path = REPO) -> str:
    """A short hash of the sandbox package's *.py, so that numbers can be tied to the code they measured."""
    where, name = sandbox_package(repo)
    digest = hashlib.sha256()
    for path in sorted((where / name).glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def serve(
    flags: list[str], workdir: Path, kernel_root: Path, repo: Path = REPO
) -> Iterator[tuple[subprocess.Popen, str, list[int]]]:
    """The server with these flags (its code: `repo`'s sandbox package), until it answers /healthz: (process, URL,
    the pids it left behind, filled in once it is stopped, with its kernels, on leaving the block)."""
    pool: dict = {"scratch_root": str(kernel_root)}
    config = workdir / "server.yaml"
    config.write_text(json.dumps({"pool": pool}))  # JSON is YAML
    print(f"server config: {config.read_text()}")
    port = free_port()
    where, package = sandbox_package(repo)
    cmd = [sys.executable, "-m", package, "serve", "--host=127.0.0.1", f"--port={port}", *flags]
    cmd.append(f"--config={config}")
    print(f"server: python -m {package} serve " + " ".join(cmd[4:]), flush=True)
    url = f"http://127.0.0.1:{port}"
    log_path = workdir / "server.log"
    with open(log_path, "w") as log:
        # run from the package's folder, so that `-m` finds `repo`'s (the script's own, or --compare-code's)
        proc = subprocess.Popen(cmd, cwd=where, stdout=log, stderr=subprocess.STDOUT)
    left: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthz", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit("the server did not answer /healthz within 60 s")
            time.sleep(0.1)
        yield proc, url, left
    finally:
        left += stop_server(proc, str(kernel_root))


def run_all(args: argparse.Namespace, workdir: Path) -> tuple[list[Result], dict, list[str], list[int]]:
    """The subprocess baseline, then the server's cases, then (--compare-max-starting) the burst section on a
    second server; each server and its kernels are always stopped."""
    workdir.chmod(0o711)  # kernels run as other uids and must reach their scratch dirs below it
    kernel_root = workdir / "kernels"  # kernels' scratch dirs: `cpu_snapshot` tells our kernels by this path
    baseline: list[Result] = []
    for snippet in SNIPPETS if not args.burst_only else ():
        for c in args.concurrency:
            warmup = max(args.baseline_warmup, c)
            res = measure_subprocess(snippet, c, args.baseline_calls, args.baseline_max_s, warmup, str(kernel_root))
            baseline.append(res)
            print(f"  {res.case:16s} c={c:<3d} n={res.n:<4d} p50={res.pct(50):8.2f} ms  {res.rate:7.1f}/s", flush=True)

    flags = server_flags(args)
    first_label = f"pool_size={args.pool_size}" if args.compare_pool_size is not None else None
    with serve(flags, workdir, kernel_root) as (proc, url, left):
        http_out = asyncio.run(
            bench_http(args, url, proc.pid, str(kernel_root), main_cases=not args.burst_only, label=first_label)
        )
    compares = (args.compare_max_starting, args.compare_pool_size, args.compare_code)
    if any(value is not None for value in compares):
        other, repo, label = flags, REPO, None
        if args.compare_max_starting is not None:
            other = [f for f in other if not f.startswith("--max-starting=")]
            other.append(f"--max-starting={args.compare_max_starting}")
        if args.compare_pool_size is not None:
            other = [f for f in other if not f.startswith("--pool-size=")]
            other.append(f"--pool-size={args.compare_pool_size}")
            label = f"pool_size={args.compare_pool_size}"
            args = argparse.Namespace(**{**vars(args), "pool_size": args.compare_pool_size})  # what to wait for
        if args.compare_code is not None:
            repo, label = args.compare_code.resolve(), f"code {code_version(args.compare_code)}"
        with serve(other, workdir, kernel_root, repo) as (proc, url, left_too):
            compared = asyncio.run(bench_http(args, url, proc.pid, str(kernel_root), main_cases=False, label=label))
        http_out["burst"] += compared["burst"]
        http_out["kernel_start_failures"] += compared["kernel_start_failures"]
        http_out["rejected_429"] += compared["rejected_429"]
        left += left_too
    return http_out["results"] + baseline, http_out, flags, left


# ---------------------------------------------------------------- burst report


def burst_json(rows: list[dict]) -> list[dict]:
    out = []
    for row in rows:
        r = row["result"]
        out.append(
            {
                "server": r.case,
                "concurrency": r.concurrency,
                "n_ok": r.n,
                "p50_ms": r.pct(50),
                "p99_ms": r.pct(99),
                "calls_per_s": r.rate,
                "http_429": r.bad["HTTP 429"],
                "http_503": r.bad["HTTP 503"],
                "timeouts": r.bad["timeout"],
                "bad": dict(r.bad),
                "kernel_starts": row["kernel_starts"],
                "kernels_starting_peak": row["starting_peak"],
                "kernel_start_failures": row["start_failures"],
                "kernels_retired": row["retired"],
                "cpu": r.cpu,
            }
        )
    return out


def burst_ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per server: p99 and calls/s at each concurrency over those at the first ("p99 32/8"). With two servers
    (--compare-max-starting), "after" is the first (the main server) and "before" the second: p99 before/after
    and calls/s after/before at each concurrency, so a ratio above 1 favours the main server."""
    by_server: dict[str, dict[int, Result]] = collections.defaultdict(dict)
    for row in rows:
        by_server[row["result"].case][row["result"].concurrency] = row["result"]
    ratios: dict[str, dict[str, float]] = {}
    for server, cells in by_server.items():
        base_c, base = next(iter(cells.items()))
        ratios[server] = {}
        for c, r in list(cells.items())[1:]:
            ratios[server][f"p99 {c}/{base_c}"] = r.pct(99) / base.pct(99) if base.n and r.n else float("nan")
            ratios[server][f"calls/s {c}/{base_c}"] = r.rate / base.rate if base.rate else float("nan")
    if len(by_server) == 2:
        (after, new), (before, old) = by_server.items()
        key = f"{after} vs {before}"
        ratios[key] = {}
        for c in new.keys() & old.keys():
            ratios[key][f"p99 before/after c={c}"] = old[c].pct(99) / new[c].pct(99) if new[c].n else float("nan")
            ratios[key][f"calls/s after/before c={c}"] = new[c].rate / old[c].rate if old[c].rate else float("nan")
    return ratios


def print_burst(rows: list[dict]) -> None:
    head = (
        f"{'server':16s} {'c':>4s} {'n ok':>5s} {'p50 ms':>8s} {'p99 ms':>8s} {'calls/s':>8s} {'429':>5s} "
        f"{'503':>5s} {'timeout':>7s} {'other':>5s} {'starts':>6s} {'peak':>4s} {'cli ms':>6s} {'srv ms':>6s} "
        f"{'krn ms':>6s}  retired"
    )
    print(head)
    print("-" * len(head))
    for row in burst_json(rows):
        other = sum(row["bad"].values()) - row["http_429"] - row["http_503"] - row["timeouts"]
        print(
            f"{row['server']:16s} {row['concurrency']:4d} {row['n_ok']:5d} {fmt(row['p50_ms']):>8s} "
            f"{fmt(row['p99_ms']):>8s} {fmt(row['calls_per_s']):>8s} {row['http_429']:5d} {row['http_503']:5d} "
            f"{row['timeouts']:7d} {other:5d} {row['kernel_starts']:6d} {row['kernels_starting_peak'] or 0:4d} "
            f"{fmt(row['cpu']['client']):>6s} {fmt(row['cpu']['server']):>6s} {fmt(row['cpu']['kernels']):>6s}  "
            + (", ".join(f"{cause} {n}" for cause, n in row["kernels_retired"].items() if n) or "-")
        )
    print(
        "starts: kernel starts the server completed during the cell; peak: the most it had starting at once so far; "
        "p50/p99 over the calls that succeeded; cli ms, srv ms, krn ms: CPU ms per call of this client, the server "
        "process and the kernels; retired: kernels stopped during the cell, by cause"
    )
    for server, values in burst_ratios(rows).items():
        print(f"  {server}: " + ", ".join(f"{name} = {fmt(v, 2)}" for name, v in values.items()))


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--calls", type=int, default=200, help="timed HTTP calls per (case, concurrency)")
    parser.add_argument("--max-s", type=float, default=15.0, help="time limit of one HTTP measurement")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls first (at least 2 per task)")
    parser.add_argument("--baseline-calls", type=int, default=40, help="timed subprocess calls per measurement")
    parser.add_argument("--baseline-max-s", type=float, default=12.0)
    parser.add_argument("--baseline-warmup", type=int, default=2)
    parser.add_argument("--profile-calls", type=int, default=100, help="calls per profile row (0: no profile)")
    parser.add_argument("--pool-size", type=int, default=8)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--max-waiting", type=int, default=256)
    parser.add_argument(
        "--max-kernels", type=int, default=0, help="0: 2 x max concurrency (burst: up to --max-running) + pool + 8"
    )
    parser.add_argument("--max-starting", type=int, help="the server's --max-starting (default: the server's)")
    parser.add_argument("--burst-concurrency", type=int, nargs="*", default=[8, 32, 128], help="none: no burst")
    parser.add_argument("--burst-calls", type=int, default=400, help="calls per burst cell (refused ones count)")
    parser.add_argument("--burst-max-s", type=float, default=30.0, help="time limit of one burst cell")
    parser.add_argument(
        "--burst-http-timeout-s", type=float, default=60.0, help="a burst call unanswered is a timeout"
    )
    parser.add_argument(
        "--compare-max-starting",
        type=int,
        metavar="N",
        help="repeat the burst section on a second server with --max-starting N (0: no bound, as before it)",
    )
    parser.add_argument(
        "--compare-pool-size",
        type=int,
        metavar="N",
        help="repeat the burst section on a second server with --pool-size N",
    )
    parser.add_argument(
        "--compare-code",
        type=Path,
        metavar="DIR",
        help="repeat the burst section on a second server run from the sandbox package of the checkout DIR "
        "(e.g. `git worktree add /tmp/before COMMIT`), same flags: before/after of a code change",
    )
    parser.add_argument("--burst-only", action="store_true", help="no baseline, session/stateless cases or profile")
    parser.add_argument("--isolation", choices=["auto", "namespaces", "process"], default="auto")
    parser.add_argument("--json", type=Path, help="also write all numbers here")
    args = parser.parse_args(argv)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the server
    t0 = time.perf_counter()
    version = code_version()
    print(f"sandbox code: {version} (sha256 of sandbox/stare_sandbox/*.py)", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-sandbox-"))
    try:
        results, http_out, flags, left = run_all(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    isolation = http_out["isolation"]
    print()
    print(f"isolation: {isolation['mode'] if isolation else None} ({json.dumps(isolation)})")
    print(
        f"server flags: {' '.join(flags)}; sandbox code {version}"
        + (" (unchanged during the run)" if version == code_version() else " CHANGED DURING THE RUN")
    )
    if results:
        print_table(results)
    if http_out["burst"]:
        print("\nburst: stateless sympy, timed from the first call, raw httpx without retries")
        print_burst(http_out["burst"])
    if "profile" in http_out:
        print("\nprofile (c=1, client-side ms; srv = the server's duration_ms):")
        for label, row in http_out["profile"].items():
            srv = f"  srv p50 {row['server_p50_ms']:.2f}" if "server_p50_ms" in row else ""
            print(f"  {label:44s} p50 {row['p50_ms']:7.2f}  p99 {row['p99_ms']:7.2f}{srv}")
    print(
        f"\n429s refused by the server: {http_out['rejected_429']:g}; "
        f"kernel start failures: {http_out['kernel_start_failures']}; processes left behind: {len(left)}"
    )
    for line in verdicts(results):
        print(line)
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        data = {
            "isolation": isolation,
            "flags": flags,
            "sandbox_code": version,
            "results": [r.to_json() for r in results],
            "profile": http_out.get("profile"),
            "rejected_429": http_out["rejected_429"],
            "verdicts": verdicts(results),
            "burst": burst_json(http_out["burst"]),
            "burst_ratios": burst_ratios(http_out["burst"]),
        }
        args.json.write_text(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
