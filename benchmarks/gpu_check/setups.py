"""What the GPU check builds: the model shapes and sizes of a check, and the PPO roles of each setup on random
weights (``benchmarks/gpu_check/run.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.memory.shapes import MODELS, ModelShape

if TYPE_CHECKING:
    from transformers import Qwen2Config

    from rlhf_core.config import PPOConfig
    from rlhf_core.training.experience import PPOModels

SETUPS = ("lora_head", "lora_critic", "full_head", "full_critic")


@dataclass(frozen=True)
class Scale:
    """The sizes of one check: the model shape and what a PPO step does with it."""

    shape: ModelShape
    prompt_tokens: int
    new_tokens: int
    rollout_batch: int
    mini_batch: int
    micro_batch: int
    matmul: int
    vocab_rows: int
    lora_rank: int = 16
    vocab_chunk: int | None = None
    """Logits per chunk of the vocabulary check (None: the library's ``VOCAB_CHUNK_ELEMENTS``)."""


FULL = Scale(MODELS["qwen2.5-0.5b"], prompt_tokens=256, new_tokens=128, rollout_batch=64, mini_batch=32,
             micro_batch=8, matmul=8192, vocab_rows=4096)
SMOKE = Scale(ModelShape("tiny-qwen2", "llama", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                         vocab=4096, tied_embeddings=True, qkv_bias=True),
              prompt_tokens=8, new_tokens=6, rollout_batch=8, mini_batch=8, micro_batch=4, matmul=256,
              vocab_rows=600, lora_rank=4, vocab_chunk=4096 * 128)


def qwen2_config(shape: ModelShape, **extra: Any) -> Qwen2Config:
    """A Qwen2 config with ``shape``'s numbers, dropout off; token ids 0 (pad), 1 (bos), 2 (eos)."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                       num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                       intermediate_size=shape.intermediate, tie_word_embeddings=shape.tied_embeddings,
                       max_position_embeddings=4096, attention_dropout=0.0, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2, **extra)


def build(setup: str, scale: Scale, device: torch.device, seed: int = 0) -> PPOModels:
    """The PPO roles of ``setup`` on random weights: LoRA setups in bf16, full ones in fp32."""
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

    from benchmarks.memory.worker import TokenIdScorer
    from rlhf_core.config import LoRAConfig
    from rlhf_core.models.lora import LoRACritic, lora_policy
    from rlhf_core.models.roles import Critic, ValueHead, disable_dropout, freeze, make_reference
    from rlhf_core.training.experience import PPOModels

    dtype = torch.bfloat16 if setup.startswith("lora") else torch.float32
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where they run: a CPU init of 0.5B parameters takes seconds
        policy = disable_dropout(Qwen2ForCausalLM(qwen2_config(scale.shape)).to(dtype))
        reward_model = freeze(Qwen2ForSequenceClassification(qwen2_config(scale.shape, num_labels=1)).to(dtype))
    scorer = TokenIdScorer(reward_model, batch_size=scale.micro_batch)
    lora = LoRAConfig(enabled=True, rank=scale.lora_rank, alpha=2.0 * scale.lora_rank)
    if setup == "full_head":
        head = ValueHead(scale.shape.hidden).to(device)
        return PPOModels(policy, make_reference(policy), scorer, (2,), 0, value_head=head)
    if setup == "full_critic":
        return PPOModels(policy, make_reference(policy), scorer, (2,), 0, critic=Critic(reward_model).to(device))
    policy, reference = lora_policy(policy, lora)
    policy.to(device)
    if setup == "lora_head":
        return PPOModels(policy, reference, scorer, (2,), 0, value_head=ValueHead(scale.shape.hidden).to(device))
    return PPOModels(policy, reference, scorer, (2,), 0, critic=LoRACritic(reward_model, lora).to(device))


def ppo_config(setup: str, scale: Scale, **overrides: Any) -> PPOConfig:
    """One PPO epoch over the rollout batch, bf16 autocast, the value model the setup names."""
    from rlhf_core.config import GenerationConfig, PPOConfig

    settings = dict(rollout_batch_size=scale.rollout_batch, mini_batch_size=scale.mini_batch,
                    micro_batch_size=scale.micro_batch, ppo_epochs=1, learning_rate=1e-6, value_learning_rate=1e-6,
                    autocast="bf16", value_model="head" if setup.endswith("head") else "critic",
                    generation=GenerationConfig(max_new_tokens=scale.new_tokens, batch_size=scale.rollout_batch))
    return PPOConfig(**{**settings, **overrides})


def prompts(scale: Scale, count: int, seed: int = 0) -> list[list[int]]:
    """Random token prompts of ``prompt_tokens / 2`` to ``prompt_tokens`` tokens, starting with bos."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(scale.prompt_tokens // 2, scale.prompt_tokens + 1, (count,), generator=generator)
    return [[1, *torch.randint(3, scale.shape.vocab, (int(n) - 1,), generator=generator).tolist()] for n in lengths]
