"""Padded, packed and token-budget micro-batches through the openrlhf backend's real forward: the STARE
experience pass and the update.

    .venv-openrlhf/bin/python benchmarks/bench_openrlhf_packing.py --out runs/bench-openrlhf-packing   # ~4 min

Why: OpenRLHF pads each micro-batch of `rollout.micro_batch_size` / `train.micro_batch_size` samples to its
longest, so with multi-turn episodes of a few hundred to 8k tokens much of what the passes compute is padding.
`ds.packing_samples` runs a micro-batch as one row of its real tokens; `loss.max_tokens_per_micro_batch` (OpenRLHF's
token-budget micro-batches, train.dynamic_batch_enable) also chooses the micro-batches by tokens, so their count
follows the tokens rather than the samples.

What runs: OpenRLHF 0.11.2's `Actor` around the lab's Qwen2 (random weights, sdpa, fp32, use_cache off as OpenRLHF
sets it), in our `StarePolicyModelActor` built without Ray, as tests/test_openrlhf_hooks.py builds it (a real rank
initialises DeepSpeed on a GPU):
- experience pass: `forward_with_stats` per micro-batch (OpenRLHF's log-probs plus the entropy and S2 of STARE);
- update: the Actor's forward with gradients and a backward of the summed action log-probs per micro-batch, what
  OpenRLHF's training step computes before its loss (the loss itself is a few element-wise operations).
Three ways of cutting the same episodes, in the order the sample generator produced them:
- padded: OpenRLHF's default, consecutive micro-batches of `--micro` samples, each right-padded to its longest;
- packed: the same micro-batches with ds.packing_samples;
- budget: OpenRLHF's own token-budget split (`get_minimum_num_micro_batch_size` for the count, rounded to a multiple
  of `--ranks` as `split_rollout_samples` does, then `get_seqlen_balanced_partitions`), packed.
Each repeat runs the three in a rotated order, so drift in the machine's load is shared; medians are reported.

Episodes: bench_packing.py's (`--lengths recorded` by default: a recorded run's multi-turn episodes scaled to
`--max-len`, the 8k budget scaled by 1/4 for this machine's memory), random ids; the first 1/8 of each is
prompt (not an action), the rest actions.

Results: OUT/results.json (settings, every timing) and OUT/results.md. No thresholds: the script reports.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_snapshot, other_cores, write_results  # noqa: E402
from bench_packing import add_arguments, bench_model, lengths_of  # noqa: E402

MODES = ("padded", "packed", "budget")


def split(lengths: list[int], mode: str, micro: int, budget: int, ranks: int) -> list[list[int]]:
    """Each micro-batch's sample indices: consecutive groups of `micro`, or OpenRLHF's token-budget partitions."""
    if mode != "budget":
        return [list(range(i, min(i + micro, len(lengths)))) for i in range(0, len(lengths), micro)]
    from stare_agent.backends.openrlhf import upstream

    balancing = upstream.import_openrlhf("openrlhf.utils.seqlen_balancing")
    count = balancing.get_minimum_num_micro_batch_size(lengths, budget, 1, 1)
    count = max(count // ranks * ranks, ranks)  # experience_maker.split_rollout_samples
    return balancing.get_seqlen_balanced_partitions(lengths, count, False)


def micro_batch(lengths: list[int], indices: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Right-padded sequences, attention and OpenRLHF's action mask (width - 1) of these episodes."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths[i] for i in indices)
    sequences = torch.zeros((len(indices), width), dtype=torch.long)
    attention = torch.zeros_like(sequences)
    actions = torch.zeros_like(sequences)
    for row, i in enumerate(indices):
        n = lengths[i]
        sequences[row, :n] = torch.randint(3, vocab, (n,), generator=g)
        attention[row, :n] = 1
        actions[row, max(1, n // 8) : n] = 1
    return sequences, attention, actions[:, 1:]


def make_rank(model, packing: bool):
    """Our policy rank around OpenRLHF's Actor, packing or not (no Ray, no DeepSpeed)."""
    from stare_agent.backends.openrlhf import hooks, upstream

    actor = upstream.import_openrlhf("openrlhf.models").Actor(model, temperature=1.0)
    actor.packing_samples = packing  # what Actor sets when it loads a model by name
    rank = object.__new__(hooks.StarePolicyModelActor)
    rank.actor = actor
    rank.strategy = NS(ring_attn_group=None, args=NS(ds=NS(packing_samples=packing, ring_attn_size=1,
                                                           tensor_parallel_size=1)))  # fmt: skip
    return rank


def time_passes(rank, batches: list[tuple[torch.Tensor, ...]]) -> dict[str, float]:
    started = time.perf_counter()
    for sequences, attention, action_mask in batches:
        rank.forward_with_stats(sequences, action_mask, attention)
    experience = time.perf_counter() - started
    rank.actor.train()
    started = time.perf_counter()
    for sequences, attention, action_mask in batches:
        log_probs = rank.actor(sequences, action_mask, attention_mask=attention)
        log_probs.sum().backward()
    update = time.perf_counter() - started
    rank.actor.zero_grad(set_to_none=True)
    return {"experience_s": experience, "update_s": update}


def run(args: argparse.Namespace) -> dict:
    model = bench_model(args, "bench-openrlhf-packing-")
    model.config.use_cache = False  # as OpenRLHF's Actor sets it for a model it loads
    lengths = lengths_of(args)
    parts = {mode: split(lengths, mode, args.micro, args.budget, args.ranks) for mode in MODES}
    batches = {
        mode: [micro_batch(lengths, indices, model.config.vocab_size, args.seed + k) for k, indices in enumerate(p)]
        for mode, p in parts.items()
    }
    ranks = {mode: make_rank(model, packing=mode != "padded") for mode in MODES}
    for mode in MODES:  # warm-up of each path
        time_passes(ranks[mode], batches[mode][:1])
    timings = []
    busy = cpu_snapshot()
    for repeat in range(args.repeats):
        for mode in MODES[repeat % 3 :] + MODES[: repeat % 3]:
            timings.append({"repeat": repeat, "mode": mode, **time_passes(ranks[mode], batches[mode])})
    real = sum(lengths)
    summary = {}
    for mode in MODES:
        rows = [t for t in timings if t["mode"] == mode]
        tokens = [sum(lengths[i] for i in p) for p in parts[mode]]
        computed = real if mode != "padded" else sum(len(p) * max(lengths[i] for i in p) for p in parts[mode])
        summary[mode] = {
            "micro_batches": len(parts[mode]),
            "largest_micro_batch_tokens": max(tokens),
            "computed_per_real_token": computed / real,
            "experience_s": statistics.median(t["experience_s"] for t in rows),
            "update_s": statistics.median(t["update_s"] for t in rows),
        }
    ratios = {
        f"padded_over_{mode}": {
            key: summary["padded"][key] / summary[mode][key]
            for key in ("computed_per_real_token", "experience_s", "update_s")
        }
        for mode in ("packed", "budget")
    }
    return {
        "settings": vars(args),
        "lengths": {
            "count": len(lengths),
            "min": min(lengths),
            "median": statistics.median(lengths),
            "max": max(lengths),
            "total": real,
        },  # fmt: skip
        "other_cores_busy": other_cores(busy),
        "summary": summary,
        "ratios": ratios,
        "timings": timings,
    }


def markdown(result: dict) -> str:
    s, summary, lengths = result["settings"], result["summary"], result["lengths"]
    lines = [
        f"{lengths['count']} {s['lengths']} episodes of {lengths['min']}-{lengths['max']} tokens (median "
        f"{lengths['median']}, {lengths['total']} in all), hidden {s['hidden']}, {s['layers']} layers, "
        f"{s['repeats']} repeats (medians); padded and packed: {s['micro']} samples per micro-batch; budget: "
        f"{s['budget']} tokens, count a multiple of {s['ranks']} ranks. Other processes kept "
        f"{result['other_cores_busy'] or 0:.2f} cores busy.",
        "",
        "| | micro-batches | largest (tokens) | computed / real tokens | experience pass (s) | update fwd+bwd (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, row in summary.items():
        lines.append(
            f"| {mode} | {row['micro_batches']} | {row['largest_micro_batch_tokens']} | "
            f"{row['computed_per_real_token']:.2f} | {row['experience_s']:.2f} | {row['update_s']:.2f} |"
        )
    for name, ratio in result["ratios"].items():
        lines.append(
            f"| {name.replace('_', ' ').replace('over', '/')} | | | {ratio['computed_per_real_token']:.2f} | "
            f"{ratio['experience_s']:.2f} | {ratio['update_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--micro", type=int, default=4, help="samples per padded or packed micro-batch")
    parser.add_argument("--ranks", type=int, default=1, help="the budget split's count is a multiple of this")
    args = parser.parse_args(argv)
    result = run(args)
    write_results(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
