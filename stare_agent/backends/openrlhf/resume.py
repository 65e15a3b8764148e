"""Where a rerun of `stare-agent rl` (backend openrlhf) continues from, checked before OpenRLHF starts.

OpenRLHF 0.11.2 keeps DeepSpeed checkpoints in `<ckpt.path>/_actor/global_stepN/` and loads the one DeepSpeed's
`_actor/latest` file names (`ckpt.load_enable`, which resume=auto sets). What it does not handle, and this does:

- **A save that did not finish.** A 7B ZeRO-3 save writes ~100 GB; a kill or a full disk in the middle leaves a
  `global_stepN` folder with part of its shards and `latest` naming the previous one, or, when the interrupted
  save was the first, no `latest` at all (OpenRLHF then returns an empty state and fails with KeyError 'episode'),
  or an emptied `latest` (DeepSpeed rewrites it in place). After every save has returned on every rank, the
  trainer writes `COMPLETE` into the checkpoint's folder (`mark_complete`); before a run starts, `prepare` points
  `latest` at the last complete checkpoint, saying so in one line, or, when there is none, sets the broken pointer
  aside so that the run starts at step 0 (the trainer's `init_checkpoint_states` takes an empty state as a fresh
  start). A checkpoint from before these markers counts as complete when `latest` names it.
- **Another number of GPUs.** DeepSpeed's ZeRO checkpoints hold one shard per data-parallel rank and refuse to
  load on another count (`ZeRORuntimeException`); `world_size_problem` says how to convert the checkpoint to
  DeepSpeed's universal format, which loads on any count (`openrlhf.ds.use_universal_ckpt`).
- **A fresh start over a run** is refused as in the local backend (stare_agent/reruns.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ACTOR = "_actor"
"""OpenRLHF's folder of the policy's DeepSpeed checkpoints, under ckpt.path."""
COMPLETE = "stare_complete.json"
"""Written into a checkpoint's folder once its save has finished on every rank."""
_TAG = re.compile(r"global_step(\d+)")
_SHARD = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt")


def actor_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / ACTOR


def mark_complete(ckpt_path: str | Path, step: int) -> None:
    """Record that the checkpoint of `step` was saved whole (call after OpenRLHF's save returned on every rank)."""
    folder = Path(ckpt_path) / ACTOR / f"global_step{step}"
    if folder.is_dir():
        (folder / COMPLETE).write_text(json.dumps({"step": step}) + "\n")


def latest_named(folder: Path) -> str:
    """The checkpoint DeepSpeed's `latest` file in `folder` names; '' when there is none (or it is empty)."""
    latest = folder / "latest"
    return latest.read_text().strip() if latest.is_file() else ""


def complete_checkpoints(actor: Path) -> list[Path]:
    """The complete checkpoints in `actor`, oldest step first: marked ones, and the one `latest` names."""
    named = latest_named(actor)
    found = []
    for folder in actor.glob("global_step*"):
        match = _TAG.fullmatch(folder.name)
        if match and folder.is_dir() and ((folder / COMPLETE).is_file() or folder.name == named):
            found.append((int(match.group(1)), folder))
    return [folder for _, folder in sorted(found)]


def newest_complete(run_dir: Path) -> Path | None:
    complete = complete_checkpoints(actor_dir(run_dir))
    return complete[-1] if complete else None


def saved_ranks(checkpoint: Path) -> int:
    """The data-parallel ranks a DeepSpeed ZeRO checkpoint was saved by (one optimizer shard each); 0 if unknown."""
    ranks = {int(m.group(1)) for p in checkpoint.iterdir() if (m := _SHARD.search(p.name))}
    return len(ranks)


def world_size_problem(checkpoint: Path | None, ranks: int, universal: bool) -> str:
    """Why `checkpoint` cannot be loaded by `ranks` training ranks, with how to convert it; '' when it can."""
    if checkpoint is None or universal:
        return ""
    saved = saved_ranks(checkpoint)
    if not saved or saved == ranks:
        return ""
    return (
        f"the checkpoint {checkpoint} was saved by {saved} training ranks and this run has {ranks}: DeepSpeed's ZeRO "
        "checkpoints load only on the same count. Convert it to DeepSpeed's universal format, `python -m "
        f"deepspeed.checkpoint.ds_to_universal --input_folder {checkpoint} --output_folder {checkpoint}_universal`, "
        "then rerun with openrlhf.ds.use_universal_ckpt: true (or keep the GPU count it was saved with)"
    )


def prepare(run_dir: Path) -> Path | None:
    """Before OpenRLHF starts: point `latest` at the last complete checkpoint (returned), or set a pointer to an
    incomplete one aside when there is none. Each change is one line on stdout; nothing is deleted."""
    actor = actor_dir(run_dir)
    if not actor.is_dir():
        return None
    named, newest = latest_named(actor), newest_complete(run_dir)
    latest = actor / "latest"
    if newest is None:
        if latest.exists():
            aside = latest.with_name("latest.incomplete")
            latest.replace(aside)
            print(f"rl: {actor} holds no complete checkpoint ({latest} named {named!r}, set aside as {aside.name}); "
                  "starting at step 0", flush=True)  # fmt: skip
        return None
    if named != newest.name:
        why = f"names {named!r}, which is not a complete checkpoint" if named else "is missing or empty"
        temporary = latest.with_name("latest.tmp")
        temporary.write_text(newest.name)
        temporary.replace(latest)
        print(f"rl: {latest} {why}; continuing from {newest.name}, the last complete checkpoint", flush=True)
    return newest
