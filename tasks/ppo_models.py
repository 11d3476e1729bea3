"""The four models a PPO job trains and reads (policy, reference, scorer, value model), built the same way in the
ppo-iteration stage and in its DeepSpeed workers (``tasks.ppo_job``).

Apart from ``tasks.models`` (tokenizers, frozen models and scorers every stage loads) so that the stages that never
train a policy do not import PPO's code, and their keys do not change when it does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import PPOConfig
from rlhf_core.models.lora import LoRACritic, lora_policy
from rlhf_core.models.roles import (Critic, ValueHead, freeze, load_policy, load_reward_model, make_reference,
                                    split_classifier)
from rlhf_core.models.scoring import RewardModelScorer
from rlhf_core.models.text import pad_id, same_vocabulary
from rlhf_core.training.experience import PPOModels
from tasks.models import ensemble_of, load_tokenizer, reward_members
from tasks.runtime import Runtime


def build_ppo_models(config: PPOConfig, runtime: Runtime, seed: int, reference_dir: str | Path,
                     reward_dir: str | Path, tokenizer: PreTrainedTokenizerBase,
                     policy_loading: Callable[[str | Path], contextlib.AbstractContextManager[bool]] | None = None,
                     ) -> PPOModels:
    """Policy (starts as the reference), frozen reference, frozen RM scorer and the configured value model (none for
    a critic-free estimator).

    With ``config.lora.enabled`` the policy is a LoRA adapter on the SFT weights, the reference is the same
    model with the adapter disabled, and a critic is a LoRA adapter on the scorer's reward model: two copies
    of base weights instead of four. ``policy_loading(reference_dir)``: the block the policy is loaded in, which
    says whether it came out partitioned (DeepSpeed workers: ``zero.partitioned_loading``); a partitioned policy
    is left where ZeRO put it, the reference is loaded from disk on its own, not copied from it, and so is a
    critic's reward model, in the same block as the policy.
    """
    device, dtype, lora, loading = runtime.torch_device, runtime.torch_dtype, config.lora, policy_loading or _whole
    with loading(reference_dir) as partitioned:
        policy = load_policy(str(reference_dir), dtype)
    policy = policy if partitioned else policy.to(device)
    hidden_size = policy.config.hidden_size
    members = reward_members(reward_dir)
    scorers = [RewardModelScorer(load_reward_model(str(member), dtype).to(device), tokenizer, load_tokenizer(member),
                                 batch_size=config.micro_batch_size, max_tokens=config.max_tokens_per_forward)
               for member in members]
    scorer = ensemble_of(scorers, config.reward.ensemble, config.reward.ensemble_coef)
    # a critic starts from the (first) reward model
    reward_model, rm_tokenizer, critic_dir = scorers[0].model, scorers[0].rm_tokenizer, members[0]
    if partitioned:  # ZeRO-3 refuses LoRA (frozen weights in a trained model); the copy would copy only shards
        reference = freeze(load_policy(str(reference_dir), dtype).to(device))
    else:
        policy, reference = lora_policy(policy, lora, seed) if lora.enabled else (policy, make_reference(policy))
    common = dict(policy=policy, reference=reference, scorer=scorer,
                  stop_token_ids=(tokenizer.eos_token_id,), pad_token_id=pad_id(tokenizer))
    if not config.uses_value_model:  # a critic-free estimator: no value model is built or loaded
        return PPOModels(**common)
    if config.value_model == "critic":
        check_critic(reward_model, tokenizer, rm_tokenizer)
        if partitioned:  # its own copy, loaded partitioned as the policy was: no rank holds the critic whole
            with loading(critic_dir):
                return PPOModels(**common, critic=Critic(load_reward_model(str(critic_dir), dtype), copy_weights=False))
        critic = LoRACritic(reward_model, lora, seed) if lora.enabled else Critic(reward_model)
        return PPOModels(**common, critic=critic.to(device))
    return PPOModels(**common, value_head=ValueHead(hidden_size, seed=seed).to(device))


@contextlib.contextmanager
def _whole(folder: str | Path) -> Iterator[bool]:
    """Load as usual: every process holds the whole model."""
    yield False


def check_critic(reward_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 rm_tokenizer: PreTrainedTokenizerBase) -> None:
    """ValueError in one line unless the reward model can be a per-token critic of this policy: a decoder with a
    per-token score head (``roles.split_classifier``) that reads the policy's token ids in the same vocabulary."""
    split_classifier(reward_model)
    if not same_vocabulary(tokenizer, rm_tokenizer):
        raise ValueError(f"ppo.value_model='critic' reads the policy's token ids, but the reward model's tokenizer "
                         f"({rm_tokenizer.name_or_path!r}) has another vocabulary than the policy's "
                         f"({tokenizer.name_or_path!r}); use ppo.value_model=head, or a reward model trained on the "
                         "policy's tokenizer (reward_model.init=sft)")
