"""The Hugging Face snapshots a training run leaves in its `checkpoints/` folder: finding them (`stare-agent eval
snapshots=RUN`) and rotating them (both backends call `rotate` after each save, so the rule is written once).

The two layouts:
- local backend: `checkpoints/step-NNNNNN/`, a Hugging Face folder plus trainer_state.pt (the snapshot is the
  resumable checkpoint itself); `checkpoints/latest` names the latest one; the final model is the last of them.
- openrlhf backend: `checkpoints/global_stepN_hf/` (OpenRLHF's `ckpt.save_hf`) beside DeepSpeed's checkpoints in
  `checkpoints/_actor/global_stepN/`, which OpenRLHF rotates itself (`ckpt.max_num`, `ckpt.max_mem`; it never
  touches the `_hf` folders); `checkpoints/_actor/latest` names the latest DeepSpeed tag; the final model is
  `final/`, outside `checkpoints/`, and never looked at here.

The rule (`kept_steps`): keep the `keep` snapshots of the highest steps, every pinned one (a step the config lists
in `pin_snapshots`, or a folder holding a file named KEEP), and the one the latest resumable checkpoint
corresponds to, which a resume from an earlier step can put below the highest ones.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from pathlib import Path

PIN_FILE = "KEEP"
"""A file of this name in a snapshot folder pins it: rotation never deletes it (`touch .../step-000040/KEEP`)."""

_SNAPSHOT = re.compile(r"step-(\d+)|global_step(\d+)_hf")
_DEEPSPEED_TAG = re.compile(r"global_step(\d+)")


def snapshot_step(name: str) -> int | None:
    """The training step of a snapshot folder's name (step-000040, global_step40_hf); None for any other name."""
    match = _SNAPSHOT.fullmatch(name)
    return None if match is None else int(match.group(1) or match.group(2))


def find(folder: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every snapshot of a run, by step: `folder` is the run folder or its checkpoints/ folder.
    Folders being written (`.partial-*`) and DeepSpeed's own checkpoints (under `_actor/`) are not snapshots."""
    folder = Path(folder)
    if (folder / "checkpoints").is_dir():
        folder = folder / "checkpoints"
    if not folder.is_dir():
        return []
    found = [(snapshot_step(p.name), p) for p in folder.iterdir() if p.is_dir()]
    return sorted((step, path) for step, path in found if step is not None)


def latest_resumable_step(checkpoints: str | Path) -> int | None:
    """The step of the checkpoint a resume would load: the local backend's `latest`, else DeepSpeed's `_actor/latest`
    (the openrlhf backend); None when neither exists."""
    checkpoints = Path(checkpoints)
    for pointer, pattern in ((checkpoints / "latest", _SNAPSHOT), (checkpoints / "_actor" / "latest", _DEEPSPEED_TAG)):
        if pointer.is_file():
            match = pattern.fullmatch(pointer.read_text().strip())
            if match is not None:
                return int(next(group for group in match.groups() if group is not None))
    return None


def kept_steps(steps: Iterable[int], keep: int, pinned: Iterable[int] = (), protected: Iterable[int] = ()) -> set[int]:
    """The steps whose snapshots stay: the `keep` highest (keep 0: all), and those of `pinned` and `protected` that
    exist."""
    steps = sorted(set(steps))
    kept = set(steps[-keep:]) if keep > 0 else set(steps)
    return kept | (set(steps) & (set(pinned) | set(protected)))


def rotate(checkpoints: str | Path, keep: int, pinned: Iterable[int] = ()) -> list[Path]:
    """Delete the snapshots in `checkpoints` that `kept_steps` does not keep; returns the folders deleted.

    Pinned: the steps in `pinned` and every folder holding a PIN_FILE. Protected: the latest resumable checkpoint's
    step (its snapshot is the model a resume continues from)."""
    snapshots = find(checkpoints)
    pins = set(pinned) | {step for step, path in snapshots if (path / PIN_FILE).exists()}
    latest = latest_resumable_step(checkpoints)
    kept = kept_steps([step for step, _ in snapshots], keep, pins, [] if latest is None else [latest])
    deleted = [path for step, path in snapshots if step not in kept]
    for path in deleted:
        shutil.rmtree(path)
    return deleted
