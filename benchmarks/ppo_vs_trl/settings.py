"""One set of PPO hyperparameters, turned into this project's ``PPOConfig`` and into TRL 1.12's ``PPOConfig``.

Every value that both sides read comes from :class:`Settings`, so the two configurations cannot drift apart.
Where TRL has no equivalent of one of our settings (gradient clipping) ours is set to TRL's behaviour; what
cannot be matched at all is listed in ``UNMATCHED`` and in benchmarks/README.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.fixtures import FixtureSpec
from rlhf_core.config import GenerationConfig, KLConfig, PPOConfig, RewardShapingConfig


@dataclass(frozen=True)
class Settings:
    """The shared setup of one comparison."""

    fixture: FixtureSpec = field(
        default_factory=lambda: FixtureSpec(sft_demonstrations=2000, rm_pairs=2000)
    )
    """Tokenizer, policy and reward model (policy SFT'd and RM trained, so rewards carry signal)."""
    rollout_batch_size: int = 32
    """Rollouts per PPO update (TRL: per_device_train_batch_size x gradient_accumulation_steps)."""
    micro_batch_size: int = 32
    """Rollouts per forward/backward (TRL: per_device_train_batch_size); also the scoring chunk on both sides."""
    max_new_tokens: int = 48
    """Longest response (TRL: response_length)."""
    ppo_epochs: int = 4
    """Passes over each rollout batch."""
    learning_rate: float = 3e-5
    """AdamW learning rate of the policy AND the value model (TRL has one optimizer over both)."""
    clip_range: float = 0.2
    """Policy ratio clip (TRL: cliprange)."""
    clip_range_value: float = 0.2
    """Value clip around the old values (TRL: cliprange_value)."""
    vf_coef: float = 0.1
    """Weight of the value loss."""
    kl_coef: float = 0.05
    """Fixed KL coefficient of the k1 KL penalty in the reward."""
    gamma: float = 1.0
    """Discount."""
    lam: float = 0.95
    """GAE lambda."""
    temperature: float = 0.7
    """Sampling temperature (TRL's default), also used in every log-prob recomputation."""
    missing_eos_penalty: float = 1.0
    """Subtracted from the score of a response without a stop token (TRL semantics; see ``penalised_scorer``)."""
    updates: int = 6
    """PPO updates per run (the first is reported but left out of the timing medians: warm-up)."""
    repeats: int = 3
    """Runs per side; run k of each side uses seed k; sides alternate ours, TRL, ours, TRL ..."""
    threads: int | None = None
    """torch intra-op threads in every run (None = torch's default, one per core)."""

    @property
    def mini_batch_size(self) -> int:
        """One optimizer step per epoch over the whole rollout batch: the only mini-batching TRL 1.12 does
        correctly (see ``UNMATCHED``)."""
        return self.rollout_batch_size


def smoke_settings() -> Settings:
    """Tiny sizes for the smoke test: random models, 8 rollouts x 8 tokens, 2 updates, one run per side."""
    tiny = FixtureSpec(vocab_size=400, n_layer=2, n_embd=64, n_head=4, n_positions=128, n_prompts=32,
                       prompt_max_tokens=24)
    return Settings(fixture=tiny, rollout_batch_size=8, micro_batch_size=8, max_new_tokens=8, ppo_epochs=2,
                    updates=2, repeats=1)


def small_settings() -> Settings:
    """The scale of the first speed target: a ~0.5M-parameter GPT-2 (2 x 128), 32 new tokens.

    Fixed costs (Python per generated token, TRL's ``gc.collect()`` calls) weigh more here than at the
    default ~3.5M parameters, where the matmuls of the training phase dominate both sides.
    """
    small = FixtureSpec(n_layer=2, n_embd=128, n_head=4, sft_demonstrations=2000, rm_pairs=2000)
    return Settings(fixture=small, max_new_tokens=32, learning_rate=1e-4)


PRESETS = {"default": Settings, "small": small_settings, "smoke": smoke_settings}
"""Named settings: ``default`` (~3.5M parameters, 48 new tokens), ``small`` (~0.5M, 32), ``smoke`` (tiny)."""


def ours_config(s: Settings, seed: int) -> PPOConfig:
    """This project's config for the shared settings."""
    return PPOConfig(
        rollout_batch_size=s.rollout_batch_size,
        mini_batch_size=s.mini_batch_size,
        micro_batch_size=s.micro_batch_size,
        ppo_epochs=s.ppo_epochs,
        learning_rate=s.learning_rate,
        value_learning_rate=s.learning_rate,
        weight_decay=0.0,
        lr_schedule="constant",
        # TRL 1.12's PPO never clips gradients: an infinite norm makes ours a no-op too.
        max_grad_norm=math.inf,
        clip_range=s.clip_range,
        clip_range_value=s.clip_range_value,
        vf_coef=s.vf_coef,
        entropy_coef=0.0,
        gamma=s.gamma,
        lam=s.lam,
        advantage="gae",
        whiten_advantages=True,
        value_model="critic",
        kl=KLConfig(coef=s.kl_coef, estimator="k1", placement="reward", adaptive=False),
        # The missing-stop penalty is applied by the scorer (TRL subtracts it; our shaping option replaces the
        # score), so shaping here stays off.
        reward=RewardShapingConfig(missing_stop_penalty=None, clip=None, normalize=False),
        generation=GenerationConfig(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=0, top_p=1.0,
                                    batch_size=s.rollout_batch_size),
        seed=seed,
    )


def trl_config_kwargs(s: Settings, seed: int, output_dir: str) -> dict[str, Any]:
    """Keyword arguments of ``trl.experimental.ppo.PPOConfig`` for the shared settings."""
    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=s.micro_batch_size,
        gradient_accumulation_steps=s.rollout_batch_size // s.micro_batch_size,
        num_mini_batches=s.rollout_batch_size // s.mini_batch_size,
        local_rollout_forward_batch_size=s.micro_batch_size,
        total_episodes=s.rollout_batch_size * s.updates,
        num_ppo_epochs=s.ppo_epochs,
        learning_rate=s.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        response_length=s.max_new_tokens,
        stop_token="eos",
        temperature=s.temperature,
        missing_eos_penalty=s.missing_eos_penalty,
        kl_coef=s.kl_coef,
        kl_estimator="k1",
        cliprange=s.clip_range,
        cliprange_value=s.clip_range_value,
        vf_coef=s.vf_coef,
        gamma=s.gamma,
        lam=s.lam,
        whiten_rewards=False,
        # CPU: no bf16 (TRL's default would turn it on), no gradient checkpointing (TRL's default; ours has none).
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        # Debug sample tables and checkpoints are not part of a PPO update.
        num_sample_generations=0,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        seed=seed,
    )


#: Settings that differ between the two sides and why. Written into the result JSON and into the README.
UNMATCHED: dict[str, str] = {
    "reward position": "TRL adds the score one slot after the last real token (the first pad); "
    "ours adds it on the last real token (the stop token). Not configurable in TRL.",
    "value mask": "TRL trains values on one extra (pad) position after each response (padding_mask_p1); ours on "
    "real response tokens only.",
    "old log-probs": "TRL takes them from generate()'s scores (KV-cache pass, temperature + 1e-7); ours recompute "
    "them with a full forward pass so the first ratio is exactly 1.",
    "temperature": "TRL divides logits by temperature + 1e-7; ours by the temperature itself.",
    "mini-batches": "TRL 1.12 steps the optimizer every gradient_accumulation_steps micro-batches counted across "
    "mini-batch boundaries, so num_mini_batches > 1 does not give more optimizer steps; both sides use one "
    "mini-batch = the whole rollout batch (4 optimizer steps per update).",
    "optimizer": "Both use torch's fused AdamW (TRL: the Trainer's default adamw_torch_fused); TRL has one param "
    "group over policy + value model, ours two groups at the same lr. Same update.",
    "gradient clipping": "TRL never clips in PPO; ours clips at max_grad_norm=inf (a no-op, the norm is still "
    "computed).",
    "missing-eos penalty": "TRL subtracts it from the score; our RewardShapingConfig.missing_stop_penalty replaces "
    "the score. Ours composes the RM scorer with a -penalty rule instead (WeightedSum), i.e. TRL's semantics.",
    "random streams": "Same seeds, same prompts in the same order, same initial weights, but each side draws its "
    "samples from its own RNG stream (TRL: the global torch RNG; ours: a torch.Generator), so the rollouts and "
    "the reward curves are statistically, not bitwise, comparable.",
    "entropy": "Both report entropy without a bonus; TRL computes it under no_grad, ours inside the graph "
    "(entropy_coef=0).",
}


def describe(s: Settings) -> dict[str, Any]:
    """The settings as a JSON-able dict."""
    out = asdict(s)
    out["mini_batch_size"] = s.mini_batch_size
    return out
