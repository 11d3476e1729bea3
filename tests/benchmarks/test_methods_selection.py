"""The selection rules of benchmarks/methods/selection.py on hand-made runs: each rule's score, the choice over
seeds (runs the held-out verdict does not pass left out), and rank correlations with gold."""

from __future__ import annotations

import math

import pytest

from benchmarks.methods.selection import (KL_BUDGET, Run, choose, correlations, final_policy_stage, gold_targets,
                                          rule_scores)

BEST_OF_N = [{"n": 1, "kl": 0.0, "heldout": 1.0, "gold": 1.0}, {"n": 16, "kl": 2.0, "heldout": 2.0, "gold": 3.0}]


def run(setting: str, seed: int, heldout: float, kl: float, gold: float, eligible: bool = True) -> Run:
    iterations = [{"heldout": heldout - 0.5, "proxy": 0.0, "kl": kl / 2, "gold": gold},
                  {"heldout": heldout, "proxy": 0.0, "kl": kl, "gold": gold}]
    return Run(1, f"{setting}-{seed}", seed, setting, eligible, f"a-{setting}-{seed}", iterations, BEST_OF_N)


def test_rule_scores_from_the_judge_and_kl_by_hand():
    """Held-out 2.5 at KL 4: the best-of-N curve (slope 0.5 per nat) continued is 3.0 there -> B = -0.5; held at
    best-of-16 -> 0.5; C = (2.5 - 1.0) / sqrt(4) = 0.75; D = the best iteration, 2.5. Gold 2.0 against the curve's
    gold 5.0 at KL 4 (slope 1): gap -3.0; held at best-of-16's 3.0: -1.0."""
    scores = rule_scores(run("a", 0, heldout=2.5, kl=4.0, gold=2.0))
    assert scores == pytest.approx({"A_final": 2.5, "B_frontier_gain": -0.5, "B_frontier_gain_clamped": 0.5,
                                    "C_efficiency": 0.75, "D_best_iteration": 2.5, "E_kl_budget": 2.5,
                                    "ref_lowest_kl": -4.0})
    assert gold_targets(run("a", 0, heldout=2.5, kl=4.0, gold=2.0)) == pytest.approx(
        {"gold": 2.0, "gold_gap": -3.0, "gold_gap_clamped": -1.0})


def test_a_rule_chooses_by_its_mean_over_eligible_runs_and_is_correlated_with_gold():
    """Setting high: held-out 2.6 at KL 4 (B -0.4). Setting low: held-out 2.0 at KL 1.5 (B 0.25). A picks high, B low;
    an ineligible run of low with a huge held-out is left out of the choice."""
    runs = [run("high", s, 2.6, 4.0, 1.0) for s in (0, 1)] + [run("low", s, 2.0, 1.5, 2.0) for s in (0, 1)]
    runs.append(run("low", 2, 9.0, 1.5, 2.0, eligible=False))
    assert choose(runs, "A_final")["chosen"] == "high"
    b = choose(runs, "B_frontier_gain")
    assert b["chosen"] == "low" and b["mean_score"]["low"] == pytest.approx(0.25)
    rho = correlations(runs[:4])
    assert rho["B_frontier_gain"]["gold"]["pooled"] == pytest.approx(1.0)
    assert rho["A_final"]["gold"]["pooled"] == pytest.approx(-1.0)
    assert math.isclose(rho["B_frontier_gain"]["gold"]["mean_per_seed"], 1.0)


def test_rule_e_chooses_the_best_heldout_mean_among_settings_within_best_of_64s_kl():
    """Budget log 64 - 63/64 = 3.1745 nats. far: held-out 3.0 at KL 3.0 and 4.0 (mean 3.5: out, though one run is
    within). near: 2.0 at KL 3.0 and 3.3 (mean 3.15: in, though one run is past). low: 1.5 at KL 1.0. A picks far,
    E near."""
    assert math.isclose(KL_BUDGET, 3.17451, abs_tol=1e-5)
    runs = [run("far", 0, 3.0, 3.0, 1.0), run("far", 1, 3.0, 4.0, 1.0), run("near", 0, 2.0, 3.0, 2.0),
            run("near", 1, 2.0, 3.3, 2.0), run("low", 0, 1.5, 1.0, 3.0), run("low", 1, 1.5, 1.0, 3.0)]
    assert choose(runs, "A_final")["chosen"] == "far"
    e = choose(runs, "E_kl_budget")
    assert e["chosen"] == "near" and e["over_kl_budget"] == ["far"] and e["mean_score"]["far"] == pytest.approx(3.0)


def test_the_final_policy_is_the_last_iteration_or_dpos_one():
    """Iterations are compared as numbers (10 after 9), and an offline DPO run's one policy is its 'dpo' stage."""
    ppo = {"sft": {}, "ppo-iteration-9": {}, "ppo-iteration-10": {}, "heldout-eval-10": {}}
    assert final_policy_stage(ppo) == "ppo-iteration-10"
    assert final_policy_stage({"sft": {}, "dpo": {}, "heldout-eval-1": {}}) == "dpo"
