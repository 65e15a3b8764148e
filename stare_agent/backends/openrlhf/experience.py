"""The STARE experience pass inside OpenRLHF 0.11.2 (put in place by hooks.install): the policy rank's forward that
also gives the sampling policy's entropy and S2, the experience maker that runs the entropy control once per step,
and the step's rollout-trainer metrics (the engine's log-probs against the trainer's, the importance weights, the
staleness of the samples). hooks.py's docstring says where each piece plugs in."""

from __future__ import annotations

import math
from typing import Any

import ray
import torch
from torch import Tensor

from stare_agent.backends.openrlhf import updates, upstream
from stare_agent.config import RLConfig
from stare_agent.entropy_control import (
    EntropyControl,
)
from stare_agent.loss import correction_stats, logprob_mismatch
from stare_agent.step import MicroBatch, control_step
from stare_agent.theory import entropy_and_s2

_actor_module = upstream.import_openrlhf("openrlhf.trainer.ray.ppo_actor")
_maker_module = upstream.import_openrlhf("openrlhf.trainer.ppo_utils.experience_maker")
_ring_module = upstream.import_openrlhf("openrlhf.models.ring_attn_utils")
# The Ray-wrapped class as OpenRLHF defines it, taken before install() replaces the module attribute.
ORIGINAL_ACTOR = _actor_module.PolicyModelActor


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
