"""One fresh process of the memory benchmark: build one setup, run one PPO step, report memory as JSON.

    .venv/bin/python -m benchmarks.memory.worker --setup full --size '{"n_layer": 2, ...}' --out r.json

Setups (all with a frozen reward model as the scorer):
- ``full``: policy, reference (a frozen deep copy), critic (a deep copy of the reward model): four models.
- ``lora_head``: LoRA policy, reference = the same weights with the adapter disabled, value head on the policy.
- ``lora_critic``: LoRA policy and adapter-disabled reference, critic = LoRA on the scorer's reward model.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

from benchmarks.common import peak_rss_mib, rss_mib
from rlhf_core.config import GenerationConfig, LoRAConfig, PPOConfig
from rlhf_core.models.lora import LoRACritic, lora_policy
from rlhf_core.models.roles import Critic, ValueHead, disable_dropout, freeze, make_reference, sequence_scores
from rlhf_core.models.sequences import Rollout
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.ppo_step import PPOState, make_kl_controller, ppo_step, prepare_training

SETUPS = ("full", "lora_head", "lora_critic", "critic_free")


def build_models(setup: str, size: dict[str, int], lora_rank: int) -> PPOModels:
    """The PPO roles of one setup on randomly initialised GPT-2s (weights' values do not change memory)."""
    config = GPT2Config(vocab_size=size["vocab_size"], n_positions=size["n_positions"], n_embd=size["n_embd"],
                        n_layer=size["n_layer"], n_head=size["n_head"], pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, num_labels=1)
    torch.manual_seed(0)
    policy = disable_dropout(GPT2LMHeadModel(config))
    reward_model = freeze(GPT2ForSequenceClassification(config))
    scorer = TokenIdScorer(reward_model)
    lora = LoRAConfig(enabled=True, rank=lora_rank, alpha=2.0 * lora_rank)
    if setup == "full":
        return PPOModels(policy, make_reference(policy), scorer, (2,), 0, critic=Critic(reward_model))
    if setup == "critic_free":  # GRPO / RLOO / REINFORCE++: no value model at all
        return PPOModels(policy, make_reference(policy), scorer, (2,), 0)
    policy, reference = lora_policy(policy, lora)
    if setup == "lora_head":
        return PPOModels(policy, reference, scorer, (2,), 0, value_head=ValueHead(config.n_embd))
    return PPOModels(policy, reference, scorer, (2,), 0, critic=LoRACritic(reward_model, lora))


class TokenIdScorer:
    """The reward model's score at the last real token, in micro-batches (what RewardModelScorer does with a
    shared tokenizer, without needing one). Its ``model`` is what ``ppo.offload_frozen`` parks."""

    def __init__(self, model: GPT2ForSequenceClassification, batch_size: int = 8) -> None:
        self.model, self.batch_size = model, batch_size

    def __call__(self, rollout: Rollout) -> torch.Tensor:
        with torch.no_grad():
            parts = [sequence_scores(self.model, chunk.input_ids, chunk.attention_mask)
                     for chunk in (rollout.select(slice(s, s + self.batch_size))
                                   for s in range(0, rollout.query_ids.shape[0], self.batch_size))]
        return torch.cat(parts)


def analytic_bytes(models: PPOModels) -> dict[str, int]:
    """Weights (each distinct tensor once: shared weights count once), gradients and AdamW's two moments of
    the trainable parameters. Activations are not included: they are what the measured RSS adds."""
    modules = [models.policy, models.reference, models.scorer.model]
    if models.value_model is not None:
        modules.append(models.value_model)
    seen: dict[int, torch.Tensor] = {}
    for module in modules:
        for tensor in module.parameters():
            seen.setdefault(tensor.data_ptr(), tensor)
    weights = sum(t.numel() * t.element_size() for t in seen.values())
    trainable = [t for t in seen.values() if t.requires_grad]
    grads = sum(t.numel() * t.element_size() for t in trainable)
    adam = sum(2 * t.numel() * 4 for t in trainable)  # exp_avg and exp_avg_sq, float32
    return {"weights": weights, "gradients": grads, "optimizer_state": adam, "total": weights + grads + adam,
            "parameters_distinct": sum(t.numel() for t in seen.values()),
            "parameters_trainable": sum(t.numel() for t in trainable)}


def measured_optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state after the step (checks the analytic count)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def run(setup: str, size: dict[str, int], ppo: dict[str, int], lora_rank: int) -> dict[str, Any]:
    """Build the setup and run ``ppo['steps']`` PPO steps (rollout + scoring + update); peak RSS at the end."""
    rss_after_imports = rss_mib()
    models = build_models(setup, size, lora_rank)
    rss_after_build = rss_mib()
    config = PPOConfig(rollout_batch_size=ppo["rollout_batch_size"], mini_batch_size=ppo["mini_batch_size"],
                       micro_batch_size=ppo["micro_batch_size"], ppo_epochs=ppo["ppo_epochs"],
                       value_model="head" if setup == "lora_head" else "critic",
                       advantage="grpo" if setup == "critic_free" else "gae",
                       samples_per_prompt=2 if setup == "critic_free" else 1,
                       gradient_checkpointing=bool(ppo.get("gradient_checkpointing", False)),
                       generation=GenerationConfig(max_new_tokens=ppo["max_new_tokens"],
                                                   batch_size=ppo["rollout_batch_size"]))
    rng = random.Random(0)
    vocab = size["vocab_size"]
    prompts = [[1] + [rng.randrange(3, vocab) for _ in range(rng.randint(ppo["prompt_tokens"] // 2,
                                                                           ppo["prompt_tokens"] - 1))]
               for _ in range(config.prompts_per_update)]
    models, strategy = prepare_training(models, config)
    state = PPOState(make_kl_controller(config), torch.Generator().manual_seed(0))
    started = time.perf_counter()
    response_tokens = 0
    for _ in range(ppo["steps"]):
        stats = ppo_step(models, strategy, state, prompts, config)
        response_tokens += int(stats.rollout.response_length_mean * config.rollout_batch_size)
    return {
        "setup": setup,
        "peak_rss_mib": peak_rss_mib(),
        "rss_after_imports_mib": rss_after_imports,
        "rss_after_build_mib": rss_after_build,
        "analytic_bytes": analytic_bytes(models),
        "measured_optimizer_state_bytes": measured_optimizer_bytes(strategy.optimizer),
        "response_tokens": response_tokens,
        "step_s": (time.perf_counter() - started) / ppo["steps"],
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", choices=SETUPS, required=True)
    parser.add_argument("--size", required=True, help="JSON: vocab_size, n_positions, n_embd, n_layer, n_head")
    parser.add_argument("--ppo", required=True, help="JSON: batch sizes, epochs, tokens, steps[, gradient_checkpointing]")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = run(args.setup, json.loads(args.size), json.loads(args.ppo), args.lora_rank)
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
