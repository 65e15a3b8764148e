"""A bare clone works on its own: nothing reads or names the development folder beside the checkout,
and the benchmark files come from the clone's own data/benchmarks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Built from pieces so that this file does not match itself.
FORBIDDEN = (".." + "/shared", "shared" + "/benchmarks")


def _git(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd or ROOT, capture_output=True, text=True, timeout=120)


def _require_git_checkout() -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    if _git("rev-parse", "--show-toplevel").returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout (e.g. an unpacked source archive)")


def test_no_tracked_file_names_the_development_folder():
    _require_git_checkout()
    listed = _git("ls-files", "-z")
    assert listed.returncode == 0, listed.stderr
    hits = []
    for name in filter(None, listed.stdout.split("\0")):
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, or a submodule
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            hits += [f"{name}:{number}: {word!r} in {line.strip()[:120]!r}" for word in FORBIDDEN if word in line]
    assert not hits, "tracked files still name the development folder:\n" + "\n".join(hits)


@pytest.mark.slow
def test_a_fresh_clone_passes_its_data_tests_on_its_own_benchmarks(tmp_path):
    _require_git_checkout()
    clone = tmp_path / "x" / "p"  # nothing named shared/ above it
    made = _git("clone", "--quiet", str(ROOT), str(clone), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert (clone / "data" / "benchmarks" / "math500.json").is_file(), "the benchmark files are not committed"

    env = {k: v for k, v in os.environ.items() if k != "STARE_BENCHMARKS_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(clone), str(clone / "sandbox")])  # stare_sandbox: the clone's too
    env["PYTHONDONTWRITEBYTECODE"] = "1"

    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import stare_agent.data as d; print(d.__file__); print(d.benchmark_dir().resolve())",
        ],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    module_file, default_dir = (Path(line) for line in probe.stdout.split())
    real_clone = clone.resolve()
    assert module_file.resolve().is_relative_to(real_clone), f"imported {module_file}, not the clone's module"
    assert default_dir == real_clone / "data" / "benchmarks", default_dir

    run = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_data.py", "-q", "-p", "no:cacheprovider"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"pytest in the clone failed:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
