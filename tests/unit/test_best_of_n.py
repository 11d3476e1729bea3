"""Best-of-n selection on hand-written scores, its nested-subset monotonicity, the analytic KL, and candidate
sampling on a tiny GPT-2 (row order, seeding, scoring shapes)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GPT2LMHeadModel

from rlhf_core.config import GenerationConfig
from rlhf_core.evaluation.best_of_n import (Candidates, best_of_n_curve, best_of_n_indices, best_of_n_kl, check_ns,
                                            sample_candidates, score_candidates, take)
from rlhf_core.evaluation.metrics import frontier_at
from rlhf_core.models.scoring import TextRewardFunction, decode_rollout
from tests.tiny_models import gpt2_config, word_tokenizer


def _loop_indices(scores: torch.Tensor, n: int) -> list[int]:
    """Reference: first index of the largest of the first n scores, prompt by prompt."""
    out = []
    for row in scores.tolist():
        best = 0
        for i in range(1, n):
            if row[i] > row[best]:
                best = i
        out.append(best)
    return out


def test_indices_by_hand_on_a_2x4_tensor() -> None:
    scores = torch.tensor([[0.1, 0.5, 0.3, 0.9],
                           [0.7, 0.2, 0.8, 0.8]])
    chosen = best_of_n_indices(scores, [1, 2, 3, 4])
    assert chosen[1].tolist() == [0, 0]  # n=1: always the first sample
    assert chosen[2].tolist() == [1, 0]  # best of (0.1, 0.5) and of (0.7, 0.2)
    assert chosen[3].tolist() == [1, 2]  # 0.3 < 0.5; 0.8 > 0.7
    assert chosen[4].tolist() == [3, 2]  # 0.9 wins; the tie 0.8 / 0.8 goes to the earlier sample
    assert take(scores, chosen[4]).tolist() == pytest.approx([0.9, 0.8])


def test_indices_match_a_loop_and_ns_are_sorted_and_deduplicated() -> None:
    scores = torch.randn(7, 16, generator=torch.Generator().manual_seed(0)).round(decimals=1)  # ties happen
    chosen = best_of_n_indices(scores, [16, 4, 1, 4, 8, 2])
    assert list(chosen) == [1, 2, 4, 8, 16]
    for n, index in chosen.items():
        assert index.tolist() == _loop_indices(scores, n)


def test_proxy_mean_of_best_of_n_never_falls_with_n() -> None:
    proxy = torch.randn(50, 16, generator=torch.Generator().manual_seed(1))
    other = torch.randn(50, 16, generator=torch.Generator().manual_seed(2))
    _, points = best_of_n_curve(proxy, {"proxy": proxy, "other": other}, (1, 2, 4, 8, 16))
    means = [p.means["proxy"] for p in points]
    assert all(a <= b for a, b in zip(means, means[1:])), means
    assert means[-1] > means[0] + 1.0  # the max of 16 normals sits ~1.8 sigma above one draw
    assert means[0] == pytest.approx(float(proxy[:, 0].mean()), abs=1e-6)  # n=1 is the plain first sample
    assert points[-1].means["other"] == pytest.approx(float(take(other, proxy.argmax(dim=1)).mean()), abs=1e-6)


def test_analytic_kl_of_each_point() -> None:
    _, points = best_of_n_curve(torch.zeros(2, 16), {}, (1, 2, 4, 8, 16))
    expected = [0.0, 0.19314718, 0.63629436, 1.20444154, 1.83508872]  # log n - (n - 1) / n
    assert [p.kl for p in points] == pytest.approx(expected, abs=1e-7)
    assert [p.n for p in points] == [1, 2, 4, 8, 16]
    assert best_of_n_kl(16) == pytest.approx(math.log(16) - 15 / 16)


def test_bad_sizes_and_shapes_fail_with_the_reason() -> None:
    with pytest.raises(ValueError, match="<= 4"):
        best_of_n_indices(torch.zeros(2, 4), [1, 8])
    with pytest.raises(ValueError, match=">= 1"):
        check_ns([0, 2])
    with pytest.raises(ValueError, match="at least one n"):
        check_ns([])
    with pytest.raises(ValueError, match=r"\(prompts, samples\)"):
        best_of_n_indices(torch.zeros(4), [1])
    with pytest.raises(ValueError, match="judge 'gold'"):
        best_of_n_curve(torch.zeros(2, 4), {"gold": torch.zeros(2, 3)}, [1])


def test_candidates_grid_is_prompt_major() -> None:
    candidates = Candidates(3, tuple("abcdef"), (1,) * 6, (True,) * 6, ())
    assert candidates.n_prompts == 2
    assert candidates.grid(range(6)).tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="5 values for 6 candidates"):
        candidates.grid(range(5))


def test_sample_candidates_repeats_each_prompt_in_a_row_and_is_seeded() -> None:
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(gpt2_config(len(tokenizer))).eval()
    prompts = ["hello the cat", "q", "why the dog ran"]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    generation = GenerationConfig(max_new_tokens=4, batch_size=5)  # 5 rows a batch: batches cut across prompts
    candidates = sample_candidates(policy, tokenizer, prompt_ids, 4, generation, seed=3)
    assert len(candidates.replies) == len(candidates.lengths) == len(candidates.stopped) == 12
    assert len(candidates.rollouts) == 3  # 12 rows in batches of 5
    queried = [text for r in candidates.rollouts for text in decode_rollout(r, tokenizer)[0]]
    assert queried == [p for p in prompts for _ in range(4)]
    assert len(set(candidates.replies)) > 3  # real sampling, not one reply per prompt
    again = sample_candidates(policy, tokenizer, prompt_ids, 4, generation, seed=3)
    assert again.replies == candidates.replies
    assert sample_candidates(policy, tokenizer, prompt_ids, 4, generation, seed=4).replies != candidates.replies

    words = TextRewardFunction(lambda _, replies: [len(r.split()) for r in replies], tokenizer)
    scores = score_candidates(candidates, {"words": words})
    assert scores["words"].shape == (3, 4)
    assert scores["words"].flatten().tolist() == [len(r.split()) for r in candidates.replies]


def test_frontier_interpolates_between_best_of_n_points_and_continues_past_the_last():
    """Points (KL, score) (0, 1.0), (1, 2.0), (2, 2.5), given out of order: 1.5 at KL 0.5 and 2.25 at 1.5 (linear);
    at KL 3 the last segment's slope 0.5 continues to 3.0, or the curve holds at 2.5; below the first point, 1.0."""
    points = [(2.0, 2.5), (0.0, 1.0), (1.0, 2.0)]
    assert frontier_at(points, 0.5) == pytest.approx(1.5)
    assert frontier_at(points, 1.5) == pytest.approx(2.25)
    assert frontier_at(points, 2.0) == pytest.approx(2.5)
    assert frontier_at(points, 3.0) == pytest.approx(3.0)
    assert frontier_at(points, 3.0, extrapolate=False) == pytest.approx(2.5)
    assert frontier_at(points, -1.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="at least two points"):
        frontier_at([(0.0, 1.0)], 0.5)
