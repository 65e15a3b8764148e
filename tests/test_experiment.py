"""`stare-agent experiment`: a tiny sweep end to end, resuming, the report's numbers, the config's checks."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest
from tiny import TINY_QUICKSTART  # tests/tiny.py

from stare_agent.cli import main
from stare_agent.config import ConfigError, RLConfig, load_config
from stare_agent.lab import experiment, report
from stare_agent.lab.experiment import ExperimentConfig
from stare_agent.lab.stats import bootstrap_interval, t_interval

TINY = [*TINY_QUICKSTART, "eval.k=2"]


@pytest.mark.slow
def test_a_tiny_sweep_runs_resumes_and_reports(tmp_path, capsys):
    overrides = [
        f"run.output_dir={tmp_path}",
        "run.name=sweep",
        *TINY,
        "seeds=[0, 1]",
        "variants={grpo-ds: {entropy_control: {method: none}}, "
        "critical: {stare: {w_mode: critical, w_max: 8.0, w: 1.5}}}",
    ]
    run_dir = experiment.run(load_config(ExperimentConfig, None, overrides))
    names = {p.name for p in run_dir.iterdir()}
    expected = {f"{kind}-{v}-s{s}" for kind in ("rl", "eval") for v in ("grpo-ds", "critical") for s in (0, 1)}
    assert expected | {"data", "model", "sft", "eval-sft", "report.md", "report.json", "entropy.png"} <= names
    assert "w_mode: critical" in (run_dir / "rl-critical-s1" / "config.yaml").read_text()
    assert load_config(RLConfig, run_dir / "rl-grpo-ds-s0" / "config.yaml").entropy_control.method == "none"

    report = json.loads((run_dir / "report.json").read_text())
    for variant in ("grpo-ds", "critical"):
        for seed in (0, 1):
            saved = json.loads((run_dir / f"eval-{variant}-s{seed}" / "results.json").read_text())[0]
            assert report["variants"][variant][str(seed)]["held_out"]["avg@k"] == saved["avg_at_k"]
    text = (run_dir / "report.md").read_text()
    values = [report["variants"]["grpo-ds"][s]["held_out"]["avg@k"] * 100 for s in ("0", "1")]
    low, high = t_interval(values)[1:]
    assert f"| grpo-ds | 2 | {statistics.fmean(values):.1f} [{low:.1f}, {high:.1f}]" in text

    # Everything finished is reused: a second run trains and evaluates nothing (no new metrics rows or files).
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.suffix != ".png"}
    before = {p: t for p, t in before.items() if p.name not in {"report.md", "report.json"}}
    capsys.readouterr()
    assert main(["experiment", *overrides]) == 0
    assert "experiment: RL" not in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in before} == before

    # A cut-short RL run is resumed, and a new seed adds only its own runs.
    (run_dir / "eval-grpo-ds-s1" / "results.json").unlink()
    assert main(["experiment", *overrides[:-2], "seeds=[1, 2]", "only=[grpo-ds]", overrides[-1]]) == 0
    out = capsys.readouterr().out
    assert "experiment: RL grpo-ds-s2" in out and "experiment: RL grpo-ds-s1" not in out
    assert "evaluating grpo-ds-s1" in out and not (run_dir / "rl-critical-s2").exists()
    assert "| grpo-ds | 3 |" in (run_dir / "report.md").read_text()


def test_bootstrap_interval_covers_the_mean_and_shrinks_with_more_problems():
    few = [1.0, 0.0] * 8
    many = few * 16
    lo_few, hi_few = bootstrap_interval(few)
    lo_many, hi_many = bootstrap_interval(many)
    assert lo_few < 0.5 < hi_few and lo_many < 0.5 < hi_many
    assert hi_many - lo_many < 0.5 * (hi_few - lo_few)


@pytest.mark.parametrize(
    "override, message",
    [
        ("variants={a: {wx: {w: 2}}}", r"variants\.a\.wx: unknown section; a variant may change entropy_control, "),
        ("variants={a: {stare: {wx: 1}}}", r"variants\.a\.stare\.wx: unknown key; allowed: op, top_ratio"),
        ("variants={a: {stare: {schedule: adaptive}}}", r"variants\.a\.stare\.schedule was renamed to 'w_mode'"),
        ("variants={a: {stare: {w: 0.5}}}", r"variants\.a\.stare: w must be >= 1; got 0.5"),
        (
            "variants={a: {entropy_control: {method: nope}}}",
            r"variants\.a\.entropy_control\.method: Input should be 'none', 'stare'",
        ),
        ("variants={a: {optim: {updates_per_batch: 3}}}", r"variants\.a: optim\.updates_per_batch=3 must divide"),
        ("variants={a: {stare: 1}}", r"variants\.a\.stare must be a mapping"),
        ("variants={a: {clip_cov: {lb: x}}}", r"variants\.a\.clip_cov\.lb: Input should be a valid number"),
        ("variants={a: {clip_cov: {lb: 6}}}", r"variants\.a\.clip_cov: clip_cov\.lb must be < clip_cov\.ub"),
        (
            "variants={a: {enabled: false}}",
            r"variants\.a: \{enabled: false\} is the old format.*write \{entropy_control: "
            r"\{method: none\}\}$",
        ),
        ("variants={a: {op: C2}}", r"write \{stare: \{op: C2\}\}$"),
        (
            "variants={a: {enabled: true, w: 2.0}}",
            r"write \{entropy_control: \{method: stare\}, stare: \{w: 2\.0\}\}$",
        ),
        ("variants={a: {stare: {enabled: false}}}", r"write \{entropy_control: \{method: none\}\}$"),
        ("variants={a/b: {}}", "variant name 'a/b' must be letters"),
        ("only=[nope]", r"only names unknown variants \['nope'\]"),
        ("seeds=[1, 1]", "seeds must be a non-empty list of distinct integers"),
    ],
)
def test_bad_experiment_configs_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ExperimentConfig, None, [override])


def test_a_folder_refuses_other_settings_but_takes_new_variants(tmp_path):
    """Finished runs are reused, so a second command on the folder must have made them the same way."""
    folder = [f"run.output_dir={tmp_path}", "run.name=x"]
    first = load_config(
        ExperimentConfig, None, [*folder, "variants={a: {entropy_control: {method: none}}}", "seeds=[0]"]
    )
    experiment.save_config(first, tmp_path / "x")
    saved = tmp_path / "x" / "config.yaml"
    other_seeds = load_config(
        ExperimentConfig, None, [*folder, "variants={b: {stare: {w: 2.0}}}", "seeds=[5]", "run.threads=2"]
    )
    merged = experiment.check_same_experiment(other_seeds, saved)
    assert set(merged.variants) == {"a", "b"} and merged.seeds == [0]
    for change in ("rl.steps=7", "tasks.test_problems=9", "variants={a: {entropy_control: {method: stare}}}"):
        other = load_config(ExperimentConfig, None, [*folder, change])
        key = change.split("=")[0].replace("variants", "variants.a")
        with pytest.raises(ConfigError, match=rf"holds an experiment made with other settings \({key} differ"):
            experiment.check_same_experiment(other, saved)


@pytest.mark.slow
def test_a_results_folder_carries_a_sweep_to_a_new_output_folder(tmp_path, capsys):
    """A sweep kept in results_dir outlives its output folder: a fresh folder restores its data, SFT model and
    runs instead of making them again, and a new run starts from the kept SFT weights."""
    results = tmp_path / "kept"
    common = [
        *TINY,
        "run.name=sweep",
        f"results_dir={results}",
        "variants={grpo-ds: {entropy_control: {method: none}}}",
        "seeds=[0]",
        "coverage_eval.k=3",
        "coverage_eval.max_problems=2",
    ]
    first = experiment.run(load_config(ExperimentConfig, None, [f"run.output_dir={tmp_path / 'a'}", *common]))
    kept = {p.relative_to(results).as_posix() for p in results.rglob("*") if p.is_file()}
    assert {"config.yaml", "data/test.jsonl", "sft/model/model.safetensors", "eval-sft/results.json"} <= kept
    assert {"rl-grpo-ds-s0/metrics.jsonl", "eval-grpo-ds-s0/results.json", "eval-grpo-ds-s0/test.json"} <= kept
    # The coverage evaluation of every model: its own k and problems, kept with the run.
    assert {"eval-sft-k3/results.json", "eval-grpo-ds-s0-k3/results.json", "eval-grpo-ds-s0-k3/test.json"} <= kept
    (coverage,) = json.loads((results / "eval-grpo-ds-s0-k3" / "results.json").read_text())
    assert (coverage["samples_per_problem"], coverage["problems"]) == (3, 2)
    assert "Coverage: pass@3 on the first 2 test problems" in (first / "report.md").read_text()
    assert not any("checkpoints" in p or "trainer_state" in p for p in kept)
    report = json.loads((first / "report.json").read_text())
    sft_weights = (results / "sft" / "model" / "model.safetensors").read_bytes()

    # A new output folder: everything is restored, nothing is made, trained or evaluated; the same report.
    capsys.readouterr()
    second = tmp_path / "b"
    assert main(["experiment", f"run.output_dir={second}", *common]) == 0
    out = capsys.readouterr().out
    restored = ("data", "SFT model", "sft", "sft-k3", "grpo-ds-s0", "grpo-ds-s0-k3")
    assert all(f"experiment: {n} restored" in out for n in restored)
    assert not any(step in out for step in ("synthetic tasks", "experiment: SFT\n", "experiment: RL", "evaluating"))
    assert json.loads((second / "sweep" / "report.json").read_text()) == report

    # A new seed is trained from the kept SFT weights (SFT is not made again) and joins the results folder.
    assert main(["experiment", f"run.output_dir={second}", *common, "seeds=[0, 2]"]) == 0
    out = capsys.readouterr().out
    assert "experiment: RL grpo-ds-s2" in out and "RL grpo-ds-s0" not in out and "experiment: SFT\n" not in out
    start = load_config(RLConfig, second / "sweep" / "rl-grpo-ds-s2" / "config.yaml").model.path
    assert (Path(start) / "model.safetensors").read_bytes() == sft_weights
    assert (results / "eval-grpo-ds-s2" / "results.json").exists()

    # A run whose coverage evaluation is missing where no checkpoint was kept is not trained again: an error.
    for folder in (results, second / "sweep"):
        shutil.rmtree(folder / "eval-grpo-ds-s0-k3")
    with pytest.raises(ConfigError, match=r"eval-grpo-ds-s0-k3 is not, and .*rl-grpo-ds-s0 has no final checkpoint"):
        experiment.run(load_config(ExperimentConfig, None, [f"run.output_dir={second}", *common]))

    # The results folder's settings bind like the output folder's.
    with pytest.raises(ConfigError, match=r"holds an experiment made with other settings \(rl.steps differ"):
        experiment.run(
            load_config(ExperimentConfig, None, [f"run.output_dir={tmp_path / 'c'}", *common, "rl.steps=3"])
        )


def test_the_entropy_plot_marks_each_targets_variants_and_none_for_grpo():
    config = load_config(
        ExperimentConfig,
        None,
        [
            "rl.stare.target_entropy=0.12",
            "variants={grpo-ds: {entropy_control: {method: none}}, a: {stare: {target_entropy: 0.18}}, "
            "b: {entropy_control: {method: low_prob_reweight}, stare: {target_entropy: 0.18}}, c: {}, "
            "d: {entropy_control: {method: entropy_bonus}, entropy_bonus: {target_entropy: 0.25}}, "
            "e: {entropy_control: {method: clip_cov}}}",
        ],
    )
    everything = ["grpo-ds", "a", "b", "c", "d", "e"]
    assert report.entropy_targets(config, everything) == {0.18: ["a", "b"], 0.12: ["c"], 0.25: ["d"]}
    assert report.entropy_targets(config, ["grpo-ds", "e"]) == {}


def test_a_variant_changes_its_sections_and_keeps_the_rest_of_rl():
    config = load_config(
        ExperimentConfig,
        None,
        ["rl.stare.w=2.0", "variants={x: {entropy_control: {method: kl_cov}, kl_cov: {coef: 0.5}, stare: {op: C2}}}"],
    )
    rl = config.variant_rl("x")
    assert (rl.entropy_control.method, rl.kl_cov.coef, rl.stare.op, rl.stare.w) == ("kl_cov", 0.5, "C2", 2.0)
    assert (rl.kl_cov.ratio, rl.rollout, rl.steps) == (config.rl.kl_cov.ratio, config.rl.rollout, config.rl.steps)
    assert ExperimentConfig().variant_rl("grpo-ds").entropy_control.method == "none"
    # A value is typed as in a config file: YAML reads 1.0e9 (no exponent sign) as text, the section as a number.
    wide = load_config(ExperimentConfig, None, ["variants={x: {clip_cov: {lb: -1.0e9, ub: 1.0e9}}}"]).variant_rl("x")
    assert (wide.clip_cov.lb, wide.clip_cov.ub) == (-1e9, 1e9)
