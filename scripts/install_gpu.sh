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
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
req=requirements-gpu.txt

pin() {  # the exact `name==version` line of requirements-gpu.txt
    grep -E "^$1==" "$req" || { echo "install_gpu: $1 is not pinned in $req" >&2; exit 1; }
}

"$python" -m pip install "$(pin torch)" "$(pin torchvision)" "$(pin torchaudio)" \
    packaging ninja wheel psutil einops "setuptools>=77"
if ! "$python" -c "import flash_attn" 2>/dev/null; then
    if ! command -v nvcc >/dev/null && [ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
        echo "install_gpu: flash-attn must be compiled and nvcc is not found (install the CUDA 13 toolkit," \
             "or set CUDA_HOME)" >&2
        exit 1
    fi
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
