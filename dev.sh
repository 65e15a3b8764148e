#!/usr/bin/env bash
# Set up (or reuse) the repo's virtual environment, then run the main job or the test suite.
#   ./dev.sh main [key=value ...]   the main job: the CPU quickstart (stare-agent quickstart)
#   ./dev.sh test [pytest args ...] lint + the whole test suite
# Installs are skipped while pyproject.toml and this file are unchanged since the last install.
set -euo pipefail
cd "$(dirname "$0")"

venv=.venv
python=${PYTHON:-$(command -v python3.11 || command -v python3)}
# torch is installed before the project: on these CPU machines torch==2.13.0 is a CPU build on the local
# disk, while an unpinned torch would download a multi-GB CUDA build. Set STARE_TORCH to change it.
torch_spec=${STARE_TORCH:-torch==2.13.0}

stamp="$venv/.stare-agent-install"
want="$(cat pyproject.toml dev.sh | sha256sum | cut -d' ' -f1) $torch_spec"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "dev.sh: installing into $venv ..." >&2
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
        "$venv/bin/python" -m pip install --quiet "$torch_spec"
    fi
    "$venv/bin/python" -m pip install --quiet -e ".[dev]"
    echo "$want" > "$stamp"
fi

cmd=${1:-}
shift || true
case "$cmd" in
    main)
        exec "$venv/bin/stare-agent" quickstart "$@"
        ;;
    test)
        "$venv/bin/ruff" check .
        "$venv/bin/ruff" format --check .
        exec "$venv/bin/python" -m pytest "$@"
        ;;
    *)
        echo "usage: ./dev.sh main [key=value ...] | ./dev.sh test [pytest args ...]" >&2
        exit 2
        ;;
esac
