"""`stare-agent experiment`: RL variants x seeds from one SFT checkpoint, each evaluated on held-out problems.

The folder `run.output_dir/run.name` holds, as the quickstart's does:

    config.yaml, data/, model/, sft/, eval-sft/          made once ("prepare"), seeded by run.seed
    rl-<variant>-s<seed>/, eval-<variant>-s<seed>/      one RL run and its evaluation per variant and seed
    eval-sft-k<K>/, eval-<variant>-s<seed>-k<K>/        with coverage_eval.k = K: each model's second evaluation
    report.md, report.json, entropy.png                 over every finished run ("report")

A stage whose output is complete is skipped, so rerunning the command resumes a sweep. The shared stages and
each run happen under a file lock, so several commands (say `seeds=[0]` and `seeds=[1]`, one per core) may
share one folder: a command waits for a run another one is doing and then reuses it.
Each run's numbers come from its own metrics.jsonl and eval results; the report's intervals are over seeds.

With `results_dir` (stare_agent/lab/results.py), a sweep outlives its output folder: the data, the SFT model
and each finished run's numbers are copied there, and a later command restores them instead of making them
again. New runs then start from the very SFT weights the kept runs started from: remaking SFT would give other
weights (float sums differ with thread timing), so the runs of a sweep would not share their start. The report
is stare_agent/lab/report.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml

from stare_agent.backends.local import evaluate, rl, sft
from stare_agent.backends.local.common import latest_checkpoint
from stare_agent.config import ConfigError, RLConfig, RunConfig, load_config, run_path, save_config, to_dict
from stare_agent.lab import results
from stare_agent.lab.models import build_tiny_model, tiny_corpus
from stare_agent.lab.quickstart import QuickstartConfig, make_data, quickstart_rl
from stare_agent.lab.report import write_report
from stare_agent.stare import StareConfig

# --- the command's config -----------------------------------------------------------------------------------------

_VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

VARIANT_SECTIONS = (
    "entropy_control",
    "stare",
    "clip_cov",
    "kl_cov",
    "forking_tokens",
    "low_prob_reweight",
    "entropy_bonus",
    "loss",
    "optim",
)
"""The RL config sections a variant may change; data, agent, rollout, steps and the rest are the experiment's."""


@dataclass
class CoverageEval:
    """A second evaluation of every model (SFT and each run's final checkpoint): the `eval` section with more
    samples on fewer problems, for pass@k at large k (e.g. k 64 on the first 64 test problems)."""

    k: int = 0
    """Samples per problem; 0: no second evaluation."""
    max_problems: int = 0
    """The first max_problems test problems; 0: all."""

    def __post_init__(self) -> None:
        if self.k < 0 or self.max_problems < 0:
            raise ValueError(f"coverage_eval.k and coverage_eval.max_problems must be >= 0; got {self.k}, "
                             f"{self.max_problems}")  # fmt: skip


@dataclass
class ExperimentConfig(QuickstartConfig):
    """`stare-agent experiment`: the quickstart's pipeline with several RL variants and seeds, for measurements.

    Data, tiny model and SFT are made once (seeded by run.seed); then every variant runs RL for every seed
    from that SFT checkpoint, each run is evaluated on the held-out problems, and a report with intervals
    over seeds is written. Every stage that has finished is reused, so the same command resumes a sweep,
    and several commands with different `seeds` or `only` may run at once on one output folder."""

    run: RunConfig = field(default_factory=RunConfig)
    """One thread by default: several experiment commands may share the cores (one per core)."""
    rl: RLConfig = field(default_factory=lambda: quickstart_rl(steps=40))
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """RL seeds (each sets rl.run.seed: the prompts drawn and the sampling)."""
    variants: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {
            "grpo-ds": {"entropy_control": {"method": "none"}},
            "stare-O1": {"entropy_control": {"method": "stare"}, "stare": {"op": "O1"}},
        }
    )
    """name -> the variant's changes to `rl`, by section: {section: {key: value}}, each section one of
    VARIANT_SECTIONS, e.g. `{entropy_control: {method: none}}` (GRPO-ds) or `{stare: {op: C2, w: 2.0}}`."""
    coverage_eval: CoverageEval = field(default_factory=CoverageEval)
    """With k > 0, each model is evaluated a second time into eval-<name>-k<k>/ (same seed, `eval`'s settings
    with this k and max_problems); a run counts as finished once both evaluations are."""
    only: list[str] = field(default_factory=list)
    """Variants to run now (empty = all); the report covers every finished run."""
    stage: Literal["all", "prepare", "report"] = "all"
    """all: whatever is missing, then the report; prepare: data, model, SFT and its evaluation; report: only that."""
    results_dir: str = ""
    """A folder outside the repository for a sweep spread over several machines or sessions: it gets the data,
    the SFT model and each finished run's numbers as they are made, and a command restores what its output
    folder lacks from it, so new runs start from the same SFT weights. Its config.yaml must match the command's
    (run.output_dir and run.name may differ). Empty: none. Model weights are never committed to git."""

    def __post_init__(self) -> None:
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be a non-empty list of distinct integers; got {self.seeds}")
        if not self.variants:
            raise ValueError("variants must name at least one variant")
        for name in self.variants:
            if not _VARIANT_NAME.fullmatch(name):
                raise ValueError(f"variant name {name!r} must be letters, digits, '_', '.' or '-' (it names folders)")
            self.variant_rl(name)
        unknown = [name for name in self.only if name not in self.variants]
        if unknown:
            raise ValueError(f"only names unknown variants {unknown}; the variants are {', '.join(self.variants)}")

    def variant_rl(self, name: str) -> RLConfig:
        """`rl` with the variant's changes applied (checked like any RLConfig)."""
        return rl_with_changes(self.rl, self.variants[name], f"variants.{name}")


def rl_with_changes(rl: RLConfig, changes: Mapping[str, Any] | None, where: str) -> RLConfig:
    """`rl` with `changes` ({section: {key: value}}, sections of VARIANT_SECTIONS) applied by dataclasses.replace,
    so each changed section and the whole RLConfig are checked again; an error names `where.SECTION.KEY`."""
    changes = dict(changes or {})
    if _is_old_format(changes):
        raise ValueError(
            f"{where}: {_flow(changes)} is the old format (keys of rl.stare); a variant now changes RL config "
            f"sections: write {_flow(_new_variant(changes))}"
        )
    sections = {}
    for section, keys in changes.items():
        if section not in VARIANT_SECTIONS:
            raise ValueError(f"{where}.{section}: unknown section; a variant may change {', '.join(VARIANT_SECTIONS)}")
        keys = keys or {}
        if not isinstance(keys, Mapping):
            raise ValueError(f"{where}.{section} must be a mapping of its keys to values; got {keys!r}")
        current = getattr(rl, section)
        allowed = [f.name for f in dataclasses.fields(current)]
        for key in keys:
            if key in allowed:
                continue
            renamed = getattr(current, "RENAMED_KEYS", {}).get(key)
            replaced = getattr(current, "REPLACED_KEYS", {}).get(key)
            if renamed is not None:
                raise ValueError(f"{where}.{section}.{key} was renamed to {renamed!r}; use that key instead")
            if replaced is not None:
                raise ValueError(f"{where}.{section}.{key} is gone: {replaced}")
            raise ValueError(f"{where}.{section}.{key}: unknown key; allowed: {', '.join(allowed)}")
        # Validated as a config file's section is (types included: YAML reads `1.0e9` as text), then checked.
        try:
            sections[section] = pydantic.TypeAdapter(type(current)).validate_python({**asdict(current), **keys})
        except pydantic.ValidationError as exc:
            error = exc.errors()[0]
            key = ".".join(str(part) for part in error["loc"])
            message = error["ctx"]["error"] if error["type"] == "value_error" else error["msg"]  # the check's own
            raise ValueError(f"{where}.{section}{'.' + key if key else ''}: {message}") from None
    try:
        return dataclasses.replace(rl, **sections)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _is_old_format(changes: Mapping[str, Any]) -> bool:
    """Whether `changes` is (partly) in the format before entropy_control: keys of rl.stare (`enabled` among them) at
    the top level, or `stare.enabled`."""
    stare_keys = {"enabled", *(f.name for f in dataclasses.fields(StareConfig))}
    stare = changes.get("stare")
    return bool(stare_keys & set(changes)) or (isinstance(stare, Mapping) and "enabled" in stare)


def _new_variant(changes: Mapping[str, Any]) -> dict[str, Any]:
    """An old-format variant in the section format: `enabled` becomes entropy_control.method (none or stare), the
    other keys of rl.stare go to the `stare` section."""
    out: dict[str, Any] = {}
    stare: dict[str, Any] = {}
    for key, value in changes.items():
        if key in VARIANT_SECTIONS and key != "stare":
            out[key] = value
        elif key == "stare" and isinstance(value, Mapping):
            stare.update(value)
        else:
            stare[key] = value
    if "enabled" in stare:
        method = "stare" if stare.pop("enabled") else "none"
        out["entropy_control"] = {**(out.get("entropy_control") or {}), "method": method}
    if stare:
        out["stare"] = stare
    return out


def _flow(value: Any) -> str:
    """`value` as one line of YAML flow style, as a config file or an override would write it."""
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000).strip()


# --- the stages ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created), held for the block: one process prepares, the others wait."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _final_checkpoint(run_dir: Path, steps: int) -> Path | None:
    """The run's last checkpoint if the run reached `steps`; None while it has not."""
    last = latest_checkpoint(run_dir)
    return last if last is not None and last.name == f"step-{steps:06d}" else None


def _stage_run(run_dir: Path, name: str, seed: int, threads: int) -> RunConfig:
    return RunConfig(output_dir=str(run_dir), name=name, seed=seed, threads=threads)


def prepare(config: ExperimentConfig, run_dir: Path) -> dict[str, Path]:
    """Data, tiny model, SFT and the SFT model's evaluation, each made only if missing; their paths."""
    data_dir, seed = run_dir / "data", config.run.seed
    with _locked(run_dir / ".prepare.lock"):
        files = {
            name: data_dir / f"{stem}.jsonl" for name, stem in (("sft", "sft"), ("rl", "rl_train"), ("test", "test"))
        }
        if not all(path.exists() for path in files.values()):
            print("experiment: synthetic tasks and SFT transcripts (code run in the sandbox)")
            files = make_data(config, run_dir)
        model_dir = run_dir / "model"
        if not (model_dir / "config.json").exists():
            print("experiment: tiny model and tokenizer")
            corpus = tiny_corpus() + [
                m["content"] for line in files["sft"].read_text().splitlines() for m in json.loads(line)["messages"]
            ]
            build_tiny_model(model_dir, corpus, **asdict(config.model), seed=seed)
        finished = run_dir / "sft" / "finished"  # names the final checkpoint once SFT has returned
        if finished.exists():
            checkpoint = Path(finished.read_text().strip())
        else:
            print("experiment: SFT")
            checkpoint = sft.run(
                replace(
                    config.sft,
                    run=_stage_run(run_dir, "sft", seed, config.run.threads),
                    model=replace(config.sft.model, path=str(model_dir)),
                    data=replace(config.sft.data, train_file=str(files["sft"])),
                    resume="auto",
                )
            )
            finished.write_text(f"{checkpoint}\n")
        results.keep_sft(config.results_dir, files, checkpoint)
        _evaluate(config, run_dir, "sft", checkpoint, files["test"], seed)
        results.keep(config.results_dir, run_dir, *eval_names(config, "sft"))
    return {**files, "sft_model": checkpoint}


def eval_names(config: ExperimentConfig, name: str) -> list[str]:
    """The evaluation folders of the model `name` (sft, or <variant>-s<seed>): eval-<name>, and eval-<name>-k<K>
    with a coverage evaluation."""
    k = config.coverage_eval.k
    return [f"eval-{name}", *([f"eval-{name}-k{k}"] if k else [])]


def _evaluate(config: ExperimentConfig, run_dir: Path, name: str, model: Path, test: Path, seed: int) -> None:
    """Every evaluation of the model `name` that is not finished yet (all scored with the same seed)."""
    for folder in eval_names(config, name):
        if (run_dir / folder / "results.json").exists():
            continue
        settings = config.eval
        if folder != f"eval-{name}":
            cover = config.coverage_eval
            settings = replace(settings, k=cover.k, k_per_benchmark={}, max_problems=cover.max_problems)
        print(f"experiment: evaluating {folder.removeprefix('eval-')} on {test}")
        evaluate.run(
            replace(
                settings,
                run=_stage_run(run_dir, folder, seed, config.run.threads),
                model=replace(settings.model, path=str(model)),
                files=[str(test)],
            )
        )


def run_variant(config: ExperimentConfig, run_dir: Path, files: dict[str, Path], variant: str, seed: int) -> None:
    """One RL run (resumed from its last checkpoint if it was cut short) and its evaluation."""
    name = f"{variant}-s{seed}"
    with _locked(run_dir / f".{name}.lock"):  # another command on this folder may be running the same one
        _run_variant(config, run_dir, files, variant, seed, name)


def _run_variant(
    config: ExperimentConfig, run_dir: Path, files: dict[str, Path], variant: str, seed: int, name: str
) -> None:
    if _done(config, run_dir, name):  # evaluated (here, or restored from the results folder without checkpoints)
        return
    final = _final_checkpoint(run_dir / f"rl-{name}", config.rl.steps)
    if final is None and (run_dir / f"eval-{name}" / "results.json").exists():
        raise ConfigError(
            f"{run_dir / f'eval-{name}'} is finished but {', '.join(eval_names(config, name)[1:])} is not, and "
            f"{run_dir / f'rl-{name}'} has no final checkpoint (a run restored from a results folder keeps none): "
            "evaluate that checkpoint with `stare-agent eval`, or train the run again in another folder"
        )
    if final is None:
        print(f"experiment: RL {name}, {config.rl.steps} steps")
        variant_rl = config.variant_rl(variant)
        final = rl.run(
            replace(
                variant_rl,
                run=_stage_run(run_dir, f"rl-{name}", seed, config.run.threads),
                model=replace(variant_rl.model, path=str(files["sft_model"])),
                data=replace(variant_rl.data, train_file=str(files["rl"])),
                resume="auto",
            )
        )
    # Every model is scored with the same evaluation seed: the comparison between runs is paired.
    _evaluate(config, run_dir, name, final, files["test"], config.run.seed)
    results.keep(config.results_dir, run_dir, f"rl-{name}", *eval_names(config, name))


def _done(config: ExperimentConfig, run_dir: Path, name: str) -> bool:
    return all((run_dir / folder / "results.json").exists() for folder in eval_names(config, name))


# Keys that may differ between commands sharing one experiment folder: what to run now, and how fast.
PER_COMMAND = ("seeds", "only", "stage", "variants")


def _join(config: ExperimentConfig, folder: Path, where: tuple[str, ...] = ()) -> ExperimentConfig:
    """`config` checked against `folder`'s config.yaml (written if it has none; new variants added to it).
    Returns the command's config with the folder's variants joined in."""
    saved = folder / "config.yaml"
    if not saved.exists():
        save_config(config, folder)
        return config
    joined = check_same_experiment(config, saved, where)
    if joined.variants != load_config(ExperimentConfig, saved).variants:
        save_config(replace(load_config(ExperimentConfig, saved), variants=joined.variants), folder)
    return replace(config, variants=joined.variants)


def check_same_experiment(config: ExperimentConfig, saved_path: Path, where: tuple[str, ...] = ()) -> ExperimentConfig:
    """The config to save: the folder's own config with any new variants added. Anything else that differs
    from the folder's config (data, model, SFT, RL or eval settings, or an existing variant's changes) is an
    error naming the keys: its finished runs would otherwise be reused as if made with the new settings.
    Keys in `where` (where the folder is) may differ too."""
    saved = load_config(ExperimentConfig, saved_path)
    mine, theirs = _flat(to_dict(config)), _flat(to_dict(saved))
    free = {"run.threads", "results_dir", *where}
    differ = sorted(
        key
        for key in mine.keys() | theirs.keys()
        if key.split(".")[0] not in PER_COMMAND and key not in free and mine.get(key) != theirs.get(key)
    )
    differ += [
        f"variants.{name}"
        for name in sorted(config.variants.keys() & saved.variants.keys())
        if config.variants[name] != saved.variants[name]
    ]
    if differ:
        raise ConfigError(
            f"{saved_path.parent} holds an experiment made with other settings ({', '.join(differ)} differ from "
            f"{saved_path}); use another run.name, or the same settings (seeds, only and stage may differ, and "
            "new variants may be added)"
        )
    return replace(saved, variants={**saved.variants, **config.variants})


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "variants":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def open_folder(config: ExperimentConfig) -> tuple[Path, ExperimentConfig]:
    """The experiment's output folder, with what the results folder keeps restored into it, and the config of
    the folder (the command's, with every variant either folder has); a folder of other settings is an error."""
    run_dir = run_path(config.run, "experiment")
    with _locked(run_dir / ".config.lock"):
        folder_config = config
        if config.results_dir:  # its settings must be this command's, as the output folder's must
            folder_config = _join(config, Path(config.results_dir), where=("run.output_dir", "run.name"))
            for name in results.restore(Path(config.results_dir), run_dir):
                print(f"experiment: {name} restored from {config.results_dir}")
        folder_config = _join(folder_config, run_dir)  # the report covers every variant of both folders
    return run_dir, folder_config


def run(config: ExperimentConfig) -> Path:
    run_dir, folder_config = open_folder(config)
    if config.stage != "report":
        names = [f"{v}-s{seed}" for seed in config.seeds for v in config.only or list(config.variants)]
        # Data and SFT only when something needs them: a sweep restored whole goes straight to its report.
        if config.stage == "prepare" or not all(_done(config, run_dir, n) for n in ["sft", *names]):
            files = prepare(config, run_dir)
        if config.stage == "all":
            for seed in config.seeds:
                for variant in config.only or list(config.variants):
                    if not _done(config, run_dir, f"{variant}-s{seed}"):
                        run_variant(config, run_dir, files, variant, seed)
    report = write_report(folder_config, run_dir)  # every variant of the folder, not only this command's
    print(report.read_text())
    print(f"experiment: everything is in {run_dir}")
    return run_dir
