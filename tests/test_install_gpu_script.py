"""scripts/install_gpu.sh stops with one line, before the flash-attn build, when CUDA is not usable.

The script runs for real (bash, its pins, its check), with `PYTHON` pointing at a wrapper that hands every
`python -m pip ...` to a log instead of pip, so nothing is installed, and every other call to this interpreter.
The first test uses the real torch of this environment (a CPU build here); the others put a small stand-in `torch`
on PYTHONPATH, and stand-ins for nvidia-smi and nvcc on PATH / in CUDA_HOME, to reach the GPU node's cases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install_gpu.sh"
ENV_DROPPED = ("CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "INSTALL_GPU_WITHOUT_GPU", "PYTHONPATH")

FAKE_TORCH = """
import json, types

_state = json.loads({state!r})
__version__ = "2.13.0"
version = types.SimpleNamespace(cuda=_state["cuda"])


class _Tensor:
    def add_(self, other):
        return self

    def cpu(self):
        return self


def ones(*shape, device=None):
    if _state.get("kernel_error"):
        raise RuntimeError(_state["kernel_error"])
    return _Tensor()


class _Cuda:
    def is_available(self):
        return _state["available"]

    def init(self):
        if _state.get("init_error"):
            raise RuntimeError(_state["init_error"])

    def get_device_capability(self, index):
        return (7, 0)

    def get_device_name(self, index):
        return "Tesla V100-SXM2-32GB"

    def get_arch_list(self):
        return ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


cuda = _Cuda()
"""


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def run_script(
    tmp_path: Path, torch_state: dict | None = None, driver: str | None = None, nvcc: str | None = None, **env: str
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the script; returns the process and the pip commands it would have run."""
    log = tmp_path / "pip.log"
    python = executable(
        tmp_path / "python",
        f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$*" >> "{log}"; exit 0; fi\n'
        f'exec "{sys.executable}" "$@"\n',
    )
    environ = {key: value for key, value in os.environ.items() if key not in ENV_DROPPED}
    environ["PYTHON"] = str(python)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    environ["PATH"] = f"{bin_dir}{os.pathsep}{environ.get('PATH', '')}"
    if torch_state is not None:
        executable(tmp_path / "fake" / "torch" / "__init__.py", FAKE_TORCH.format(state=json.dumps(torch_state)))
        environ["PYTHONPATH"] = str(tmp_path / "fake")
    if driver is not None:  # nvidia-smi answering with this driver version ("" = no driver: it fails)
        reply = f'echo "{driver}"' if driver else 'echo "NVIDIA-SMI has failed" >&2; exit 9'
        executable(bin_dir / "nvidia-smi", f"#!/bin/sh\n{reply}\n")
    cuda_home = tmp_path / "cuda"
    (cuda_home / "bin").mkdir(parents=True)
    environ["CUDA_HOME"] = str(cuda_home)  # the only place the check looks for nvcc when it is set
    if nvcc is not None:
        reply = f"Cuda compilation tools, release {nvcc}, V{nvcc}.88"
        executable(cuda_home / "bin" / "nvcc", f'#!/bin/sh\necho "{reply}"\n')
    environ.update(env)
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=environ, timeout=300)
    return done, log.read_text().splitlines() if log.exists() else []


def assert_stopped_with_one_line(done: subprocess.CompletedProcess, pips: list[str], *parts: str) -> str:
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("install_gpu: "), done.stderr
    for part in parts:
        assert part in lines[0]
    assert done.stdout == ""
    assert len(pips) == 1 and "torch==2.13.0" in pips[0]  # torch was installed, flash-attn's build not started
    return lines[0]


GOOD = {"cuda": "13.0", "available": True}


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU build of torch (this one has CUDA)")
def test_a_cpu_build_of_torch_stops_the_script_before_the_flash_attn_build(tmp_path):
    """The real torch of this environment, 2.13.0+cpu: torch.cuda.is_available() is False."""
    done, pips = run_script(tmp_path)
    assert_stopped_with_one_line(done, pips, f"torch {torch.__version__} is a CPU-only build", "pip uninstall")


def test_a_driver_too_old_for_cuda_13_is_named(tmp_path):
    too_old = "The NVIDIA driver on your system is too old (found version 12080). Please update your GPU driver"
    done, pips = run_script(
        tmp_path, {"cuda": "13.0", "available": False, "init_error": too_old}, driver="575.57.08", nvcc="13.0"
    )
    assert_stopped_with_one_line(done, pips, "NVIDIA driver 575.57.08 is too old", "needs a driver >= 580")


@pytest.mark.skipif(Path("/proc/driver/nvidia/version").exists(), reason="an NVIDIA driver is loaded here")
def test_no_driver_is_named(tmp_path):
    state = {"cuda": "13.0", "available": False, "init_error": "Found no NVIDIA driver on your system."}
    done, pips = run_script(tmp_path, state, driver="", nvcc="13.0")
    assert_stopped_with_one_line(done, pips, "no NVIDIA driver is loaded", "INSTALL_GPU_WITHOUT_GPU=1")


def test_no_visible_gpu_is_named(tmp_path):
    state = {"cuda": "13.0", "available": False, "init_error": "No CUDA GPUs are available"}
    done, pips = run_script(tmp_path, state, driver="580.95.05", nvcc="13.0", CUDA_VISIBLE_DEVICES="")
    assert_stopped_with_one_line(done, pips, "no GPU is visible", "driver 580.95.05", "CUDA_VISIBLE_DEVICES=")


def test_a_gpu_without_kernels_in_this_torch_is_named(tmp_path):
    state = {**GOOD, "kernel_error": "CUDA error: no kernel image is available for execution on the device"}
    done, pips = run_script(tmp_path, state, driver="580.95.05", nvcc="13.0")
    assert_stopped_with_one_line(done, pips, "first CUDA kernel fails", "compute capability 7.0", "no kernel image")


@pytest.mark.parametrize(
    ("nvcc", "message"), [(None, "nvcc is not found"), ("12.8", "is CUDA 12.8, torch 2.13.0 (built with CUDA 13.0)")]
)
def test_missing_or_other_major_nvcc_is_named(tmp_path, nvcc, message):
    done, pips = run_script(tmp_path, GOOD, driver="580.95.05", nvcc=nvcc)
    assert_stopped_with_one_line(done, pips, message)


@pytest.mark.parametrize(
    ("state", "env"),
    [(GOOD, {}), ({"cuda": "13.0", "available": False}, {"INSTALL_GPU_WITHOUT_GPU": "1"})],
    ids=["gpu-node", "without-gpu-override"],
)
def test_a_usable_node_goes_on_to_the_flash_attn_build(tmp_path, state, env):
    done, pips = run_script(tmp_path, state, driver="580.95.05", nvcc="13.0", **env)
    stops = [line for line in done.stderr.splitlines() if line.startswith("install_gpu: ")]
    assert all("versions differ from the pins" in line for line in stops), stops  # only the final check's, if any
    assert any("--no-build-isolation flash-attn==2.8.3" in pip for pip in pips), (pips, done.stderr)


def test_the_override_still_refuses_a_cpu_build_of_torch(tmp_path):
    done, pips = run_script(tmp_path, {"cuda": None, "available": False}, nvcc="13.0", INSTALL_GPU_WITHOUT_GPU="1")
    assert_stopped_with_one_line(done, pips, "is a CPU-only build")
