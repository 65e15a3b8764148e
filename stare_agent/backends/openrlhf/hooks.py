"""Entropy control (STARE and the methods it is compared against) inside OpenRLHF 0.11.2's PPO loop: subclasses of
its actor, experience maker and trainer, put in place by `install()` before `runpy` runs
`openrlhf.cli.train_ppo_ray` (no fork of OpenRLHF).

Where each piece plugs in (the hook facts checked against OpenRLHF's source: docs/dev/openrlhf_cpu.md):

- `StarePolicyModelActor` (a DeepSpeed actor rank): `forward_with_stats` is OpenRLHF's experience forward plus the
  entropy H and S2 of the sampling policy at every action position, from the same forward's logits (already
  float32 and divided by rollout.temperature inside OpenRLHF's `Actor`), in one chunked pass
  (`theory.entropy_and_s2`). Entropy is needed on the driver before the update, and OpenRLHF computes it only in
  the training forward, per rank, after the weights would be needed. Its `fit` puts in place what the methods
  that act at each update need (updates.py: Clip-Cov's and KL-Cov's selection and loss, the entropy bonus's
  coefficient, the ratio statistics).
- `StareExperienceMaker` (on the trainer actor, which holds the whole step's batch): dispatches that forward to
  the actor group instead of `forward`, keeps H and S2 per micro-batch, and after OpenRLHF's advantages runs
  `step.control_step` once over all micro-batches, multiplies each `experience.advantages` by its weights (the
  methods that scale advantages) and sends the ranks the step's state for the update (`set_update_control`).
  Scaling the advantage by omega >= 0 equals weighting OpenRLHF's clipped loss per token (clip-higher and dual clip
  included), so for those methods the loss itself is not touched.
- `StarePPOTrainer`: builds the `EntropyControl` from our RLConfig ($STARE_AGENT_RL_CONFIG), uses the maker
  above, adds the step's `control/*`, `stare/*` and `theory/*` metrics to `train_step`'s status (logged as
  `train/stare/...`), keeps the control's state in the DeepSpeed checkpoint's `client_states`, and after each save
  rotates the Hugging Face snapshots (`global_stepN_hf`, which OpenRLHF never deletes) by stare_agent/snapshots.py.

Async mode (`--train.async_enable`, OpenRLHF's `PPOTrainerAsync`): `StarePPOTrainerAsync` makes OpenRLHF's two
halves as ours, `StareGenerateSamplesActor` (its loop, our `StareSamplesGenerator`) and `StareTrainingActor` (its
loop, the trainer above: `StareTrainerMixin` holds what both trainers share), tells the generator on resume how
many batches were trained, and ends the run as soon as either half fails. A batch crosses the queue as a
`RolloutBatch`, carrying its rollout/ metrics and keep rate. `StareRolloutRayActor` gives vLLM the policy version
of the engine's weights at every sync (`_VersionStamp`, inside the sync's lock and pause), so that every sampled
token carries the version that sampled it (`staleness/*` per step). docs/entropy_control.md says which policy each
method reads then; docs/dev/openrlhf_async.md maps OpenRLHF's async code.

Packed samples (`--ds.packing_samples`, and OpenRLHF's token-budget micro-batches, which pack): OpenRLHF's `Actor`
runs a micro-batch as one row of its real tokens and pads its log-probs back; the entropy pass computes H and S2
on that row's logits and pads them back with OpenRLHF's own indices and function, so every later quantity is
computed from the same (B, A) tensors as without packing. Not supported (refused here, and by the launcher before
anything starts): ring attention and tensor parallelism (`--ds.ring_attn_size`, `--ds.tensor_parallel_size` > 1:
the entropy pass does not gather sharded logits).

Private OpenRLHF names this relies on (pinned by tests/test_openrlhf_hooks.py, and for async mode
tests/test_openrlhf_async.py): RemoteExperienceMaker's
`_dispatch_forward` and `_flatten_results`, the classes under Ray's wrappers (`__ray_actor_class__`), the
`client_states` dict `PPOTrainer.fit` hands to `save_logs_and_checkpoints`, and on the ranks the trainer's
`actor_loss_fn` and `training_step` and ppo_actor's `iter_grad_accum_global_norm` (updates.py).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch
from torch import Tensor

from stare_agent import protocol, snapshots
from stare_agent.audit import audit_trained
from stare_agent.backends.openrlhf import resume, updates, upstream
from stare_agent.backends.openrlhf.episodes import config_from_env
from stare_agent.batching import EPISODE_STATS, BatchFill, dispatch_count
from stare_agent.config import RLConfig, RolloutConfig
from stare_agent.entropy_control import (
    ADVANTAGE_METHODS,
    SELECTED_TOKENS,
    EntropyControl,
    keep_reports_until,
)
from stare_agent.loss import correction_stats, logprob_mismatch
from stare_agent.step import MicroBatch, control_step
from stare_agent.theory import entropy_and_s2

_actor_module = upstream.import_openrlhf("openrlhf.trainer.ray.ppo_actor")
_maker_module = upstream.import_openrlhf("openrlhf.trainer.ppo_utils.experience_maker")
_samples_module = upstream.import_openrlhf("openrlhf.trainer.ppo_utils.samples_generator")
_trainer_module = upstream.import_openrlhf("openrlhf.trainer.ppo_trainer")
_async_module = upstream.import_openrlhf("openrlhf.trainer.ppo_trainer_async")
_engines_package = upstream.import_openrlhf("openrlhf.trainer.ray")
_engine_module = upstream.import_openrlhf("openrlhf.trainer.ray.vllm_engine")
_ring_module = upstream.import_openrlhf("openrlhf.models.ring_attn_utils")

# The Ray-wrapped classes as OpenRLHF defines them, taken before install() replaces the module attributes.
ORIGINAL_ACTOR = _actor_module.PolicyModelActor
ORIGINAL_TRAINER = _trainer_module.PPOTrainer
ORIGINAL_ASYNC_TRAINER = _async_module.PPOTrainerAsync
ORIGINAL_GENERATOR_ACTOR = _async_module.GenerateSamplesActor
ORIGINAL_TRAINING_ACTOR = _async_module.TrainingActor
ORIGINAL_ENGINE = _engine_module.RolloutRayActor

CHECKPOINT_KEY = "stare_controller"
"""Key of the controller's state_dict in the DeepSpeed checkpoint's client_states."""
KEEP_RATE_KEY = "stare_keep_rate"
"""Key of the sample generator's keep rate (up-front dispatch) in the same client_states."""
CANCEL_WAIT_S = 120.0
"""How long a step waits for the groups it cancelled once its batch was full to end on the engines."""


def unsupported(ds_args: Any) -> list[str]:
    """What in OpenRLHF's `args.ds` the STARE entropy pass cannot handle, as messages naming the flag; [] if fine."""
    problems = []
    if getattr(ds_args, "ring_attn_size", 1) > 1:
        problems.append("--ds.ring_attn_size > 1: the STARE entropy pass does not gather ring-attention shards")
    if getattr(ds_args, "tensor_parallel_size", 1) > 1:
        problems.append("--ds.tensor_parallel_size > 1: the STARE entropy pass does not gather tensor-parallel logits")
    return problems


def _refuse_unsupported(ds_args: Any) -> None:
    problems = unsupported(ds_args)
    if problems:
        raise NotImplementedError("STARE hooks: unsupported OpenRLHF options: " + "; ".join(problems))


def _device_of(module: torch.nn.Module) -> torch.device:
    """Where the module's weights are (the GPU of this rank on a GPU machine, the CPU here)."""
    for param in module.parameters():
        return param.device
    return torch.device("cpu")


def _padded_like_openrlhf(packed: list[Tensor], sequences: Tensor, attention_mask: Tensor) -> list[Tensor]:
    """Per-position values of a packed row (1, real tokens) put back at their (B, S) places with OpenRLHF's own
    unpad indices and padding function (models/ring_attn_utils.py), as its `Actor.forward` does with the log-probs;
    0 at padding."""
    batch, length = sequences.shape
    *_, pad_len, indices = _ring_module.unpad_and_slice_tensor(sequences, attention_mask, None)
    return [_ring_module.gather_and_pad_tensor(t, None, pad_len, indices, batch, length) for t in packed]


class StarePolicyModelActor(ORIGINAL_ACTOR.__ray_actor_class__):
    """OpenRLHF's policy actor rank plus `forward_with_stats` (install() wraps it with the original's Ray options)."""

    def forward_with_stats(
        self,
        sequences: torch.LongTensor,
        action_mask: Tensor,
        attention_mask: Tensor,
        packed_seq_lens: Any = None,
        mm_train_inputs_list: Any = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """OpenRLHF's experience forward (`forward`) that also returns the sampling policy's entropy and S2.

        sequences, attention_mask: (B, S), right-padded; action_mask: (B, A), 1 = sampled by the policy, aligned
        with the predicted token (A = S - 1 as the sample generator makes it). Returns (action_log_probs, entropy,
        s2), each (B, A) float32 on the CPU and 0 outside the action mask. The log-probs are exactly OpenRLHF's;
        H and S2 come from the same logits at the same positions (`H[:, :-1][:, -A:]`, as OpenRLHF aligns its
        entropy), packed rows included. `packed_seq_lens` is accepted and ignored, as OpenRLHF's `forward` does.
        """
        _refuse_unsupported(self.strategy.args.ds)
        if self.strategy.ring_attn_group is not None:
            raise NotImplementedError("STARE hooks: the entropy pass does not gather ring-attention shards")
        device = _device_of(self.actor)
        sequences, attention_mask = sequences.to(device), attention_mask.to(device)
        mm_inputs = {}
        if mm_train_inputs_list and getattr(self.actor, "is_vlm", False):
            mm_inputs = _actor_module.merge_mm_train_inputs(mm_train_inputs_list, device)

        self.actor.eval()
        try:
            with torch.no_grad():
                action_log_probs, output = self.actor(
                    sequences,
                    action_mask.to(device),
                    attention_mask,
                    return_output=True,
                    ring_attn_group=self.strategy.ring_attn_group,
                    **mm_inputs,
                )
                entropy, s2 = entropy_and_s2(output["logits"])  # the distribution predicting token t+1
                del output
                if self.actor.packing_samples:  # (1, real tokens) -> (B, S), as OpenRLHF pads its log-probs
                    entropy, s2 = _padded_like_openrlhf([entropy, s2], sequences, attention_mask)
        finally:
            self.actor.train()
        width = action_mask.shape[1]
        mask = action_mask.to(device=device, dtype=torch.float32)
        entropy = entropy[:, :-1][:, -width:] * mask
        s2 = s2[:, :-1][:, -width:] * mask
        return action_log_probs.to("cpu"), entropy.to("cpu"), s2.to("cpu")

    def set_update_control(self, config: RLConfig, step: int, alpha: float) -> None:
        """The entropy-control state of the step about to be trained, from the experience maker (updates.py)."""
        control = EntropyControl(config)
        control.step = step
        self.update_control = updates.UpdateControl(control, alpha=alpha)

    def fit(self, kl_ctl: float = 0) -> Any:
        """OpenRLHF's fit with the step's entropy control in place (updates.prepare_fit)."""
        updates.prepare_fit(self)
        try:
            return super().fit(kl_ctl)
        finally:
            updates.finish_fit()


class StareExperienceMaker(_maker_module.RemoteExperienceMaker):
    """OpenRLHF's experience maker with the entropy-control method's weights applied to the advantages, once per
    optimizer step (step.control_step).

    Built with RemoteExperienceMaker's arguments plus `control`. For a method that does not scale the advantages
    (none) the experiences are left exactly as OpenRLHF made them; the entropy and theory metrics are still
    computed.
    """

    def __init__(self, *args: Any, control: EntropyControl, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self.args.ds)
        self.control = control
        self.metrics: dict[str, float] = {}
        """The last step's stare/* and theory/* metrics, until `pop_metrics`."""
        self._stats_refs: Any = None  # the actor group's refs from _dispatch_forward, recognised in _flatten_results
        self._stats: list[tuple[Tensor, Tensor]] | None = None  # (entropy, s2) per micro-batch, in samples order
        self.policy_version = 0
        """The policy version of the weights this step's experience pass scores with (the trainer sets it)."""

    def _dispatch_forward(self, group: Any, sync_condition: bool, **kwargs: Any) -> Any:
        if group is not self.actor_model_group:
            return super()._dispatch_forward(group, sync_condition, **kwargs)
        refs = group.async_run_method_batch(method_name="forward_with_stats", **kwargs)
        if sync_condition:  # colocated models: finish and free this one's memory before the next one runs
            ray.get(refs)
            ray.get(group.async_run_method(method_name="empty_cache"))
        self._stats_refs = refs
        return refs

    def _flatten_results(self, refs: Any, duplicate_factor: int) -> list:
        results = super()._flatten_results(refs, duplicate_factor)
        if refs is not self._stats_refs:
            return results
        self._stats_refs = None
        self._stats = [(entropy, s2) for _, entropy, s2 in results]
        return [log_probs for log_probs, _, _ in results]

    @torch.no_grad()
    def make_experience_batch(self, rollout_samples: list) -> list:
        experiences = super().make_experience_batch(rollout_samples)
        stats, self._stats = self._stats, None
        if stats is None or len(stats) != len(experiences):
            raise RuntimeError(
                "STARE hooks: no entropy for every micro-batch (the actor group was not dispatched "
                "forward_with_stats; is StarePolicyModelActor installed? call hooks.install() before train_ppo_ray)"
            )
        self.apply_control(experiences, stats)
        self.metrics.update(rollout_mismatch(experiences))
        self.metrics.update(correction_metrics(experiences, self.args.algo.advantage))
        self.metrics.update(staleness(rollout_samples, self.policy_version))
        return experiences

    def apply_control(self, experiences: list, stats: list[tuple[Tensor, Tensor]]) -> None:
        """Run the method once over the step's micro-batches; scale each `advantages` by its weights."""
        parts = [
            MicroBatch(exp.action_log_probs, exp.advantages, exp.action_mask, entropy, s2,
                       updates.experience_classes(self.tokenizer, exp), exp.sequences[:, 1:])
            for exp, (entropy, s2) in zip(experiences, stats, strict=True)
        ]  # fmt: skip
        weights, self.metrics = control_step(self.control, parts)
        alpha = self.metrics.get("control/coef", 0.0) if self.control.method == "entropy_bonus" else 0.0
        ray.get(
            self.actor_model_group.async_run_method(
                method_name="set_update_control", config=self.control.config, step=self.control.step, alpha=alpha
            )
        )
        if not self.control.reweights:
            return
        for exp, weight in zip(experiences, weights, strict=True):
            exp.advantages = exp.advantages * weight.to(exp.advantages.dtype)

    def pop_metrics(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        return metrics


def rollout_mismatch(experiences: list) -> dict[str, float]:
    """The engine's log-probs of the sampled tokens against the trainer's (`action_log_probs`, made with the weights
    the engine should have), over every action token of the step: loss.logprob_mismatch. {} when the executor
    returned none (ours always does: episodes.turn_params)."""
    if any(exp.rollout_log_probs is None for exp in experiences):
        return {}
    rollout = torch.cat([exp.rollout_log_probs[exp.action_mask.bool()].float().cpu() for exp in experiences])
    trainer = torch.cat([exp.action_log_probs[exp.action_mask.bool()].float().cpu() for exp in experiences])
    return logprob_mismatch(rollout, trainer, torch.ones_like(rollout))


def correction_metrics(experiences: list, settings: Any) -> dict[str, float]:
    """The importance weights pi_old / pi_rollout over all the step's action tokens, their mean and extremes, and with
    OpenRLHF's mismatch correction on (`settings`: args.algo.advantage, is_correction_*) the share of tokens it
    masked or clipped (loss.correction_stats). The gate reads only the trainer's and the engine's log-probs of the
    sampled tokens, which the step's experiences hold, so the numbers are exact here, where OpenRLHF's own logs
    would only average them per micro-batch. {} when the engines returned no log-probs."""
    if any(exp.rollout_log_probs is None for exp in experiences):
        return {}
    width = max(exp.action_mask.shape[1] for exp in experiences)

    def rows(name: str) -> Tensor:  # every micro-batch's rows, right-padded to one width (the gate is per row)
        parts = [getattr(exp, name).float().cpu() for exp in experiences]
        return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in parts])

    on = settings.is_correction_level != "off"
    low, high = settings.is_correction_threshold if on else (0.0, math.inf)  # off: a band that holds every weight
    stats = correction_stats(
        rows("action_log_probs"), rows("rollout_log_probs"), rows("action_mask"),
        level=settings.is_correction_level if on else "token", mode=settings.is_correction_mode if on else "mask",
        gating=settings.is_correction_gating if on else "ratio", low=low, high=high,
    )  # fmt: skip
    if not on:
        stats.pop("mismatch/corrected_share")
    return {name: float(value) for name, value in stats.items()}


def staleness(samples: list, version: int) -> dict[str, float]:
    """How old the sampling policy was, over the step's action tokens: each token's lag is `version` (the policy the
    experience pass scores with) minus the version that sampled it (StareSamplesGenerator keeps each sample's
    `policy_versions`). 0 everywhere in sync mode; up to the queue size in async mode, and with partial rollouts an
    episode can hold several versions. {} when no sample carries versions."""
    lags, mixed, episodes, unknown, tokens = [], 0, 0, 0, 0
    for sample in samples:
        versions = getattr(sample, "policy_versions", None)
        if versions is None:
            continue
        sampled = versions[sample.action_mask.bool()]
        known = sampled[sampled >= 0]
        tokens += sampled.numel()
        unknown += sampled.numel() - known.numel()
        episodes += 1
        mixed += int(known.unique().numel() > 1)
        lags.append(version - known)
    if not episodes:
        return {}
    lag = torch.cat(lags).float() if lags else torch.zeros(0)
    return {
        "staleness/lag_mean": lag.mean().item() if lag.numel() else math.nan,
        "staleness/lag_max": lag.max().item() if lag.numel() else math.nan,
        "staleness/mixed_episodes": mixed / episodes,
        "staleness/unversioned_share": unknown / max(tokens, 1),
    }


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


class WaitClock:
    """A queue (OpenRLHF's Ray queues of async mode) whose blocking `get` and `put` add up the time they waited."""

    def __init__(self, queue: Any):
        self.queue = queue
        self.waited = 0.0

    def get(self, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return self.queue.get(*args, **kwargs)
        finally:
            self.waited += time.monotonic() - started

    def put(self, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return self.queue.put(*args, **kwargs)
        finally:
            self.waited += time.monotonic() - started

    def pop(self) -> float:
        """Seconds waited since the last pop."""
        waited, self.waited = self.waited, 0.0
        return waited

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


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


class StareTrainerMixin:
    """What STARE adds to OpenRLHF's trainer, the same in sync mode (`StarePPOTrainer`, trainer and sample generator
    in one actor) and in async mode (`StareTrainingActor`, fed batches through a queue by `StareGenerateSamplesActor`):
    our experience maker driving the entropy control, the step's metrics, the controller's and keep rate's state in
    the checkpoint, snapshot rotation, and the policy version of the weights the engines hold."""

    def setup_stare(self, config: RLConfig, control: EntropyControl | None = None) -> None:
        """Our state, and our experience maker driving `control` (by default the one `config` describes)."""
        self.run_config = config
        self.steps_trained = 0
        self.policy_version = 0
        """Optimizer steps in the weights the engines get at the next broadcast (_VersionStamp)."""
        self.keep_rate = config.rollout.initial_keep_rate
        """The sample generator's keep rate after the last trained batch, saved in the checkpoint."""
        self.use_control(control or EntropyControl(config))

    def get_max_steps(self) -> int:
        # OpenRLHF sizes the actor's LR schedule from this (train_ppo_ray.py), in optimizer updates; its own count
        # comes from the prompt file's length, which is not the number of updates once groups are refilled.
        return self.run_config.steps * self.run_config.optim.updates_per_batch

    def end_report(self) -> dict[str, Any]:
        """After fit: steps trained in all (resumed ones included), of how many, and why it stopped early."""
        reason = getattr(getattr(self, "samples_generator", None), "stop_reason", "")
        return {"trained": self.steps_trained, "steps": self.run_config.steps, "reason": reason}

    def use_control(self, control: EntropyControl) -> None:
        """Replace OpenRLHF's experience maker by ours, built with the same arguments, driving `control`."""
        self.control = control
        self.experience_maker = StareExperienceMaker(
            self.actor_model_group,
            self.critic_model_group,
            self.reward_model_group,
            self.reference_model_group,
            self.kl_ctl,
            self.strategy,
            self.tokenizer,
            control=control,
        )

    def train_step(self, rollout_samples: list, global_step: int) -> tuple[dict, int]:
        self.experience_maker.policy_version = global_step  # the weights the experience pass scores with
        self.policy_version = global_step + 1  # what the broadcast at the end of this step sends
        status, next_step = super().train_step(rollout_samples, global_step)
        status.update(self.experience_maker.pop_metrics())
        status.update(class_shares_of(status))
        self.report_selected_tokens(next_step)
        status.update(getattr(rollout_samples, "fill_metrics", {}))
        self.keep_rate = getattr(rollout_samples, "keep_rate", self.keep_rate)
        self.steps_trained = next_step
        return status, next_step

    def report_selected_tokens(self, step: int) -> None:
        """Every entropy_control.report_every steps, the tokens the method acted on most often since the last report
        (counted where the advantages are weighted: not for Clip-Cov and KL-Cov, whose selection is on the ranks),
        as one line of `selected_tokens.jsonl` in the run folder (the parent of ckpt.path)."""
        every, control = self.run_config.entropy_control.report_every, self.control
        if not every or step % every or control.method not in ADVANTAGE_METHODS:
            return
        line = control.selected.report(
            step, control.method, self.tokenizer, self.run_config.entropy_control.report_top
        )
        with (Path(self.args.ckpt.path).parent / SELECTED_TOKENS).open("a") as out:
            out.write(json.dumps(line) + "\n")

    def save_logs_and_checkpoints(self, global_step: int, logs_dict: Any = None, client_states: Any = None) -> None:
        # In place: fit() hands the same dict to save_best_checkpoint afterwards.
        client_states = {} if client_states is None else client_states
        client_states[CHECKPOINT_KEY] = self.control.state_dict()
        client_states[KEEP_RATE_KEY] = self.keep_rate
        super().save_logs_and_checkpoints(global_step, logs_dict, client_states)
        if global_step % self.args.ckpt.save_steps == 0:  # OpenRLHF's condition for the save above
            # OpenRLHF rotates its DeepSpeed checkpoints (ckpt.max_num) but keeps every `global_stepN_hf` snapshot. The
            # save has finished on every rank (OpenRLHF waits for it), so DeepSpeed's `latest` names the new one.
            resume.mark_complete(self.args.ckpt.path, global_step)
            snapshots.rotate(self.args.ckpt.path, self.run_config.keep_snapshots, self.run_config.pin_snapshots)

    def init_checkpoint_states(self) -> dict:
        states = super().init_checkpoint_states()
        if "global_step" not in states:  # `_actor/` exists but DeepSpeed found no checkpoint in it: step 0
            states = {"episode": 0, "global_step": 0, "total_consumed_prompts": 0, "data_loader_state_dict": {}}
        resumed = CHECKPOINT_KEY in states
        writer = getattr(getattr(self, "tensorboard_logger", None), "writer", None)
        if writer is not None:  # each step once: hide what a crashed run logged after the checkpoint
            self.tensorboard_logger.writer = continued_writer(writer, states["global_step"])
        if resumed:
            self.control.load_state_dict(states[CHECKPOINT_KEY])
        keep_reports_until(
            Path(self.args.ckpt.path).parent / SELECTED_TOKENS, states["global_step"] if resumed else None
        )
        self.steps_trained = self.policy_version = states.get("global_step", 0)
        self.keep_rate = states.get(KEEP_RATE_KEY, self.keep_rate)
        if hasattr(self, "samples_generator"):  # sync mode; in async StarePPOTrainerAsync.fit tells the generator
            self.samples_generator.handed = self.steps_trained
            self.samples_generator.keep_rate = self.keep_rate
        return states


class _VersionStamp(_trainer_module.BasePPOTrainer):
    """Tells the engines the policy version of the weights just broadcast. Listed as a trainer's last base, so that in
    async mode it runs inside TrainingActor.broadcast_to_vllm's lock and, with partial rollouts, before the engines
    resume: every token sampled after the resume carries the new version (StareRolloutRayActor)."""

    def broadcast_to_vllm(self) -> None:
        started = time.monotonic()
        super().broadcast_to_vllm()
        ray.get([engine.set_policy_version.remote(self.policy_version) for engine in self.vllm_engines or []])
        self.sync_seconds = time.monotonic() - started  # the transfer itself, without async mode's lock and pause


class StarePPOTrainer(StareTrainerMixin, ORIGINAL_TRAINER.__ray_actor_class__, _VersionStamp):
    """OpenRLHF's PPO trainer (the single controller) with STARE (install() wraps it with the original's options)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        config = config_from_env()
        self.setup_stare(config)
        if hasattr(self, "samples_generator"):
            self.samples_generator = StareSamplesGenerator.replacing(self.samples_generator, config)


class StareTrainingActor(StareTrainerMixin, ORIGINAL_TRAINING_ACTOR.__ray_actor_class__, _VersionStamp):
    """Async mode's training half (OpenRLHF's TrainingActor) with STARE: each batch it takes from the queue is a
    RolloutBatch from StareGenerateSamplesActor."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.setup_stare(config_from_env())
        self.rollout_queue = WaitClock(self.rollout_queue)  # OpenRLHF's loop blocks on it for the next batch
        self.lock_wait = 0.0

    def train_step(self, rollout_samples: list, global_step: int) -> tuple[dict, int]:
        """OpenRLHF's step plus `timing/trainer_wait`: the time this step waited for its batch on the queue and, at
        its weight sync, for the engines (the lock the generator holds while it generates, or the pause and
        resume of partial rollouts)."""
        waited = self.rollout_queue.pop()
        status, next_step = super().train_step(rollout_samples, global_step)
        status["timing/trainer_wait"] = waited + self.lock_wait
        self.lock_wait = 0.0
        return status, next_step

    def broadcast_to_vllm(self) -> None:
        # Defined here so that the method Ray wraps for the actor is this importable one. Ray wraps each method the
        # actor class resolves and pickles the wrapper by value; OpenRLHF's own TrainingActor.broadcast_to_vllm,
        # reached from a class whose module name is a Ray wrapper, would travel as a copy bound to a copy of
        # TrainingActor, and its zero-argument super() would then fail on our instance.
        started = time.monotonic()
        super().broadcast_to_vllm()
        self.lock_wait += time.monotonic() - started - self.sync_seconds


class StareGenerateSamplesActor(ORIGINAL_GENERATOR_ACTOR.__ray_actor_class__):
    """Async mode's generating half (OpenRLHF's GenerateSamplesActor, its loop unchanged) with our sample generator:
    full batches, exactly `steps` of them, up-front dispatch, group verdicts and the sandbox-outage stop, as in sync
    mode. OpenRLHF's loop saves the loader's position after each batch it queues, so a checkpoint's position is the
    one after the batch it trained; the batches queued or being generated at a crash are drawn again on resume."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.run_config = config_from_env()
        self.samples_generator = StareSamplesGenerator.replacing(self.samples_generator, self.run_config)

    def get_max_steps(self) -> int:
        return self.run_config.steps * self.run_config.optim.updates_per_batch

    def restore(self, handed: int, keep_rate: float | None) -> None:
        """Resume: the batches already trained (the checkpoint's global_step) and the keep rate saved with them."""
        self.samples_generator.handed = handed
        if keep_rate is not None:
            self.samples_generator.keep_rate = keep_rate

    def stop_reason(self) -> str:
        return self.samples_generator.stop_reason


class StarePPOTrainerAsync(ORIGINAL_ASYNC_TRAINER.__ray_actor_class__):
    """OpenRLHF's async controller making our two halves (StareGenerateSamplesActor, StareTrainingActor), telling the
    generator on resume how many batches were trained, and stopping the run when either half fails."""

    def __init__(self, *args: Any, **kwargs: Any):
        # OpenRLHF's __init__ makes both halves by these module names, in this actor's process.
        _async_module.GenerateSamplesActor = _ray_remote(StareGenerateSamplesActor, ORIGINAL_GENERATOR_ACTOR)
        _async_module.TrainingActor = _ray_remote(StareTrainingActor, ORIGINAL_TRAINING_ACTOR)
        super().__init__(*args, **kwargs)
        self.run_config = config_from_env()

    def get_max_steps(self) -> int:
        return self.run_config.steps * self.run_config.optim.updates_per_batch

    def fit(self) -> None:
        # OpenRLHF's fit, plus `restore` on the generator, and an end as soon as one half fails: the other may be
        # blocked on the queue (the trainer waits for a batch with no timeout) and would never return.
        trainer, generator = self.trainer_actor, self.generator_actor
        states = ray.get(trainer.init_checkpoint_states.remote())
        ray.get(trainer.restore_best_checkpoint_state.remote(states))
        global_step = states["global_step"]
        refs = [generator.restore.remote(global_step, states.get(KEEP_RATE_KEY))]
        if global_step > 0:  # the engines get the checkpoint's weights, the generator the prompts' position
            refs += [
                generator.load_state_dict.remote(states["data_loader_state_dict"]),
                trainer.broadcast_to_vllm.remote(),
            ]
        ray.get(refs)
        halves = {
            generator.fit.remote(episode=states["episode"], total_consumed_prompts=states["total_consumed_prompts"]):
                generator,
            trainer.fit.remote(global_step=global_step): trainer,
        }  # fmt: skip
        pending = list(halves)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception:
                for ref in pending:
                    ray.kill(halves[ref])
                raise

    def end_report(self) -> dict[str, Any]:
        report = ray.get(self.trainer_actor.end_report.remote())
        report["reason"] = ray.get(self.generator_actor.stop_reason.remote())
        return report


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


def continued_writer(writer: Any, step: int) -> Any:
    """A TensorBoard writer on `writer`'s folder that hides the events a crashed run logged after `step` (the
    checkpoint the run continues from); TensorBoard then shows each step once."""
    from torch.utils.tensorboard import SummaryWriter

    folder = writer.log_dir
    writer.close()
    return SummaryWriter(log_dir=folder, purge_step=step + 1)


def class_shares_of(status: dict[str, Any]) -> dict[str, float]:
    """control/selected_share_<name> from the `_selected_<name>` and `_tokens_<name>` token means the ranks logged
    (updates.class_shares), which leave the status; {} when there are none."""
    out = {}
    for key in [k for k in status if k.startswith("_selected_")]:
        name = key[len("_selected_") :]
        selected, members = status.pop(key), status.pop(f"_tokens_{name}", 0.0)
        out[f"control/selected_share_{name}"] = selected / members if members else math.nan
    return out


class _RememberedActorClass:
    """A Ray actor class whose `.remote(...)` also keeps the handle: the driver asks the trainer for its
    end_report after OpenRLHF's train() returned (and the handle keeps the actor alive until then)."""

    def __init__(self, actor_class: Any):
        self.actor_class = actor_class
        self.handles: list[Any] = []

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        handle = self.actor_class.remote(*args, **kwargs)
        self.handles.append(handle)
        return handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self.actor_class, name)


def end_report() -> dict[str, Any] | None:
    """The last trainer's end_report (StareTrainerMixin; StarePPOTrainerAsync in async mode), or None if no trainer
    was made; releases it."""
    for name in ("PPOTrainer", "PPOTrainerAsync"):
        trainer = _remote.get(name)
        if trainer is not None and trainer.handles:
            handle = trainer.handles.pop()
            trainer.handles.clear()
            return ray.get(handle.end_report.remote())
    return None


_remote: dict[str, Any] = {}


def _ray_remote(cls: type, like: Any) -> Any:
    options = dict(like._default_options)
    return ray.remote(**options)(cls) if options else ray.remote(cls)


def install() -> dict[str, Any]:
    """Put our classes where `openrlhf.cli.train_ppo_ray` takes them from; idempotent.

    Wraps StarePolicyModelActor, StarePPOTrainer, StarePPOTrainerAsync and StareRolloutRayActor with ray.remote and
    the originals' options, and assigns them to the names OpenRLHF takes them by (`ppo_actor.PolicyModelActor`,
    `ppo_trainer.PPOTrainer`, `ppo_trainer_async.PPOTrainerAsync`, `vllm_engine.RolloutRayActor`), and to every
    already-imported openrlhf module that holds an original under that name (e.g. the CLI module). The CLI imports
    the actor at module level and the trainer inside train(), and create_vllm_engines reads the engine class when
    it runs, so a later `runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")` uses ours. The async
    trainer's two halves are put in place by StarePPOTrainerAsync itself, in its own process. Returns
    {name: wrapped class}.
    """
    if not _remote:
        _remote["PolicyModelActor"] = _ray_remote(StarePolicyModelActor, ORIGINAL_ACTOR)
        _remote["PPOTrainer"] = _RememberedActorClass(_ray_remote(StarePPOTrainer, ORIGINAL_TRAINER))
        _remote["PPOTrainerAsync"] = _RememberedActorClass(_ray_remote(StarePPOTrainerAsync, ORIGINAL_ASYNC_TRAINER))
        _remote["RolloutRayActor"] = _ray_remote(StareRolloutRayActor, ORIGINAL_ENGINE)
    places = {
        "PolicyModelActor": (ORIGINAL_ACTOR, _actor_module),
        "PPOTrainer": (ORIGINAL_TRAINER, _trainer_module),
        "PPOTrainerAsync": (ORIGINAL_ASYNC_TRAINER, _async_module),
        "RolloutRayActor": (ORIGINAL_ENGINE, _engine_module),
    }
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("openrlhf"):
            continue
        for name, (original, _) in places.items():
            if getattr(module, name, None) is original:
                setattr(module, name, _remote[name])
    for name, (_, defining) in places.items():  # even if something replaced their attribute in between
        setattr(defining, name, _remote[name])
    # The CLI takes create_vllm_engines from the package openrlhf.trainer.ray when it runs.
    if not getattr(_engines_package.create_vllm_engines, "stare_processed_logprobs", False):
        _engines_package.create_vllm_engines = _processed_logprobs(_engines_package.create_vllm_engines)
    return dict(_remote)
