"""runtime.start_client's capacity check, the one rule both backends start their sandbox client with: a run whose
stateful episodes at once exceed what its sandbox servers hold is refused at start, naming the numbers.

Two real `python -m stare_sandbox serve` processes on loopback with unequal limits and no warm kernels (nothing to
start: the check reads /healthz only). A server holds min(max_sessions, max_kernels) sessions, so together they
hold 3 + 2 = 5, although their summed max_sessions (11) and max_kernels (10) are both larger.
"""

from __future__ import annotations

import asyncio
import re

import pytest
from procs import sandbox_service

from stare_agent.backends.local import rl
from stare_agent.backends.openrlhf.episodes import ReToolExecutor
from stare_agent.config import AgentConfig, ConfigError, RLConfig, RolloutConfig, SandboxConfig, load_config
from stare_agent.data import write_records
from stare_agent.lab.tasks import generate_tasks
from stare_agent.runtime import make_client, start_client

HOLDS = 5
"""Sessions the two servers hold at once between them: min(3, 8) + min(8, 2)."""
STEP = "rollout.prompts_per_step x rollout.group_size"
IN_FLIGHT = re.escape(RLConfig.IN_FLIGHT_KEYS)
"""How the runs name the keys behind the episodes they may have in flight."""


@pytest.fixture(scope="module")
def urls():
    flags = ("--isolation", "process")
    with (
        sandbox_service(0, "--max-sessions", "3", "--max-kernels", "8", *flags) as a,
        sandbox_service(0, "--max-sessions", "8", "--max-kernels", "2", *flags) as b,
    ):
        yield [a.url, b.url]


def start(config: SandboxConfig, episodes: int) -> None:
    async def go() -> None:
        client = make_client(config)
        try:
            await start_client(client, config, episodes, STEP)
        finally:
            await client.close()

    asyncio.run(go())


def test_a_run_whose_episodes_exceed_the_servers_capacity_is_refused_naming_the_numbers(urls):
    with pytest.raises(ConfigError) as refused:
        start(SandboxConfig(urls=urls), HOLDS + 1)
    message = str(refused.value)
    assert f"{STEP} = 6 stateful episodes" in message
    assert f"answered (2 of 2) hold {HOLDS} at once" in message
    assert f"{urls[0]} max_sessions 3, max_kernels 8; {urls[1]} max_sessions 8, max_kernels 2" in message
    assert "summed: 11 sessions, 10 kernels" in message
    assert f"Lower {STEP}, or raise the servers' --max-sessions and --max-kernels" in message
    assert "add servers to sandbox.urls" in message


def test_a_run_that_fits_the_servers_capacity_starts(urls):
    start(SandboxConfig(urls=urls), HOLDS)  # exactly what they hold
    start(SandboxConfig(urls=urls), 0)  # stateless mode: no sessions held
    start(SandboxConfig(url=urls[0]), 3)  # one server: its own min(3, 8)
    with pytest.raises(ConfigError, match=r"= 4 stateful episodes .* \(1 of 1\) hold 3 at once"):
        start(SandboxConfig(url=urls[0]), 4)


def test_the_openrlhf_executor_checks_the_whole_step_against_the_servers(urls):
    """Each engine's executor checks the step's episodes, all engines' together, not a share of them."""

    def client_of(prompts: int, group: int, mode: str = "stateful") -> None:
        config = RLConfig(
            agent=AgentConfig(tool_mode=mode),
            rollout=RolloutConfig(prompts_per_step=prompts, group_size=group),
            sandbox=SandboxConfig(urls=urls),
        )
        executor = ReToolExecutor(config)

        async def go() -> None:
            try:
                await executor.client()
            finally:
                await executor.close()

        asyncio.run(go())

    with pytest.raises(ConfigError, match=rf"{IN_FLIGHT} = 6 stateful episodes .* hold {HOLDS} at once"):
        client_of(3, 2)
    client_of(1, 4)  # 4 fit
    client_of(3, 2, "stateless")  # no sessions


def test_the_local_rl_run_is_refused_before_it_writes_anything(urls, tmp_path, tiny_model_dir):
    prompts = tmp_path / "prompts.jsonl"
    write_records(prompts, [{"id": p.id, "problem": p.problem, "answer": p.answer} for p in generate_tasks(4, seed=0)])
    overrides = [f"run.output_dir={tmp_path / 'runs'}", "run.name=refused", f"model.path={tiny_model_dir}"]
    overrides += [f"data.train_file={prompts}", "rollout.prompts_per_step=3", "rollout.group_size=2"]
    overrides += [f"sandbox.urls=[{','.join(urls)}]", "loss.micro_batch_size=6"]
    trainer = rl.Trainer(load_config(RLConfig, None, overrides))
    with pytest.raises(ConfigError, match=rf"{IN_FLIGHT} = 6 stateful episodes .* hold {HOLDS} at once"):
        asyncio.run(trainer.train())
    assert not (trainer.run_dir / "metrics.jsonl").exists()
    # 2 x 2 episodes fit, but up-front dispatch at twice the need keeps 4 groups of 2 out
    ahead = [*overrides, "rollout.prompts_per_step=2", "rollout.max_dispatch_factor=2", "loss.micro_batch_size=4"]
    trainer = rl.Trainer(load_config(RLConfig, None, ahead))
    with pytest.raises(ConfigError, match=rf"{IN_FLIGHT} = 8 stateful episodes .* hold {HOLDS} at once"):
        asyncio.run(trainer.train())
