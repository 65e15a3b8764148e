"""Import rules of DESIGN section 2: the math imports nothing but torch and the standard library basics,
and the shared modules import no training framework."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "stare_agent"
SANDBOX = PACKAGE.parent / "sandbox" / "stare_sandbox"
MATH_MODULES = ["stare.py", "theory.py", "loss.py"]
MATH_ALLOWED = {"torch", "math", "typing", "dataclasses", "fractions", "collections", "__future__"}
SHARED_MODULES = [
    "stare.py", "theory.py", "loss.py", "protocol.py", "agent.py", "reward.py", "data.py", "config.py", "runtime.py",
    "batching.py", "step.py", "snapshots.py",
]  # fmt: skip
FRAMEWORKS = {"openrlhf", "vllm", "ray", "deepspeed", "flash_attn"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("name", MATH_MODULES)
def test_math_modules_import_only_torch_and_basics(name):
    assert imported_roots(PACKAGE / name) <= MATH_ALLOWED


@pytest.mark.parametrize("name", [n for n in SHARED_MODULES if (PACKAGE / n).exists()])
def test_shared_modules_import_no_framework(name):
    assert not imported_roots(PACKAGE / name) & FRAMEWORKS


def test_importing_the_math_loads_nothing_else():
    code = (
        "import sys, stare_agent.stare, stare_agent.theory, stare_agent.loss\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'openrlhf','vllm','ray','deepspeed','transformers','yaml','pydantic'})\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_only_the_openrlhf_backend_imports_the_cluster_stack():
    """openrlhf, deepspeed and ray only under backends/openrlhf/; vllm there and in the local backend's optional
    vLLM generator. Every import counts, also one inside a function."""
    root = PACKAGE.parent
    allowed = {
        "openrlhf": set(),
        "deepspeed": set(),
        "ray": set(),
        "vllm": {"stare_agent/backends/local/vllm_generation.py"},
    }
    offenders = []
    for path in sorted([*PACKAGE.rglob("*.py"), *SANDBOX.rglob("*.py")]):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("stare_agent/backends/openrlhf/"):
            continue
        for name in imported_roots(path) & set(allowed):
            if rel not in allowed[name]:
                offenders.append(f"{rel} imports {name}")
    assert offenders == []


def test_the_sandbox_never_imports_stare_agent():
    """The sandbox is deployable on its own (sandbox/pyproject.toml): no import of it, in any module of the
    package, also inside a function, and importing every module loads none."""
    offenders = [
        f"{path.name} imports stare_agent" for path in SANDBOX.rglob("*.py") if "stare_agent" in imported_roots(path)
    ]
    assert offenders == []
    modules = sorted(path.stem for path in SANDBOX.glob("*.py") if path.stem not in ("__init__", "__main__"))
    code = (
        f"import sys\nfor name in {modules!r}:\n    __import__('stare_sandbox.' + name)\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] == 'stare_agent')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name a file imports, also inside functions (`from a.b import c` gives a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


def test_backends_depend_on_the_core_never_on_each_other():
    """What both backends need lives in the shared layer (runtime, agent, batching, loss ...), not in one of them."""
    offenders = []
    for this, other in (("local", "openrlhf"), ("openrlhf", "local")):
        for path in sorted((PACKAGE / "backends" / this).rglob("*.py")):
            for name in imported_modules(path):
                if name.startswith(f"stare_agent.backends.{other}"):
                    offenders.append(f"backends/{this}/{path.name} imports {name}")
    assert offenders == []


def test_the_core_imports_no_backend():
    offenders = [
        f"{path.name} imports {name}"
        for path in sorted(PACKAGE.glob("*.py"))
        if path.name != "cli.py"  # the command line dispatches to the backends
        for name in imported_modules(path)
        if name.startswith("stare_agent.backends")
    ]
    assert offenders == []


def test_the_backends_leave_the_stare_step_to_the_shared_layer():
    """Both backends get their weights, selections and metrics from step.control_step and step.update_selection;
    none selects tokens or computes the diagnostics itself (a second copy is how the two drifted apart before)."""
    own = {"select_quadrants", "token_weights", "batch_diagnostics", "critical_surprisal", "regime_codes",
           "clip_cov_select", "kl_cov_select", "forking_weights", "covariance_term"}  # fmt: skip
    offenders = []
    for path in sorted((PACKAGE / "backends").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = {a.name for a in node.names} if isinstance(node, ast.ImportFrom) else set()
            if isinstance(node, ast.Attribute):
                names = {node.attr}
            offenders += [f"{path.relative_to(PACKAGE)} uses {name}" for name in sorted(names & own)]
    assert offenders == []


def test_nothing_outside_the_lab_imports_it():
    """Three tiers: the product core and the backends never import the lab (tasks, toy, tiny models, pipelines,
    analysis); only the command line dispatches to it."""
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "lab" and path.name != "cli.py"
        for name in imported_modules(path)
        if name.startswith("stare_agent.lab")
    ]
    assert offenders == []
