"""Trainable heads and adapters are float32 whatever the base weights' dtype.

With bf16 weights an Adam step of lr = 5e-5 on a weight with |w| >= 2^-6 is under half the spacing between bf16
numbers there, so a bf16 head never moves ("0 of 13 weights moved"); a float32 one does. A float32 head also reads
bf16 hidden states without autocast (that combination used to crash with a dtype mismatch).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from rlhf_core.config import GenerationConfig, LoRAConfig, PPOConfig, RewardShapingConfig, RewardTrainingConfig
from rlhf_core.models.lora import LoRACritic, lora_layers, lora_policy
from rlhf_core.models.memory import autocast
from rlhf_core.models.roles import Critic, ValueHead, disable_dropout, policy_forward
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.ppo_loop import train_ppo
from rlhf_core.training.reward_training import train_reward_model
from rlhf_core.data.records import PreferencePair
from tests.tiny_models import gpt2_config, word_tokenizer

VOCAB, PAD, BOS, EOS = 28, 0, 1, 2
LORA = LoRAConfig(enabled=True, rank=4, alpha=8.0)
LR = 5e-5
BIG = 2.0**-6
"""From this magnitude on, a bf16 weight cannot take a step of LR (half the bf16 spacing there is 2^-14 > LR)."""


def tiny_rm(dtype: torch.dtype = torch.bfloat16) -> GPT2ForSequenceClassification:
    torch.manual_seed(1)
    return disable_dropout(GPT2ForSequenceClassification(gpt2_config(VOCAB, num_labels=1))).to(dtype)


def tiny_lm(dtype: torch.dtype = torch.bfloat16) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return disable_dropout(GPT2LMHeadModel(gpt2_config(VOCAB))).to(dtype)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (4, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # one left-padded row
    return ids, mask


def adam_steps(params: list[torch.nn.Parameter], loss_fn, steps: int = 1) -> None:
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    for _ in range(steps):
        optimizer.zero_grad()
        loss_fn().backward()
        optimizer.step()


def big_weights_moved(before: torch.Tensor, after: torch.Tensor) -> tuple[int, int]:
    """(how many weights with |w| >= 2^-6 changed, how many there are)."""
    big = before.abs() >= BIG
    return int((after[big] != before[big]).sum()), int(big.sum())


def assert_big_weights_move(before: torch.Tensor, after: torch.Tensor) -> None:
    moved, big = big_weights_moved(before, after)
    assert big >= 3 and moved == big


def test_lora_critic_on_a_bf16_reward_model_trains_head_and_adapter_in_float32():
    rm = tiny_rm()
    critic = LoRACritic(rm, LORA)
    ids, mask = batch()
    assert critic.head.weight.dtype == torch.float32 and rm.score.weight.dtype == torch.bfloat16
    adapters = [p for layer in lora_layers(critic.backbone) for p in (*layer.lora_A.parameters(),
                                                                      *layer.lora_B.parameters())]
    assert adapters and {p.dtype for p in adapters} == {torch.float32}
    head_before = critic.head.weight.detach().clone()
    a = next(lora_layers(critic.backbone)).lora_A["default"].weight
    a_before = a.detach().clone()
    optimizer = torch.optim.AdamW([p for p in critic.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    for _ in range(2):  # A gets no gradient while B = 0: the second step moves it
        optimizer.zero_grad()
        (critic(ids, mask) - 1.0).pow(2).mean().backward()
        optimizer.step()
        if torch.equal(a, a_before):
            assert_big_weights_move(head_before, critic.head.weight.detach())
    assert_big_weights_move(a_before, a.detach())
    assert rm.score.weight.dtype == torch.bfloat16 and not rm.score.weight.requires_grad  # the scorer is untouched


def test_the_same_step_on_a_bf16_head_rounds_away():
    """What the float32 head fixes: the bf16 head's '0 of 13 weights with |w| >= 2^-6 moved'."""
    critic = LoRACritic(tiny_rm(), LORA)
    critic.head.bfloat16()
    ids, mask = batch()
    before = critic.head.weight.detach().clone()
    adam_steps([critic.head.weight], lambda: (critic(ids, mask) - 1.0).pow(2).mean())
    moved, big = big_weights_moved(before, critic.head.weight.detach())
    assert big >= 3 and moved == 0


@pytest.mark.parametrize("kind", ["none", "bf16"])
def test_a_float32_value_head_on_a_bf16_lora_policy(kind: str):
    policy, _ = lora_policy(tiny_lm(), LORA)
    head = ValueHead(policy.config.hidden_size)
    ids, mask = batch()
    assert head.summary.weight.dtype == torch.float32
    assert {p.dtype for n, p in policy.named_parameters() if p.requires_grad} == {torch.float32}  # the adapter

    def loss() -> torch.Tensor:
        with autocast(kind, ids.device):
            out = policy_forward(policy, ids, mask, query_len=4, temperature=1.0, value_head=head)
        assert out.values.dtype == torch.float32
        return (out.values - 1.0).pow(2).mean() - out.logprobs.mean()

    before = head.summary.weight.detach().clone()
    adam_steps([*head.parameters(), *(p for p in policy.parameters() if p.requires_grad)], loss)
    assert torch.all(head.summary.weight != before)  # initialised near zero: no weight reaches 2^-6 yet


def test_a_full_critic_holds_its_score_head_in_float32():
    critic = Critic(tiny_rm())
    ids, mask = batch()
    head = critic.model.score
    assert head.weight.dtype == torch.float32 and critic.model.transformer.wte.weight.dtype == torch.bfloat16
    before = head.weight.detach().clone()
    adam_steps([head.weight], lambda: (critic(ids, mask) - 1.0).pow(2).mean())
    assert_big_weights_move(before, head.weight.detach())


@pytest.mark.parametrize("lora", [False, True])
def test_reward_training_in_bf16_keeps_the_head_updates(lora: bool):
    """Each step is below bf16's resolution at |w| >= 2^-6; in a float32 head eight of them add up to a move."""
    tokenizer = word_tokenizer()
    model = tiny_rm()
    before = model.score.weight.detach().float().clone()
    pairs = [PreferencePair("hello", "good cat", "bad dog"), PreferencePair("why", "good sun", "bad moon")] * 4
    config = RewardTrainingConfig(epochs=8, batch_size=8, learning_rate=LR, weight_decay=0.0,
                                  lora=LORA if lora else LoRAConfig())
    train_reward_model(model, tokenizer, pairs, [], config)
    after = model.score.weight.detach()
    assert after.dtype == torch.bfloat16  # saved and reloaded in the model's own dtype
    big = before.abs() >= BIG
    assert (after.float()[big] != before[big]).float().mean() > 0.5


@pytest.mark.parametrize(("value_model", "kind"), [("head", "none"), ("critic", "none"), ("head", "bf16")])
def test_a_ppo_update_runs_on_bf16_weights(value_model: str, kind: str):
    """The whole update (rollout, old values, training forward, checkpointless loop) with bf16 base weights."""
    policy, reference = lora_policy(tiny_lm(), LORA)
    rm = tiny_rm()
    common = {"policy": policy, "reference": reference, "scorer": lambda r: r.response_mask.float().sum(1),
              "stop_token_ids": (EOS,), "pad_token_id": PAD}
    models = (PPOModels(**common, value_head=ValueHead(policy.config.hidden_size)) if value_model == "head"
              else PPOModels(**common, critic=LoRACritic(rm, LORA)))
    config = PPOConfig(rollout_batch_size=8, mini_batch_size=8, micro_batch_size=4, ppo_epochs=1, autocast=kind,
                       value_model=value_model, lora=LORA, learning_rate=LR, value_learning_rate=LR,
                       reward=RewardShapingConfig(normalize=True),
                       generation=GenerationConfig(max_new_tokens=4, batch_size=8))
    value_before = [p.detach().clone() for p in models.value_parameters()]
    prompts = [[BOS] + [random.Random(i).randrange(3, VOCAB) for _ in range(2)] for i in range(8)]
    (metrics,) = train_ppo(models, prompts, config, 1).history
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    moved = sum(int((a != b).sum()) for a, b in zip(value_before, models.value_parameters(), strict=True))
    assert moved > 0
    assert {p.dtype for p in models.value_parameters()} == {torch.float32}
