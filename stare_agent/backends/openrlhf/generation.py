"""Sample generation inside OpenRLHF 0.11.2 (put in place by hooks.install): our sample generator (full batches,
exactly `steps` of them, up-front dispatch, group verdicts), the batch it hands on, and the engine actor that knows
the policy version of its weights. hooks.py's docstring says where each piece plugs in."""

from __future__ import annotations

import functools
import inspect
import math
import time
from typing import Any

import ray
import torch

from stare_agent import protocol
from stare_agent.audit import audit_trained
from stare_agent.backends.openrlhf import upstream
from stare_agent.batching import EPISODE_STATS, BatchFill, dispatch_count
from stare_agent.config import RLConfig, RolloutConfig

_samples_module = upstream.import_openrlhf("openrlhf.trainer.ppo_utils.samples_generator")
_engine_module = upstream.import_openrlhf("openrlhf.trainer.ray.vllm_engine")
# The Ray-wrapped engine class as OpenRLHF defines it, taken before install() replaces the module attribute.
ORIGINAL_ENGINE = _engine_module.RolloutRayActor

CANCEL_WAIT_S = 120.0
"""How long a step waits for the groups it cancelled once its batch was full to end on the engines."""


def _processed_logprobs(create: Any) -> Any:
    """OpenRLHF's create_vllm_engines with the engines' logprobs_mode "processed_logprobs" (the distribution sampled
    from, after temperature and top-p, which is what the trainer scores); OpenRLHF chooses it only when its
    importance-sampling correction is on and leaves vLLM's raw log-probs otherwise."""
    signature = inspect.signature(create)

    @functools.wraps(create)
    def create_vllm_engines(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["logprobs_mode"] = "processed_logprobs"
        return create(*bound.args, **bound.kwargs)

    create_vllm_engines.stare_processed_logprobs = True
    return create_vllm_engines


class RolloutBatch(list):
    """One full batch's samples (OpenRLHF's list of per-sample Experiences) with what the generator knew when it
    made it: the batch's rollout/ metrics (`fill_metrics`) and the keep rate after it. In async mode the batch
    crosses OpenRLHF's Ray queue from the generator actor to the training actor; pickling keeps the attributes."""

    def __init__(self, samples: Any = (), *, fill_metrics: dict[str, float] | None = None, keep_rate: float = 0.0):
        super().__init__(samples)
        self.fill_metrics = dict(fill_metrics or {})
        self.keep_rate = keep_rate


class StareSamplesGenerator(_samples_module.SamplesGenerator):
    """OpenRLHF's sample generator, handing `fit` only full batches, exactly `steps` of them (stare_agent/batching).

    OpenRLHF 0.11.2 gives fit whatever its prompt budget leaves (a partial last batch, which DeepSpeed never
    steps on), stops when one pass over the prompts is done, and replaces a dropped group by one new prompt only
    once that group has finished, so a step at a low keep rate ends with refills generated one after another.
    Here each call fills one batch of rollout.prompts_per_step groups from endless passes over the prompts
    (`fill_batch`): prompts are dispatched up front by the recent keep rate and, as each group finishes, by what
    the batch still needs counting the groups in flight (batching.dispatch_count), each group is judged by
    batching's rule, and once the batch is full the groups still generating are stopped. Every group is counted
    by its verdict; the run stops, by returning no samples and `exhausted`, when the step's prompt budget ran out
    before the batch was full; the last of `steps` batches is returned with `exhausted`, so fit trains it and
    ends. A step with too many sandbox failures raises SandboxFailures (it propagates out of fit and stops the
    run). Built by `replacing` the trainer's generator.
    """

    def __init__(
        self, *args: Any, steps: int, rollout: RolloutConfig, system_prompt: str | None = protocol.SYSTEM_PROMPT,
        **kwargs: Any,
    ):  # fmt: skip
        super().__init__(*args, **kwargs)
        self.steps, self.rollout = steps, rollout
        self.system_prompt = system_prompt
        """The agent's system prompt: the mask audit rebuilds each sample's prompt ids with it."""
        self.handed = 0
        """Full batches handed to fit so far in this run (the checkpoint's global_step on resume)."""
        self.keep_rate = rollout.initial_keep_rate
        """The last step's share of judged groups that were kept (rollout.initial_keep_rate before the first)."""
        self.stop_reason = ""
        self.fill_metrics: dict[str, float] = {}
        """The last batch's rollout/ metrics (batching.BatchFill.metrics), added to that step's logs."""
        self._loader_iter: Any = None
        self._seen: list[dict[str, float]] = []  # the group being judged: each sample's batching.episode_stats
        self._handed_at: float | None = None  # when the last batch was handed on (time.monotonic)

    @classmethod
    def replacing(cls, generator: Any, config: RLConfig) -> StareSamplesGenerator:
        return cls(
            strategy=generator.strategy,
            prompts_dataloader=generator.prompts_dataloader,
            eval_dataloader=generator.eval_dataloader,
            tokenizer=generator.tokenizer,
            vllm_engines=generator.vllm_engines,
            steps=config.steps,
            rollout=config.rollout,
            system_prompt=config.agent.system_prompt,
        )

    def next_prompt(self) -> Any:
        """The next item of the prompt loader, starting a new pass when one ends (after a resume: where it was)."""
        for fresh in (False, True):
            if self._loader_iter is None or fresh:
                self._loader_iter = iter(self.prompts_dataloader)
            try:
                return next(self._loader_iter)
            except StopIteration:
                continue
        raise RuntimeError("the prompt set is empty (a pass over it yielded no prompt)")

    def generate_samples(self, **generate_kwargs: Any) -> tuple[list, float | None, int, bool]:
        if self.handed >= self.steps:  # a resumed run that had already trained them all
            return [], None, 0, True
        # Since the last batch: in sync mode the trainer's step; in async mode a full queue or the weight sync's lock
        idle = 0.0 if self._handed_at is None else time.monotonic() - self._handed_at
        r = self.rollout
        fill = BatchFill(r.prompts_per_step, r.prompt_budget, r.max_sandbox_failure_fraction)
        if self.args.vllm.enable_sleep:
            _samples_module.batch_vllm_engine_call(self.vllm_engines, "wake_up")
        try:
            experiences = self.fill_batch(fill, **generate_kwargs)
        finally:
            if self.args.vllm.enable_sleep:
                _samples_module.batch_vllm_engine_call(self.vllm_engines, "sleep")
        self.keep_rate = fill.keep_rate() or self.keep_rate
        self.fill_metrics = fill.metrics()
        self.fill_metrics["timing/generator_wait"] = idle
        fill.check_sandbox()
        if not fill.full:
            self.stop_reason = fill.why_not_full()
            return [], None, fill.consumed, True
        self.handed += 1
        self._handed_at = time.monotonic()
        batch = RolloutBatch(experiences, fill_metrics=self.fill_metrics, keep_rate=self.keep_rate)
        return batch, 100.0 * fill.kept / fill.consumed, fill.consumed, self.handed >= self.steps

    def fill_batch(self, fill: BatchFill, **generate_kwargs: Any) -> list:
        """The kept groups' samples of one step, in the order their groups finished; `fill` counts every group.

        Dispatches `batching.dispatch_count` prompts up front and again after each finished group that leaves the
        batch short, OpenRLHF's way (`_dispatch_prompts_to_vllm`: load-balanced over the engines, one Ray task per
        prompt's group). Once the batch is full the groups still generating are cancelled (vLLM aborts their
        requests, the executor closes their sandbox sessions) and waited for, so that no engine is still busy
        with them when the update (or the engines' sleep) comes."""
        r = self.rollout
        pending: list = []
        dispatched = 0
        kept: list = []

        def dispatch() -> None:
            nonlocal dispatched
            count = dispatch_count(
                fill.target - fill.kept, fill.budget - dispatched, self.keep_rate, r.max_dispatch_factor, len(pending)
            )
            for _ in range(count):
                _, prompts, labels, images = self.next_prompt()
                pending.extend(self._dispatch_prompts_to_vllm(prompts, labels, images=images, **generate_kwargs))
            dispatched += count

        dispatch()
        while pending and not fill.full:
            ready, pending[:] = ray.wait(pending, num_returns=1, timeout=10.0)
            for ref in ready:
                verdict, group = self._judge(ref, fill, generate_kwargs)
                if verdict == "kept":
                    kept.extend(group)
            if not fill.full:
                dispatch()
        if pending:  # the batch is full: what has finished by now is judged (surplus or dropped), the rest stopped
            done, running = ray.wait(pending, num_returns=len(pending), timeout=0)
            for ref in done:
                self._judge(ref, fill, generate_kwargs)
            for ref in running:
                ray.cancel(ref)
                fill.cancel()
            if running:
                ray.wait(running, num_returns=len(running), timeout=CANCEL_WAIT_S)
        return kept

    def _judge(self, ref: Any, fill: BatchFill, generate_kwargs: dict) -> tuple[str, list]:
        """One finished prompt's group: its samples as Experiences, and its verdict, counted in `fill`."""
        self._seen = []
        group = [self._process_response_into_experience(resp, **generate_kwargs) for resp in ray.get(ref)]
        return fill.add_group(self._seen, drop_equal=self.rollout.dynamic_sampling), group

    def _process_response_into_experience(self, response: dict, **generate_kwargs: Any) -> Any:
        # Called for every sample OpenRLHF receives, kept or filtered, a prompt's group together: the verdicts and
        # the step's rollout metrics are made from these. Our per-episode numbers then leave the sample's info, so
        # that OpenRLHF does not log them a second time, averaged over the trained samples only.
        score = response.get("scores")
        stats = {**(response.get("extra_logs") or {}), "reward": math.nan if score is None else float(score)}
        if missing := [key for key in EPISODE_STATS if key not in stats]:
            raise ValueError(
                f"STARE hooks: a sample's extra_logs lacks {missing}: it did not come from stare_agent's executor "
                "(train.agent_func_path: stare_agent/backends/openrlhf/episodes.py, as `stare-agent rl` sets it)"
            )
        self._seen.append(stats)
        experience = super()._process_response_into_experience(response, **generate_kwargs)
        versions = response.get("policy_versions")
        if versions is not None:  # shifted and cut as OpenRLHF shifts and cuts the action mask
            max_len = generate_kwargs.get("max_len", 2048)
            experience.policy_versions = torch.tensor(versions[1:max_len], dtype=torch.long).unsqueeze(0)
        if self.rollout.audit_masks:
            self.audit(response, experience, generate_kwargs.get("max_len", 2048))
        for key in EPISODE_STATS:
            if key != "reward":  # OpenRLHF's own
                experience.info.pop(key, None)
        return experience

    def audit(self, response: dict, experience: Any, max_len: int) -> None:
        """rollout.audit_masks: the Experience as OpenRLHF made it (action mask and log-probs shifted by one, all
        cut at max_len) against its ids and the episode's own counts (stare_agent/audit.py)."""
        ids = experience.sequences[0].tolist()
        mask = experience.action_mask[0].tolist()
        logprobs = experience.rollout_log_probs
        logprobs = [0.0] * len(mask) if logprobs is None else logprobs[0].tolist()
        logs = response.get("extra_logs") or {}
        audit_trained(
            self.tokenizer, ids, mask, logprobs, response["prompt"], self.system_prompt,
            where=f"openrlhf sample of prompt {response['prompt'][:60]!r}",
            sampled_tokens=int(logs["sampled_tokens"]), observation_tokens=int(logs["tool_output_tokens"]),
            cut=len(response["observation_tokens"]) > max_len,
        )  # fmt: skip


def version_stamp_problem() -> str:
    """Why this install's vLLM cannot run partial rollouts, or ''. A weight update then comes in the middle of a
    request, and only vLLM's per-token stamps (CompletionOutput.weight_versions) say which tokens each version
    sampled: vLLM 0.32.0 has them, 0.29.0 (the GPU pin) has the engine's weight version but not the stamps."""
    import vllm
    import vllm.outputs

    if hasattr(vllm.outputs, "WeightVersionSpan"):
        return ""
    return (
        f"openrlhf.train.partial_rollout_enable: vLLM {vllm.__version__} does not stamp each sampled token with the "
        "weights' version, so the policy that sampled the tokens of an episode cut by a weight sync would be unknown; "
        "run async without partial rollouts, or install a vLLM that stamps them (0.32.0 does)"
    )


class StareRolloutRayActor(ORIGINAL_ENGINE.__ray_actor_class__):
    """OpenRLHF's vLLM engine actor that knows the policy version of its weights (0 until the first broadcast) and
    gives it to vLLM, which stamps every sampled token with the version it had (CompletionOutput.weight_versions;
    agent.span_versions). The executor reads `policy_version` itself when vLLM has no such stamps."""

    async def __init__(self, *args: Any, **kwargs: Any):
        await super().__init__(*args, **kwargs)
        await self.set_policy_version(0)

    async def set_policy_version(self, version: int) -> None:
        self.policy_version = version
        if hasattr(self.llm, "update_weight_version"):
            await self.llm.update_weight_version(str(version))
