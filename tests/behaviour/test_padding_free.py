"""The speed paths give the results of the plain ones: padding-free (packed) forwards equal padded forwards in
values and gradients, inverse-CDF sampling draws from the given distribution, the LM head applied at the response
tokens only equals the full logits, the fused GELU equals GPT-2's, and fused AdamW makes the for-each update."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from transformers import GPT2LMHeadModel, GPT2Model
from transformers.activations import GELUTanh

from rlhf_core.models.lm_head import split_lm_head
from rlhf_core.models.packing import pack, padded_forward, supports_packing
from rlhf_core.models.roles import ValueHead, fuse_activations, load_policy, policy_forward
from rlhf_core.models.sequences import positions_from_mask
from rlhf_core.training.rollout import sample_tokens
from tests.tiny_models import gpt2_config

PAD = 0


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A [query (left-padded) | response (right-padded)] batch of very different lengths, like a rollout."""
    ids = torch.tensor([
        [PAD, PAD, PAD, 5, 6, 7, 8, PAD, PAD, PAD],
        [3, 4, 5, 6, 7, 9, 10, 11, 12, 13],
        [PAD, PAD, 9, 10, 3, 4, PAD, PAD, PAD, PAD],
        [PAD, PAD, PAD, PAD, 11, PAD, PAD, PAD, PAD, PAD],
    ])
    return ids, (ids != PAD).long()


def test_packing_lays_every_real_token_once_with_restarting_positions():
    ids, mask = batch()
    packing = pack(ids, mask)
    assert packing is not None and packing.input_ids.numel() < ids.numel()
    real = packing.source[mask.bool()]
    assert real.unique().numel() == int(mask.sum())  # one slot per real token
    flat_ids = packing.input_ids.reshape(-1)
    assert torch.equal(flat_ids[real], ids[mask.bool()])
    assert torch.equal(packing.position_ids.reshape(-1)[real], positions_from_mask(mask)[mask.bool()])
    assert (packing.source[~mask.bool()] == packing.input_ids.numel()).all()  # padding -> the zero slot


def test_packed_forward_equals_the_padded_forward_in_values_and_gradients():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config(24))
    ids, mask = batch()
    assert supports_packing(model) and supports_packing(model.transformer)
    plain = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask), output_hidden_states=True)
    packed = padded_forward(model, ids, mask, output_hidden_states=True)
    real = mask.bool()
    torch.testing.assert_close(packed.logits[real], plain.logits[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed.hidden_states[-1][real], plain.hidden_states[-1][real], atol=1e-5, rtol=1e-5)
    assert (packed.logits[~real] == 0).all()  # padded slots are zeros, not another row's tokens
    weight = model.transformer.h[0].attn.c_attn.weight
    expected = torch.autograd.grad(plain.logits[real].logsumexp(-1).sum(), weight)[0]
    got = torch.autograd.grad(packed.logits[real].logsumexp(-1).sum(), weight)[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_other_modules_run_padded():
    class Wrapper(torch.nn.Module):
        """A custom wrapper: its forward may need the attention mask, so it is never packed."""

        def __init__(self) -> None:
            super().__init__()
            self.inner = GPT2Model(gpt2_config(24))

        def forward(self, input_ids, attention_mask, position_ids):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    ids, mask = batch()
    assert supports_packing(torch.nn.Linear(2, 2)) is False
    assert supports_packing(Wrapper()) is False
    torch.manual_seed(0)
    wrapper = Wrapper()
    plain = wrapper(ids, mask, positions_from_mask(mask)).last_hidden_state
    assert torch.equal(padded_forward(wrapper, ids, mask).last_hidden_state, plain)


def test_inverse_cdf_sampling_follows_the_distribution_and_skips_zero_probabilities():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.0, 0.0, 0.0, 1.0], [0.0, 0.5, 0.5, 0.0]])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros_like(probs)
    for _ in range(4000):
        counts[torch.arange(3), sample_tokens(probs, generator)] += 1
    assert (counts[probs == 0] == 0).all()
    torch.testing.assert_close(counts / 4000, probs, atol=0.03, rtol=0)


def llama(vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_head_only_policy_forward_equals_the_full_logits_path(family: str):
    """Log-probs, entropy, head values and their gradients from the LM head applied at the response tokens
    only equal those from the whole model's logits (``split_lm_head`` found, then forced off)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config(24)) if family == "gpt2" else llama(24)
    head = ValueHead(32)
    ids, mask = batch()
    query_len = 4
    assert split_lm_head(model) is not None

    def run(split: bool) -> tuple:
        with patch("rlhf_core.models.roles.split_lm_head", side_effect=lambda m: split_lm_head(m) if split else None):
            out = policy_forward(model, ids, mask, query_len, 0.7, head, with_entropy=True)
        real = mask[:, query_len:].bool()
        loss = (out.logprobs[real].sum() + out.entropy[real].sum() + out.values[real].sum())
        weight = next(p for n, p in model.named_parameters() if n.endswith("layers.0.self_attn.q_proj.weight")
                      or n.endswith("h.0.attn.c_attn.weight"))
        return out, real, torch.autograd.grad(loss, weight)[0]

    fast, real, fast_grad = run(split=True)
    full, _, full_grad = run(split=False)
    for name in ("logprobs", "entropy", "values"):
        torch.testing.assert_close(getattr(fast, name)[real], getattr(full, name)[real], atol=1e-5, rtol=1e-5)
    assert (fast.logprobs[~real] == 0).all() and (fast.entropy[~real] == 0).all()  # never computed there
    torch.testing.assert_close(fast_grad, full_grad, atol=1e-5, rtol=1e-4)


def test_split_lm_head_only_for_plain_heads():
    model = GPT2LMHeadModel(gpt2_config(24))
    backbone, head = split_lm_head(model)
    assert backbone is model.transformer and head is model.lm_head
    from rlhf_core.config import LoRAConfig
    from rlhf_core.models.lora import lora_policy

    policy, reference = lora_policy(GPT2LMHeadModel(gpt2_config(24)), LoRAConfig(enabled=True, rank=2))
    inner = policy.get_base_model()
    assert split_lm_head(policy) == (inner.transformer, inner.lm_head)  # the adapters live inside those modules
    assert reference.runs_under()[0] is policy  # the reference takes the same path, adapter disabled
    model.config.model_type = "gemma2"  # soft-caps its logits: the head alone would not give them
    assert split_lm_head(model) is None
    assert split_lm_head(torch.nn.Linear(2, 2)) is None


def test_fused_gelu_is_gpt2s_gelu_and_checkpoints_keep_their_config(tmp_path):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config(24))
    ids, mask = batch()
    expected = model(input_ids=ids, attention_mask=mask).logits
    assert fuse_activations(model) is model
    assert all(type(block.mlp.act) is GELUTanh for block in model.transformer.h)
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, expected, atol=1e-5, rtol=1e-5)
    model.save_pretrained(tmp_path)
    assert GPT2LMHeadModel.from_pretrained(tmp_path).config.activation_function == "gelu_new"
    loaded = load_policy(str(tmp_path))
    assert all(type(block.mlp.act) is GELUTanh for block in loaded.transformer.h)


def test_local_optimizer_is_fused_adamw_with_the_for_each_update():
    from rlhf_core.training.strategy import TrainableGroup, local_optimizer

    torch.manual_seed(0)
    models = [torch.nn.Linear(6, 4), torch.nn.Linear(6, 4)]
    models[1].load_state_dict(models[0].state_dict())
    fused, _ = local_optimizer([TrainableGroup(models[0], list(models[0].parameters()), 1e-2)], 0.01)
    plain = torch.optim.AdamW(models[1].parameters(), lr=1e-2, weight_decay=0.01, foreach=True)
    assert fused.defaults["fused"] is True
    for step in range(5):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        for model, optimizer in zip(models, (fused, plain), strict=True):
            optimizer.zero_grad()
            model(x).pow(2).sum().backward()
            optimizer.step()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
