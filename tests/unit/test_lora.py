"""LoRA-shared models: the reference is the untouched base, the critic shares the reward model's weights,
merged saves reproduce the adapted model, and bad LoRA settings fail in one line."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from rlhf_core.config import LoRAConfig, PPOConfig
from rlhf_core.models.lora import (AdapterDisabled, LoRACritic, add_adapter, lora_layers, lora_policy, plain_model,
                                   target_modules)
from rlhf_core.models.roles import ValueHead, policy_forward, sequence_scores, token_scores
from rlhf_core.training.checkpoint import TrainableView, trainable_view
from tasks.config import ConfigError, load_config
from tests.tiny_models import gpt2_config

VOCAB = 24
LORA = LoRAConfig(enabled=True, rank=4, alpha=8.0)


def tiny_policy(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config(VOCAB))


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (4, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # one left-padded row
    return ids, mask


def perturb_adapter(model: torch.nn.Module, scale: float = 0.2) -> None:
    """Stand-in for training: give every B a non-zero value."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(model):
            for weight in (layer.lora_B[name].weight for name in layer.active_adapters):
                weight.copy_(scale * torch.randn(weight.shape, generator=generator))


def logprobs(model: torch.nn.Module) -> torch.Tensor:
    ids, mask = batch()
    with torch.no_grad():
        return policy_forward(model, ids, mask, query_len=5, temperature=0.7).logprobs


def test_reference_is_the_untouched_base_bit_for_bit():
    untouched = tiny_policy()
    policy, reference = lora_policy(copy.deepcopy(untouched), LORA)
    assert torch.equal(logprobs(policy), logprobs(untouched))  # B = 0: the adapter starts as a no-op
    perturb_adapter(policy)
    assert not torch.allclose(logprobs(policy), logprobs(untouched), atol=1e-3)
    assert torch.equal(logprobs(reference), logprobs(untouched))
    assert list(reference.parameters()) == []  # one copy of the base: the reference owns no weights


def test_only_the_adapter_trains_and_the_reference_runs_without_grad():
    policy, reference = lora_policy(tiny_policy(), LORA)
    trainable = [name for name, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in name or "lora_B" in name for name in trainable)
    n_trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    # 2 blocks x (c_attn 32->96, attn c_proj 32->32, c_fc 32->128, mlp c_proj 128->32), rank 4: r * (in + out)
    assert n_trainable == 2 * 4 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32))
    ids, mask = batch()
    assert not reference(input_ids=ids, attention_mask=mask).logits.requires_grad
    assert policy(input_ids=ids, attention_mask=mask).logits.requires_grad


def test_default_targets_cover_every_block_linear_layer():
    assert target_modules(tiny_policy(), LoRAConfig()) == ["c_attn", "c_proj", "c_fc"]
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    assert target_modules(llama, LoRAConfig()) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"]
    wrapped = add_adapter(llama, LORA)
    assert len(list(lora_layers(wrapped))) == 7
    assert target_modules(llama, LoRAConfig(target_modules=("q_proj",))) == ["q_proj"]


def test_adapter_init_comes_from_its_seed_not_the_global_rng():
    def adapter(seed: int, global_seed: int) -> list[torch.Tensor]:
        model = tiny_policy()
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        wrapped = add_adapter(model, LORA, seed=seed)
        assert torch.equal(torch.get_rng_state(), state)  # adding an adapter drew no global random numbers
        return [p.detach().clone() for p in wrapped.parameters() if p.requires_grad]

    same = zip(adapter(3, global_seed=0), adapter(3, global_seed=123), strict=True)
    assert all(torch.equal(a, b) for a, b in same)
    assert not torch.equal(adapter(3, 0)[0], adapter(4, 0)[0])


def test_merged_copy_is_a_plain_model_with_the_adapted_logits(tmp_path):
    policy, reference = lora_policy(tiny_policy(), LORA)
    perturb_adapter(policy)
    ids, mask = batch()
    with torch.no_grad():
        adapted = policy(input_ids=ids, attention_mask=mask).logits
        base = reference(input_ids=ids, attention_mask=mask).logits
    merged = plain_model(policy)
    assert type(merged) is GPT2LMHeadModel and not list(lora_layers(merged))
    merged.save_pretrained(tmp_path)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits, adapted, rtol=0, atol=1e-5)
        # the live policy keeps its adapter, and its reference its base
        assert torch.equal(policy(input_ids=ids, attention_mask=mask).logits, adapted)
        assert torch.equal(reference(input_ids=ids, attention_mask=mask).logits, base)


def test_refresh_merges_the_adapter_into_the_base_and_restarts_it():
    policy, reference = lora_policy(tiny_policy(), LORA)
    perturb_adapter(policy)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    policy(input_ids=batch()[0]).logits.sum().backward()
    optimizer.step()
    assert optimizer.state
    before = logprobs(policy)
    reference.refresh(optimizer, seed=5)
    torch.testing.assert_close(logprobs(policy), before, rtol=0, atol=1e-5)
    torch.testing.assert_close(logprobs(reference), before, rtol=0, atol=1e-5)
    assert all(not layer.lora_B["default"].weight.any() for layer in lora_layers(policy))
    assert not optimizer.state  # the restarted adapter starts with fresh Adam moments


def tiny_reward_model() -> GPT2ForSequenceClassification:
    torch.manual_seed(1)
    return GPT2ForSequenceClassification(gpt2_config(VOCAB, num_labels=1))


def test_lora_critic_shares_the_reward_models_frozen_weights():
    reward_model = tiny_reward_model()
    ids, mask = batch()
    with torch.no_grad():
        scores_before = sequence_scores(reward_model, ids, mask)
    critic = LoRACritic(reward_model, LORA)
    shared = {id(p) for p in reward_model.parameters()}
    frozen = [p for p in critic.parameters() if not p.requires_grad]
    assert frozen and all(id(p) in shared for p in frozen)  # the base is the reward model's own tensors
    trainable = [name for name, p in critic.named_parameters() if p.requires_grad]
    assert all("lora_" in name or name.startswith("head.") for name in trainable)
    with torch.no_grad():
        torch.testing.assert_close(critic(ids, mask), token_scores(reward_model, ids, mask), rtol=0, atol=0)
    perturb_adapter(critic)
    with torch.no_grad():
        critic.head.weight.add_(1.0)
        assert not torch.allclose(critic(ids, mask), token_scores(reward_model, ids, mask), atol=1e-3)
        # the scorer's reward model never runs the critic's adapter or head
        assert torch.equal(sequence_scores(reward_model, ids, mask), scores_before)


def test_checkpoint_view_holds_only_the_trainable_tensors():
    policy, _ = lora_policy(tiny_policy(), LORA)
    view = trainable_view(policy)
    assert isinstance(view, TrainableView)
    assert {id(p) for p in view.parameters()} == {id(p) for p in policy.parameters() if p.requires_grad}
    full = tiny_policy()
    assert trainable_view(full) is full  # full fine-tuning checkpoints are unchanged
    head = ValueHead(32)
    assert trainable_view(head) is head


def test_lora_settings_load_from_dotted_overrides():
    config = load_config(preset="tiny", overrides=["ppo.lora.enabled=true", "ppo.lora.rank=4",
                                                   "ppo.lora.target_modules=[c_attn, c_fc]",
                                                   "reward_model.training.lora.enabled=true"])
    assert config.ppo.lora == LoRAConfig(enabled=True, rank=4, target_modules=("c_attn", "c_fc"))
    assert config.reward_model.training.lora.enabled and not config.reward_model.heldout.lora.enabled


@pytest.mark.parametrize(("override", "expected"), [
    ("ppo.lora.rank=0", "bad value 0 for 'ppo.lora.rank' (from override 'ppo.lora.rank=0'): must be >= 1"),
    ("ppo.lora.alpha=-1", "'ppo.lora.alpha' (from override 'ppo.lora.alpha=-1'): must be > 0"),
    ("ppo.lora.enabled=yes please", "expected true or false"),
    ("ppo.lora.ranks=4", "did you mean 'ppo.lora.rank'"),
    ("reward_model.training.lora.dropout=1.5", "'reward_model.training.lora.dropout' (from override "
                                               "'reward_model.training.lora.dropout=1.5'): must be in [0, 1)"),
])
def test_bad_lora_settings_fail_in_one_line(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(preset="tiny", overrides=[override])
    message = str(info.value)
    assert expected in message and "\n" not in message


def test_ppo_refuses_adapter_dropout():
    with pytest.raises(ValueError, match="ppo.lora.dropout must be 0") as info:
        PPOConfig(lora=LoRAConfig(enabled=True, dropout=0.1))
    assert "\n" not in str(info.value)
    PPOConfig(lora=LoRAConfig(enabled=False, dropout=0.1))  # a disabled adapter's dropout is never used


def test_unknown_target_module_names_the_layers_that_exist():
    with pytest.raises(ValueError, match="choose from its linear layers: c_attn, c_fc, c_proj") as info:
        lora_policy(tiny_policy(), LoRAConfig(enabled=True, target_modules=("q_proj",)))
    assert "lora.target_modules=['q_proj']" in str(info.value)


def test_reference_wrapper_is_an_adapter_disabled_view():
    policy, reference = lora_policy(tiny_policy(), LORA)
    assert isinstance(reference, AdapterDisabled) and reference.policy is policy
