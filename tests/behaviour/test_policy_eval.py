"""Evaluation's generation settings and its KL of the policy's replies to the reference
(rlhf_core/evaluation/policy_eval.py), on tiny random models."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2LMHeadModel

from rlhf_core.config import GenerationConfig
from rlhf_core.evaluation.policy_eval import evaluation_generation, rollout_kl
from rlhf_core.models.sequences import left_pad
from rlhf_core.training.rollout import generate
from tests.tiny_models import gpt2_config, word_tokenizer


def test_greedy_evaluation_is_top1_sampling_and_kl_of_a_model_to_itself_is_zero() -> None:
    greedy = evaluation_generation(GenerationConfig(max_new_tokens=5, temperature=0.7, top_k=5), 0.0, 3)
    assert (greedy.temperature, greedy.top_k, greedy.top_p, greedy.batch_size) == (1.0, 1, 1.0, 3)
    assert evaluation_generation(GenerationConfig(top_k=5), 0.5, 3).top_k == 5
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(gpt2_config(len(tokenizer))).eval()
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.3 * torch.randn_like(param))
    ids, mask = left_pad([tokenizer("the cat")["input_ids"], tokenizer("q")["input_ids"]], tokenizer.pad_token_id)
    outs = [generate(policy, ids, mask, greedy, [tokenizer.eos_token_id], 0, torch.Generator().manual_seed(s))
            for s in (0, 1)]
    assert torch.equal(outs[0].response_ids, outs[1].response_ids)  # greedy ignores the seed
    k1, k3 = rollout_kl(policy, policy, outs[0])
    assert torch.equal(k1, torch.zeros(2)) and torch.equal(k3, torch.zeros(2))
    # k1 against a loop over the real response tokens of row 0
    k1, _ = rollout_kl(policy, reference, outs[0])
    full = outs[0].input_ids
    tq = ids.shape[1]
    expected = 0.0
    with torch.no_grad():  # one forward per real response token, on the unpadded prefix (no cache, no masks)
        for t in range(outs[0].response_ids.shape[1]):
            if outs[0].response_mask[0, t]:
                prefix = full[0, : tq + t][mask[0].tolist().index(True):].unsqueeze(0)
                token = full[0, tq + t]
                expected += float(policy(prefix).logits[0, -1].log_softmax(-1)[token]
                                  - reference(prefix).logits[0, -1].log_softmax(-1)[token])
    assert float(k1[0]) == pytest.approx(expected, abs=1e-4)
