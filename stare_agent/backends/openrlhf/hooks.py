"""Entropy control (STARE and the methods it is compared against) inside OpenRLHF 0.11.2's PPO loop: subclasses of
its actor, experience maker and trainer, put in place by `install()` before `runpy` runs
`openrlhf.cli.train_ppo_ray` (no fork of OpenRLHF).

The pieces live by concern: experience.py (the policy rank's entropy pass and the experience maker), generation.py
(the sample generator and the engine actor), this module (the trainers, sync and async, and `install`, which also
re-exports the other two's names). Where each piece plugs in (the hook facts checked against OpenRLHF's source:
docs/dev/openrlhf_cpu.md):

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

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import ray

from stare_agent import snapshots
from stare_agent.backends.openrlhf import resume, updates, upstream  # noqa: F401 - updates: also hooks.updates
from stare_agent.backends.openrlhf.episodes import config_from_env
from stare_agent.backends.openrlhf.experience import (  # noqa: F401 - also reached as hooks.<name>
    ORIGINAL_ACTOR,
    StareExperienceMaker,
    StarePolicyModelActor,
    correction_metrics,
    rollout_mismatch,
    staleness,
    unsupported,
)
from stare_agent.backends.openrlhf.generation import (  # noqa: F401 - also reached as hooks.<name>
    CANCEL_WAIT_S,
    ORIGINAL_ENGINE,
    RolloutBatch,
    StareRolloutRayActor,
    StareSamplesGenerator,
    _processed_logprobs,
    version_stamp_problem,
)
from stare_agent.config import RLConfig
from stare_agent.entropy_control import (
    ADVANTAGE_METHODS,
    SELECTED_TOKENS,
    EntropyControl,
    keep_reports_until,
)

_actor_module = upstream.import_openrlhf("openrlhf.trainer.ray.ppo_actor")
_trainer_module = upstream.import_openrlhf("openrlhf.trainer.ppo_trainer")
_async_module = upstream.import_openrlhf("openrlhf.trainer.ppo_trainer_async")
_engines_package = upstream.import_openrlhf("openrlhf.trainer.ray")
_engine_module = upstream.import_openrlhf("openrlhf.trainer.ray.vllm_engine")
# The Ray-wrapped classes as OpenRLHF defines them, taken before install() replaces the module attributes.
ORIGINAL_TRAINER = _trainer_module.PPOTrainer
ORIGINAL_ASYNC_TRAINER = _async_module.PPOTrainerAsync
ORIGINAL_GENERATOR_ACTOR = _async_module.GenerateSamplesActor
ORIGINAL_TRAINING_ACTOR = _async_module.TrainingActor

CHECKPOINT_KEY = "stare_controller"
"""Key of the controller's state_dict in the DeepSpeed checkpoint's client_states."""
KEEP_RATE_KEY = "stare_keep_rate"
"""Key of the sample generator's keep rate (up-front dispatch) in the same client_states."""


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
