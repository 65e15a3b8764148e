"""Batched sampling over a Hugging Face causal LM for the local backend; an `HFGenerator` is an agent.GenerateBatch.

Written with torch rather than `model.generate` so that what RL relies on is explicit: the log-prob of every
sampled id under the distribution it was drawn from, stop strings found in decoded text without ever cutting a
token (DESIGN section 4), and one seeded random generator.

A call splits the prompts into chunks of at most `max_batch_size`. Each chunk is left-padded and prefilled in
one forward, then every step feeds one new token per live row through a KV cache (transformers DynamicCache,
extended in place by the model). A row that ends is removed from the batch and from the cache
(`DynamicCache.batch_select_indices`), so the rows still running do not pay for it.

Simplifications: one temperature and one top_p for all rows; a chunk keeps its left padding until it ends, even
once its longest prompt has finished (the cache has no left crop), so a chunk costs what its longest prompt costs.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from stare_agent import protocol
from stare_agent.agent import GenerationEnd, Sample


def nucleus_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`logits` with every token outside its row's nucleus set to -inf.

    logits: (B, V). The nucleus is the smallest set of most probable tokens whose probability reaches top_p:
    a token is kept when the tokens more probable than it hold less than top_p, so the token that crosses
    top_p is kept, and so is the most probable one (ties at the boundary are broken by sort order).
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V); probability of the tokens ranked above each one
    drop_sorted = mass_before >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def check_batch(prompts: list[list[int]], max_new_tokens: list[int]) -> None:
    """A batch call's arguments: one budget >= 1 per non-empty prompt; ValueError naming the row otherwise."""
    if len(prompts) != len(max_new_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens; give one per prompt")
    for i, (ids, budget) in enumerate(zip(prompts, max_new_tokens, strict=True)):
        if not ids:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if budget < 1:
            raise ValueError(f"max_new_tokens[{i}] must be >= 1; got {budget}")


def turn_limits(
    prompts: list[list[int]], max_new_tokens: list[int], max_turn_tokens: int | None, context_len: int | None
) -> list[int]:
    """How many ids each row may generate: its budget, the turn limit and the room left in the context
    (0 or less: the prompt already fills it). Checks the arguments first."""
    check_batch(prompts, max_new_tokens)
    limits = [min(budget, max_turn_tokens or budget) for budget in max_new_tokens]
    if context_len is not None:
        limits = [min(limit, context_len - len(ids)) for limit, ids in zip(limits, prompts, strict=True)]
    return limits


@dataclass
class GenerationStats:
    """Cumulative counters of one generator, for tokens/s reports."""

    generated_tokens: int = 0
    """Sampled ids returned, all calls together."""
    forward_passes: int = 0
    """Model forwards: one prefill per chunk plus one per decoding step."""
    seconds: float = 0.0
    """Wall-clock time inside calls (padding, sampling and stop checks included)."""

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


class HFGenerator:
    """`generator(prompts, max_new_tokens) -> list[Sample]` over a causal LM (fits agent.GenerateBatch).

    Each row samples logits / temperature under top-p with this generator's seeded torch.Generator (temperature
    0: greedy), and returns the log-prob of each id under the distribution it was drawn from. A turn ends with
    "eos" (id kept), "stop" (the id completing a stop string is the last kept) or "length" (the turn's budget or
    the model's context). Sampling, log-probs and stops in full: docs/local_backend.md.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_turn_tokens: int | None = None,
        stop_strings: Sequence[str] = protocol.STOP_STRINGS,
        max_batch_size: int = 64,
        seed: int | None = None,
    ):
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy); got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = no filtering); got {top_p}")
        if max_turn_tokens is not None and max_turn_tokens < 1:
            raise ValueError(f"max_turn_tokens must be >= 1 or None (no limit); got {max_turn_tokens}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1; got {max_batch_size}")
        if isinstance(stop_strings, str) or not all(isinstance(s, str) and s for s in stop_strings):
            raise ValueError(f"stop_strings must be a sequence of non-empty strings; got {stop_strings!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.top_p = top_p
        self.max_turn_tokens = max_turn_tokens
        self.stop_strings = tuple(stop_strings)
        self.max_batch_size = max_batch_size
        self.stats = GenerationStats()

        # A stop string of n bytes spans at most n ids (every id decodes to at least one byte), and an occurrence
        # that does not end in the newest id was found one step earlier; so decoding the last n ids suffices.
        # Two more cover decoders that drop the leading space of the first id.
        self._stop_window = max((len(s.encode()) for s in self.stop_strings), default=0) + 2
        configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        configured = list(configured) if isinstance(configured, (list, tuple)) else [configured]
        self.eos_ids = frozenset(i for i in [tokenizer.eos_token_id, *configured] if i is not None)
        # Padded positions are masked out, so the id written there only has to be a valid one.
        self.pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
        self.max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        # transformers 5.x renamed the forward's `past_key_values` to `cache` (the old name is deprecated).
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def __call__(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[Sample]:
        limits = turn_limits(prompts, max_new_tokens, self.max_turn_tokens, self.max_positions)
        samples: list[Sample | None] = [None if limit > 0 else Sample([], [], "length") for limit in limits]
        todo = [i for i, limit in enumerate(limits) if limit > 0]

        started = time.perf_counter()
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for start in range(0, len(todo), self.max_batch_size):
                    chunk = todo[start : start + self.max_batch_size]
                    generated = self._generate([prompts[i] for i in chunk], [limits[i] for i in chunk])
                    for i, sample in zip(chunk, generated, strict=True):
                        samples[i] = sample
        finally:
            self.model.train(was_training)
            self.stats.seconds += time.perf_counter() - started
        return samples

    def _generate(self, prompts: list[list[int]], limits: list[int]) -> list[Sample]:
        """One chunk: left-padded prefill, then one id per live row per step; finished rows leave the batch."""
        width = max(len(ids) for ids in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, T); 1 = a real token, 0 = left padding
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            mask[row, width - len(ids) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)  # (B, T); each row counts from its first real token
        cache = DynamicCache(config=self.model.config)

        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        finish: list[GenerationEnd | None] = [None] * len(prompts)
        live = list(range(len(prompts)))  # the chunk row of each batch row still generating
        logits = self._forward(input_ids, mask, positions, cache)
        while True:
            new_ids, new_logprobs = self._sample(logits)
            for row, token, logprob in zip(live, new_ids.tolist(), new_logprobs.tolist(), strict=True):
                tokens[row].append(token)
                logprobs[row].append(logprob)
            self.stats.generated_tokens += len(live)
            self._mark_finished(live, tokens, limits, finish)
            keep = [k for k, row in enumerate(live) if finish[row] is None]
            if not keep:
                break
            if len(keep) < len(live):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                mask, positions, new_ids = mask[index], positions[index], new_ids[index]
                live = [live[k] for k in keep]
            mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
            positions = positions[:, -1:] + 1
            logits = self._forward(new_ids[:, None], mask, positions, cache)
        return [Sample(tokens[row], logprobs[row], finish[row]) for row in range(len(prompts))]

    def _forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """Float32 logits of the last position, (B, V); the model appends this step's keys and values to `cache`."""
        output = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_arg: cache},
        )
        self.stats.forward_passes += 1
        return output.logits[:, -1].float()

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, log-probs), both (B,), from last-position logits (B, V); the class docstring says which log-probs."""
        if self.temperature == 0:
            ids = logits.argmax(dim=-1)
            logp = logits.log_softmax(dim=-1)
        else:
            logits = logits / self.temperature
            if self.top_p < 1:
                logits = nucleus_filter(logits, self.top_p)
            logp = logits.log_softmax(dim=-1)
            ids = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(-1)
        return ids, logp.gather(-1, ids[:, None]).squeeze(-1)

    def _mark_finished(
        self, live: list[int], tokens: list[list[int]], limits: list[int], finish: list[GenerationEnd | None]
    ) -> None:
        """Set `finish` for the live rows whose newest id ends their turn: EOS, then a stop string, then the limit."""
        rows = []
        for row in live:
            if tokens[row][-1] in self.eos_ids:
                finish[row] = "eos"
            else:
                rows.append(row)
        tails = [""] * len(rows)
        if self.stop_strings and rows:
            tails = self.tokenizer.batch_decode([tokens[row][-self._stop_window :] for row in rows])
        for row, tail in zip(rows, tails, strict=True):
            if any(stop in tail for stop in self.stop_strings):
                finish[row] = "stop"
            elif len(tokens[row]) >= limits[row]:
                finish[row] = "length"
