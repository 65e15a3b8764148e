"""A non-finite update in the openrlhf backend stops the run, as in the local backend (updates.skipped_updates).

Runs in .venv-openrlhf (skipped where openrlhf is not installed). DeepSpeed is real: one rank on the CPU
(DS_ACCELERATOR=cpu, gloo), bf16 and ZeRO-2 as OpenRLHF configures it, around a two-layer model; what stands in for
OpenRLHF's policy rank is only what prepare_fit reads (its trainer, with a training step that runs a micro-batch
through the engine, and the step's update control); for SFT, OpenRLHF's own strategy and Actor step the engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

RANK = """
import json, os, socket
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    os.environ["MASTER_PORT"] = str(free.getsockname()[1])
from types import SimpleNamespace as NS
import torch
import deepspeed
import deepspeed.comm.torch

deepspeed.comm.torch.build_shm_op = lambda: None  # one rank: nothing to all-reduce (as tests/openrlhf_cpu_shim)
from stare_agent.backends.openrlhf import updates
from stare_agent.config import RLConfig
from stare_agent.entropy_control import EntropyControl
from stare_agent.runtime import NonFiniteGradient

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)


def micro_batch(scale, *_, **__):  # as OpenRLHF's training step: forward, backward, the engine's step
    loss = engine(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum() * scale
    engine.backward(loss)
    engine.step()
    return {"policy_loss": float(loss)}


def weights():
    return [p.detach().clone() for p in engine.module.parameters()]


def moved(before):
    return any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))


trainer = NS(actor=NS(model=engine), actor_loss_fn=None, training_step=micro_batch)
rank = NS(trainer=trainer, strategy=NS(args=NS(actor=NS(entropy_coef=None))))
control = EntropyControl(RLConfig())
control.step = 7
rank.update_control = updates.UpdateControl(control)
out = {}
before = weights()
for scale in (1.0, float("nan")):  # OpenRLHF's own step: the update is skipped, and nothing says so
    micro_batch(scale)
out["plain"] = {"skipped": engine.skipped_steps, "moved": moved(before)}
updates.prepare_fit(rank)
before = weights()
for scale in (1.0, 1.0):
    rank.trainer.training_step(scale)
out["finite"] = {"skipped": engine.skipped_steps, "moved": moved(before)}
before = weights()
rank.trainer.training_step(1.0)
try:
    rank.trainer.training_step(float("nan"))
    out["nan"] = {"raised": None}
except NonFiniteGradient as exc:
    out["nan"] = {"raised": str(exc), "skipped": engine.skipped_steps, "moved": moved(before)}
# SFT: OpenRLHF's SFT trainer steps through the strategy, which sft.install wraps
from openrlhf.utils.deepspeed import DeepspeedStrategy
from stare_agent.backends.openrlhf import sft

sft.install(sft.EntryOptions(truncation="right", warmup_steps=0))
actor = updates._actor_module.Actor.__new__(updates._actor_module.Actor)
torch.nn.Module.__init__(actor)
actor.model = engine  # an Actor after the strategy prepared it
strategy = object.__new__(DeepspeedStrategy)
for scale in (1.0, 1.0):
    engine.backward(engine(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum() * scale)
    strategy.optimizer_step(None, actor, None)
before = weights()
engine.backward(engine(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum())
strategy.optimizer_step(None, actor, None)
engine.backward(engine(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum() * float("nan"))
try:
    strategy.optimizer_step(None, actor, None)
    out["sft"] = {"raised": None}
except NonFiniteGradient as exc:
    out["sft"] = {"raised": str(exc), "skipped": engine.skipped_steps, "moved": moved(before)}
print(json.dumps(out))
"""


def test_an_update_deepspeed_skips_for_non_finite_gradients_stops_the_run():
    """DeepSpeed 0.19.6 under bf16 skips an update whose gradients are NaN and says nothing (the first case); our
    RL training step, and the strategy's optimizer step as SFT installs it, raise NonFiniteGradient at that update,
    naming the step, and the weights are those before it."""
    pytest.importorskip("openrlhf")
    pytest.importorskip("deepspeed")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", RANK], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["plain"] == {"skipped": 1, "moved": False}
    assert out["finite"] == {"skipped": 1, "moved": True}
    assert out["nan"]["raised"].startswith("rl step 7: the gradients of an optimizer update were not finite")
    assert out["nan"]["skipped"] == 2 and out["nan"]["moved"] is False
    # SFT, the same engine, numbered as OpenRLHF logs it (DeepSpeed's global_steps, which counts skipped updates):
    # 4 updates before it (2 of them skipped)
    assert out["sft"]["raised"].startswith("sft step 5: the gradients of an optimizer update were not finite")
    assert out["sft"]["skipped"] == 3 and out["sft"]["moved"] is False


def test_the_cli_prints_the_ranks_message_of_a_non_finite_update_not_rays_traceback():
    """A rank's NonFiniteGradient reaches the driver as Ray's error (an instance of ours whose str is the remote
    traceback): the command exits 6 with our one line."""
    exceptions = pytest.importorskip("ray.exceptions")
    from stare_agent.cli import _expected_failure
    from stare_agent.runtime import NonFiniteGradient

    cause = NonFiniteGradient("rl step 7: the gradients of an optimizer update were not finite")
    error = exceptions.RayTaskError("fit", "Traceback (most recent call last):\n  ...", cause).as_instanceof_cause()
    assert isinstance(error, NonFiniteGradient) and str(error) != str(cause)
    assert _expected_failure(error) == (6, str(cause))
