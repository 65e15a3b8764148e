"""run.threads: the `stare-agent` command sets torch's intra-op threads before a run starts; < 0 is a config error."""

from __future__ import annotations

import pytest
import torch

from stare_agent import cli
from stare_agent.config import ConfigError, RunConfig, SFTConfig, load_config
from stare_agent.lab.simulate import SimulateConfig

seen: list[int] = []


def run(config: SimulateConfig) -> None:
    """Stands in for a command's module (cli.COMMANDS): records the thread count the run starts with."""
    seen.append(torch.get_num_threads())


@pytest.fixture
def fake_simulate(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setitem(cli.COMMANDS, "simulate", ("stare_agent.lab.simulate:SimulateConfig", __name__))
    seen.clear()
    yield seen
    torch.set_num_threads(before)


def test_the_command_sets_the_configured_threads_before_the_run(fake_simulate):
    torch.set_num_threads(2)
    assert cli.main(["simulate"]) == 0
    assert cli.main(["simulate", "run.threads=0"]) == 0  # 0: torch's own setting is left as it is
    assert cli.main(["simulate", "run.threads=2"]) == 0
    assert fake_simulate == [RunConfig().threads, RunConfig().threads, 2]
    assert RunConfig().threads == 1  # the measured default (docs/benchmarks.md)


def test_negative_threads_is_a_config_error_naming_the_key(capsys):
    with pytest.raises(ConfigError, match=r"run: threads must be >= 0 .*got -1"):
        load_config(SFTConfig, overrides=["run.threads=-1"])
    assert cli.main(["sft", "run.threads=-1"]) == 2
    err = capsys.readouterr().err
    assert "override 'run.threads=-1': run: threads must be >= 0" in err and "Traceback" not in err
