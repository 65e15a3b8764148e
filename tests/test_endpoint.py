"""The primary endpoint of an experiment (`stare-agent lab endpoint`): paired pass@k differences by seed and by
problem, the bootstrap's interval and p-value, and Holm's adjustment."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from stare_agent.cli import main as cli
from stare_agent.lab.analysis.endpoint import endpoint
from stare_agent.lab.stats import bootstrap_test, holm, t_interval


def _eval(folder: Path, rewards: dict[str, list[float]]) -> None:
    """An evaluation folder as `stare-agent eval` writes it (the fields the endpoint reads)."""
    folder.mkdir(parents=True)
    n = len(next(iter(rewards.values())))
    report = {"name": "test", "problems": len(rewards), "samples_per_problem": n, "avg_at_k": 0.0, "pass_at": {}}
    (folder / "results.json").write_text(json.dumps([report]))
    problems = [{"problem_id": pid, "rewards": r} for pid, r in rewards.items()]
    (folder / "test.json").write_text(json.dumps({"report": report, "problems": problems}))


def _pass2(rewards: list[float]) -> float:
    """pass@2 by counting: the share of the C(n, 2) pairs of samples holding a right one."""
    n = len(rewards)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    return sum(rewards[i] == 1.0 or rewards[j] == 1.0 for i, j in pairs) / len(pairs)


ARM = {
    0: {"p1": [1, 0, 0, 0], "p2": [0, 0, 0, 0], "p3": [1, 1, 0, 0]},
    1: {"p1": [0, 0, 1, 0], "p2": [0, 1, 0, 0], "p3": [1, 1, 1, 1]},
}
BASE = {
    0: {"p1": [0, 0, 0, 0], "p2": [0, 0, 0, 0], "p3": [1, 0, 0, 0]},
    1: {"p1": [1, 0, 0, 0], "p2": [0, 0, 0, 0], "p3": [1, 1, 0, 0]},
}


@pytest.fixture
def folder(tmp_path):
    for seed in (0, 1):
        _eval(tmp_path / f"eval-arm-s{seed}-k4", {p: [float(x) for x in r] for p, r in ARM[seed].items()})
        _eval(tmp_path / f"eval-base-s{seed}-k4", {p: [float(x) for x in r] for p, r in BASE[seed].items()})
    _eval(tmp_path / "eval-arm-s2-k4", {"p1": [1.0] * 4, "p2": [1.0] * 4, "p3": [1.0] * 4})  # no baseline seed 2
    (tmp_path / "config.yaml").write_text("coverage_eval:\n  k: 4\n  max_problems: 3\n")
    return tmp_path


def test_differences_are_paired_by_seed_and_by_problem(folder):
    (c,) = endpoint(folder, [("arm", "base")], "-k4", k=2)
    assert c.seeds == [0, 1] and c.problems == 3 and c.k == 2  # seed 2 has no baseline: left out
    arm = {s: {p: _pass2(r) for p, r in ARM[s].items()} for s in (0, 1)}
    base = {s: {p: _pass2(r) for p, r in BASE[s].items()} for s in (0, 1)}
    per_seed = [statistics.fmean(arm[s].values()) - statistics.fmean(base[s].values()) for s in (0, 1)]
    assert c.per_seed == pytest.approx(per_seed)
    mean, low, high = t_interval(per_seed)
    assert (c.seed_mean, c.seed_low, c.seed_high) == pytest.approx((mean, low, high))
    per_problem = [statistics.fmean(arm[s][p] - base[s][p] for s in (0, 1)) for p in ("p1", "p2", "p3")]
    assert (c.boot_low, c.boot_high, c.p) == pytest.approx(bootstrap_test(per_problem))
    assert c.arm_pass == pytest.approx(statistics.fmean(statistics.fmean(arm[s].values()) for s in (0, 1)))


def test_the_command_reads_the_coverage_suffix_and_adjusts_over_comparisons(folder, tmp_path, capsys):
    out = tmp_path / "endpoint.json"
    assert (
        cli(["lab", "endpoint", str(folder), "--compare", "arm:base", "--compare", "base:arm", "--json", str(out)])
        == 0
    )
    rows = json.loads(out.read_text())
    assert [r["k"] for r in rows] == [4, 4]  # the samples per problem by default
    assert rows[0]["per_seed"] == pytest.approx([-d for d in rows[1]["per_seed"]])
    assert [r["p_holm"] for r in rows] == pytest.approx(holm([r["p"] for r in rows]))
    assert "| arm | base | 2 | 3 |" in capsys.readouterr().out


def test_a_comparison_without_common_seeds_or_problems_is_an_error(folder):
    with pytest.raises(SystemExit, match="no seed has finished evaluations of both arm and other"):
        endpoint(folder, [("arm", "other")], "-k4", k=None)
    _eval(folder / "eval-base-s2-k4", {"p1": [0.0] * 4, "p9": [0.0] * 4, "p3": [0.0] * 4})
    with pytest.raises(SystemExit, match="seed 2 of arm or base was evaluated on other problems"):
        endpoint(folder, [("arm", "base")], "-k4", k=None)


def test_holm_multiplies_by_the_rank_and_keeps_the_order():
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert holm([0.2]) == [0.2]


def test_the_bootstrap_p_value_is_two_sided_and_matches_the_interval():
    low, high, p = bootstrap_test([0.1, 0.2, 0.05, 0.3] * 8)
    assert 0 < low < high and p == 0.0
    low, high, p = bootstrap_test([-0.1, -0.2, -0.05, -0.3] * 8)
    assert low < high < 0 and p == 0.0
    assert bootstrap_test([0.0] * 10)[2] == 1.0
    low, high, p = bootstrap_test([1.0, -1.0] * 20)
    assert low < 0 < high and p > 0.5
    # one side: twice the share of resampled means at or below 0
    low, high, p = bootstrap_test([1.0, -0.9, 0.3, -0.2, 0.1] * 3)
    assert 0.05 < p < 1 and low < 0 < high and math.isfinite(p)


@pytest.mark.slow
def test_the_calibration_measures_each_arm_on_one_first_batch(tmp_path):
    """`stare-agent lab calibrate_control` on a tiny experiment: every arm's selection on the same batch, with
    the counts its rule gives (Clip-Cov's candidates are its band, KL-Cov takes max(int(ratio N), 1))."""
    from tiny import TINY_QUICKSTART  # tests/tiny.py

    from stare_agent.config import load_config
    from stare_agent.lab.analysis.calibrate_control import calibrate
    from stare_agent.lab.experiment import ExperimentConfig

    variants = (
        "{grpo-ds: {entropy_control: {method: none}}, "
        "clip: {entropy_control: {method: clip_cov}, clip_cov: {ratio: 0.1, lb: -1.0e9, ub: 1.0e9}}, "
        "kl: {entropy_control: {method: kl_cov}, kl_cov: {ratio: 0.1}}, "
        "fork: {entropy_control: {method: forking_tokens}, forking_tokens: {top_ratio: 0.25}}, "
        "stare: {entropy_control: {method: stare}, stare: {target_entropy: 0.0, top_ratio: 0.5}}, "
        "bonus: {entropy_control: {method: entropy_bonus}, entropy_bonus: {target_entropy: 0.0, delta: 0.002}}}"
    )
    overrides = [
        *TINY_QUICKSTART,
        "rl.rollout.prompts_per_step=4",
        f"run.output_dir={tmp_path}",
        f"variants={variants}",
    ]
    result = calibrate(load_config(ExperimentConfig, None, overrides), seed=0)
    cov = result["covariance"]
    n = cov["action_tokens"]
    values = [cov["min"], *cov["quantiles"].values(), cov["max"]]
    assert n > 0 and values == sorted(values)
    arms = {name: row["as_configured"] for name, row in result["variants"].items()}
    assert "selected_share" not in arms["grpo-ds"]
    assert arms["kl"]["selected_tokens"] == max(int(0.1 * n), 1)
    assert arms["clip"]["candidates"] == n  # a band holding every term: no token is clipped at update 0
    assert arms["clip"]["selected_tokens"] == max(int(0.1 * n), 1)
    assert arms["fork"]["selected_share"] == pytest.approx(math.ceil(0.25 * n) / n)
    # The gates: off at a target of 0, on once the target is above the batch's entropy (STARE's reweighting needs
    # positive advantages, which this tiny model rarely earns; the bonus's coefficient moves either way).
    assert arms["stare"]["selected_share"] == 0.0 and "gate_on" in result["variants"]["stare"]
    assert arms["bonus"]["coef"] == 0.0
    assert result["variants"]["bonus"]["gate_on"]["coef"] == pytest.approx(0.002)
