"""The ReTool agent as OpenRLHF's agent executor, minus OpenRLHF's base class (see agent_executor.py).

OpenRLHF 0.11.2 runs `AgentExecutor().execute(prompt=..., label=..., sampling_params=..., max_length=...,
hf_tokenizer=..., llm_engine=...)` inside each vLLM engine's Ray actor, N times at once for a prompt's group,
and turns each returned dict into one training sample (`samples_generator._process_response_into_experience`).
Everything here is the episode of `stare_agent.agent.run_episode`; this module only connects it:

- `EngineGenerate`: agent.Generate over the engine (`await llm_engine.generate(ids, params)` returns a vLLM
  RequestOutput). Each turn stops after `</code>` or `</answer>` (kept) or EOS, with at most
  min(rollout.max_turn_tokens, tokens left in the episode) new tokens; ids are kept exactly as sampled.
  OpenRLHF's own `max_tokens` (--rollout.max_new_tokens) is not used: the turn cap and the episode budget
  (agent.max_total_tokens) are ours, as in the local backend.
- `to_response`: an EpisodeResult as the dict OpenRLHF consumes. Observation ids (tool output, tags
  included) are separate segments outside `action_ranges`, so they are 0 in OpenRLHF's action mask (its
  loss, KL and entropy mask).
- `ReToolExecutor`: the executor itself. A sandbox infrastructure failure drops the prompt's whole group: the
  sample generator (generation.StareSamplesGenerator) judges each group by stare_agent/batching's rule, which drops
  it whatever rollout.dynamic_sampling says, and refills it; `scores` is NaN besides, so no filter of OpenRLHF's
  could keep it. A failure is never scored as a wrong answer.

The executor is built with no arguments in every engine actor, possibly on another node, so our config comes
through the environment: `STARE_AGENT_RL_CONFIG` holds the whole RLConfig as JSON (`config_env`). JSON in the
environment (Ray's runtime_env env_vars) reaches every node; a path to the run's config.yaml would need a
file system shared by all nodes.

Nothing here imports openrlhf or vllm: the engine, its outputs and the sampling params are duck-typed, so
this runs and is tested without either.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from stare_agent import protocol
from stare_agent.agent import (
    NO_VERSION,
    EpisodeResult,
    Sample,
    ToolClient,
    completion_sample,
    run_episode,
    score_problem,
)
from stare_agent.batching import episode_stats
from stare_agent.config import ConfigError, RLConfig, load_config, to_dict
from stare_agent.data import Problem
from stare_sandbox.client import SandboxUnavailable

logger = logging.getLogger(__name__)

CONFIG_ENV = "STARE_AGENT_RL_CONFIG"
"""Environment variable holding the run's RLConfig as JSON, for the executor in every vLLM engine actor."""

# --- config -------------------------------------------------------------------------------------------------------


def config_env(config: RLConfig) -> dict[str, str]:
    """The environment variables that carry `config` to the executor (for Ray's runtime_env env_vars)."""
    return {CONFIG_ENV: json.dumps(to_dict(config))}


def config_from_env(environ: Mapping[str, str] | None = None) -> RLConfig:
    """The RLConfig in $STARE_AGENT_RL_CONFIG, validated like a config file; ConfigError saying what is wrong."""
    environ = os.environ if environ is None else environ
    text = environ.get(CONFIG_ENV, "")
    if not text:
        raise ConfigError(
            f"${CONFIG_ENV} is not set: the stare-agent executor reads its config from it in every vLLM engine. "
            "Start training with `stare-agent rl` (backend openrlhf), which sets it; to run OpenRLHF by hand, set "
            f"it to the JSON of config_env(config)[{CONFIG_ENV!r}]"
        )
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"${CONFIG_ENV} is not valid JSON ({exc}); it must hold the RLConfig as JSON") from None
    if not isinstance(data, dict):
        raise ConfigError(f"${CONFIG_ENV} must hold a JSON object (the RLConfig); got {type(data).__name__}")
    return load_config(RLConfig, values={key: (value, f"${CONFIG_ENV}") for key, value in data.items()})


# --- the engine as agent.Generate ---------------------------------------------------------------------------------


def turn_params(shared: Any, max_tokens: int) -> Any:
    """A copy of OpenRLHF's SamplingParams for one turn: our stop strings (kept in the output) and token cap.

    The shared object is used by all N episodes of the prompt at once, so it is never changed. Temperature and
    top_p/top_k stay as OpenRLHF set them; the sampled token's log-prob is always asked for (OpenRLHF asks only
    when its importance-sampling correction is on, and its loss reads them only then): the trainer compares them
    with its own every step (`rollout_logprob_abs_diff`, experience.py), which is how a weight sync that did not reach
    the engine shows. Setting these fields after construction is what vLLM's own __post_init__ would do with them:
    with include_stop_str_in_output no text is held back.
    """
    params = copy.deepcopy(shared)
    params.stop = list(protocol.STOP_STRINGS)
    params.include_stop_str_in_output = True
    params.max_tokens = max_tokens
    if params.logprobs is None:
        params.logprobs = 0  # the sampled token's only
    return params


class EngineGenerate:
    """agent.Generate over OpenRLHF's engine actor: one `llm_engine.generate` call per turn."""

    def __init__(self, engine: Any, sampling_params: Any, max_turn_tokens: int):
        self.engine = engine
        self.shared = sampling_params
        self.max_turn_tokens = max_turn_tokens

    async def __call__(self, ids: list[int], max_new_tokens: int) -> Sample:
        params = turn_params(self.shared, min(self.max_turn_tokens, max_new_tokens))
        before = getattr(self.engine, "policy_version", None)
        output = await self.engine.generate(ids, params)
        sample = completion_sample(output.outputs[0])
        if sample.versions is not None or before is None:
            return sample
        # An engine without vLLM's per-token spans: the version its weights had for the whole turn, which holds
        # when no weight update can come mid-request (partial rollouts need the spans; the launcher checks).
        after = getattr(self.engine, "policy_version", None)
        if after != before:
            raise RuntimeError(
                f"the engine's weights changed from policy version {before} to {after} during one request, and this "
                "vLLM reports no per-token weight versions: partial rollouts need a vLLM that does"
            )
        return dataclasses.replace(sample, versions=[before] * len(sample.token_ids))


# --- the episode as OpenRLHF's dict -------------------------------------------------------------------------------


def action_ranges(action_mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s: the sampled segments, in the token list's positions."""
    ranges, start = [], None
    for i, m in enumerate([*action_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            ranges.append((start, i))
            start = None
    return ranges


def to_response(result: EpisodeResult, *, prompt: str, label: Any, images: Any = None) -> dict[str, Any]:
    """The dict OpenRLHF 0.11.2 makes a sample of (keys as its stock executors return them).

    observation_tokens: all ids (prompt, sampled and observation segments); action_ranges: the sampled ones;
    rollout_log_probs: one per id (0.0 outside actions); policy_versions: one per id, the policy version that sampled
    it (agent.NO_VERSION outside actions; OpenRLHF ignores the key, generation.StareSamplesGenerator reads it);
    extra_logs: batching.episode_stats without the reward.
    A sandbox failure, or a prompt that leaves no room for a response, cannot be scored: reward 0.0 and
    scores NaN, which makes dynamic filtering drop the whole group.
    """
    extra_logs = episode_stats(result)
    score = extra_logs.pop("reward")  # OpenRLHF's own info key: it travels as reward and scores
    return {
        "prompt": prompt,
        "label": label,
        "images": images,
        "mm_train_inputs": None,
        "observation_tokens": list(result.token_ids),
        "action_ranges": action_ranges(result.action_mask),
        "rollout_log_probs": list(result.logprobs),
        "policy_versions": list(result.versions) or [NO_VERSION] * len(result.token_ids),
        "reward": 0.0 if math.isnan(score) else score,
        "scores": score,
        "truncated": result.finish_reason == "length",
        "extra_logs": extra_logs,
    }


# --- the executor -------------------------------------------------------------------------------------------------


class ReToolExecutor:
    """OpenRLHF's `execute` contract over our episode; `agent_executor.AgentExecutor` adds OpenRLHF's base class.

    One sandbox client per executor (per engine actor), made on the first call inside the running event loop
    (an HTTP client's connection pool belongs to the loop it was made in): AsyncSandboxClient for sandbox.url,
    else kernels in the engine actor's process. Sandbox calls are awaited and the answer check runs in a
    thread, so the engine's event loop, which also streams vLLM's outputs, never waits on them.
    """

    def __init__(self, config: RLConfig | None = None, *, make_client: Callable[[], Any] | None = None):
        self.config = config if config is not None else config_from_env()
        self._make_client = make_client or self._default_client
        self._client: Any = None
        self._client_lock = asyncio.Lock()

    def check_sandbox(self) -> None:
        """Start the run's sandbox and run one call, blocking (runtime.check_sandbox); SandboxBroken or ConfigError,
        one line, when it cannot serve this engine's episodes."""
        from stare_agent.runtime import check_sandbox

        check_sandbox(self.config.sandbox, self.config.stateful_episodes_in_flight, RLConfig.IN_FLIGHT_KEYS)

    def _default_client(self) -> Any:
        from stare_agent.runtime import make_client

        return make_client(self.config.sandbox, self.config.stateful_episodes_in_flight)

    async def client(self) -> ToolClient:
        """The executor's sandbox client, started on first use; an unreachable sandbox is an error, not a NaN, and so
        is a sandbox service that cannot hold a step's episodes (ConfigError, runtime.check_capacity)."""
        from stare_agent.runtime import sandbox_where, start_client

        async with self._client_lock:
            if self._client is None:
                client = self._make_client()
                try:
                    # Every engine actor has an executor and a client of its own, to the same servers: the step's
                    # episodes of all engines share them, so each engine checks the whole step against them, not
                    # its own share (the same count, and the same answer, in every engine).
                    await start_client(
                        client, self.config.sandbox, self.config.stateful_episodes_in_flight, RLConfig.IN_FLIGHT_KEYS
                    )
                except SandboxUnavailable as exc:
                    # Not a per-episode failure: dropping every group would silently consume the prompt set.
                    raise RuntimeError(
                        f"the sandbox ({sandbox_where(self.config.sandbox)}) does not answer: {exc}. Start it "
                        "(`stare-agent sandbox serve`) and check sandbox.url (or sandbox.urls) and sandbox.token"
                    ) from exc
                self._client = client
            return self._client

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def execute(
        self,
        prompt: str,
        label: Any,
        sampling_params: Any,
        max_length: int,
        hf_tokenizer: Any,
        llm_engine: Any,
        images: Any = None,
    ) -> dict[str, Any]:
        """One episode for OpenRLHF (called by keyword; the names are its contract).

        prompt: the dataset's problem text as is (no --data.apply_chat_template: the prompt ids come from
        protocol.encode_prompt, as in SFT and eval); label: the gold answer; max_length: --data.max_len, where
        OpenRLHF cuts sequences silently, so the episode budget is min(agent.max_total_tokens, max_length).
        """
        if images:
            raise ValueError("the ReTool agent is text-only, but this prompt comes with images")
        if label is None:
            raise ValueError("a prompt has no gold answer: set data.answer_field to the prompt set's answer column")
        agent = self.config.agent
        if max_length < agent.max_total_tokens:
            agent = dataclasses.replace(agent, max_total_tokens=max_length)
        client = await self.client()
        generate = EngineGenerate(llm_engine, sampling_params, self.config.rollout.max_turn_tokens)
        problem = Problem(id="openrlhf", problem=str(prompt), answer=str(label), source="openrlhf")
        result = await run_episode(
            problem, tokenizer=hf_tokenizer, generate=generate, client=client, config=agent, scorer=None
        )  # scored below, in a thread: math-verify can take seconds and the engine's event loop serves all episodes
        if result.finish_reason == "sandbox_error":
            logger.warning("sandbox failed; the prompt's group is dropped: %s", result.sandbox_error)
        elif not result.turns:
            logger.warning(
                "a prompt of %d tokens leaves no room under the budget of %d tokens; its group is dropped",
                result.prompt_len,
                agent.max_total_tokens,
            )
        else:
            model_text = "".join(turn.text for turn in result.turns)  # the model's own text, as the agent scores it
            result.reward = await asyncio.to_thread(score_problem, model_text, problem)
        return to_response(result, prompt=prompt, label=label, images=images)
