#!/usr/bin/env bash
# Install the GPU environment of the openrlhf backend into the active Python environment (make and activate a
# venv first), with the versions pinned in requirements-gpu.txt; run it on every node of the cluster.
#
#   python3.11 -m venv .venv-gpu && . .venv-gpu/bin/activate && scripts/install_gpu.sh
#
# Three pip steps, because flash-attn 2.8.3 (required by OpenRLHF) ships only an sdist whose setup.py imports
# torch: torch first, then flash-attn built against it without build isolation (compiled when no prebuilt
# wheel matches: set MAX_JOBS to bound its memory, ~4 GB per job), then everything else and this repository.
# Needs nvcc of CUDA 13 (the CUDA of the PyPI torch 2.13.0) on PATH or in $CUDA_HOME for that build and for
# DeepSpeed's JIT-compiled ops. Ends with an import check that prints every version. Safe to re-run.
#
# Right after torch is installed, and before the long flash-attn build, `check_cuda` stops the script (exit 1,
# one line on stderr) when CUDA is not usable here: torch is a CPU-only build, no NVIDIA driver, a driver too
# old for CUDA 13 (NVIDIA: CUDA 13.x needs driver >= 580), no GPU visible, a first CUDA kernel fails (a GPU this
# torch has no kernels for), or nvcc missing or not CUDA 13 (torch's extension builder, used by flash-attn and
# DeepSpeed, refuses another major version). INSTALL_GPU_WITHOUT_GPU=1 skips only the GPU part (driver, device,
# kernel), to build the environment on a node without GPUs (a build or login node whose environment the GPU
# nodes share): torch must still be a CUDA build and nvcc CUDA 13 is still required.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
req=requirements-gpu.txt

pin() {  # the exact `name==version` line of requirements-gpu.txt
    grep -E "^$1==" "$req" || { echo "install_gpu: $1 is not pinned in $req" >&2; exit 1; }
}

check_cuda() {  # exit 1 with one line on stderr unless torch can use CUDA here and nvcc matches its CUDA
    "$python" - <<'PY'
import os, re, shutil, subprocess, sys, warnings

warnings.simplefilter("ignore")  # torch warns about a failed CUDA initialisation: the one line below says it
MIN_DRIVER = {12: 525, 13: 580}  # NVIDIA's CUDA minor version compatibility table: CUDA 12.x >= 525, 13.x >= 580


def fail(message):
    print(f"install_gpu: {message}", file=sys.stderr)
    sys.exit(1)


def first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def driver_version():
    """The NVIDIA driver's version ("580.95.05"), from nvidia-smi or the kernel module; None if none is loaded."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout
        found = re.search(r"\d+\.\d+(\.\d+)?", out)
        if found:
            return found.group(0)
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/driver/nvidia/version") as f:
            found = re.search(r"Kernel Module\s+(\d+\.\d+(\.\d+)?)", f.read())
        return found.group(1) if found else None
    except OSError:
        return None


try:
    import torch
except Exception as error:
    fail(f"torch does not import ({first_line(error)}): rerun this script to reinstall it")
built = torch.version.cuda
if not built:
    fail(f"torch {torch.__version__} is a CPU-only build, CUDA is not usable: run "
         "`python -m pip uninstall -y torch torchvision torchaudio`, then rerun this script with pip using PyPI "
         "(no CPU --index-url / PIP_INDEX_URL), which has the CUDA 13.0 build of torch 2.13.0")
major = int(built.split(".")[0])
names = f"torch {torch.__version__} (built with CUDA {built})"
if os.environ.get("INSTALL_GPU_WITHOUT_GPU") != "1":
    if not torch.cuda.is_available():
        try:
            torch.cuda.init()
            reason = "no CUDA device"
        except Exception as error:
            reason = first_line(error)
        driver, least = driver_version(), MIN_DRIVER.get(major)
        if driver is None:
            fail(f"CUDA is not usable by {names}: no NVIDIA driver is loaded (torch: {reason}); install an NVIDIA "
                 f"driver{f' >= {least}' if least else ''} on this node (or start the container with GPU "
                 "access), or set INSTALL_GPU_WITHOUT_GPU=1 to build the environment on a node without GPUs")
        if least and int(driver.split(".")[0]) < least:
            fail(f"CUDA is not usable by {names}: NVIDIA driver {driver} is too old, CUDA {major}.x needs a driver "
                 f">= {least} (torch: {reason}); upgrade the driver on this node")
        fail(f"CUDA is not usable by {names}: no GPU is visible (driver {driver}, CUDA_VISIBLE_DEVICES="
             f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}; torch: {reason}); run this on a GPU node, "
             "or set INSTALL_GPU_WITHOUT_GPU=1 to build the environment on a node without GPUs")
    try:
        torch.ones(1, device="cuda").add_(1).cpu()
    except Exception as error:
        try:
            capability = ".".join(map(str, torch.cuda.get_device_capability(0)))
            gpu = (f"{torch.cuda.get_device_name(0)}, compute capability {capability}; this torch has kernels for "
                   f"{' '.join(torch.cuda.get_arch_list())}")
        except Exception:
            gpu = "no details"
        fail(f"CUDA is not usable by {names}: a first CUDA kernel fails on GPU 0 ({gpu}): {first_line(error)}")
# Where torch's extension builder (flash-attn's setup, DeepSpeed's JIT ops) looks: $CUDA_HOME, $CUDA_PATH, the
# nvcc on PATH, /usr/local/cuda (torch.utils.cpp_extension._find_cuda_home).
home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
fix = (f"set CUDA_HOME to the CUDA {major} toolkit (torch looks only there when CUDA_HOME or CUDA_PATH is set)"
       if home else f"install the CUDA {major} toolkit and put its bin/ first on PATH, or set CUDA_HOME to it")
if not os.access(nvcc, os.X_OK):
    fail(f"nvcc is not found ({nvcc if home else 'not on PATH, nor /usr/local/cuda/bin/nvcc'}), and flash-attn's "
         f"build and DeepSpeed's JIT-compiled ops need nvcc of CUDA {major}: {fix}")
try:
    release = re.search(r"release (\d+)\.(\d+)", subprocess.run([nvcc, "--version"], capture_output=True,
                                                                text=True, timeout=60).stdout)
except (OSError, subprocess.SubprocessError) as error:
    fail(f"{nvcc} --version fails ({first_line(error)}): {fix}")
if release is None or int(release.group(1)) != major:
    found = f"CUDA {release.group(1)}.{release.group(2)}" if release else "an unknown version"
    fail(f"{nvcc} is {found}, {names} needs nvcc of CUDA {major} (torch's extension builder, used by "
         f"flash-attn and DeepSpeed, refuses another major version): {fix}")
PY
}

"$python" -m pip install "$(pin torch)" "$(pin torchvision)" "$(pin torchaudio)" \
    packaging ninja wheel psutil einops "setuptools>=77"
check_cuda
if ! "$python" -c "import flash_attn" 2>/dev/null; then
    MAX_JOBS=${MAX_JOBS:-8} "$python" -m pip install --no-build-isolation "$(pin flash-attn)"
fi
"$python" -m pip install -r "$req" -e .

"$python" - "$req" <<'PY'
import importlib, importlib.metadata as md, sys
lines = open(sys.argv[1]).read().split("\n")
pins = dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))
bad = []
for spec, want in pins.items():
    name = spec.split("[")[0]
    got = md.version(name)
    print(f"{name:14s} {got}")
    if got.split("+")[0] != want:
        bad.append(f"{name} {got} (pinned {want})")
for module in ("torch", "flash_attn", "vllm", "deepspeed", "ray", "openrlhf.cli.train_ppo_ray", "stare_agent"):
    importlib.import_module(module)
import torch
print(f"CUDA available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
sys.exit(f"install_gpu: versions differ from the pins: {bad}" if bad else 0)
PY
echo "install_gpu: done"
