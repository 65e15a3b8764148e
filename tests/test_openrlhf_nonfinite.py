"""A non-finite update in the openrlhf backend stops the run, as in the local backend (upstream.checking_updates).

Runs in .venv-openrlhf (skipped where openrlhf is not installed). DeepSpeed is real: one rank on the CPU
(DS_ACCELERATOR=cpu, gloo), bf16 with ZeRO-2 and ZeRO-3, around a two-layer model, stepped through OpenRLHF's own
`DeepspeedStrategy.optimizer_step` and `Actor` as its RL and SFT trainers step it after each micro-batch's backward.
What stands in for OpenRLHF's policy rank is only what prepare_fit reads (its trainer and the step's update control).
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
from stare_agent.backends.openrlhf import sft, updates  # imports OpenRLHF (flash_attn stood in for, upstream.py)
from stare_agent.config import RLConfig
from stare_agent.entropy_control import EntropyControl
from stare_agent.runtime import NonFiniteGradient

Actor = updates._strategy_module.Actor
strategy = object.__new__(updates._strategy_module.DeepspeedStrategy)


def make(stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    actor = Actor.__new__(Actor)
    torch.nn.Module.__init__(actor)
    actor.model = engine  # an Actor once the strategy has prepared it
    return engine, actor


def weights(engine):
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):  # ZeRO-3 partitions them; a no-op otherwise
        return [p.detach().float().clone() for p in params]


def train(engine, actor, scales):
    # one optimizer update (2 micro-batches) as OpenRLHF's trainers make it: backward, then the strategy's step
    before, label = weights(engine), None
    try:
        for scale in scales:
            engine.backward(engine(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum() * scale)
            strategy.optimizer_step(None, actor, None)
    except NonFiniteGradient as exc:
        label = str(exc)
    after = weights(engine)
    return {
        "raised": label, "skipped": engine.skipped_steps,
        "moved": any(not torch.equal(a, b) for a, b in zip(before, after)),
        "finite": all(bool(torch.isfinite(w).all()) for w in after),
    }


NAN = float("nan")
out = {"plain": {}, "rl": {}, "sft": {}}
for stage in (2, 3):  # OpenRLHF's own step: ZeRO-2 skips the update without a word, ZeRO-3 applies it
    engine, actor = make(stage)
    out["plain"][stage] = train(engine, actor, [1.0, NAN])
rank = NS(trainer=NS(actor_loss_fn=None, training_step=None), strategy=NS(args=NS(actor=NS(entropy_coef=None))))
control = EntropyControl(RLConfig())
control.step = 7
rank.update_control = updates.UpdateControl(control)
updates.prepare_fit(rank)  # what each RL rank does before its fit
for stage in (2, 3):
    engine, actor = make(stage)
    out["rl"][stage] = [train(engine, actor, [1.0, 1.0]), train(engine, actor, [1.0, NAN])]
updates.finish_fit()
sft.install(sft.EntryOptions(truncation="right", warmup_steps=0))  # what each SFT rank does
for stage in (2, 3):
    engine, actor = make(stage)
    out["sft"][stage] = [train(engine, actor, [1.0, 1.0]), train(engine, actor, [1.0, 1.0]),
                         train(engine, actor, [NAN, 1.0])]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ranks():
    pytest.importorskip("openrlhf")
    pytest.importorskip("deepspeed")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", RANK], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_under_bf16_deepspeed_skips_a_non_finite_update_silently_or_under_zero_3_applies_it(ranks):
    """Why the check exists: OpenRLHF's own optimizer step raises nothing either way."""
    assert ranks["plain"]["2"] == {"raised": None, "skipped": 1, "moved": False, "finite": True}
    assert ranks["plain"]["3"] == {"raised": None, "skipped": 0, "moved": True, "finite": False}


@pytest.mark.parametrize("stage", ["2", "3"])
def test_an_rl_rank_stops_at_a_non_finite_update_having_applied_none_of_it(ranks, stage):
    finite, bad = ranks["rl"][stage]
    assert finite == {"raised": None, "skipped": 0, "moved": True, "finite": True}
    assert bad["raised"].startswith("rl step 7: the gradients of an optimizer update were not finite")
    assert bad["moved"] is False and bad["finite"] is True


@pytest.mark.parametrize("stage", ["2", "3"])
def test_an_sft_rank_stops_at_a_non_finite_update_named_as_openrlhf_numbers_it(ranks, stage):
    first, second, bad = ranks["sft"][stage]
    assert first["raised"] is None and second["raised"] is None and second["moved"]
    assert bad["raised"].startswith("sft step 3: the gradients of an optimizer update were not finite")
    assert bad["moved"] is False and bad["finite"] is True


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
