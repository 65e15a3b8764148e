"""Padded against packed token-budget micro-batches in the local backend's reference pass and update.

    .venv/bin/python benchmarks/bench_packing.py --out runs/bench-packing        # ~3 min on 2 idle cores

Why: a step's episodes run from a few hundred tokens to the budget. The local backend pads every micro-batch of
`loss.micro_batch_size` rows to the batch's longest episode, so most of what its forwards and backwards compute is
padding; with `loss.max_tokens_per_micro_batch` consecutive episodes are packed into one row of at most that many
tokens and only real tokens go through the model (stare_agent/backends/local/common.next_token_logits).

What runs: the trainer's own passes, `rl.reference_stats` (the no-grad reference pass: log-probs, entropy, S2) and
`rl.policy_outputs` with a backward of the summed log-probs of every real position (the update's forward and
backward), over the same episodes cut into micro-batches both ways: `--micro` rows padded to the batch's longest
(what the trainer does without a budget), and `--budget`-token packed rows (`common.token_budget_micro_batches`).
Each repeat times both, in alternating order, so drift in the machine's load is shared.

Episodes (random token ids, lengths seeded): `--lengths recorded` (the default) draws them from the 2,048 episodes
of a recorded run (`RECORDED`: the SFT model's evaluation in docs/experiments/collapse, multi-turn episodes with 0-4
tool calls under a 512-token budget), each response length scaled by `--max-len` / 512, i.e. the run's budget
stretched to `--max-len`; `--lengths log-uniform` draws them log-uniformly between `--min-len` and `--max-len`.
The default `--max-len` 2048 is the 8k budget scaled by 1/4 so that the padded attention fits this machine's
memory; the spread, not the scale, is what padding costs. Model: the lab's Qwen2 architecture at
`--hidden`/`--layers` (random weights, sdpa attention, fp32, vocabulary 2048).

Results: OUT/results.json (settings, every timing) and OUT/results.md. No thresholds: the script reports.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_snapshot, other_cores, write_results  # noqa: E402

RECORDED = Path(__file__).resolve().parents[1] / "docs" / "experiments" / "collapse" / "eval-sft" / "test.json"
"""A recorded run's episodes: per problem, `response_lengths` of its 16 samples (tokens after the prompt)."""
RECORDED_BUDGET = 512
"""That run's episode budget (agent.max_total_tokens in the config beside it)."""


def episode_lengths(count: int, low: int, high: int, seed: int) -> list[int]:
    """`count` lengths drawn log-uniformly in [low, high]."""
    g = torch.Generator().manual_seed(seed)
    logs = torch.empty(count).uniform_(math.log(low), math.log(high), generator=g)
    return [int(round(math.exp(float(x)))) for x in logs]


def recorded_lengths(count: int, high: int, seed: int, low: int = 16) -> list[int]:
    """`count` lengths drawn (with replacement, seeded) from RECORDED's episodes, each scaled by high /
    RECORDED_BUDGET and kept within [low, high]."""
    recorded = json.loads(RECORDED.read_text())
    pool = [n for problem in recorded["problems"] for n in problem["response_lengths"]]
    picks = torch.randint(len(pool), (count,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [min(high, max(low, round(pool[i] * high / RECORDED_BUDGET))) for i in picks]


def lengths_of(args: argparse.Namespace) -> list[int]:
    if args.lengths == "recorded":
        return recorded_lengths(args.episodes, args.max_len, args.seed)
    return episode_lengths(args.episodes, args.min_len, args.max_len, args.seed)


def padded_batch(lengths: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention of random episodes of these lengths, as the trainer's pad_batch lays them out."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros((len(lengths), max(lengths)), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(3, vocab, (n,), generator=g)
        attention[row, :n] = 1
    return ids, attention


def micro_batches(lengths: list[int], mode: str, micro: int, budget: int) -> list[slice]:
    from stare_agent.backends.local.common import token_budget_micro_batches

    if mode == "packed":
        return token_budget_micro_batches(lengths, budget)
    return [slice(i, min(i + micro, len(lengths))) for i in range(0, len(lengths), micro)]


def computed_tokens(lengths: list[int], mode: str, parts: list[slice]) -> int:
    """Positions the model computes: every row padded to the batch's longest, or only the real tokens."""
    if mode == "packed":
        return sum(lengths)
    return sum((part.stop - part.start) * max(lengths) for part in parts)


def time_passes(model, ids, attention, parts, packed: bool) -> dict[str, float]:
    from stare_agent.backends.local import rl

    started = time.perf_counter()
    for part in parts:
        rl.reference_stats(model, ids[part], attention[part], 1.0, packed)
    reference = time.perf_counter() - started
    started = time.perf_counter()
    for part in parts:
        logprobs, _ = rl.policy_outputs(model, ids[part], attention[part], 1.0, packed=packed)
        real = (attention[part][:, 1:] * attention[part][:, :-1]).bool()
        logprobs[real].sum().backward()
    update = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return {"reference_s": reference, "update_s": update}


def bench_model(args: argparse.Namespace, prefix: str) -> Any:
    """The lab's Qwen2 at --hidden/--layers (random weights, sdpa, fp32), long enough for --max-len; the torch
    threads set to --threads. Both packing benchmarks run it."""
    from transformers import AutoModelForCausalLM

    from stare_agent.lab.models import build_tiny_model, tiny_corpus

    torch.set_num_threads(args.threads)
    folder = build_tiny_model(
        Path(tempfile.mkdtemp(prefix=prefix)), tiny_corpus(), hidden_size=args.hidden, num_layers=args.layers,
        intermediate_size=3 * args.hidden, max_position_embeddings=max(4096, args.max_len),
    )  # fmt: skip
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")


def run(args: argparse.Namespace) -> dict:
    model = bench_model(args, "bench-packing-").eval()
    lengths = lengths_of(args)
    ids, attention = padded_batch(lengths, model.config.vocab_size, args.seed)
    modes = {mode: micro_batches(lengths, mode, args.micro, args.budget) for mode in ("padded", "packed")}
    time_passes(model, ids, attention, modes["packed"][:1], True)  # warm-up of both paths
    time_passes(model, ids, attention, modes["padded"][:1], False)
    timings = []
    busy = cpu_snapshot()
    for repeat in range(args.repeats):
        order = ("padded", "packed") if repeat % 2 == 0 else ("packed", "padded")
        for mode in order:
            timed = time_passes(model, ids, attention, modes[mode], mode == "packed")
            timings.append({"repeat": repeat, "mode": mode, **timed})
    summary = {}
    for mode, parts in modes.items():
        rows = [t for t in timings if t["mode"] == mode]
        summary[mode] = {
            "micro_batches": len(parts),
            "computed_per_real_token": computed_tokens(lengths, mode, parts) / sum(lengths),
            "reference_s": statistics.median(t["reference_s"] for t in rows),
            "update_s": statistics.median(t["update_s"] for t in rows),
        }
    ratios = {
        name: summary["padded"][name] / summary["packed"][name]
        for name in ("reference_s", "update_s", "computed_per_real_token")
    }
    return {
        "settings": vars(args),
        "lengths": {
            "count": len(lengths),
            "min": min(lengths),
            "median": statistics.median(lengths),
            "max": max(lengths),
            "total": sum(lengths),
        },  # fmt: skip
        "other_cores_busy": other_cores(busy),
        "summary": summary,
        "padded_over_packed": ratios,
        "timings": timings,
    }


def markdown(result: dict) -> str:
    s, summary, ratios = result["settings"], result["summary"], result["padded_over_packed"]
    lengths = result["lengths"]
    lines = [
        f"{lengths['count']} {s['lengths']} episodes of {lengths['min']}-{lengths['max']} tokens (median "
        f"{lengths['median']}), "
        f"hidden {s['hidden']}, {s['layers']} layers, {s['repeats']} repeats (medians); padded: {s['micro']} rows "
        f"per micro-batch; packed: {s['budget']} tokens per row. Other processes kept "
        f"{result['other_cores_busy'] or 0:.2f} cores busy.",
        "",
        "| | micro-batches | computed / real tokens | reference pass (s) | update fwd+bwd (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode, row in summary.items():
        lines.append(
            f"| {mode} | {row['micro_batches']} | {row['computed_per_real_token']:.2f} | {row['reference_s']:.2f} | "
            f"{row['update_s']:.2f} |"
        )
    lines.append(
        f"| padded / packed | | {ratios['computed_per_real_token']:.2f} | {ratios['reference_s']:.2f} | "
        f"{ratios['update_s']:.2f} |"
    )
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The episodes, model, repeats and output options both packing benchmarks take (bench_openrlhf_packing.py)."""
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", choices=("recorded", "log-uniform"), default="recorded")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=96, help="log-uniform lengths only")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=4096, help="tokens per packed micro-batch")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--micro", type=int, default=4, help="rows per padded micro-batch (loss.micro_batch_size)")
    args = parser.parse_args(argv)
    result = run(args)
    write_results(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
