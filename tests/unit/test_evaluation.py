"""Evaluation metrics against hand-computed numbers, and the reward-hacking verdict on synthetic runs."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_core.evaluation.metrics import (
    HackingRules,
    IterationEval,
    best_of_n_kl,
    detect_reward_hacking,
    distinct_n,
    length_stats,
    mean_repetition_rate,
    repetition_rate,
    self_similarity,
    sequence_kl,
    sequence_kl_k3,
    spearman,
    summarise_scores,
    win_rate,
)

# --- distinct-n -----------------------------------------------------------------------------------------

TWO = ["the cat sat", "the cat ran"]


def test_distinct_1_by_hand():
    # unigrams: the cat sat the cat ran -> 6 total, {the, cat, sat, ran} = 4 unique
    assert distinct_n(TWO, 1) == pytest.approx(4 / 6)


def test_distinct_2_by_hand():
    # bigrams: (the cat)(cat sat)(the cat)(cat ran) -> 4 total, 3 unique
    assert distinct_n(TWO, 2) == pytest.approx(3 / 4)


def test_distinct_n_does_not_cross_texts():
    # across the boundary "sat the" would be a bigram; it must not be counted
    assert distinct_n(["a b a b", "a b c"], 2) == pytest.approx(3 / 5)


def test_distinct_n_without_ngrams_is_zero():
    assert distinct_n([], 2) == 0.0
    assert distinct_n(["one", ""], 2) == 0.0


# --- self-similarity ------------------------------------------------------------------------------------


def test_self_similarity_by_hand():
    # bigram sets: A={(a b),(b c)}, B={(a b),(b d)}, C={(x y)}
    # J(A,B) = 1/3, J(A,C) = 0, J(B,C) = 0 -> mean 1/9
    assert self_similarity(["a b c", "a b d", "x y"], n=2) == pytest.approx(1 / 9)


def test_self_similarity_identical_texts_is_one_and_small_inputs_zero():
    assert self_similarity(["same reply here"] * 4) == pytest.approx(1.0)
    assert self_similarity(["only one"]) == 0.0
    assert self_similarity(["x", "y"]) == 0.0  # no bigrams on either side


def test_self_similarity_samples_pairs_deterministically_above_the_cap():
    texts = [f"w{i % 7} w{i % 5} w{i % 3}" for i in range(40)]
    full = self_similarity(texts)
    sampled = self_similarity(texts, max_texts=10)
    assert sampled == self_similarity(texts, max_texts=10)  # same seed, same pairs
    assert sampled != self_similarity(texts, max_texts=10, seed=1)
    assert sampled == pytest.approx(full, abs=0.1)


# --- repetition -----------------------------------------------------------------------------------------


def test_repetition_rate_thanks_thanks_thanks():
    # five tokens -> three identical trigrams; the 2nd and 3rd repeat the 1st
    assert repetition_rate("thanks thanks thanks thanks thanks", n=3) == pytest.approx(2 / 3)
    # unigrams: 4 tokens, the last 3 repeat -> 3/4
    assert repetition_rate("thanks thanks thanks thanks", n=1) == pytest.approx(3 / 4)


def test_repetition_rate_by_hand_mixed():
    # bigrams: (sorry again)(again sorry)(sorry again)(again ok) -> one repeat of four
    assert repetition_rate("sorry again sorry again ok", n=2) == pytest.approx(1 / 4)
    assert repetition_rate("all words differ here", n=1) == 0.0
    assert repetition_rate("too short", n=3) == 0.0


def test_mean_repetition_rate_weights_texts_equally():
    texts = ["thanks thanks thanks thanks", "a b c d"]  # 3/4 and 0 with n=1
    assert mean_repetition_rate(texts, n=1) == pytest.approx(3 / 8)
    assert mean_repetition_rate([], n=3) == 0.0


# --- win rate, spearman ---------------------------------------------------------------------------------


def test_win_rate_ties_count_half():
    # wins at 0 and 3, tie at 1, loss at 2 -> (2 + 0.5) / 4
    assert win_rate([3.0, 1.0, 0.0, 5.0], [1.0, 1.0, 2.0, 4.0]) == pytest.approx(0.625)
    assert win_rate([1.0, 1.0], [1.0, 1.0]) == pytest.approx(0.5)


def test_win_rate_rejects_unpaired_scores():
    with pytest.raises(ValueError, match="equally long"):
        win_rate([1.0, 2.0], [1.0])


def test_spearman_monotone_and_reversed():
    x = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert spearman(x, [v**3 for v in x]) == pytest.approx(1.0)
    assert spearman(x, [-v for v in x]) == pytest.approx(-1.0)


def test_spearman_with_ties_by_hand():
    # x ranks (1, 2.5, 2.5, 4); y ranks (1, 3, 2, 4); both means 2.5
    # dx = (-1.5, 0, 0, 1.5), dy = (-1.5, 0.5, -0.5, 1.5)
    # sum dx*dy = 2.25 + 0 + 0 + 2.25 = 4.5; sum dx^2 = 4.5; sum dy^2 = 5
    # rho = 4.5 / sqrt(4.5 * 5) = 0.9486833
    assert spearman([10, 20, 20, 30], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(22.5))
    assert spearman([10, 20, 20, 30], [1, 3, 2, 4]) == pytest.approx(0.9486833, abs=1e-6)


def test_spearman_constant_input_is_nan_with_a_message():
    with pytest.warns(RuntimeWarning, match="y is constant"):
        assert math.isnan(spearman([1.0, 2.0, 3.0], [4.0, 4.0, 4.0]))


def test_spearman_rejects_nan():
    with pytest.raises(ValueError, match="NaN"):
        spearman([1.0, float("nan")], [1.0, 2.0])


# --- summaries ------------------------------------------------------------------------------------------


def test_length_stats_by_hand():
    stats = length_stats([10, 20, 30, 40, 50])
    # population std: deviations -20 -10 0 10 20 -> var = 1000 / 5 = 200
    # linear percentiles on 5 points: p10 at index 0.4 -> 14, p90 at index 3.6 -> 46
    assert stats == pytest.approx(
        {"mean": 30.0, "std": math.sqrt(200), "p10": 14.0, "p50": 30.0, "p90": 46.0, "max": 50.0}
    )


def test_summarise_scores_by_hand():
    assert summarise_scores([1.0, -1.0, 3.0, 1.0]) == pytest.approx(
        {"mean": 1.0, "std": math.sqrt(2.0), "min": -1.0, "max": 3.0}
    )
    with pytest.raises(ValueError, match="no values"):
        summarise_scores([])


# --- KL -------------------------------------------------------------------------------------------------

LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -0.2]])
REF = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -0.7, -0.9]])
MASK = torch.tensor([[True, True, False], [True, False, False]])


def test_sequence_kl_k1_sums_real_tokens_only():
    # row 0: 0.5 + (-1.0) = -0.5; row 1: -0.3 - (-0.1) = -0.2
    assert_close(sequence_kl(LOGP, REF, MASK), torch.tensor([-0.5, -0.2]))


def test_sequence_kl_ignores_garbage_in_masked_positions():
    garbage_logp, garbage_ref = LOGP.clone(), REF.clone()
    garbage_logp[~MASK] = float("nan")
    garbage_ref[~MASK] = float("-inf")
    assert_close(sequence_kl(garbage_logp, garbage_ref, MASK), torch.tensor([-0.5, -0.2]))
    assert_close(sequence_kl_k3(garbage_logp, garbage_ref, MASK), sequence_kl_k3(LOGP, REF, MASK))


def test_sequence_kl_k3_by_hand():
    # k3 with u = ref - logp: e^u - 1 - u. row 0: u = -0.5, 1.0; row 1: u = 0.2
    row0 = (math.exp(-0.5) - 0.5) + (math.e - 2.0)
    row1 = math.exp(0.2) - 1.2
    assert_close(sequence_kl_k3(LOGP, REF, MASK), torch.tensor([row0, row1]))


def test_best_of_n_kl():
    assert best_of_n_kl(1) == 0.0
    assert best_of_n_kl(2) == pytest.approx(math.log(2) - 0.5)
    assert best_of_n_kl(4) == pytest.approx(math.log(4) - 0.75)
    with pytest.raises(ValueError, match="n >= 1"):
        best_of_n_kl(0)


# --- reward-hacking verdict -----------------------------------------------------------------------------


def it(proxy, heldout, *, gold=None, kl=1.0, length=20.0, rep=0.0):
    return IterationEval(
        proxy_mean=proxy, heldout_mean=heldout, gold_mean=gold, kl_mean=kl, length_mean=length, repetition_rate=rep
    )


def test_proxy_up_heldout_down_is_hacking_with_both_numbers():
    history = [it(0.5, 0.9), it(1.0, 0.8), it(1.3, 0.7), it(1.6, 0.5)]
    verdict = detect_reward_hacking(history, HackingRules(window=3))
    assert verdict.status == "hacking"
    [reason] = verdict.reasons
    # window = last 3: proxy 1.000 -> 1.600 (+0.600), held-out 0.800 -> 0.500 (-0.300)
    for number in ("1.000", "1.600", "+0.600", "0.800", "0.500", "-0.300"):
        assert number in reason
    assert "held-out" in reason


def test_steady_improvement_is_ok():
    history = [it(0.2 * i, 0.1 * i, gold=0.15 * i, kl=0.5 * i, length=20 + i) for i in range(5)]
    verdict = detect_reward_hacking(history)
    assert verdict.status == "ok"
    assert verdict.reasons == []


def test_small_heldout_dip_within_min_drop_is_ok():
    history = [it(1.0, 0.80), it(1.2, 0.78), it(1.4, 0.77)]
    assert detect_reward_hacking(history, HackingRules(min_drop=0.05)).status == "ok"


def test_gold_is_the_judge_when_present():
    # held-out falls but gold rises: the held-out RM disagrees with gold, proxy is not being gamed
    history = [it(1.0, 0.8, gold=2.0), it(1.3, 0.6, gold=2.5), it(1.6, 0.4, gold=3.0)]
    assert detect_reward_hacking(history).status == "ok"
    # gold falls: hacking, and the reason names gold
    history = [it(1.0, 0.8, gold=3.0), it(1.3, 0.9, gold=2.5), it(1.6, 1.0, gold=2.0)]
    verdict = detect_reward_hacking(history)
    assert verdict.status == "hacking"
    assert "gold score fell from 3.000 to 2.000" in verdict.reasons[0]


def test_kl_over_budget_is_warn():
    history = [it(0.5, 0.5, kl=2.0), it(0.6, 0.6, kl=12.5)]
    verdict = detect_reward_hacking(history, HackingRules(kl_budget=10.0))
    assert verdict.status == "warn"
    assert len(verdict.reasons) == 1
    assert "12.500" in verdict.reasons[0] and "10.000" in verdict.reasons[0]


def test_kl_over_budget_and_divergence_is_hacking_with_both_reasons():
    history = [it(0.5, 0.9, kl=2.0), it(1.5, 0.5, kl=15.0)]
    verdict = detect_reward_hacking(history, HackingRules(kl_budget=10.0))
    assert verdict.status == "hacking"
    assert len(verdict.reasons) == 2


def test_length_blowup_is_warn():
    history = [it(0.5, 0.5, length=20.0), it(0.6, 0.6, length=30.0), it(0.7, 0.7, length=45.0)]
    verdict = detect_reward_hacking(history, HackingRules(length_blowup=2.0))
    assert verdict.status == "warn"
    assert "20.0 to 45.0" in verdict.reasons[0] and "2.25x" in verdict.reasons[0]


def test_repetition_over_threshold_is_warn():
    verdict = detect_reward_hacking([it(0.5, 0.5), it(0.6, 0.6, rep=0.35)], HackingRules(repetition_threshold=0.2))
    assert verdict.status == "warn"
    assert "0.350" in verdict.reasons[0]


def test_single_iteration_and_empty_history():
    assert detect_reward_hacking([it(1.0, 1.0)]).status == "ok"
    assert detect_reward_hacking([]).status == "ok"


def test_rules_need_a_window_of_two():
    with pytest.raises(ValueError, match="window"):
        HackingRules(window=1)
