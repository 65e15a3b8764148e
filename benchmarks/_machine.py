"""What else the machine was doing during a benchmark (other processes distort CPU timings here), and what the
memory benchmarks share: peak-memory probes, fresh worker processes, and their (V, rows) arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def cpu_snapshot() -> tuple[float, float, float] | None:
    """(CPU seconds busy on the whole machine, CPU seconds of this process, wall clock); None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.perf_counter()


def other_cores(start: tuple[float, float, float] | None) -> float | None:
    """Average number of cores other processes kept busy since `start` (None where /proc/stat is missing)."""
    end = cpu_snapshot()
    if start is None or end is None:
        return None
    return max((end[0] - start[0]) - (end[1] - start[1]), 0.0) / (end[2] - start[2])


def proc_status_kib(key: str) -> int | None:
    """A kB field of /proc/self/status (VmRSS, VmHWM, ...); None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Set VmHWM to the current VmRSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def sizes(vocab: str, rows: str) -> list[tuple[int, int]]:
    """(V, rows) pairs from comma-separated --vocab and --rows values (one --rows value applies to every V)."""
    vocabs = [int(v) for v in vocab.split(",")]
    counts = [int(r) for r in rows.split(",")]
    counts = counts * len(vocabs) if len(counts) == 1 else counts
    if len(counts) != len(vocabs):
        raise SystemExit("--rows needs one value, or one per --vocab value")
    return list(zip(vocabs, counts, strict=True))


def run_worker(script: str, spec: dict) -> tuple[dict, Any]:
    """Run `script --_worker SPEC --_out FILE` in a fresh process (its own peak RSS and thread pool) with the
    project on PYTHONPATH; returns the JSON of its last stdout line and what it saved to FILE with torch.save."""
    import torch

    import stare_agent

    root = Path(stare_agent.__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "out.pt")
        cmd = [sys.executable, os.path.abspath(script), "--_worker", json.dumps(spec), "--_out", out_path]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"worker {spec} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1]), torch.load(out_path)


def write_results(out: str | Path, result: dict, markdown: str) -> None:
    """A benchmark's results: OUT/results.json (everything) and OUT/results.md (the table), printed too."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "results.md").write_text(markdown)
    print(markdown)
