"""Config loading: defaults, YAML, overrides, and errors that say what and where."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import stare_agent
from stare_agent.config import ConfigError, RLConfig, StareConfig, load_config, save_config
from stare_agent.lab.simulate import SimulateConfig
from stare_agent.provenance import PROVENANCE, source_version

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_come_from_the_dataclasses():
    config = load_config(SimulateConfig)
    assert config == SimulateConfig()
    assert config.stare == StareConfig()


def test_file_then_overrides_take_precedence(tmp_path):
    path = write(tmp_path, "stare:\n  w: 1.3\n  gate: sample\nrun:\n  seed: 4\n")
    config = load_config(SimulateConfig, path, ["stare.w=2", "toy.steps=7", "run.name=007"])
    assert config.stare.w == 2.0 and isinstance(config.stare.w, float)
    assert config.stare.gate == "sample"
    assert config.run.seed == 4 and config.toy.steps == 7
    assert config.run.name == "007"  # a str field keeps the text, not the int 7


def test_override_types_lists_maps_and_bools():
    config = load_config(SimulateConfig, None, ["open_loop_w=[1.5, 3]", "stare.op={high+: 2, low-: 1.5}"])
    assert config.open_loop_w == [1.5, 3.0]
    assert config.stare.op == {"high+": 2.0, "low-": 1.5}
    assert load_config(RLConfig, None, ["rollout.dynamic_sampling=false"]).rollout.dynamic_sampling is False


def test_unknown_key_in_file_names_file_line_and_suggestion(tmp_path):
    path = write(tmp_path, "run:\n  seed: 1\nstare:\n  gate: batch\n  targt_entropy: 0.2\n")
    with pytest.raises(
        ConfigError, match=r"c\.yaml:5: unknown key 'stare\.targt_entropy' \(did you mean 'target_entropy'"
    ):
        load_config(SimulateConfig, path)


def test_unknown_section_and_override_key():
    with pytest.raises(ConfigError, match=r"override 'stare\.gat=off': unknown key 'stare\.gat'.*'gate'"):
        load_config(SimulateConfig, None, ["stare.gat=off"])
    with pytest.raises(ConfigError, match="unknown key 'optim'"):
        load_config(SimulateConfig, None, ["optim.lr=1"])
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(SimulateConfig, None, ["stare.gate"])
    with pytest.raises(ConfigError, match="stare is a section"):
        load_config(SimulateConfig, None, ["stare=3"])


def test_bad_value_names_allowed_values_and_where(tmp_path):
    path = write(tmp_path, "stare:\n  gate: btach\n")
    with pytest.raises(ConfigError) as info:
        load_config(SimulateConfig, path)
    message = str(info.value)
    assert f"{path}:2: stare.gate:" in message
    assert "'batch', 'sample', 'token' or 'off'" in message and "got 'btach'" in message
    with pytest.raises(ConfigError, match=r"override 'toy.steps=many'.*toy\.steps.*valid integer"):
        load_config(SimulateConfig, None, ["toy.steps=many"])


def test_range_checks_cite_the_source(tmp_path):
    path = write(tmp_path, "toy:\n  length: 8\n")
    with pytest.raises(ConfigError, match=r"override 'toy\.max_wrong=9'.*max_wrong must be in \[0, length\)"):
        load_config(SimulateConfig, path, ["toy.max_wrong=9"])
    with pytest.raises(ConfigError, match=r"stare: w must be >= 1"):
        load_config(SimulateConfig, None, ["stare.w=0.5"])


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(SimulateConfig, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(SimulateConfig, write(tmp_path, "stare: [\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(SimulateConfig, write(tmp_path, "- 1\n- 2\n"))


def test_empty_file_means_defaults(tmp_path):
    assert load_config(SimulateConfig, write(tmp_path, "")) == SimulateConfig()


def test_saved_config_loads_back_equal(tmp_path):
    config = load_config(SimulateConfig, None, ["stare.op={high+: 1.4}", "stare.w_mode=adaptive", "toy.lr=5"])
    path = save_config(config, tmp_path)
    assert load_config(SimulateConfig, path) == config


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("**/*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    """configs/<command>*.yaml is a config of that command."""
    from stare_agent.cli import COMMANDS, config_class

    command = next(c for c in sorted(COMMANDS, key=len, reverse=True) if path.name.startswith(c))
    load_config(config_class(command), path)


@pytest.mark.parametrize("command", ["sft", "rl", "eval", "quickstart"])
def test_training_configs_save_and_load_back_equal(tmp_path, command):
    from stare_agent.cli import config_class

    config = load_config(config_class(command), None, ["run.seed=3"])
    assert load_config(config_class(command), save_config(config, tmp_path)) == config


# A key changes exactly that key: a section the root fills with its own defaults keeps them.
NESTED = [
    ("sft.epochs", "3", lambda c: c.sft.epochs),
    ("sft.optim.warmup_steps", "7", lambda c: c.sft.optim.warmup_steps),
    ("rl.stare.w", "4.0", lambda c: c.rl.stare.w),
    ("rl.agent.max_tool_calls", "2", lambda c: c.rl.agent.max_tool_calls),
    ("eval.k", "2", lambda c: c.eval.k),
    ("eval.agent.tool_timeout_s", "1.5", lambda c: c.eval.agent.tool_timeout_s),
]


@pytest.mark.parametrize("source", ["override", "file"])
@pytest.mark.parametrize(("key", "value", "read"), NESTED, ids=[k for k, _, _ in NESTED])
def test_a_nested_quickstart_key_changes_only_that_key(tmp_path, source, key, value, read):
    from stare_agent.config import to_dict
    from stare_agent.lab.quickstart import QuickstartConfig

    if source == "override":
        config = load_config(QuickstartConfig, None, [f"{key}={value}"])
    else:
        *sections, leaf = key.split(".")
        text = "".join(f"{'  ' * depth}{name}:\n" for depth, name in enumerate(sections))
        config = load_config(QuickstartConfig, write(tmp_path, text + f"{'  ' * len(sections)}{leaf}: {value}\n"))
    assert read(config) == type(read(config))(value)
    changed, expected = to_dict(config), to_dict(QuickstartConfig())
    node = expected
    for part in key.split(".")[:-1]:
        node = node[part]
    node[key.split(".")[-1]] = read(config)
    assert changed == expected


def test_a_key_keeps_the_default_a_parent_gives_its_section(tmp_path):
    from stare_agent.config import RLConfig

    config = load_config(RLConfig, write(tmp_path, "optim:\n  warmup_steps: 5\n"))
    assert (config.optim.warmup_steps, config.optim.lr) == (5, 1e-6)  # lr: RLConfig's own default, not OptimConfig's
    assert load_config(RLConfig, None, ["optim.warmup_steps=5"]).optim.lr == 1e-6
    empty = load_config(RLConfig, write(tmp_path, "optim:\nstare:\n  w: 2\n"))  # an empty section changes nothing
    assert empty.optim == RLConfig().optim and empty.stare.w == 2.0


def test_a_dict_field_is_replaced_whole(tmp_path):
    from stare_agent.config import EvalConfig

    config = load_config(
        EvalConfig, write(tmp_path, "k_per_benchmark: {aime24: 16}\n"), ["k_per_benchmark={amc23: 8}"]
    )
    assert config.k_per_benchmark == {"amc23": 8}


def test_an_override_below_a_mapping_sets_one_entry_dots_and_all(tmp_path):
    from stare_agent.config import EvalConfig, RLConfig

    path = write(tmp_path, "backend: openrlhf\nopenrlhf:\n  ds.zero_stage: 3\n")
    config = load_config(
        RLConfig, path, ["openrlhf.vllm.num_engines=8", "openrlhf.actor.eps_clip_low_high=[0.2, 0.3]"]
    )
    assert config.openrlhf == {"ds.zero_stage": 3, "vllm.num_engines": 8, "actor.eps_clip_low_high": [0.2, 0.3]}
    assert load_config(EvalConfig, None, ["k_per_benchmark.aime24=16"]).k_per_benchmark == {"aime24": 16}
    with pytest.raises(ConfigError, match="but backend is 'local'; set backend: openrlhf"):
        load_config(RLConfig, None, ["openrlhf.vllm.num_engines=8"])
    with pytest.raises(ConfigError, match="without the leading dashes, e.g. 'vllm.num_engines'"):
        load_config(RLConfig, None, ["backend=openrlhf", "openrlhf.--vllm.num_engines=8"])


def test_a_renamed_key_names_its_new_name(tmp_path):
    """stare.schedule became stare.w_mode: an old run's config.yaml or override says so, with the file's line."""
    renamed = r"'stare.schedule' was renamed to 'stare.w_mode'"
    with pytest.raises(ConfigError, match=r"override 'stare.schedule=adaptive': " + renamed):
        load_config(RLConfig, None, ["stare.schedule=adaptive"])
    old = tmp_path / "old.yaml"
    old.write_text("steps: 3\nstare:\n  w: 1.2\n  schedule: fixed\n")
    with pytest.raises(ConfigError, match=r"old.yaml:4: " + renamed):
        load_config(RLConfig, old)


def test_sandbox_urls_reach_the_client_and_exclude_url():
    from stare_agent.runtime import make_client

    config = load_config(RLConfig, overrides=["sandbox.urls=[http://127.0.0.1:8765,http://127.0.0.1:8766/]"])
    client = make_client(config.sandbox)
    assert client.urls == ("http://127.0.0.1:8765", "http://127.0.0.1:8766")
    one = make_client(load_config(RLConfig, overrides=["sandbox.url=http://127.0.0.1:8765"]).sandbox)
    assert one.urls == ("http://127.0.0.1:8765",)
    with pytest.raises(ConfigError, match="sandbox.url .one server. or sandbox.urls"):
        load_config(RLConfig, overrides=["sandbox.url=http://127.0.0.1:8765", "sandbox.urls=[http://127.0.0.1:8766]"])
    with pytest.raises(ConfigError, match=r"\[1\].*listed twice"):
        load_config(RLConfig, overrides=["sandbox.urls=[http://127.0.0.1:8765,http://127.0.0.1:8765]"])


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout


def test_every_start_of_a_run_records_the_code_it_runs(tmp_path):
    """save_config appends one provenance line per call (a resumed run adds one), with the commit of the checkout
    the package was imported from and its uncommitted changes."""
    save_config(RLConfig(), tmp_path)
    save_config(RLConfig(), tmp_path)
    lines = [json.loads(line) for line in (tmp_path / PROVENANCE).read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["stare_agent"] == stare_agent.__version__
    if shutil.which("git") is None or not (REPO / ".git").exists():
        assert lines[0]["git"] is None
        return
    changed = [line[3:] for line in _git(REPO, "status", "--porcelain", "--untracked-files=no").splitlines()]
    assert lines[0]["git"] == {
        "commit": _git(REPO, "rev-parse", "HEAD").strip(),
        "dirty": bool(changed),
        "changed": changed[:50],
        "changed_count": len(changed),
    }


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_copy_installed_inside_another_repository_is_not_given_its_commit(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "f").write_text("1")
    _git(tmp_path, "add", "f")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    installed = tmp_path / "venv" / "site-packages" / "stare_agent"
    installed.mkdir(parents=True)
    assert source_version(installed) is None
    (tmp_path / "stare_agent").mkdir()
    (tmp_path / "f").write_text("2")
    found = source_version(tmp_path / "stare_agent")
    assert found == {
        "commit": _git(tmp_path, "rev-parse", "HEAD").strip(),
        "dirty": True,
        "changed": ["f"],
        "changed_count": 1,
    }


def test_stateful_episodes_in_flight_count_the_groups_dispatched_ahead():
    base = ["rollout.prompts_per_step=4", "rollout.group_size=8"]
    assert load_config(RLConfig, None, base).stateful_episodes_in_flight == 32
    ahead = load_config(RLConfig, None, [*base, "rollout.max_dispatch_factor=2.5"])
    assert ahead.rollout.max_groups_in_flight == 10 and ahead.stateful_episodes_in_flight == 80
    capped = load_config(RLConfig, None, [*base, "rollout.max_dispatch_factor=3", "rollout.max_prompts_per_step=9"])
    assert capped.stateful_episodes_in_flight == 72  # the step's prompt budget
    assert load_config(RLConfig, None, [*base, "agent.tool_mode=stateless"]).stateful_episodes_in_flight == 0
