"""What running the same command again over a run folder does, in both backends (docs/cluster.md, "Reruns").

A cluster scheduler that requeues a job replays its command line, so a rerun continues the run and never starts it
over: `resume=auto` (the default) continues from the run folder's last complete checkpoint, and a folder without
one starts at step 0. Starting fresh (`resume=''`) over a folder that holds a complete checkpoint is refused: it
would train step 1 again over the run's metrics, token reports and checkpoints. Each backend finds its own
checkpoints (their layouts differ) and asks `check_fresh_start`.
"""

from __future__ import annotations

from pathlib import Path

from stare_agent.config import ConfigError


def check_fresh_start(resume: str, run_dir: Path, newest: Path | None) -> None:
    """ConfigError when `resume` asks for a fresh start and `newest` (the run folder's last complete checkpoint, or
    None) exists."""
    if resume or newest is None:
        return
    raise ConfigError(
        f"resume='' starts the run over, but {run_dir} already holds a complete checkpoint ({newest}): leave "
        "resume at its default (auto) to continue it, or give the new run another run.name or run.output_dir"
    )
