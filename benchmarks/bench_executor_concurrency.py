"""The openrlhf backend's agent executor at a vLLM engine's episode concurrency, over the real sandbox.

    .venv/bin/python benchmarks/bench_executor_concurrency.py --out runs/bench-executor-concurrency

Why: in the paper's shape (64 prompts x 8 samples per step over 8 engines) each engine runs about 64 episodes at
once, each up to the turn cap, and in stateful tool mode each holds a kernel from its first tool call to its end.
The question is whether the sandbox keeps up: does any episode end in `sandbox_error` because its call waited
too long for a kernel, and how long do calls wait?

What runs: `ReToolExecutor.execute` (stare_agent/backends/openrlhf/episodes.py), N at once with asyncio.gather
and called by keyword, as OpenRLHF 0.11.2's engine actor runs a step's episodes; a real tokenizer (the tiny test
model's, `stare_agent.lab.models.build_tiny_model`); real Jupyter kernels, either
    in-process  the executor's own default client (sandbox.url empty): a kernel pool in this process, sized by
                `config.stateful_episodes_in_flight` (prompts_per_step x group_size = 512 in stateful mode); or
    server      a real `python -m stare_sandbox serve` on loopback (sandbox.url), sized by docs/sandbox.md's rule for
                its largest level L in whole groups (--max-sessions L + 8, --max-kernels L + pool + 8,
                --max-waiting max(L, 64)),
in stateful tool mode (a session, so a kernel, per episode) and stateless (a pooled kernel per call).

Generation is scripted: `llm_engine` is a stand-in for OpenRLHF's engine actor whose `generate(prompt_token_ids,
sampling_params)` returns a vLLM RequestOutput-shaped object at once (no GPU here, and the question is the
sandbox's queueing, not the model's speed). Each episode writes --tool-calls turns that end in a tool call (small
sympy programs of ~20-250 ms each, different in every episode so that no cache answers them), then a `\\boxed{}`
answer. With no generation time (--gen-delay-s 0) every episode reaches the sandbox at once: the harshest case.

--old-sizing N adds a pair of in-process stateful cells at N episodes: first the sizing before the explicit limit
(the executor's client made by `make_client(config.sandbox)` without the episode count, so max_kernels =
sandbox.max_kernels: 64 by default, --sandbox-max-kernels scales it down), then the executor's default client.

Measured per cell: episodes that ended in `sandbox_error` (extra_logs["finish_sandbox_error"]) and with a tool error
(the code's own failure, e.g. a timeout); each tool call's latency as the episode saw it (from the engine's
answer to the episode's next request: kernel wait, queueing, the run and the observation's tokenization); time
from an episode's start to its first tool output; the batch's wall time; kernels started, the most alive at once,
calls that waited past queue_wait_s for a kernel (retried by the client, so not errors), the mean kernel wait,
(server) calls refused with 429; the most memory the kernels held at once (resident minus shared pages, summed
over the kernels' processes: the server's descendants, or this process's but the server's); the CPU time of this
process, the server and the kernels per episode (the machine's busy time less the others'); and how many cores
processes that are not ours kept busy (the machine is shared). The script reports; it judges nothing and has no
thresholds.

Results: OUT/results.json (settings, machine, every cell) and OUT/results.md (the table). --append adds this
run's cells to those already in OUT/results.json, so a long matrix can be run in pieces.
Tiny check: --levels 2 --tool-calls 1 --clients in-process --modes stateful --out /tmp/bench-exec
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import os
import platform
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import numpy as np

from stare_agent import protocol

PAGE = os.sysconf("SC_PAGE_SIZE")

TOOL_CODE = (
    "import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x**4 - {b}*x**2 + {a}, x))",
    "import sympy as sp\nx = sp.symbols('x')\nprint(sp.factor(sp.expand((x + {a})**9 * (x - {b})**7)))",
    "import sympy as sp\nx = sp.symbols('x')\nprint(sp.series(sp.exp(sp.sin(x)) * (x + {a}), x, 0, 6))",
    "import sympy as sp\nx = sp.symbols('x')\nprint(sp.integrate(x**2 * sp.exp({a}*x) * sp.sin(x), x))",
)
"""One math step per turn, cycled; {a} is the episode's own number, {b} = a + 4. Timed in one Python process on
this machine: about 30, 30, 200 and 150-250 ms (sympy caches results per process, hence a new {a} per episode)."""


# --- the scripted engine --------------------------------------------------------------------------------------------


@dataclass
class Trace:
    """One episode as the engine saw it: perf_counter times of its requests and of the engine's answers."""

    number: int
    """The episode's own number ({a} in its code)."""
    start: float = 0.0
    end: float = 0.0
    requests: list[float] = field(default_factory=list)
    answers: list[float] = field(default_factory=list)
    grew: bool = True
    """Every request extended the previous one's ids by the engine's answer and then some (the observation)."""
    last: list[int] = field(default_factory=list)


CURRENT: contextvars.ContextVar[Trace] = contextvars.ContextVar("episode")
"""The episode whose task is running: set in each gathered task, read by the engine (context is per task)."""


def turn_text(number: int, turn: int, tool_calls: int, label: str) -> str:
    """What the scripted model writes in a turn: a tool call while turn < tool_calls, then the answer."""
    if turn < tool_calls:
        code = TOOL_CODE[turn % len(TOOL_CODE)].format(a=number, b=number + 4)
        return f"Step {turn + 1}.\n<code>\n```python\n{code}\n```\n</code>"
    return "So the answer is\n" + protocol.final_answer(label)


class ScriptedEngine:
    """Stands in for OpenRLHF's vLLM engine actor: `await generate(ids, params)` returns a RequestOutput-like object.

    The turn's text comes from the episode's script (turn_text, the episode from CURRENT); its ids end with the
    turn's stop string, which must be one of the request's (the executor sets them), and are cut at
    params.max_tokens ("length") as vLLM would.
    """

    def __init__(self, tokenizer: Any, tool_calls: int, labels: dict[int, str], gen_delay_s: float = 0.0):
        self.tokenizer = tokenizer
        self.tool_calls = tool_calls
        self.labels = labels
        self.gen_delay_s = gen_delay_s

    async def generate(self, prompt_token_ids: Any, sampling_params: Any, multi_modal_data: Any = None) -> NS:
        trace = CURRENT.get()
        trace.requests.append(time.perf_counter())
        ids = list(prompt_token_ids)
        turn = len(trace.answers)
        if turn and len(ids) <= len(trace.last) or ids[: len(trace.last)] != trace.last:
            trace.grew = False
        text = turn_text(trace.number, turn, self.tool_calls, self.labels[trace.number])
        stop = protocol.STOP_STRINGS[0] if turn < self.tool_calls else protocol.STOP_STRINGS[1]
        if stop not in (sampling_params.stop or []):
            raise RuntimeError(f"the request's stop strings {sampling_params.stop} lack {stop!r}")
        out = protocol.encode_segment(self.tokenizer, text)
        finish, stop_reason = "stop", stop
        if len(out) > sampling_params.max_tokens:
            out, finish, stop_reason = out[: sampling_params.max_tokens], "length", None
        await asyncio.sleep(self.gen_delay_s)  # 0: the answer still comes later, other episodes run meanwhile
        trace.last = ids + out
        trace.answers.append(time.perf_counter())
        completion = NS(
            token_ids=out,
            text=self.tokenizer.decode(out),
            # the sampled id's log-prob when asked (the executor always asks), as vLLM's logprobs=0 gives it
            logprobs=None if sampling_params.logprobs is None else [{t: NS(logprob=-0.5)} for t in out],
            finish_reason=finish,
            stop_reason=stop_reason,
        )
        return NS(outputs=[completion])


def shared_params() -> NS:
    """OpenRLHF's SamplingParams for a step (a keyword bag for vLLM's class): the executor copies it per turn."""
    return NS(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        max_tokens=1024,
        min_tokens=1,
        skip_special_tokens=False,
        logprobs=None,
        stop=[],
        include_stop_str_in_output=False,
    )


# --- what a cell measured -------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def call_times(traces: list[Trace], responses: list[dict]) -> tuple[list[float], list[float], list[float]]:
    """Seconds each tool call took as its episode saw it, from the engine's answer that made the call to the
    episode's next request: (first calls, later calls, start of episode to first tool output).

    A first call includes opening the session (stateful), so the wait for a kernel; with no generation time it
    ends about when the time from the episode's start does. A call that failed (sandbox_error) makes no next
    request and is not timed."""
    first, later, from_start = [], [], []
    for trace, response in zip(traces, responses, strict=True):
        made = int(response["extra_logs"]["tool_calls"])
        gaps = [req - ans for ans, req in zip(trace.answers, trace.requests[1:], strict=False)][:made]
        first += gaps[:1]
        later += gaps[1:]
        if gaps:
            from_start.append(trace.requests[1] - trace.start)
    return first, later, from_start


def spread(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    """p50, p95 and max of `values` times `scale`."""
    return {
        "p50": None if not values else scale * percentile(values, 50),
        "p95": None if not values else scale * percentile(values, 95),
        "max": None if not values else scale * max(values),
    }


def summarize(traces: list[Trace], responses: list[dict], wall_s: float) -> dict[str, Any]:
    """The episodes' side of a cell: outcomes and times."""
    logs = [r["extra_logs"] for r in responses]
    first, later, from_start = call_times(traces, responses)
    scored = [r["reward"] for r in responses if r["scores"] == r["scores"]]  # NaN: unscored
    return {
        "episodes": len(responses),
        "sandbox_errors": int(sum(log["finish_sandbox_error"] for log in logs)),
        "episodes_with_tool_errors": sum(log["tool_errors"] > 0 for log in logs),
        "tool_calls": int(sum(log["tool_calls"] for log in logs)),
        "finished_with_answer": int(sum(log["finish_answer"] for log in logs)),
        "mean_reward": sum(scored) / len(scored) if scored else None,
        "ids_grew_every_turn": all(t.grew for t in traces),
        "first_call_s": spread(first),
        "first_output_from_start_s": spread(from_start),
        "later_calls_ms": spread(later, 1000),
        "episode_s": spread([t.end - t.start for t in traces]),
        "wall_s": wall_s,
    }


# --- the sandbox's side ---------------------------------------------------------------------------------------------


def _metric(text: str, name: str) -> float:
    """A sample's value in Prometheus text (the sum over its labels); 0 if absent."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def sandbox_counts(client: Any, url: str) -> dict[str, float]:
    """The counters that only grow, from the in-process pool or the server's /healthz and /metrics."""
    if not url:
        pool = client.pool
        return {
            "kernels_started": pool.kernels_started,
            "waits_refused": pool.waits_refused,
            "kernel_waits": sum(pool.wait_counts),
            "kernel_wait_s": pool.wait_sum_s,
            "start_failures": pool.start_failures,
            "rejected_429": 0,
        }
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        health = (await http.get("/healthz")).json()
        metrics = (await http.get("/metrics", headers=_auth())).text
    return {
        "kernels_started": health["kernels_started"],
        "waits_refused": health["kernel_waits_refused"],
        "kernel_waits": _metric(metrics, "sandbox_kernel_wait_seconds_count"),
        "kernel_wait_s": _metric(metrics, "sandbox_kernel_wait_seconds_sum"),
        "start_failures": health["kernel_start_failures"],
        "rejected_429": _metric(metrics, "sandbox_rejected_total"),
    }


def _auth() -> dict[str, str]:
    token = os.environ.get("SANDBOX_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def kernel_memory_mb(root: int, skip: int | None) -> float:
    """Resident minus shared memory of `root`'s descendants, less `skip` and its own, in MB (/proc/PID/statm)."""
    from bench_sandbox import _proc_table, descendants  # same directory: run as a script

    table = _proc_table()
    left_out = {skip, *descendants(skip, table)} if skip else set()
    total = 0
    for pid in descendants(root, table):
        if pid in left_out:
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{pid}/statm") as f:
                fields = f.read().split()
            total += int(fields[1]) - int(fields[2])
    return total * PAGE / 1e6


@dataclass
class Cpu:
    wall: float
    busy: float
    """CPU seconds the whole machine was busy (/proc/stat)."""
    others: dict[int, float]
    """pid -> CPU seconds of each process not ours, its reaped children's included, except for pid 1's."""


def cpu_snapshot(marker: str) -> Cpu:
    """Ours: this process, its descendants and any process whose command line names `marker`. pid 1 counts its
    own CPU only: it reaps orphans, and a kernel whose parent was killed first (a retired session's, say) ends up
    there, so its reaped-children time holds our kernels' CPU (once seen as 1.9 of 2 cores "used by others")."""
    from bench_sandbox import TICK, _proc_table, descendants  # same directory: run as a script

    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    busy = (sum(fields) - fields[3] - fields[4]) / TICK
    table = _proc_table()
    ours = {os.getpid(), *descendants(os.getpid(), table)}
    others = {}
    for pid, (_, own, total) in table.items():
        if pid in ours:
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    continue
        others[pid] = own if pid == 1 else total
    return Cpu(time.perf_counter(), busy, others)


def others_cpu_s(start: Cpu, end: Cpu) -> float:
    """CPU seconds that processes not ours used between the two snapshots."""
    return sum(max(total - start.others.get(pid, 0.0), 0.0) for pid, total in end.others.items())


class Sampler:
    """Every `every_s` while a cell runs: kernels alive and calls waiting for one; every 4th time, their memory."""

    def __init__(self, client: Any, url: str, server_pid: int | None, every_s: float = 0.5):
        self.client, self.url, self.every_s = client, url, every_s
        # the kernels of this cell's side: the server's descendants, or this process's but the server's
        self.root, self.skip = (server_pid, None) if url else (os.getpid(), server_pid)
        self.peak = {"kernels_alive": 0, "kernel_waiting": 0, "kernel_memory_mb": 0.0}
        self._task: asyncio.Task | None = None

    async def _state(self, http: Any) -> tuple[int, int]:
        if http is None:
            return self.client.pool.alive_count, self.client.pool.waiting_count
        health = (await http.get("/healthz")).json()
        return health["kernels_alive"], health["kernel_waiting"]

    async def _run(self) -> None:
        import httpx

        async with contextlib.AsyncExitStack() as stack:
            http = (
                await stack.enter_async_context(httpx.AsyncClient(base_url=self.url, timeout=30)) if self.url else None
            )
            tick = 0
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    alive, waiting = await self._state(http)
                    self.peak["kernels_alive"] = max(self.peak["kernels_alive"], alive)
                    self.peak["kernel_waiting"] = max(self.peak["kernel_waiting"], waiting)
                if tick % 4 == 0:
                    memory = await asyncio.to_thread(kernel_memory_mb, self.root, self.skip)
                    self.peak["kernel_memory_mb"] = max(self.peak["kernel_memory_mb"], memory)
                tick += 1
                await asyncio.sleep(self.every_s)

    def __enter__(self) -> Sampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


async def settle(client: Any, url: str, pool_size: int, timeout_s: float = 120.0) -> None:
    """Until the pool has its warm kernels and nothing from an earlier cell is starting, waiting or open."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if url:
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                h = (await http.get("/healthz")).json()
            quiet = h["pool_ready"] >= pool_size and not (h["sessions"] or h["kernels_starting"] or h["running"])
        else:
            pool = client.pool
            quiet = pool.ready_count >= pool_size and not pool.starting_count
        if quiet:
            return
        await asyncio.sleep(0.25)


# --- one cell -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    client: str  # in-process | server
    mode: str  # stateful | stateless
    episodes: int
    sizing: str = "explicit"  # explicit: the executor's default client; old: make_client(config.sandbox)


def make_config(cell: Cell, url: str, args: argparse.Namespace) -> Any:
    """The paper's agent and rollout settings (configs/rl_paper_*.yaml) with the cell's tool mode and sandbox.

    Over the server a step is the cell's episodes (rounded up to whole groups), which the server is sized for: the
    executor refuses a step that the server cannot hold (runtime.check_capacity). In-process it stays the paper's
    64 prompts, whose count sizes the executor's own kernel pool (stateful_episodes_in_flight), the sizing measured
    here."""
    from stare_agent.config import AgentConfig, RLConfig, RolloutConfig, SandboxConfig

    prompts = -(-cell.episodes // args.group_size) if url else 64
    return RLConfig(
        agent=AgentConfig(max_total_tokens=8192, max_tool_calls=8, tool_mode=cell.mode),
        rollout=RolloutConfig(prompts_per_step=prompts, group_size=args.group_size, max_turn_tokens=8192),
        sandbox=SandboxConfig(url=url, max_kernels=args.sandbox_max_kernels),
    )


async def run_cell(cell: Cell, tokenizer: Any, url: str, server_pid: int | None, args: argparse.Namespace) -> dict:
    from stare_agent.backends.openrlhf.episodes import ReToolExecutor
    from stare_agent.runtime import make_client

    config = make_config(cell, url, args)
    old = cell.sizing == "old"
    executor = ReToolExecutor(config, make_client=(lambda: make_client(config.sandbox)) if old else None)
    # a new number per episode and cell: sympy's per-process cache never answers a call
    first = 1 + 1000 * args.cell_index
    traces = [Trace(number=first + i) for i in range(cell.episodes)]
    labels = {t.number: str(i // args.group_size) for i, t in enumerate(traces)}  # one label per prompt (group)
    engine = ScriptedEngine(tokenizer, args.tool_calls, labels, args.gen_delay_s)
    params = shared_params()

    async def episode(trace: Trace) -> dict:
        CURRENT.set(trace)
        group = labels[trace.number]
        trace.start = time.perf_counter()
        try:
            return await executor.execute(
                prompt=f"Problem {group}: find the roots, factors, series and integral, then answer {group}.",
                label=group,
                sampling_params=params,
                max_length=8192,
                hf_tokenizer=tokenizer,
                llm_engine=engine,
            )
        finally:
            trace.end = time.perf_counter()

    try:
        client = await executor.client()
        max_kernels = client.pool.settings.max_kernels if not url else args.server_max_kernels
        await settle(client, url, config.sandbox.pool_size)
        before = await sandbox_counts(client, url)
        marker = args.kernel_root if url else str(getattr(client.pool, "_root", "") or "\0")
        cpu = cpu_snapshot(marker)
        with Sampler(client, url, server_pid) as sampler:
            started = time.perf_counter()
            responses = await asyncio.gather(*(episode(t) for t in traces))
            wall_s = time.perf_counter() - started
        end = cpu_snapshot(marker)
        others = others_cpu_s(cpu, end)
        after = await sandbox_counts(client, url)
    finally:
        await executor.close()
    row = {
        "client": cell.client,
        "mode": cell.mode,
        "gen_delay_s": args.gen_delay_s,
        "sandbox_max_kernels": args.sandbox_max_kernels,
        "scripted_tool_calls": args.tool_calls,
        "sizing": cell.sizing,
        "concurrent_episodes_passed": 0 if old or url else config.stateful_episodes_in_flight,
        "max_kernels": max_kernels,
        **summarize(traces, responses, wall_s),
        **{key: after[key] - before[key] for key in after},
        **sampler.peak,
        "others_cores": others / (end.wall - cpu.wall),
        # this process, the server and all kernels: the machine's busy time less the others'
        "our_cpu_s": (end.busy - cpu.busy) - others,
    }
    row["our_cpu_s_per_episode"] = row["our_cpu_s"] / cell.episodes
    waits = row.pop("kernel_waits")
    row["mean_kernel_wait_ms"] = 1000 * row.pop("kernel_wait_s") / waits if waits else None
    return row


# --- the report -----------------------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(report: dict) -> str:
    head = (
        "| client | mode | sizing (max kernels) | episodes | gen s/turn | sandbox errors | tool errors "
        "| first call p50 / p95 / max s | later calls p50 / p95 ms | wall s | kernels started | most alive "
        "| most waiting | waits > queue_wait_s | 429s | kernel memory GB | our CPU s / episode | other cores |"
    )
    lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
    for r in report["rows"]:
        first, later = r["first_call_s"], r["later_calls_ms"]
        lines.append(
            f"| {r['client']} | {r['mode']} | {r['sizing']} ({r['max_kernels']}) | {r['episodes']} "
            f"| {r['gen_delay_s']:g} | {r['sandbox_errors']} | {r['episodes_with_tool_errors']} "
            f"| {_fmt(first['p50'], 2)} / {_fmt(first['p95'], 2)} / {_fmt(first['max'], 2)} "
            f"| {_fmt(later['p50'], 0)} / {_fmt(later['p95'], 0)} | {r['wall_s']:.0f} "
            f"| {r['kernels_started']:.0f} | {r['kernels_alive']} | {r['kernel_waiting']} | {r['waits_refused']:.0f} "
            f"| {r['rejected_429']:.0f} | {r['kernel_memory_mb'] / 1000:.1f} "
            f"| {_fmt(r.get('our_cpu_s_per_episode'), 2)} | {r['others_cores']:.2f} |"
        )
    machine = report["machine"]
    notes = [
        "",
        f"Machine: {machine['cores']} cores, {machine['memory_gb']:.0f} GB, Python {machine['python']}, sympy "
        f"{machine['sympy']}, kernel isolation {machine['isolation']}. Each episode: "
        f"{'/'.join(sorted({str(r['scripted_tool_calls']) for r in report['rows']}))} tool calls, then an answer; "
        "generation scripted.",
    ]
    if report.get("server_flags"):
        notes.append(f"Server: python -m stare_sandbox serve {' '.join(report['server_flags'])}")
    return "\n".join(lines + notes) + "\n"


def machine_info() -> dict[str, Any]:
    import sympy

    from stare_sandbox.isolation import detect_isolation

    with open("/proc/meminfo") as f:
        total_kb = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    iso = detect_isolation("auto")
    return {
        "cores": len(os.sched_getaffinity(0)),
        "memory_gb": total_kb / 1e6,
        "python": platform.python_version(),
        "sympy": sympy.__version__,
        "isolation": iso.mode + (f", cgroup {iso.cgroup}" if iso.cgroup else ""),
    }


def cells(args: argparse.Namespace) -> list[Cell]:
    out = [
        Cell(client, mode, level) for client in args.clients for mode in args.modes for level in sorted(args.levels)
    ]
    if args.old_sizing:
        out += [
            Cell("in-process", "stateful", args.old_sizing, "old"),
            Cell("in-process", "stateful", args.old_sizing),
        ]
    return out


async def run_all(todo: list[Cell], tokenizer: Any, url: str, server_pid: int | None, args: argparse.Namespace):
    rows = []
    for cell in todo:
        args.cell_index += 1
        print(f"{cell.client} {cell.mode} {cell.sizing} x{cell.episodes} ...", flush=True)
        row = await run_cell(cell, tokenizer, url if cell.client == "server" else "", server_pid, args)
        rows.append(row)
        print(
            f"  sandbox errors {row['sandbox_errors']}, first call p95 {_fmt(row['first_call_s']['p95'], 2)} s, "
            f"later calls p95 {_fmt(row['later_calls_ms']['p95'], 0)} ms, wall {row['wall_s']:.1f} s, "
            f"kernels started {row['kernels_started']:.0f}, most alive {row['kernels_alive']}",
            flush=True,
        )
    return rows


def load_tokenizer(path: str, workdir: Path) -> Any:
    from transformers import AutoTokenizer

    if not path:
        from stare_agent.lab.models import build_tiny_model, tiny_corpus

        path = str(build_tiny_model(workdir / "tiny_model", tiny_corpus()))
    return AutoTokenizer.from_pretrained(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json and results.md")
    parser.add_argument(
        "--levels", type=int, nargs="*", default=[16, 64], help="episodes at once (default 16 64; none: no matrix)"
    )
    parser.add_argument("--clients", nargs="+", choices=["in-process", "server"], default=["in-process", "server"])
    parser.add_argument("--modes", nargs="+", choices=["stateful", "stateless"], default=["stateful", "stateless"])
    parser.add_argument("--old-sizing", type=int, default=0, help="episodes for the old-sizing pair (0: none)")
    parser.add_argument(
        "--sandbox-max-kernels", type=int, default=64, help="sandbox.max_kernels, the old sizing's cap (default 64)"
    )
    parser.add_argument("--tool-calls", type=int, default=4, help="tool calls per episode before it answers")
    parser.add_argument("--gen-delay-s", type=float, default=0.0, help="the scripted engine's time per turn")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt (episodes share its prompt)")
    parser.add_argument("--tokenizer", default="", help="a HF folder; default: the tiny test model's, built here")
    parser.add_argument("--append", action="store_true", help="keep the cells already in OUT/results.json")
    args = parser.parse_args(argv)
    if any(level < 1 for level in args.levels) or args.tool_calls < 0 or args.old_sizing < 0 or args.gen_delay_s < 0:
        parser.error("--levels must be >= 1, --tool-calls, --old-sizing and --gen-delay-s >= 0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops kernels and the server
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_sandbox, also when main() is imported
    from bench_sandbox import serve

    todo = cells(args)
    args.out.mkdir(parents=True, exist_ok=True)
    old = (
        json.loads((args.out / "results.json").read_text())
        if args.append and (args.out / "results.json").exists()
        else {}
    )
    args.cell_index = len(old.get("rows", []))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-executor-") as tmp:
        workdir = Path(tmp)
        workdir.chmod(0o711)  # kernels may run as other uids and must reach their scratch dirs below it
        tokenizer = load_tokenizer(args.tokenizer, workdir)
        flags: list[str] = []
        with contextlib.ExitStack() as stack:
            url, server_pid = "", None
            if any(cell.client == "server" for cell in todo):
                largest = max(cell.episodes for cell in todo if cell.client == "server")
                largest = -(-largest // args.group_size) * args.group_size  # whole groups: make_config's step
                pool_size = 4  # the in-process default (sandbox.pool_size), so both sides start alike
                args.server_max_kernels = largest + pool_size + 8
                flags = [
                    f"--pool-size={pool_size}",
                    f"--max-sessions={largest + 8}",
                    f"--max-kernels={args.server_max_kernels}",
                    f"--max-waiting={max(largest, 64)}",
                ]
                args.kernel_root = str(workdir / "kernels")
                proc, url, _left = stack.enter_context(serve(flags, workdir, workdir / "kernels"))
                server_pid = proc.pid
            rows = asyncio.run(run_all(todo, tokenizer, url, server_pid, args))
    report = {
        "settings": {
            "group_size": args.group_size,
            "tool_code": list(TOOL_CODE),
        },
        "machine": machine_info(),
        "server_flags": flags or old.get("server_flags", []),
        "rows": old.get("rows", []) + rows,
        "total_s": time.perf_counter() - t0,
    }
    (args.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(report))
    print()
    print(markdown(report))
    print(f"total {report['total_s']:.0f} s; results in {args.out}/results.json and results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
