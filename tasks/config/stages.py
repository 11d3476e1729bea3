"""The stage sections of the pipeline config: data, SFT, the reward models, PPO, DPO, evaluation and refresh. The
training sections ARE the ``rlhf_core.config`` dataclasses with the pipeline's own fields added."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from rlhf_core.config import DPOConfig, PPOConfig, RewardTrainingConfig, SFTConfig
from rlhf_core.data import DataPrepConfig
from rlhf_core.demo.annotator import DEFAULT_TEMPERATURE
from rlhf_core.demo.config import DemoDataConfig
from rlhf_core.models.lm import ModelSize, model_size
from rlhf_core.models.tokenizer import MIN_VOCAB_SIZE, SpecialTokens
from rlhf_core.ranges import Count, Fraction, KeptCount, NonNegative, Positive, PositiveInt, Range, check_ranges
from tasks.run_store.keys import LocalPath, ModelSource
from tasks.typed_yaml import derived


@dataclass(frozen=True)
class DataSection:
    """Where the preference data comes from and how it is validated and split."""

    source: Literal["demo", "files"] = "demo"
    """'demo': generate the embedded task; 'files': read ``files`` (Parquet / JSONL / CSV)."""
    files: tuple[LocalPath, ...] = ()
    """Preference files (local paths or URIs); only with source 'files'."""
    prompts_file: LocalPath | None = None
    """Optional separate PPO prompts file (column 'prompt'); None = PPO prompts are split off the pairs."""
    demo: DemoDataConfig = field(default_factory=DemoDataConfig)
    """Sizes of the generated task."""
    prep: DataPrepConfig = field(default_factory=DataPrepConfig)
    """Validation, dedupe and split settings of the data-prep stage."""

    def __post_init__(self) -> None:
        if self.source == "files" and not self.files:
            raise ValueError("data.source is 'files' but data.files is empty; list the preference files")
        if self.source == "demo" and (self.files or self.prompts_file):
            raise ValueError("data.files / data.prompts_file are read only with data.source='files'; "
                             "set data.source=files or drop them")


@dataclass(frozen=True)
class SFTSection(SFTConfig):
    """The policy PPO starts from (a given model, or one fine-tuned here) and the fine-tuning hyperparameters."""

    enabled: bool = True
    """Run the sft stage; False = use ``base_model`` as the SFT policy as it is (with demonstrations, its
    held-out loss and gold report are still measured)."""
    base_model: ModelSource | None = None
    """Hugging Face id or local path of the base policy; None = build a small GPT and a BPE tokenizer here."""
    vocab_size: Annotated[int, Range(ge=MIN_VOCAB_SIZE, note='byte-level BPE')] = 2000
    """Vocabulary of the BPE tokenizer trained on the task text (only when base_model is None)."""
    model_size: Literal["tiny", "demo"] | ModelSize = "demo"
    """Size of the GPT built here: a preset name (``rlhf_core.models.lm.PRESETS``) or its shape
    (n_layer, n_embd, n_head, n_positions); only when base_model is None."""
    tokens: SpecialTokens = field(default_factory=SpecialTokens)
    """The policy's eos / bos / pad, as token text, where ``base_model``'s tokenizer lacks them or should use others
    (e.g. ``eos: "<|im_end|>"`` for a chat model). Saved with the SFT policy, so every later stage reads the same."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ranges(self, "sft")
        if isinstance(self.model_size, str):
            model_size(self.model_size)  # fails with the list of presets
        if not self.enabled and self.base_model is None:
            raise ValueError("sft.enabled=false needs sft.base_model (the SFT policy to start PPO from)")


@dataclass(frozen=True)
class RewardModelSection:
    """The proxy reward model PPO optimises, and the held-out one that only evaluation sees."""

    init: ModelSource = "sft"
    """Where the proxy reward model starts. 'sft': the SFT policy's weights with a fresh scalar head; 'scratch': a fresh
    model of the policy's shape; else a local folder, ``models:/`` URI or Hugging Face id of any sequence-classification
    or base checkpoint, decoder or encoder (a 1-output classifier is continued; anything else gets a fresh scalar head)
    with its own tokenizer."""
    heldout_init: ModelSource | None = None
    """Where the held-out reward model starts (same choices as ``init``); None = the same as ``init``."""
    tokens: SpecialTokens = field(default_factory=SpecialTokens)
    """eos / bos / pad of a reward-model init's own tokenizer (not 'sft' / 'scratch', which use the policy's), as token
    text; None = its own, else the fallbacks (eos: sep, bos: cls, pad: eos)."""
    training: RewardTrainingConfig = field(default_factory=RewardTrainingConfig)
    """Training of the proxy reward model (on the train pairs)."""
    heldout: RewardTrainingConfig = field(default_factory=lambda: RewardTrainingConfig(seed=1))
    """Training of the held-out reward model (on the held-out pairs; a different seed by default)."""
    heldout_onpolicy_pairs: Count = 0
    """Pairs of the SFT policy's own replies (two samples of ``ppo.generation`` per prompt, prompts drawn from the
    preference pairs') that the simulated annotator labels, with the preference data's noise, and the held-out reward
    model trains on beside the held-out pairs: labels on the replies a policy writes (garbled sentences, order
    numbers it made up), which composed preference pairs never show, so the held-out judge can see a policy exploit
    what the proxy cannot tell. The demo task only (its simulated annotator); 0 = none."""
    ensemble_size: PositiveInt = 1
    """Proxy reward models trained (an ensemble, Coste et al. 2023): member k is trained as ``training`` says with
    seed ``training.seed + k`` (its own fresh head and data order), each a whole model, and they are registered
    together as one version; PPO, best-of-n and evaluation score with ``ppo.reward.ensemble`` over them. 1 = one
    proxy, as without an ensemble."""

    def __post_init__(self) -> None:
        for key, value in (("init", self.init), ("heldout_init", self.heldout_init)):
            if value is not None and not value.strip():
                raise ValueError(f"reward_model.{key} must be 'sft', 'scratch' or a model path / id, got ''")

    def init_of(self, role: str) -> str:
        """The init of the ``'proxy'`` or ``'heldout'`` reward model."""
        return self.heldout_init if role == "heldout" and self.heldout_init is not None else self.init

    @property
    def inits(self) -> tuple[str, ...]:
        """Both inits, proxy first (equal when ``heldout_init`` is None)."""
        return (self.init_of("proxy"), self.init_of("heldout"))


@dataclass(frozen=True)
class PPOSection(PPOConfig):
    """PPO hyperparameters and the outer loop: ``iterations`` x (ppo-iteration -> heldout-eval -> [rm-refresh])."""

    total_updates: int = field(init=False, metadata=derived("ppo.iterations x ppo.updates_per_iteration"))
    """Planned PPO updates of the whole run, ``iterations x updates_per_iteration`` (derived, not a setting;
    only the linear learning-rate schedule reads it)."""
    iterations: PositiveInt = 3
    """Outer pipeline iterations N."""
    updates_per_iteration: PositiveInt = 20
    """PPO updates (rollout batches) inside one ppo-iteration stage."""
    checkpoint_every: Annotated[int, Range(ge=0, note='0 = none')] = 5
    """Save a resumable checkpoint every this many updates inside the stage (0 = none, restart on failure)."""
    keep_resume_states: KeptCount = 2
    """Finished iterations whose resume state (last checkpoint: optimizer state, RNGs, prompt cursor; ~2x the
    policy's weights at full fine-tuning) stays in the state folder; older ones are pruned once a later iteration
    is published. Redoing an iteration after its predecessor's state was pruned refuses and says how to redo it.
    Their policies (``policy/`` of each artifact) are never pruned. Not part of any artifact key."""

    def __post_init__(self) -> None:
        check_ranges(self, "ppo")  # before the parent's rules divide by them
        super().__post_init__()
        object.__setattr__(self, "total_updates", self.iterations * self.updates_per_iteration)


@dataclass(frozen=True)
class DPOSection(DPOConfig):
    """The dpo stage (``method: dpo``): DPO or IPO on the reward-model training pairs, the policy starting from the
    SFT policy and held to the SFT policy as its frozen reference (``rlhf_core.training.dpo``)."""

    checkpoint_every: Annotated[int, Range(ge=0, note='0 = none')] = 50
    """Save a resumable checkpoint every this many steps inside the stage (0 = none: a failed attempt starts over)."""

    def __post_init__(self) -> None:
        check_ranges(self, "dpo")
        super().__post_init__()


@dataclass(frozen=True)
class EvalSection:
    """The heldout-eval stage and the promotion gate."""

    n_prompts: PositiveInt = 256
    """Evaluation prompts scored per iteration."""
    temperature: Annotated[float, Range(ge=0, note='0 = greedy')] = 1.0
    """Sampling temperature of evaluation replies; 0 = greedy. Keep it at the PPO sampling temperature: the
    reported KL is a sample estimate that is only meaningful on replies sampled from the policy itself."""
    batch_size: PositiveInt = 64
    """Prompts generated and scored at once."""
    max_tokens_per_forward: PositiveInt | None = None
    """Most tokens in one reward-model scoring forward of the evaluation stages (heldout-eval, best-of-n, rm-refresh's
    rm_judge): at most batch_size replies, fewer while they are long (rlhf_core/models/budget.py); None = rows only.
    A memory knob: the scores are the same."""
    kl_budget: Positive = 10.0
    """Largest mean per-sequence KL to the reference (nats) a promoted policy may have."""
    hacking_margin: NonNegative = 0.0
    """Flag reward hacking when the proxy score rises while the held-out score falls by more than this."""
    min_win_rate: Fraction = 0.5
    """Promote a policy only when its held-out win rate against the reference reaches this."""

    def __post_init__(self) -> None:
        check_ranges(self, "eval")


@dataclass(frozen=True)
class RefreshSection:
    """The rm-refresh stage: label fresh on-policy reply pairs and continue training the proxy reward model."""

    enabled: bool = True
    """Run rm-refresh at all."""
    every_k: Annotated[int, Range(ge=0, note='0 = only when eval flags reward hacking')] = 0
    """Refresh on a schedule every k iterations (0 = only when eval flags reward hacking)."""
    on_hacking: bool = True
    """Refresh whenever heldout-eval's held-out verdict flags reward hacking (the held-out reward model's fall; gold,
    where the task has it, only evaluates and never decides what trains next)."""
    annotator: Literal["simulated", "file", "rm_judge"] = "simulated"
    """Who labels fresh pairs: 'simulated' is the demo task's annotator, the human stand-in (needs
    data.source='demo'); 'file' exports the pairs for people to label and imports ``labels_file``;
    'rm_judge' lets the reward model ``judge_model`` prefer the higher-scoring reply."""
    annotator_temperature: Positive = DEFAULT_TEMPERATURE
    """Noise of the simulated annotator."""
    judge_model: ModelSource | None = None
    """rm_judge only: local path or ``models:/`` URI of the judging reward model. None = the held-out RM, which
    then stops being independent of the proxy: give a separate judge when the held-out eval must stay clean."""
    labels_file: LocalPath | None = None
    """file only: the labelled copy of the exported pairs (CSV or Parquet); '{iteration}' in it becomes the
    iteration number. None = export the unlabelled pairs and stop with instructions (see tasks/labelling.py)."""
    export_format: Literal["csv", "parquet"] = "csv"
    """file only: format of the exported unlabelled pairs (CSV opens in any spreadsheet)."""
    n_pairs: Annotated[int, Range(ge=2, note='a train and an eval prompt')] = 512
    """Prompts sampled per refresh; the policy writes two replies to each, and each pair is labelled once."""
    on_policy_eval_fraction: Annotated[float, Range(gt=0, lt=1)] = 0.25
    """Share of the fresh pairs' prompts held out to measure the RM on on-policy replies (never trained on)."""
    validation_fraction: Annotated[float, Range(ge=0, lt=1)] = 0.0
    """Share of the remaining fresh prompts held back to choose how long to train: the RM is scored on their
    pairs before the continued training and after every epoch, and the epoch with the lowest loss is kept
    (0 = the RM before the refresh, so over-fitting epochs are undone). 0 = train every epoch, keep the last.
    The validation pairs are saved with the refresh-train pairs, so later refreshes train on them."""
    keep_old_pairs: bool = True
    """Replay original training pairs next to the fresh ones (False = fresh ones only)."""
    old_pairs_ratio: NonNegative = 1.0
    """With keep_old_pairs: old pairs replayed per fresh training pair (a seeded sample, at most all of them)."""
    epochs: PositiveInt = 2
    """Passes over the refresh training pairs; training continues from the current proxy's weights."""
    learning_rate: Positive | None = None
    """AdamW learning rate of the continued training; None = reward_model.training.learning_rate. The other
    hyperparameters (batch size, max_length, margin, centring) are reward_model.training's."""
    promotion_tolerance: NonNegative = 0.0
    """Move the 'champion' alias to the refreshed RM only when its held-out accuracy is at least the old
    RM's minus this (0 = must not drop at all)."""

    def __post_init__(self) -> None:
        check_ranges(self, "refresh")
        if self.judge_model is not None and self.annotator != "rm_judge":
            raise ValueError("refresh.judge_model is read only with refresh.annotator='rm_judge'; "
                             "set the annotator or drop judge_model")
        if self.labels_file is not None and self.annotator != "file":
            raise ValueError("refresh.labels_file is read only with refresh.annotator='file'; "
                             "set the annotator or drop labels_file")
