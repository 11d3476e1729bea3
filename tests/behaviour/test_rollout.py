"""Generation with a KV cache and left padding agrees with full forward passes; stops are handled."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import GPT2LMHeadModel

from rlhf_core.config import GenerationConfig
from rlhf_core.models.roles import policy_forward
from rlhf_core.models.sequences import left_pad
from rlhf_core.training.rollout import filter_logits, generate, generate_in_batches
from tests.model_families import DECODERS, POLICY_CLASSES, config
from tests.tiny_models import gpt2_config

PAD, BOS, EOS = 0, 1, 2


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(gpt2_config(24)).eval()


def test_sampling_logprobs_match_full_forward_recomputation_with_temperature():
    policy = model()
    ids, mask = left_pad([[BOS, 5, 6, 7], [BOS, 9], [BOS, 3, 4]], PAD)
    rollout = generate(policy, ids, mask, GenerationConfig(max_new_tokens=10, temperature=0.7), [EOS], PAD,
                       torch.Generator().manual_seed(0))
    recomputed = policy_forward(policy, rollout.input_ids, rollout.attention_mask, ids.shape[1], 0.7).logprobs
    mask_r = rollout.response_mask
    assert torch.allclose(recomputed[mask_r], rollout.logprobs[mask_r], atol=1e-5)
    # Recomputing at the wrong temperature gives a different ratio (why every recomputation passes it).
    wrong = policy_forward(policy, rollout.input_ids, rollout.attention_mask, ids.shape[1], 1.0).logprobs
    assert (wrong[mask_r] - rollout.logprobs[mask_r]).abs().max() > 1e-2


def test_left_padding_does_not_change_a_prompts_logprobs():
    policy = model()
    alone = generate(policy, *left_pad([[BOS, 9]], PAD), GenerationConfig(max_new_tokens=6), [], PAD,
                     torch.Generator().manual_seed(3))
    ids, mask = left_pad([[BOS, 9], [BOS, 5, 6, 7, 8, 3]], PAD)
    padded_ids = torch.cat([ids, torch.cat([alone.response_ids, alone.response_ids])], dim=1)
    padded_mask = torch.cat([mask, torch.ones(2, 6, dtype=torch.bool)], dim=1).long()
    batched = policy_forward(policy, padded_ids, padded_mask, ids.shape[1], 1.0).logprobs
    assert torch.allclose(batched[0], alone.logprobs[0], atol=1e-5)


def test_stop_token_truncates_and_stays_in_the_mask():
    policy = model()
    with torch.no_grad():
        policy.lm_head.weight[EOS] += 3.0  # make the stop token likely
    ids, mask = left_pad([[BOS, 4]] * 16, PAD)
    rollout = generate(policy, ids, mask, GenerationConfig(max_new_tokens=12), [EOS], PAD,
                       torch.Generator().manual_seed(0))
    assert rollout.stopped.any()
    for row in range(16):
        real = rollout.response_ids[row][rollout.response_mask[row]].tolist()
        tail = rollout.response_ids[row][~rollout.response_mask[row]].tolist()
        if rollout.stopped[row]:
            assert real[-1] == EOS and EOS not in real[:-1]
        assert set(tail) <= {PAD}
        assert (rollout.logprobs[row][~rollout.response_mask[row]] == 0).all()


def test_top_k_and_top_p_filtering():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert torch.isinf(filter_logits(logits, 2, 1.0)[0, 2:]).all()
    assert torch.isfinite(filter_logits(logits, 2, 1.0)[0, :2]).all()
    # probs ~ [0.61, 0.22, 0.14, 0.03]: top_p 0.7 keeps the first two (mass before #3 = 0.83 > 0.7).
    kept = torch.isfinite(filter_logits(logits, 0, 0.7)[0])
    assert kept.tolist() == [True, True, False, False]


def test_same_seed_same_rollout():
    policy = model()
    ids, mask = left_pad([[BOS, 4, 5]] * 4, PAD)
    config = GenerationConfig(max_new_tokens=8, top_k=10)
    a = generate(policy, ids, mask, config, [EOS], PAD, torch.Generator().manual_seed(7))
    b = generate(policy, ids, mask, config, [EOS], PAD, torch.Generator().manual_seed(7))
    assert torch.equal(a.response_ids, b.response_ids)


def test_generation_calls_no_deprecated_transformers_api():
    """The KV cache goes by the name the installed transformers expects (``cache`` from 5.24, ``past_key_values``
    before): the old name warns now and stops working in 5.40, so a warning here is tomorrow's broken install."""
    ids, mask = left_pad([[BOS, 5, 6], [BOS, 9]], PAD)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(model(), ids, mask, GenerationConfig(max_new_tokens=4), [EOS], PAD, torch.Generator().manual_seed(0))
    deprecations = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert deprecations == []


@pytest.mark.parametrize("family", DECODERS)
def test_static_cache_gives_the_dynamic_paths_samples_and_logprobs(family: str):
    """``cache: static`` is a speed knob: the same seed gives the same replies and log-probs (float32), also
    when chunks of different prompt widths and a smaller last chunk reuse or replace the model's static cache."""
    torch.manual_seed(0)
    policy = POLICY_CLASSES[family](config(family, initializer_range=0.2)).eval()
    stop = [3]
    prompts = [[5, 6, 7], [9], [4, 8, 10, 11, 12], [6, 6], [7, 5, 9, 9, 9, 9, 9], [8]]
    runs = {}
    for cache in ("dynamic", "static"):
        settings = GenerationConfig(max_new_tokens=12, temperature=0.8, top_k=20, batch_size=4, cache=cache)
        runs[cache] = list(generate_in_batches(policy, prompts, settings, stop, 0, torch.Generator().manual_seed(5)))
    assert len(runs["static"]) == 2  # a chunk of 4 rows, then one of 2: a second cache shape
    for dynamic, static in zip(runs["dynamic"], runs["static"], strict=True):
        assert torch.equal(static.response_ids, dynamic.response_ids)
        assert torch.equal(static.response_mask, dynamic.response_mask)
        torch.testing.assert_close(static.logprobs, dynamic.logprobs, atol=1e-5, rtol=0)
    assert len({tuple(r) for chunk in runs["static"] for r in chunk.response_ids.tolist()}) > 1
    # The same shape twice in a row: the second call reuses the held cache, which must start empty.
    ids, mask = left_pad(prompts[4:], 0)
    replies = [generate(policy, ids, mask, settings, stop, 0, torch.Generator().manual_seed(9)).response_ids
               for _ in range(2)]
    assert torch.equal(replies[0], replies[1])


def test_static_cache_is_refused_in_one_line_where_transformers_lacks_it(monkeypatch: pytest.MonkeyPatch):
    import rlhf_core.config.ppo

    monkeypatch.setattr(rlhf_core.config.ppo, "STATIC_CACHE", False)
    with pytest.raises(ValueError, match="generation.cache=static needs transformers >= 5"):
        GenerationConfig(cache="static")
