"""`stare-agent rl` with backend openrlhf: start OpenRLHF's own PPO entry point, with our config and hooks in place.

OpenRLHF's `train()` runs on the Ray driver, which is this process: it creates the vLLM engine actors (our agent
executor runs inside them), the DeepSpeed policy actors and the single-controller `PPOTrainer` actor. We do only
what it cannot do for us:

1. Ray: `train()` calls `ray.init` only when Ray is not initialised, and then without our environment. We
   initialise it first (`ray.init()` resolves the cluster itself: $RAY_ADDRESS, else the cluster last started on
   this machine, else a new local one) with a runtime_env whose env_vars reach every actor on every node: our
   RLConfig as JSON (the agent executor and the STARE hooks read it there) and the defaults `train()` would have set.
2. The STARE hooks (`hooks.install()`): our actor and trainer classes put in place of OpenRLHF's by module attribute,
   before its CLI module runs (it looks them up when it runs).
3. OpenRLHF's CLI itself, run as `__main__` with the checked argv: its parser and post-parse validation run as
   they do for `python -m openrlhf.cli.train_ppo_ray`.

A failure inside OpenRLHF or an actor propagates with its traceback (a non-zero exit); a config problem found
before anything starts is a ConfigError (launch.resolve_rl). Ray is shut down on every way out if we started it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import runpy
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from stare_agent.backends.openrlhf import episodes, upstream
from stare_agent.batching import NoStepTrained, SandboxFailures, end_message
from stare_agent.config import ConfigError, RLConfig, save_config
from stare_agent.runtime import SandboxBroken

logger = logging.getLogger(__name__)

RAY_ENV_DEFAULTS = {
    "TOKENIZERS_PARALLELISM": "true",
    "NCCL_DEBUG": "WARN",
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
}
"""What openrlhf/cli/train_ppo_ray.py `train()` puts in its own ray.init runtime_env (0.11.2, lines 24-31); as
there, a value already in our environment wins."""


FORWARDED_ENV = ("WANDB_", "NCCL_", "HF_", "HUGGING_FACE_", "TRANSFORMERS_", "SANDBOX_TOKEN", "STARE_AGENT_")
"""Names (prefixes) of the driver's environment variables that every Ray actor gets too. Ray starts its workers
from the raylet's environment, not the driver's: without this, a job's WANDB_API_KEY, NCCL_SOCKET_IFNAME,
HF_HOME or sandbox token would not reach the trainer, the DeepSpeed ranks or the engines on other nodes."""


def ray_env(config: RLConfig, environ: dict[str, str] | None = None) -> dict[str, str]:
    """runtime_env env_vars for every Ray actor: OpenRLHF's defaults (ours win when set), the variables named by
    FORWARDED_ENV, and our config."""
    environ = dict(os.environ) if environ is None else environ
    env = {name: environ.get(name, default) for name, default in RAY_ENV_DEFAULTS.items()}
    env.update({name: value for name, value in environ.items() if name.startswith(FORWARDED_ENV)})
    env.update(episodes.config_env(config))
    return env


def wandb_env(run_dir: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """WANDB_RUN_ID (kept in the run folder, made on the first start) and WANDB_RESUME=allow, so that a rerun of the
    run logs to the same wandb run; a value the user exported wins."""
    environ = dict(os.environ) if environ is None else environ
    saved = run_dir / "wandb_run_id"
    if not saved.is_file():
        name = re.sub(r"[^A-Za-z0-9_-]", "-", run_dir.name)[:40]  # the characters wandb allows in an id
        saved.write_text(f"{name}-{os.urandom(4).hex()}\n")
    return {
        "WANDB_RUN_ID": environ.get("WANDB_RUN_ID", saved.read_text().strip()),
        "WANDB_RESUME": environ.get("WANDB_RESUME", "allow"),
    }


@contextlib.contextmanager
def _ray_session(env_vars: dict[str, str]) -> Iterator[bool]:
    """Ray initialised with `env_vars` for every actor; yields whether we started it (then we shut it down)."""
    import ray

    if ray.is_initialized():  # a caller's session (e.g. a notebook): its runtime_env is theirs, not ours
        logger.warning(
            "Ray is already initialised: the actors see our config only if its runtime_env has env_vars %s",
            sorted(env_vars),
        )
        yield False
        return
    ray.init(runtime_env={"env_vars": env_vars})
    try:
        yield True
    finally:
        ray.shutdown()


def check_gpus(needed: int, how: str) -> None:
    """ConfigError when the Ray cluster declares fewer GPUs than OpenRLHF's placement will ask for."""
    import ray

    have = ray.cluster_resources().get("GPU", 0)
    if have < needed:
        raise ConfigError(
            f"OpenRLHF's placement needs {needed} GPUs ({how}) and the Ray cluster has {have:g}; Ray would wait for "
            "them without end. Add nodes (`ray start --address=HEAD:6379`), or lower openrlhf.actor.num_gpus_per_node "
            "/ openrlhf.vllm.num_engines (docs/cluster.md)"
        )


def _carried(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The exception of type `kind` that Ray's errors around `exc` carry (their `cause`, a few levels deep: in async
    mode an actor's error reaches the driver through the controller actor), or None."""
    seen: BaseException | None = exc
    for _ in range(6):
        if isinstance(seen, kind):
            return seen
        seen = getattr(seen, "cause", None) or getattr(seen, "__cause__", None)
        if seen is None:
            break
    return None


def _sandbox_broken(exc: BaseException) -> str:
    """The one line of a SandboxBroken or sandbox ConfigError raised in an engine actor's start, from the Ray error
    that carries it (its cause, or the creation task's traceback in its message); '' if there is none."""
    broken = _carried(exc, SandboxBroken)
    if broken is not None:
        return str(broken)
    for line in str(exc).splitlines():
        if "SandboxBroken: " in line:
            return line.split("SandboxBroken: ", 1)[1]
    return ""


@contextlib.contextmanager
def _argv(words: list[str]) -> Iterator[None]:
    saved = sys.argv
    sys.argv = words
    try:
        yield
    finally:
        sys.argv = saved


def run(config: RLConfig, argv: list[str], run_dir: Path, gpus: tuple[int, str] | None = None) -> None:
    """Train: OpenRLHF's train_ppo_ray with `argv` (from launch.resolve_rl), our config in every actor.

    `gpus` (launch.gpus_needed): the GPUs OpenRLHF's placement will ask for, checked against the Ray cluster's
    before anything is placed: Ray would otherwise wait for them without end.

    Ends with one line saying how many of `steps` full batches were trained and why it stopped early, if it did
    (the trainer actor's end_report). NoStepTrained when none was; SandboxFailures, raised in the trainer actor
    when a step's sandbox failures stop the run, comes out as itself (a one-line error), not as Ray's wrapper.
    """
    from stare_agent.backends.openrlhf import hooks  # imports OpenRLHF: only once we train

    if config.openrlhf.get("train.partial_rollout_enable") and (problem := hooks.version_stamp_problem()):
        raise ConfigError(problem)  # before Ray starts: the engines and the driver share this install
    save_config(config, run_dir)
    with _ray_session({**ray_env(config), **wandb_env(run_dir)}):
        if gpus is not None:
            check_gpus(*gpus)
        hooks.install()
        with _argv([upstream.RL_CLI, *argv]), warnings.catch_warnings():
            # runpy warns that the CLI module is already imported (by the parser check); harmless, as runpy says
            warnings.filterwarnings("ignore", message=".*found in sys.modules after import", category=RuntimeWarning)
            try:
                runpy.run_module(upstream.RL_CLI, run_name="__main__")
            except Exception as exc:
                failures = _carried(exc, SandboxFailures)  # raised in the trainer, or in async mode the generator
                if failures is not None:
                    raise SandboxFailures(str(failures)) from None
                broken = _sandbox_broken(exc)
                if broken:  # an engine's check at its start (agent_executor.AgentExecutor)
                    raise SandboxBroken(broken) from None
                raise
        report = hooks.end_report()
    if report is None:
        raise RuntimeError("OpenRLHF's train() returned without making the PPO trainer (is hooks.install() in place?)")
    message = end_message(report["trained"], report["steps"], report["reason"])
    print(f"rl: {message}; the final model is in {run_dir / 'final'}", flush=True)
    if report["trained"] == 0:
        raise NoStepTrained(f"rl: {message}")
