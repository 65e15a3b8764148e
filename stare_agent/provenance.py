"""What code a run ran: one line per start of the run (a resume adds one) in its folder's `provenance.jsonl`.

A run folder's config.yaml says what was asked for; this says what answered: the package version, the git commit of
the source tree the package was imported from and whether that tree had changes (and which tracked files), the
command line, Python and the versions of the libraries that compute the results. A run resumed after the code
changed then shows it, line by line.

The commit is looked up only where the package's parent folder is the top of a git work tree (an editable install or
a checkout on `sys.path`): an installed copy inside some other repository (a virtual environment in a checkout)
would otherwise be reported with that repository's commit. No git, or no work tree: "git" is null.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import stare_agent

PROVENANCE = "provenance.jsonl"
LIBRARIES = ("torch", "transformers", "vllm", "openrlhf", "deepspeed", "ray", "stare-sandbox")
"""Whose installed versions each line records (those present)."""
_CHANGED_LISTED = 50  # at most this many changed paths are named; "changed_count" has them all


def source_version(package_dir: Path) -> dict[str, Any] | None:
    """{"commit", "dirty", "changed" (tracked paths with changes, at most _CHANGED_LISTED), "changed_count"} of the
    git work tree whose top is `package_dir`'s parent; None where there is none (or no git)."""
    root = package_dir.resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != root:
        return None
    commit, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    if commit is None or status is None:
        return None
    changed = [line[3:] for line in status.splitlines() if line.strip()]
    return {
        "commit": commit.strip(),
        "dirty": bool(changed),
        "changed": changed[:_CHANGED_LISTED],
        "changed_count": len(changed),
    }


def record_start(run_dir: str | Path) -> dict[str, Any]:
    """Append this start's line to the run folder's provenance.jsonl; the line."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    line = {
        "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "stare_agent": stare_agent.__version__,
        "git": source_version(Path(stare_agent.__file__).parent),
        "python": platform.python_version(),
        "libraries": versions,
    }
    path = Path(run_dir) / PROVENANCE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps(line) + "\n")
    return line
