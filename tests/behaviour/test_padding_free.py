"""The speed paths of rlhf_core.packing and rlhf_core.rollout give the results of the plain ones: padding-free (packed) forwards
equal padded forwards in values and gradients, and inverse-CDF sampling draws from the given distribution."""

from __future__ import annotations

import torch
from transformers import GPT2LMHeadModel, GPT2Model

from rlhf_core.packing import pack, padded_forward, supports_packing
from rlhf_core.rollout import positions_from_mask, sample_tokens
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
