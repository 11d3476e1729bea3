"""Token-budget micro-batching (rlhf_core/models/budget.py) on hand-written lengths, and its config refusals."""

from __future__ import annotations

import itertools

import pytest
import torch

from rlhf_core.config import GenerationConfig, PPOConfig, RewardTrainingConfig
from rlhf_core.models.budget import (
    chunk_cost,
    pair_lengths,
    row_chunks,
    split_to,
    token_chunks,
)


def as_lists(chunks: list[range]) -> list[list[int]]:
    return [list(c) for c in chunks]


def test_without_a_budget_chunks_are_the_row_micro_batches() -> None:
    assert as_lists(token_chunks([5, 1, 9, 2, 7], max_rows=2)) == [[0, 1], [2, 3], [4]]
    assert token_chunks([], max_rows=3, max_tokens=10) == []


def test_padded_cost_is_rows_times_the_longest_row() -> None:
    # [4, 4] -> 8; adding 6 would be 3 x 6 = 18 > 12; [6, 2] -> 12; adding 3: 3 x 6 = 18; [3, 3, 3, 3] -> 12.
    lengths = [4, 4, 6, 2, 3, 3, 3, 3]
    assert as_lists(token_chunks(lengths, max_rows=8, max_tokens=12)) == [[0, 1], [2, 3], [4, 5, 6, 7]]
    assert chunk_cost([6, 2], packed=False) == 12


def test_packed_cost_is_the_sum_of_real_tokens() -> None:
    lengths = [4, 4, 6, 2, 3, 3, 3, 3]
    # sums: 4+4 = 8 (+6 = 14 > 12); 6+2+3 = 11 (+3 = 14); 3+3+3 = 9.
    assert as_lists(token_chunks(lengths, max_rows=8, max_tokens=12, packed=True)) == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert chunk_cost([6, 2, 3], packed=True) == 11


def test_row_limit_holds_under_a_loose_budget() -> None:
    assert as_lists(token_chunks([1] * 7, max_rows=3, max_tokens=1000)) == [[0, 1, 2], [3, 4, 5], [6]]


def test_a_row_longer_than_the_budget_goes_alone_and_is_never_dropped() -> None:
    chunks = as_lists(token_chunks([2, 50, 2, 2], max_rows=4, max_tokens=10))
    assert chunks == [[0], [1], [2, 3]]
    assert [i for c in chunks for i in c] == [0, 1, 2, 3]  # every row once, in order


@pytest.mark.parametrize("packed", [False, True])
def test_every_chunk_fits_and_rows_keep_their_order(packed: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (200,), generator=generator).tolist()
    chunks = token_chunks(lengths, max_rows=16, max_tokens=64, packed=packed)
    assert [i for c in chunks for i in c] == list(range(200))
    for c in chunks:
        rows = [lengths[i] for i in c]
        assert len(rows) <= 16 and (len(rows) == 1 or chunk_cost(rows, packed) <= 64)
    # greedy: no chunk could have taken the next row
    for c, following in itertools.pairwise(chunks):
        grown = [lengths[i] for i in c] + [lengths[following.start]]
        assert len(grown) > 16 or chunk_cost(grown, packed) > 64


def test_pair_lengths_count_both_sides_of_one_forward() -> None:
    chosen, rejected = [[1, 2, 3], [1]], [[1], [1, 2, 3, 4, 5]]
    assert pair_lengths(chosen, rejected, packed=True) == [4, 6]
    # padded: 2 rows per pair, as wide as the longer side
    assert pair_lengths(chosen, rejected, packed=False) == [6, 10]
    assert chunk_cost(pair_lengths(chosen, rejected, packed=False), packed=False) == 4 * 5


def test_row_chunks_count_real_tokens_only_when_packed() -> None:
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]])
    assert as_lists(row_chunks(mask, max_rows=4, max_tokens=8, packed=True)) == [[0, 1], [2, 3]]
    assert as_lists(row_chunks(mask, max_rows=4, max_tokens=8, packed=False)) == [[0, 1], [2, 3]]
    assert as_lists(row_chunks(mask, max_rows=4, max_tokens=6, packed=True)) == [[0], [1, 2], [3]]
    assert as_lists(row_chunks(mask, max_rows=4, max_tokens=6, packed=False)) == [[0], [1], [2], [3]]


def test_split_to_reaches_the_count_in_order_or_stops_at_single_rows() -> None:
    split = as_lists(split_to([range(5), range(5, 6)], 4))
    assert [i for c in split for i in c] == list(range(6)) and len(split) == 4
    assert as_lists(split_to([range(2)], 5)) == [[0], [1]]
    assert as_lists(split_to([range(3)], 1)) == [[0, 1, 2]]


def test_reward_budget_below_one_pair_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"max_tokens_per_forward=100 .*2 x max_length=128"):
        RewardTrainingConfig(max_length=64, max_tokens_per_forward=100)
    assert RewardTrainingConfig(max_length=64, max_tokens_per_forward=128).max_tokens_per_forward == 128


def test_ppo_budget_below_one_rollout_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"ppo.max_tokens_per_forward=16 .*max_new_tokens=16"):
        PPOConfig(max_tokens_per_forward=16, generation=GenerationConfig(max_new_tokens=16))
    assert PPOConfig(max_tokens_per_forward=17, generation=GenerationConfig(max_new_tokens=16)).max_tokens_per_forward


def test_every_rank_runs_as_many_micro_batches_and_counts_its_share_once() -> None:
    """ZeRO-3's training forwards are collective: a rank whose share needs fewer micro-batches splits further, and
    one that cannot repeats a pair that is not counted."""
    from types import SimpleNamespace

    from rlhf_core.training.reward_training import EncodedPairs, _micro_batches

    lengths = [10, 10, 10, 10, 2, 2, 2]  # rank 0 gets 4 long pairs, rank 1 three short ones
    data = EncodedPairs([[1] * n for n in lengths], [[1] * n for n in lengths], [0.0] * 7, 0)
    config = RewardTrainingConfig(batch_size=7, max_length=10, max_tokens_per_forward=20)
    plans = [_micro_batches(data, list(range(7)), SimpleNamespace(rank=r, world_size=2), config, True)
             for r in range(2)]
    assert [len(p) for p in plans] == [4, 4]
    assert plans[0] == [([0], True), ([1], True), ([2], True), ([3], True)]
    assert plans[1] == [([4], True), ([5], True), ([6], True), ([4], False)]
    one = _micro_batches(data, list(range(7)), SimpleNamespace(rank=0, world_size=1), config, True)
    assert [part for part, _ in one] == [[0], [1], [2], [3], [4, 5, 6]]
