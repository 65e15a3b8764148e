"""An experiment's results folder, and what of it goes into the repository.

The results folder (`results_dir`, outside the repository) keeps a sweep across sessions and machines: the data,
the SFT model (weights and tokenizer, no optimizer state) and each finished run's numbers; a later command
restores what its output folder lacks from it. `publish` copies a results folder into the repository without
the artifacts git should not hold (weights, per-sample transcripts) and writes `manifest.json`: the sha256 and
size of every file it left out, so a rebuilt or restored artifact can be checked against the one the numbers
came from.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from stare_agent.backends.local.common import TRAINER_STATE

RL_KEPT = ("metrics.jsonl", "config.yaml")  # of an RL run; an evaluation's folder is kept whole (no subfolders)
SFT_KEPT = "sft/model"  # the SFT checkpoint in the results folder, without its optimizer state
WITHHELD = {"*.safetensors": "weights", "*.bin": "weights", "*.pt": "weights", "*_transcripts.jsonl": "transcripts"}
"""Files `publish` leaves out of the repository (pattern -> kind); everything else is configs and numbers."""
MANIFEST = "manifest.json"


def keep(results_dir: str, run_dir: Path, *names: str) -> None:
    """Copy finished runs' numbers into the results folder (replacing what it had of them); no-op without one."""
    if not results_dir:
        return
    for name in names:
        source = run_dir / name
        if name.startswith("rl-"):
            files = [source / f for f in RL_KEPT]
        else:
            files = [p for p in source.iterdir() if p.is_file()]
        _copy_files(files, Path(results_dir) / name)


def keep_sft(results_dir: str, data: dict[str, Path], checkpoint: Path) -> None:
    """The data and the SFT model into the results folder, unless it has them (then they were restored)."""
    results = Path(results_dir)
    if results_dir and not (results / SFT_KEPT).exists():
        _copy_files(list(data.values()), results / "data")
        _copy_files([p for p in checkpoint.iterdir() if p.is_file() and p.name != TRAINER_STATE], results / SFT_KEPT)


def _copy_files(files: list[Path], target: Path) -> None:
    """`target` made anew holding copies of `files`; it appears whole (renamed into place) or not at all."""
    partial = target.with_name(f".partial-{target.name}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for path in files:
        shutil.copy2(path, partial / path.name)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


def restore(results: Path, run_dir: Path) -> list[str]:
    """Copy into `run_dir` what the results folder has and `run_dir` lacks: the data and SFT model, and every
    finished run; the names of the stages restored."""
    restored = []
    if (results / "data").is_dir() and not (run_dir / "data").exists():
        shutil.copytree(results / "data", run_dir / "data")
        restored.append("data")
    finished = run_dir / "sft" / "finished"
    if (results / SFT_KEPT).is_dir() and not finished.exists():
        model = run_dir / SFT_KEPT
        shutil.copytree(results / SFT_KEPT, model, dirs_exist_ok=True)
        finished.write_text(f"{model}\n")
        restored.append("SFT model")
    for kept in sorted(results.glob("eval-*")):
        if (kept / "results.json").exists() and not (run_dir / kept.name / "results.json").exists():
            name = kept.name.removeprefix("eval-")
            for part in (kept, results / f"rl-{name}"):
                if part.is_dir():
                    shutil.copytree(part, run_dir / part.name, dirs_exist_ok=True)
            restored.append(name)
    return restored


# --- publishing into the repository ---------------------------------------------------------------------------


def withheld_kind(path: Path) -> str | None:
    """'weights' or 'transcripts' for a file the repository does not keep; None for one it does."""
    return next((kind for pattern, kind in WITHHELD.items() if fnmatch.fnmatch(path.name, pattern)), None)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_entry(path: Path, relative: str, retrieve: str) -> dict[str, Any]:
    return {"path": relative, "kind": withheld_kind(path), "sha256": sha256(path), "bytes": path.stat().st_size,
            "retrieve": retrieve}  # fmt: skip


def publish(results: Path, dest: Path) -> dict[str, Any]:
    """Copy `results` into `dest` (made anew) without the withheld files; write and return dest's manifest.

    The manifest lists each withheld file with its sha256, size and where it can be had: the results folder it
    was published from (an SFT model can also be rebuilt from the experiment's config; the sha256 says whether
    a rebuild is the same file)."""
    if not results.is_dir():
        raise FileNotFoundError(f"results folder {results} does not exist")
    if dest.exists():
        shutil.rmtree(dest)
    withheld = []
    for path in sorted(p for p in results.rglob("*") if p.is_file()):
        relative = path.relative_to(results).as_posix()
        if relative.startswith(".") or "/." in relative or relative == MANIFEST:
            continue  # locks and partial copies
        if withheld_kind(path):
            withheld.append(manifest_entry(path, relative, f"{results.resolve()}/{relative}"))
            continue
        (dest / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest / relative)
    manifest = {"published_from": str(results.resolve()), "withheld": withheld}
    dest.mkdir(parents=True, exist_ok=True)
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def check(folder: Path, artifacts: Path) -> list[str]:
    """Compare the withheld files of a published `folder` with the files under `artifacts` (a results folder, a
    rebuild); one line per file: 'same', 'differs' or 'missing'."""
    manifest = json.loads((folder / MANIFEST).read_text())
    lines = []
    for entry in manifest["withheld"]:
        candidate = artifacts / entry["path"]
        state = "missing" if not candidate.exists() else "same" if sha256(candidate) == entry["sha256"] else "differs"
        lines.append(f"{state}: {entry['path']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """`stare-agent lab publish RESULTS DEST`, or `... publish --check DEST ARTIFACTS`."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="stare-agent lab publish",
        description="copy an experiment's results folder into the repository without its weights and transcripts, "
        "with a manifest of their sha256; or (--check) compare files against a published folder's manifest",
    )
    parser.add_argument("source", metavar="RESULTS|DEST", help="the results folder (with --check: the published one)")
    parser.add_argument("target", metavar="DEST|ARTIFACTS", help="where to publish (with --check: the files to check)")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if args.check:
        lines = check(Path(args.source), Path(args.target))
        print("\n".join(lines))
        return 0 if all(line.startswith("same") for line in lines) else 1
    manifest = publish(Path(args.source), Path(args.target))
    print(f"published {args.source} into {args.target}; withheld {len(manifest['withheld'])} files (manifest.json)")
    return 0
