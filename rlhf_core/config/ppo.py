"""The PPO section and its parts: how rollouts are sampled, the KL leash, how scores become rewards, and the PPO
update itself (``PPOConfig``, which also covers GRPO, RLOO and REINFORCE++ through ``advantage``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from rlhf_core.compat import STATIC_CACHE
from rlhf_core.config.shared import Autocast, LoRAConfig, OptimizerConfig
from rlhf_core.ppo.aggregation import LossAggregation
from rlhf_core.ppo.kl import KLEstimator
from rlhf_core.ppo.rewards import EnsembleAggregation
from rlhf_core.ranges import Count, Fraction, KeptCount, NonNegative, Positive, PositiveInt, Range, check_ranges


@dataclass(frozen=True)
class GenerationConfig:
    """How rollouts are sampled."""

    max_new_tokens: PositiveInt = 48
    """Longest response; a response that reaches it without a stop token is 'truncated'."""
    temperature: Positive = 1.0
    """Sampling temperature; also divides the logits in every log-prob recomputation."""
    top_k: Annotated[int, Range(ge=0, note="0 = off")] = 0
    """Keep only the k most likely tokens when sampling (0 = off). Log-probs use the full softmax."""
    top_p: Annotated[float, Range(gt=0, le=1, note="1 = off")] = 1.0
    """Nucleus sampling threshold (1.0 = off). Log-probs use the full softmax."""
    batch_size: PositiveInt = 64
    """Prompts generated at once (rollouts are produced in chunks of this size)."""
    cache: Literal["dynamic", "static"] = "dynamic"
    """The KV cache of the decode loop: 'dynamic' grows it a token at a time; 'static' preallocates it for the
    longest rollout (transformers' StaticCache, transformers >= 5) and, on CUDA, compiles the decode step with
    torch.compile, as transformers' own generate does. A speed knob: the same samples and log-probs for the same
    seed (float32; rlhf_core/training/rollout.py)."""

    def __post_init__(self) -> None:
        check_ranges(self, "generation")
        if self.cache == "static" and not STATIC_CACHE:
            raise ValueError("generation.cache=static needs transformers >= 5 (its StaticCache keeps its own "
                             "positions); use cache=dynamic or upgrade transformers")


@dataclass(frozen=True)
class KLConfig:
    """The KL leash between the policy and the frozen reference."""

    coef: NonNegative = 0.05
    """Initial KL coefficient (TRL 0.05, OpenRLHF 0.01, verl 0.001)."""
    estimator: KLEstimator = "k1"
    """Per-token KL estimator: k1 (TRL default), k2, k3, abs. In the loss k1 is refused: its gradient averages to
    zero, so the leash would silently vanish; use k3 (GRPO) or k2 there."""
    clamp: Positive | None = 10.0
    """Bound on the per-token estimate: its value is clamped to [-clamp, clamp] in the reward penalty and in the loss
    term, where a clamped token gets no gradient (OpenRLHF: 10 for every estimator; verl: 10 for k3 only; TRL: none;
    rlhf_core/ppo/kl.py). None = unclamped."""
    placement: Literal["reward", "loss"] = "reward"
    """'reward': -coef*kl in the per-token reward (InstructGPT); 'loss': coef*KL added to the loss (GRPO-style,
    aggregated like the other loss terms)."""
    adaptive: bool = False
    """Adapt coef towards `target` per-sequence KL (Ziegler et al.); else coef stays fixed."""
    target: Positive = 6.0
    """Target per-sequence KL (nats, summed over tokens) for the adaptive controller."""
    horizon: Positive = 10000.0
    """Adaptive controller horizon in samples: larger = slower adaptation."""

    def __post_init__(self) -> None:
        check_ranges(self, "kl")
        if self.placement == "loss" and self.estimator == "k1":
            raise ValueError("ppo.kl.estimator=k1 with ppo.kl.placement=loss: the gradient of k1 averages to zero, so "
                             "the KL term would not pull the policy back; set ppo.kl.estimator=k3 (or k2)")


@dataclass(frozen=True)
class RewardShapingConfig:
    """How sequence scores become rewards."""

    missing_stop_penalty: float | None = None
    """If set, a response that ends without a stop token gets this score instead of the model's."""
    clip: Positive | None = None
    """Clip scores to [-clip, clip] (OpenRLHF 10, DeepSpeed-Chat 5), after ``normalize`` when that is on (OpenRLHF
    clips the normalised reward; PPO-max normalises, then clips); None = off."""
    normalize: bool = False
    """Normalise scores with running mean/std across batches (mean shifted), before ``clip``."""
    ensemble: EnsembleAggregation = "mean"
    """How the members of a reward-model ensemble (``reward_model.ensemble_size`` > 1) make the score PPO optimises,
    best-of-n picks by and evaluation reports as the proxy's (Coste et al. 2023): 'mean'; 'min' (worst case);
    'mean_minus_std' (uncertainty-weighted: mean - ensemble_coef x the members' std). One member: its score."""
    ensemble_coef: NonNegative = 1.0
    """'mean_minus_std' only: the weight of the members' standard deviation."""

    def __post_init__(self) -> None:
        check_ranges(self, "reward")


@dataclass(frozen=True)
class PPOConfig(OptimizerConfig):
    """One PPO update = one rollout batch, `ppo_epochs` passes over it in mini-batches."""

    rollout_batch_size: PositiveInt = 64
    """Prompts (= rollouts) per PPO update."""
    mini_batch_size: PositiveInt = 16
    """Rollouts per optimizer step; must divide rollout_batch_size."""
    micro_batch_size: PositiveInt = 16
    """Rollouts per forward/backward; mini_batch_size / micro_batch_size = gradient-accumulation steps."""
    max_tokens_per_forward: PositiveInt | None = None
    """Most tokens in one forward, in experience collection (old / reference log-probs, values, reward-model scores)
    and in the PPO training micro-batches: at most micro_batch_size rollouts, fewer while they are long (real tokens
    where the policy packs rows, else rows x width; rlhf_core/models/budget.py); a rollout longer than it goes alone.
    None = micro_batch_size rollouts always. A memory knob: the results are the same."""
    ppo_epochs: PositiveInt = 4
    """Passes over each rollout batch (TRL 4; OpenRLHF/verl 1)."""
    value_learning_rate: Positive = 1e-5
    """Value model (critic or value head) learning rate."""
    total_updates: PositiveInt = 100
    """Planned PPO updates (used only by the linear schedule). The pipeline derives it: ``ppo.iterations x
    ppo.updates_per_iteration``."""
    clip_range: Positive = 0.2
    """Policy ratio clip epsilon."""
    clip_range_value: Positive | None = 0.2
    """Value clip epsilon around the old values; None disables value clipping."""
    vf_coef: NonNegative = 0.1
    """c1: weight of the value loss in the combined objective."""
    entropy_coef: NonNegative = 0.0
    """c2: weight of the entropy bonus."""
    gamma: Fraction = 1.0
    """Discount per token."""
    lam: Fraction = 0.95
    """GAE lambda."""
    advantage: Literal["gae", "sequence", "grpo", "rloo", "reinforce_pp"] = "gae"
    """The advantage estimator. With a value model: 'gae' (token-level GAE) or 'sequence' (A = R - V(s) on every
    token). Critic-free (no value model is built): 'grpo' (each reply's score minus its group's mean, divided by
    the group's std when ``grpo_scale_by_std``), 'rloo' (score minus the mean of the group's other replies),
    'reinforce_pp' (REINFORCE++: the score itself, whitened over the batch). For the critic-free ones the
    advantage of a token is that baseline-adjusted score plus the KL penalties from that token on (with
    ``kl.placement=reward``), discounted by ``gamma``. A group is the ``samples_per_prompt`` replies to one prompt."""
    samples_per_prompt: PositiveInt = 1
    """Replies sampled per prompt; ``rollout_batch_size / samples_per_prompt`` prompts per update. 'grpo' and 'rloo'
    need at least 2 (their baseline is the group)."""
    grpo_scale_by_std: bool = True
    """'grpo': divide by the group's score std (the original GRPO); False = Dr. GRPO (no std division)."""
    loss_aggregation: LossAggregation = "token-mean"
    """How per-token loss terms (policy, value, entropy, KL) become one loss over a mini-batch, by verl's names:
    'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum' (each sequence's sum, averaged over sequences) or
    'seq-mean-token-sum-norm' (a constant normaliser: TRL GRPO's 'dr_grpo'); see rlhf_core/ppo/aggregation.py.
    Always over the whole mini-batch, so micro-batch size never changes the update."""
    whiten_advantages: bool | None = None
    """Whiten advantages over the rollout batch (mean shifted). None = the estimator's own rule, as its anchors do:
    on for 'gae' and 'sequence' (TRL, verl) and 'reinforce_pp' (its baseline); off for 'grpo' and 'rloo', whose
    group baseline is their only normalisation (verl, OpenRLHF; TRL RLOO's normalize_advantages defaults to off).
    True or False overrides the rule (reinforce_pp refuses False)."""
    dual_clip: Annotated[float, Range(gt=1, note="verl's clip_ratio_c is 3")] | None = None
    """Dual-clip PPO (Ye et al. 2020): a token with a negative advantage contributes at most ``-A * dual_clip``,
    however far its ratio ran (verl's clip_ratio_c, default 3 there; OpenRLHF's dual_clip, off by default).
    None = off (TRL has none)."""
    critic_warmup_updates: Count = 0
    """The first this many PPO updates train only the value model: rollouts are sampled and scored as usual, the
    policy is not stepped (a value head's loss does not reach the policy's weights). They count among the run's
    updates, as OpenRLHF's critic.freezing_steps and verl's critic_warmup do. 0 = off; critic-free estimators
    have nothing to warm up and refuse it."""
    critic_lam: Fraction | None = None
    """GAE lambda of the value model's targets (VC-PPO: 1.0, unbiased returns for the critic) while the advantages
    keep ``lam``; None = ``lam`` for both (TRL, verl, OpenRLHF have one lambda). Only 'gae' reads it."""
    value_model: Literal["critic", "head"] = "head"
    """'critic': separate model initialised from the reward model; 'head': linear value head on the policy.
    Critic-free estimators build neither."""
    ref_refresh_every: Annotated[int, Range(ge=0, note="0 = never")] = 0
    """Copy the policy into the reference every N updates (0 = never). With LoRA: merge the adapter into the
    shared base weights and restart the adapter (B = 0, fresh A, its optimizer moments cleared)."""
    keep_checkpoints: KeptCount = 2
    """Checkpoints (weights + optimizer state) kept inside a running stage; older ones are deleted as newer land.
    Two keep one to fall back on when the newest is damaged. Not part of any artifact key (it changes no result)."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL penalty settings."""
    reward: RewardShapingConfig = field(default_factory=RewardShapingConfig)
    """Score shaping settings."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Rollout sampling settings."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA policy whose reference is the same model with the adapter disabled; with value_model 'critic'
    the critic is a LoRA of the reward model sharing its frozen weights with the scorer."""
    gradient_checkpointing: bool = False
    """Recompute the policy's (and a critic's) block activations in the backward pass instead of storing
    them: activation memory ~1/n_layer for ~30% more training compute. Same gradients."""
    autocast: Autocast = "none"
    """'bf16': training forwards, old and reference log-probs and values under bf16 autocast (halves activation
    memory, faster on GPUs with bf16 units); 'none': the weights' own precision."""
    offload_frozen: bool = False
    """Hold the frozen reference and reward model in host memory while the policy and value model train (they are
    back on their device to collect experience; rlhf_core/models/offload.py). A network sharing weights with a
    trained one stays (LoRA reference; reward model under a LoRA critic). A memory knob: the results are the same."""
    seed: Count = 0
    """Seed for prompt order and sampling."""

    def __post_init__(self) -> None:
        check_ranges(self, "ppo")
        if self.lora.enabled and self.lora.dropout > 0:
            raise ValueError(
                f"ppo.lora.dropout must be 0 (got {self.lora.dropout}): PPO runs every model without dropout so "
                "that the first ratio is exactly 1; set ppo.lora.dropout=0"
            )
        if self.rollout_batch_size % self.samples_per_prompt:
            raise ValueError(
                f"ppo.samples_per_prompt ({self.samples_per_prompt}) must divide "
                f"ppo.rollout_batch_size ({self.rollout_batch_size}): the batch is whole groups of replies"
            )
        if self.advantage in ("grpo", "rloo") and self.samples_per_prompt < 2:
            raise ValueError(
                f"ppo.advantage={self.advantage} compares the replies to one prompt: set ppo.samples_per_prompt >= 2 "
                f"(got {self.samples_per_prompt})"
            )
        if self.advantage == "reinforce_pp" and self.whiten_advantages is False:
            raise ValueError("ppo.advantage=reinforce_pp whitens its returns over the batch (that is its baseline); "
                             "set ppo.whiten_advantages=true")
        if self.rollout_batch_size % self.mini_batch_size:
            raise ValueError(
                f"ppo.mini_batch_size ({self.mini_batch_size}) must divide "
                f"ppo.rollout_batch_size ({self.rollout_batch_size})"
            )
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError(
                f"ppo.micro_batch_size ({self.micro_batch_size}) must divide "
                f"ppo.mini_batch_size ({self.mini_batch_size})"
            )
        longest_reply = self.generation.max_new_tokens + 1  # with at least one prompt token
        if self.max_tokens_per_forward is not None and self.max_tokens_per_forward < longest_reply:
            raise ValueError(f"ppo.max_tokens_per_forward={self.max_tokens_per_forward} cannot hold one rollout of "
                             f"a prompt token and ppo.generation.max_new_tokens={self.generation.max_new_tokens}; "
                             f"raise it to at least {longest_reply} (prompt lengths on top)")
        if self.whitens and self.rollout_batch_size < 8:
            raise ValueError(
                f"ppo.whiten_advantages (on for ppo.advantage={self.advantage}) needs ppo.rollout_batch_size >= 8 "
                "(whitening a tiny batch is noise); raise the batch size or set ppo.whiten_advantages=false"
            )
        if self.critic_warmup_updates and not self.uses_value_model:
            raise ValueError(f"ppo.critic_warmup_updates={self.critic_warmup_updates} warms up a value model, which "
                             f"ppo.advantage={self.advantage} does not have; set it to 0")
        if self.critic_lam is not None and self.advantage != "gae":
            raise ValueError(f"ppo.critic_lam is the GAE lambda of the value targets; ppo.advantage={self.advantage} "
                             "computes no GAE: drop it or set ppo.advantage=gae")

    @property
    def whitens(self) -> bool:
        """Whether advantages are whitened over the batch: ``whiten_advantages``, or the estimator's rule when None."""
        if self.whiten_advantages is not None:
            return self.whiten_advantages
        return self.advantage not in ("grpo", "rloo")

    @property
    def uses_value_model(self) -> bool:
        """False for the critic-free estimators: no value model is built, trained or checkpointed."""
        return self.advantage in ("gae", "sequence")

    @property
    def prompts_per_update(self) -> int:
        """Prompts per PPO update: each is sampled ``samples_per_prompt`` times."""
        return self.rollout_batch_size // self.samples_per_prompt
