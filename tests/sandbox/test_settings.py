"""`sandbox serve` settings: the YAML --config is validated like the trainer's configs, flags win over it."""

from __future__ import annotations

import pytest

from stare_sandbox.__main__ import CONFIG_EXAMPLE, build_parser, load_settings
from stare_sandbox.app import ServerSettings


def settings(tmp_path, text: str | None, *flags: str):
    argv = ["serve", *flags]
    if text is not None:
        path = tmp_path / "sandbox.yaml"
        path.write_text(text)
        argv += ["--config", str(path)]
    return load_settings(build_parser().parse_args(argv))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_runing: 4\n", r"sandbox\.yaml:1: unknown key 'max_runing' \(did you mean 'max_running'\?\)"),
        (
            "port: 1\npool:\n  pool_sise: 2\n",
            r"sandbox\.yaml:3: unknown key 'pool\.pool_sise' \(did you mean 'pool_size'",
        ),
        ("max_kernels: 8\n", r"sandbox\.yaml:1: unknown key 'max_kernels' \(did you mean 'pool\.max_kernels'\?\)"),
        ("pool:\n  pool_size: two\n", r"sandbox\.yaml:2: pool\.pool_size: Input should be a valid integer.*'two'"),
        ("pool:\n  limits:\n    memory_mb: 10\n", r"sandbox\.yaml:3.*memory_mb must be an integer >= 256"),
    ],
)
def test_a_wrong_key_or_value_stops_the_server_naming_file_and_line(tmp_path, text, message):
    with pytest.raises(SystemExit, match=message):
        settings(tmp_path, text)


def test_file_keys_change_only_themselves_and_flags_win(tmp_path, monkeypatch):
    monkeypatch.delenv("SANDBOX_TOKEN", raising=False)
    got = settings(
        tmp_path, "max_running: 3\npool:\n  max_kernels: 9\n  limits:\n    processes: 20\n", "--max-kernels", "7"
    )
    default = ServerSettings()
    assert (got.max_running, got.pool.max_kernels, got.pool.limits.processes) == (3, 7, 20)
    assert got.pool.pool_size == default.pool.pool_size and got.pool.limits.memory_mb == default.pool.limits.memory_mb
    assert got.max_waiting == default.max_waiting and got.port == default.port


def test_the_documented_example_loads_and_a_token_never_shows_in_errors(tmp_path, monkeypatch):
    example = "\n".join(line[2:] for line in CONFIG_EXAMPLE.splitlines()[2:])
    monkeypatch.setenv("SANDBOX_TOKEN", "s3cret-value")
    got = settings(tmp_path, example)
    assert got.host == "0.0.0.0" and got.token == "s3cret-value" and got.pool.limits.processes == 64
    monkeypatch.delenv("SANDBOX_TOKEN")
    with pytest.raises(SystemExit, match="needs an access token") as info:
        settings(tmp_path, example, "--max-running", "2")
    assert "s3cret" not in str(info.value)
    with pytest.raises(SystemExit) as info:
        settings(tmp_path, "host: 0.0.0.0\nmax_running: 0\n", "--token", "s3cret-value")
    assert "s3cret" not in str(info.value) and "--token" in str(info.value)
