"""Reward scoring at the last real token, a reward model with a different tokenizer, and both value models."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2ForSequenceClassification, PreTrainedTokenizerFast

from rlhf_core.config import GenerationConfig
from rlhf_core.models.roles import (Critic, ValueHead, critic_forward, load_policy, load_reward_model, make_reference,
                                    sequence_scores)
from rlhf_core.models.scoring import RewardModelScorer, TextRewardFunction, WeightedSum
from rlhf_core.models.sequences import left_pad
from rlhf_core.models.text import encode_pair, right_pad
from rlhf_core.ppo.masking import last_token_index
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.rollout import generate
from tests.tiny_models import SPECIALS, WORDS, gpt2_config


def rollout_from(policy_dir, tokenizer, n=6):
    policy = load_policy(str(policy_dir))
    prompts = [tokenizer("q cat sat", add_special_tokens=False)["input_ids"], tokenizer("q dog", add_special_tokens=False)["input_ids"]] * (n // 2)
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    return generate(policy, ids, mask, GenerationConfig(max_new_tokens=6), [tokenizer.eos_token_id],
                    tokenizer.pad_token_id, torch.Generator().manual_seed(0))


def test_score_is_read_at_the_last_real_token_whatever_the_padding(tiny_reward_dir, tokenizer):
    rm = load_reward_model(str(tiny_reward_dir))
    seq = encode_pair(tokenizer, "q cat", " good dog")
    alone = sequence_scores(rm, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))
    right_ids, right_mask = right_pad([seq, seq + seq], tokenizer.pad_token_id)
    left_ids, left_mask = left_pad([seq, seq + seq], tokenizer.pad_token_id)
    assert torch.allclose(sequence_scores(rm, right_ids, right_mask)[0], alone[0], atol=1e-5)
    assert torch.allclose(sequence_scores(rm, left_ids, left_mask.long())[0], alone[0], atol=1e-5)
    # Reading at the first pad (the TRL #3750 mistake) would give a different number.
    wrong = sequence_scores(rm, right_ids[:1, : len(seq) + 1], torch.ones(1, len(seq) + 1, dtype=torch.long))
    assert not torch.allclose(wrong, alone)


def shuffled_tokenizer() -> PreTrainedTokenizerFast:
    """Same words, different ids: a reward model with its own tokenizer."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(reversed(WORDS)))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def test_reward_model_with_a_different_tokenizer_scores_the_same_text(tiny_policy_dir, tokenizer, tmp_path):
    rollout = rollout_from(tiny_policy_dir, tokenizer)
    other = shuffled_tokenizer()
    torch.manual_seed(5)
    rm = GPT2ForSequenceClassification(gpt2_config(len(other), num_labels=1)).eval()
    scores = RewardModelScorer(rm, tokenizer, other)(rollout)
    assert RewardModelScorer(rm, tokenizer, other).retokenize
    # Reference: score each decoded text directly with the RM's own tokenizer.
    for row in range(rollout.query_ids.shape[0]):
        prompt = tokenizer.decode(rollout.query_ids[row][rollout.query_mask[row]], skip_special_tokens=True)
        reply = tokenizer.decode(rollout.response_ids[row][rollout.response_mask[row]], skip_special_tokens=True)
        ids = other(prompt, add_special_tokens=False)["input_ids"] + other(reply, add_special_tokens=False)["input_ids"]
        if rollout.stopped[row]:
            ids.append(other.eos_token_id)
        expected = sequence_scores(rm, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
        assert torch.allclose(scores[row], expected[0], atol=1e-5)


def test_rule_reward_and_weighted_sum(tiny_policy_dir, tokenizer):
    rollout = rollout_from(tiny_policy_dir, tokenizer)
    words = TextRewardFunction(lambda prompts, replies: [len(r.split()) for r in replies], tokenizer)
    dogs = TextRewardFunction(lambda prompts, replies: [float("dog" in p) for p in prompts], tokenizer)
    combined = WeightedSum([(words, 0.5), (dogs, 10.0)])(rollout)
    expected = 0.5 * words(rollout) + 10.0 * torch.tensor([0.0, 1.0] * 3)
    assert torch.allclose(combined, expected)


def test_critic_initialised_from_reward_model_reproduces_its_score_at_the_last_token(tiny_policy_dir, tiny_reward_dir, tokenizer):
    rollout = rollout_from(tiny_policy_dir, tokenizer)
    rm = load_reward_model(str(tiny_reward_dir))
    critic = Critic(rm)
    values = critic_forward(critic, rollout.input_ids, rollout.attention_mask, rollout.query_ids.shape[1])
    assert values.shape == rollout.response_ids.shape
    # On every position the critic applies the RM's own head, so at the last real token it IS the RM score.
    full = critic(rollout.input_ids, rollout.attention_mask)  # (B, T)
    last = last_token_index(rollout.attention_mask.bool())
    rm_scores = sequence_scores(rm, rollout.input_ids, rollout.attention_mask)
    assert torch.allclose(full.gather(1, last.unsqueeze(1)).squeeze(1), rm_scores, atol=1e-5)
    assert all(p.requires_grad for p in critic.parameters())
    # The critic trains a copy: changing it leaves the frozen reward model untouched.
    critic.model.score.weight.data.add_(1.0)
    assert not torch.allclose(critic.model.score.weight, rm.score.weight)


def test_pad_equal_to_eos_keeps_the_stop_token_and_its_score(tiny_policy_dir, tiny_reward_dir, tokenizer):
    """pad == eos (GPT-2 and Llama checkpoints ship no pad; the fallback pads with eos): every batch carries its mask,
    so the same samples give the same response masks (the stop token kept, what follows dropped) and the same
    scores as with a distinct pad id."""
    policy = load_policy(str(tiny_policy_dir))
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("q cat sat", "q dog", "q a big red box")]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rollouts = []
    for pad_id in (pad, eos):
        ids, mask = left_pad(prompts * 6, pad_id)
        rollouts.append(generate(policy, ids, mask, GenerationConfig(max_new_tokens=30), [eos], pad_id,
                                 torch.Generator().manual_seed(0)))
    distinct, shared = rollouts
    assert distinct.stopped.any() and (~distinct.stopped).any()  # both kinds of rows are tested
    assert torch.equal(distinct.response_mask, shared.response_mask)
    assert torch.equal(distinct.stopped, shared.stopped)
    real = distinct.response_mask
    assert torch.equal(distinct.response_ids[real], shared.response_ids[real])
    stops = shared.response_ids[real] == eos
    assert int(stops.sum()) == int(shared.stopped.sum())  # exactly one (kept) stop token per stopped row
    rm = load_reward_model(str(tiny_reward_dir))
    assert torch.allclose(RewardModelScorer(rm, tokenizer)(distinct), RewardModelScorer(rm, tokenizer)(shared),
                          atol=1e-5)
    PPOModels(policy, make_reference(policy), lambda r: None, (eos,), eos, value_head=ValueHead(32))  # accepted
