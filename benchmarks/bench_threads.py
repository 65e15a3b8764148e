"""Torch thread settings for the quickstart's tiny model: 1 or 2 intra-op threads, alone and beside a busy process.

Two workloads, both with the library's own code on the tiny Qwen2 the quickstart builds (TinyModelConfig):
    sft: one optimizer step = forward + backward of sft.token_loss_sum on a micro-batch of --sft-batch random
         sequences of --sft-tokens tokens, then clip_and_step (AdamW); reported in steps/s.
    gen: one HFGenerator call (the RL rollout sampler) on --gen-batch random prompts of --gen-prompt tokens,
         --gen-tokens new tokens each (stop strings off; a row ends early only if it samples EOS); sampled tokens/s.
Settings (rows of the table): torch.set_num_threads(1) or (2); OMP_WAIT_POLICY unset or PASSIVE (idle OpenMP
threads sleep at once instead of spinning first); no competitor, or a competitor = a separate Python process
spinning `while True: pass` (one core), started before the worker and killed after it.
Each setting runs in a fresh worker process (this script re-invoked with a hidden flag), because OpenMP reads
OMP_WAIT_POLICY when torch loads it. The worker sets the thread count; per workload it runs untimed
warm-up (--warmup SFT steps; one generation call of 4 new tokens), then times units until --seconds have
passed (at least 2 SFT steps or 1 generation call; a slow setting takes longer). Settings are interleaved
for --rounds rounds (round r runs every setting once) so that drift in the machine's load is shared; the
table shows the median over rounds and its ratio to the baseline (2 threads, no policy, no competitor) of
the same run. `others` = cores kept busy by other processes while the worker timed (the competitor counts).

Run: .venv/bin/python benchmarks/bench_threads.py [--quick] [--help]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BASELINE = "2 threads"


@dataclass(frozen=True)
class Setting:
    name: str
    threads: int
    passive: bool
    competitor: bool


SETTINGS = [
    Setting("1 thread", 1, False, False),
    Setting(BASELINE, 2, False, False),
    Setting("2 threads, PASSIVE", 2, True, False),
    Setting("1 thread + competitor", 1, False, True),
    Setting("2 threads + competitor", 2, False, True),
    Setting("2 threads, PASSIVE + competitor", 2, True, True),
]


def build_model(out_dir: Path) -> Path:
    """The quickstart's model shape (TinyModelConfig defaults) with a tokenizer trained on the tiny corpus."""
    from transformers.utils import logging as hf_logging

    from stare_agent.lab.models import build_tiny_model, tiny_corpus
    from stare_agent.lab.quickstart import TinyModelConfig

    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in the table's output
    return build_tiny_model(out_dir, tiny_corpus(), **dataclasses.asdict(TinyModelConfig()))


def timed(unit, seconds: float, min_units: int) -> tuple[int, float]:
    """(units, seconds) of unit() calls repeated until `seconds` have passed and at least `min_units` ran."""
    count, start = 0, time.perf_counter()
    while count < min_units or time.perf_counter() - start < seconds:
        unit()
        count += 1
    return count, time.perf_counter() - start


def worker(spec: dict) -> None:
    """One setting in this fresh process: print one JSON line {workload: {rate, units, seconds, others}}."""
    import torch
    from _machine import cpu_snapshot, other_cores
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stare_agent.backends.local.common import clip_and_step, make_optimizer
    from stare_agent.backends.local.generation import HFGenerator
    from stare_agent.backends.local.sft import token_loss_sum
    from stare_agent.config import OptimConfig

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    vocab = model.config.vocab_size
    eos = set(HFGenerator(model, tokenizer).eos_ids)
    # Random token ids without EOS, so generation runs its full budget unless the model samples EOS.
    allowed = torch.tensor([i for i in range(3, vocab) if i not in eos])
    result = {"threads": torch.get_num_threads(), "wait_policy": os.environ.get("OMP_WAIT_POLICY", "")}

    if "sft" in spec["workloads"]:
        model.train()
        optimizer, scheduler = make_optimizer(model, OptimConfig(lr=1e-4), total_steps=10**6)
        ids = allowed[torch.randint(len(allowed), (spec["sft_batch"], spec["sft_tokens"]))]
        attention = torch.ones_like(ids)
        loss_mask = torch.ones(ids.shape)  # (B, T); 1 = trained on: every position, as in a full transcript

        def sft_step() -> None:
            loss_sum, count = token_loss_sum(model, ids, attention, loss_mask)
            (loss_sum / count).backward()
            clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0)

        for _ in range(spec["warmup"]):
            sft_step()
        load = cpu_snapshot()
        steps, seconds = timed(sft_step, spec["seconds"], min_units=2)
        result["sft"] = {"rate": steps / seconds, "units": steps, "seconds": seconds, "others": other_cores(load)}

    if "gen" in spec["workloads"]:
        generator = HFGenerator(model, tokenizer, stop_strings=(), max_batch_size=spec["gen_batch"], seed=0)
        prompts = allowed[torch.randint(len(allowed), (spec["gen_batch"], spec["gen_prompt"]))].tolist()
        budgets = [spec["gen_tokens"]] * len(prompts)
        generator(prompts, [4] * len(prompts))  # warm-up: prefill and a few cached steps, not counted
        before = (generator.stats.generated_tokens, generator.stats.seconds)
        load = cpu_snapshot()
        calls, seconds = timed(lambda: generator(prompts, budgets), spec["seconds"], min_units=1)
        tokens = generator.stats.generated_tokens - before[0]
        inside = generator.stats.seconds - before[1]
        result["gen"] = {"rate": tokens / inside, "units": calls, "seconds": seconds, "others": other_cores(load)}
    print(json.dumps(result))


def run_setting(setting: Setting, spec: dict) -> dict:
    """Run one worker for `setting`, with its competitor process around it when the setting has one."""
    env = dict(os.environ)
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("OMP_NUM_THREADS", None)
    if setting.passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    spec = {**spec, "threads": setting.threads}
    competitor = None
    if setting.competitor:
        competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--_worker", json.dumps(spec)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"worker for {setting.name!r} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all settings (median)")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per workload and worker")
    parser.add_argument("--warmup", type=int, default=2, help="untimed SFT steps before timing")
    parser.add_argument("--sft-batch", type=int, default=16, help="sequences per SFT micro-batch")
    parser.add_argument("--sft-tokens", type=int, default=256, help="tokens per SFT sequence")
    parser.add_argument("--gen-batch", type=int, default=64, help="prompts per generation call")
    parser.add_argument("--gen-prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--gen-tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--workloads", default="sft,gen", help="comma-separated: sft, gen")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 0.5 s, small batches")
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._worker:
        worker(json.loads(args._worker))
        return
    if args.quick:
        args.rounds, args.seconds, args.warmup = 1, 0.5, 1
        args.sft_batch, args.sft_tokens, args.gen_batch, args.gen_tokens = 4, 64, 8, 8
    workloads = [w for w in args.workloads.split(",") if w]
    if not workloads or set(workloads) - {"sft", "gen"} or args.rounds < 1 or args.warmup < 1:
        raise SystemExit("--workloads takes sft and/or gen; --rounds and --warmup must be >= 1")

    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, default {torch.get_num_threads()} threads")
    print(f"load average before: {load_average()}", flush=True)
    started = time.perf_counter()
    results: dict[str, list[dict]] = {s.name: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model")
        spec = {
            "model": str(model),
            "workloads": workloads,
            "seconds": args.seconds,
            "warmup": args.warmup,
            "sft_batch": args.sft_batch,
            "sft_tokens": args.sft_tokens,
            "gen_batch": args.gen_batch,
            "gen_prompt": args.gen_prompt,
            "gen_tokens": args.gen_tokens,
        }
        for r in range(args.rounds):
            for setting in SETTINGS:
                out = run_setting(setting, spec)
                results[setting.name].append(out)
                shown = ", ".join(f"{w} {out[w]['rate']:,.1f}" for w in workloads)
                print(f"  round {r + 1}/{args.rounds}: {setting.name}: {shown}", flush=True)
    print(f"load average after: {load_average()}; {time.perf_counter() - started:.0f} s in all\n")

    units = {"sft": "SFT steps/s", "gen": "gen tokens/s"}
    header = ["setting"] + [f"{units[w]} (× base)" for w in workloads] + [f"others ({w})" for w in workloads]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    base = {w: statistics.median(o[w]["rate"] for o in results[BASELINE]) for w in workloads}
    for setting in SETTINGS:
        cells = [f"**{setting.name}**" if setting.name == BASELINE else setting.name]
        for w in workloads:
            rates = [o[w]["rate"] for o in results[setting.name]]
            median = statistics.median(rates)
            spread = f" [{min(rates):,.1f}–{max(rates):,.1f}]" if len(rates) > 1 else ""
            cells.append(f"{median:,.1f}{spread} ({median / base[w]:.2f}×)")
        for w in workloads:
            others = [o[w]["others"] for o in results[setting.name] if o[w]["others"] is not None]
            cells.append(f"{statistics.median(others):.2f}" if others else "n/a")
        print("| " + " | ".join(cells) + " |")
    print(
        f"\nmedian [min–max] over {args.rounds} round(s); × base = median / median of {BASELINE!r} "
        f"(no competitor); SFT: micro-batch {args.sft_batch} × {args.sft_tokens} tokens; "
        f"gen: {args.gen_batch} prompts × {args.gen_tokens} new tokens; others = cores of 2 kept busy by "
        "other processes while timing (a competitor is ~1.0 of it)"
    )


if __name__ == "__main__":
    main()
