"""One typed configuration for the whole pipeline, loaded from a preset, a YAML file and dotted overrides.

The stage settings reuse the frozen dataclasses of ``rlhf_core.config``: ``PPOSection`` IS a ``PPOConfig``,
``SFTSection`` an ``SFTConfig`` and ``DPOSection`` a ``DPOConfig`` (each adds the pipeline's own fields),
``reward_model.training`` is a ``RewardTrainingConfig``; ``data.prep`` is a ``DataPrepConfig`` and ``data.demo`` a
``DemoDataConfig``. This module adds the sections around them and a strict loader:

    cfg = load_config("my.yaml", preset="tiny", overrides=["ppo.kl.coef=0.1", "data.demo.n_pairs=500"])

Layers apply in that order (preset, then the file, then each override). Conversion is driven by the
dataclasses' type hints (``tasks.typed_yaml``): an unknown key or a value of the wrong type fails with a
``ConfigError`` that names the dotted key and the layer it came from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from rlhf_core.config import DPOConfig, PPOConfig, RewardTrainingConfig, SFTConfig
from rlhf_core.data import DataPrepConfig
from rlhf_core.demo.annotator import DEFAULT_TEMPERATURE
from rlhf_core.demo.config import DemoDataConfig
from rlhf_core.models.lm import ModelSize, model_size
from rlhf_core.models.tokenizer import MIN_VOCAB_SIZE, SpecialTokens
from rlhf_core.ranges import Count, Fraction, KeptCount, NonNegative, Positive, PositiveInt, Range, check_ranges
from tasks.run_store.keys import LocalPath, ModelSource
from tasks.typed_yaml import (ConfigError, build, derived, flatten_for_params, merge_layer, one_line, parse_override,
                              read_yaml)

PRESETS_DIR = Path(__file__).resolve().parents[1] / "infra" / "presets"


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


@dataclass(frozen=True)
class TrackingSection:
    """MLflow experiment and registered-model names."""

    experiment: str = "rlhf"
    """MLflow experiment of the pipeline runs."""
    policy_model: str | None = None
    """Registered model name of policy checkpoints; None = '<experiment>-policy', so runs of another experiment
    (a smoke test on the tiny preset) never move this experiment's @champion."""
    reward_model: str | None = None
    """Registered model name of the proxy reward model; None = '<experiment>-reward-model'."""
    heldout_reward_model: str | None = None
    """Registered model name of the held-out reward model; None = '<experiment>-heldout-reward-model'."""
    tracking_uri: str | None = None
    """MLflow tracking URI; None = SQLite in the state dir. The MLFLOW_TRACKING_URI env variable wins."""
    model_storage: Literal["upload", "reference"] = "upload"
    """Where registered model versions keep their weights. 'upload': a copy in MLflow's artifact store (through the
    tracking server; the MLflow UI shows the files). 'reference': no upload, the version holds a small pointer to
    its immutable artifact in the state dir and ``models:/`` URIs load from there; the state dir must then be shared
    storage that every process loading those models sees (a 7B policy is ~15 GB per iteration not sent)."""

    def __post_init__(self) -> None:
        # resolved here, once: the recorded config names the models it registers
        for name, suffix in (("policy_model", "policy"), ("reward_model", "reward-model"),
                             ("heldout_reward_model", "heldout-reward-model")):
            if getattr(self, name) is None:
                object.__setattr__(self, name, f"{self.experiment}-{suffix}")


@dataclass(frozen=True)
class OrchestrationSection:
    """How Prefect runs the stages (none of it enters an artifact key)."""

    stage_timeout_minutes: Positive | None = None
    """A stage (one task run) still running after this many minutes fails with a timeout and the run can be
    resumed (``rlhf resume``); None = no limit. Set it on scheduled runs so a hung stage does not hold the
    deployment's single slot forever."""

    def __post_init__(self) -> None:
        check_ranges(self, "orchestration")


@dataclass(frozen=True)
class DistributedSection:
    """How the reward-model and ppo-iteration stages run their training (docs/scaling.md).

    Without ``deepspeed_config`` they train in the stage's own process (CPU or one GPU). With it, the stage
    writes a job file, starts ``num_processes`` x ``num_nodes`` workers with ``launcher``
    (``python -m tasks.ppo_job --job ...`` or ``tasks.reward_job``), follows their metrics into MLflow and continues with
    the weights they trained: data-parallel DeepSpeed ZeRO, with the same stage code and the same results.
    """

    deepspeed_config: LocalPath | None = None
    """DeepSpeed JSON (e.g. infra/deepspeed/zero2.json, zero3_offload.json); None = train in the stage's process."""
    num_processes: PositiveInt = 1
    """Worker processes per node: one per GPU."""
    num_nodes: PositiveInt = 1
    """Nodes. 'deepspeed' starts every node listed in ``hostfile`` from here (ssh/pdsh); with 'torchrun' this
    node is node 0 and each other node runs the command the stage logs (same job file on shared storage)."""
    launcher: Literal["torchrun", "deepspeed"] = "torchrun"
    """Which launcher starts the workers."""
    hostfile: str | None = None
    """'deepspeed' launcher only: one 'hostname slots=N' line per node; None = this machine."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, where rank 0 listens (another node's workers must reach it)."""
    master_port: Annotated[int, Range(ge=1, le=65535)] | None = None
    """Port of rank 0's rendezvous; None = a free port chosen at each launch (one node: a retry never meets the
    port of workers still closing). Several nodes must name it: every node dials it."""
    stages: tuple[Literal["reward-model", "ppo-iteration"], ...] = ("reward-model", "ppo-iteration")
    """Stages whose training runs this way (the others always run in their own process)."""

    def __post_init__(self) -> None:
        check_ranges(self, "distributed")
        if self.deepspeed_config is None and self.num_processes * self.num_nodes > 1:
            raise ValueError("distributed.num_processes / num_nodes > 1 need distributed.deepspeed_config "
                             "(e.g. infra/deepspeed/zero2.json)")
        if self.hostfile is not None and self.launcher != "deepspeed":
            raise ValueError("distributed.hostfile is read only by distributed.launcher='deepspeed'")
        if self.num_nodes > 1 and self.launcher == "deepspeed" and self.hostfile is None:
            raise ValueError("distributed.num_nodes > 1 with distributed.launcher=deepspeed needs distributed.hostfile "
                             "(one 'hostname slots=N' line per node: the launcher starts each of them over ssh)")
        if self.num_nodes > 1 and self.master_port is None:
            raise ValueError("distributed.num_nodes > 1 needs distributed.master_port (every node dials rank 0 there), "
                             "e.g. distributed.master_port=29500")

    def runs(self, stage: str) -> bool:
        """True when ``stage`` launches its training on DeepSpeed workers."""
        return self.deepspeed_config is not None and stage in self.stages


@dataclass(frozen=True)
class PipelineConfig:
    """Every setting of one pipeline run."""

    name: str = "rlhf"
    """Run name (MLflow run name and the label in ``rlhf runs``)."""
    seed: Count = 0
    """Seed of the generated data and the model initialisation."""
    state_dir: str = ".rlhf_state"
    """Folder for runs, caches, the MLflow store and Prefect's home (relative = to the working directory)."""
    device: str = "auto"
    """Torch device for training: 'auto' (cuda when available, else cpu), 'cpu', 'cuda', 'cuda:1'..."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weight dtype of the loaded models (bfloat16 for large models on GPUs)."""
    method: Literal["ppo", "dpo"] = "ppo"
    """How the policy is trained after the reward model: 'ppo' = the online loop (ppo-iteration -> heldout-eval ->
    [rm-refresh]) x ppo.iterations, whose estimator ``ppo.advantage`` picks; 'dpo' = the offline dpo stage on the
    reward-model training pairs (``dpo.*``), then one heldout-eval. Both are judged the same way (held-out RM, gold,
    hacking detector, best-of-n baseline), so runs that differ only here compare in MLflow."""
    data: DataSection = field(default_factory=DataSection)
    """Data source and preparation."""
    sft: SFTSection = field(default_factory=SFTSection)
    """Base policy and supervised fine-tuning."""
    reward_model: RewardModelSection = field(default_factory=RewardModelSection)
    """Proxy and held-out reward models."""
    ppo: PPOSection = field(default_factory=PPOSection)
    """PPO outer loop and hyperparameters."""
    dpo: DPOSection = field(default_factory=DPOSection)
    """DPO / IPO hyperparameters (read only with ``method: dpo``)."""
    eval: EvalSection = field(default_factory=EvalSection)
    """Held-out evaluation and promotion."""
    refresh: RefreshSection = field(default_factory=RefreshSection)
    """Reward-model refresh."""
    tracking: TrackingSection = field(default_factory=TrackingSection)
    """MLflow names."""
    distributed: DistributedSection = field(default_factory=DistributedSection)
    """In-process or DeepSpeed training for the reward-model and ppo-iteration stages."""
    orchestration: OrchestrationSection = field(default_factory=OrchestrationSection)
    """Stage timeouts."""

    def __post_init__(self) -> None:
        if self.refresh.enabled and self.refresh.annotator == "simulated" and self.data.source != "demo":
            raise ValueError("refresh.enabled with refresh.annotator='simulated' needs data.source='demo' (the "
                             "simulated annotator knows only the demo task). Set refresh.annotator to 'file' or "
                             "'rm_judge', or refresh.enabled=false")
        if self.reward_model.heldout_onpolicy_pairs and self.data.source != "demo":
            raise ValueError("reward_model.heldout_onpolicy_pairs needs data.source='demo' (the simulated annotator labels "
                             "them); with your own data, set it to 0")
        if self.sft.base_model is None:
            size = self.sft.model_size
            positions = (model_size(size) if isinstance(size, str) else size).n_positions
            lengths = {"sft.max_length": self.sft.max_length,
                       "reward_model.training.max_length": self.reward_model.training.max_length,
                       "reward_model.heldout.max_length": self.reward_model.heldout.max_length}
            if self.method == "dpo":
                lengths["dpo.max_length"] = self.dpo.max_length
            too_long = {k: v for k, v in lengths.items() if v > positions}
            if too_long:
                raise ValueError(f"{too_long} exceed the {positions} positions of model_size "
                                 f"'{self.sft.model_size}'; lower them or pick a larger model_size")


# --------------------------------------------------------------------------------------------- loading


def available_presets() -> list[str]:
    """Names of the preset files in ``infra/presets``."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_config(path: str | Path | None = None, preset: str | None = None,
                overrides: Sequence[str] = ()) -> PipelineConfig:
    """Preset YAML, then the user's YAML, then ``key.sub=value`` overrides, converted strictly.

    Without a preset the dataclass defaults are the base. Raises ConfigError naming the bad key and its source.
    """
    return build(PipelineConfig, *_layers(path, preset, overrides))


def load_config_with_origins(path: str | Path | None = None, preset: str | None = None,
                              overrides: Sequence[str] = ()) -> tuple[PipelineConfig, dict[str, str]]:
    """:func:`load_config`, and where each setting came from (dotted key -> its layer), for the checks that run
    after the config is built (``tasks.preflight.resolve_config``) to name a bad value's source."""
    merged, key, origins = _layers(path, preset, overrides)
    return build(PipelineConfig, merged, key, origins), origins


def _layers(path: str | Path | None, preset: str | None,
            overrides: Sequence[str]) -> tuple[dict[str, Any], str, dict[str, str]]:
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    if preset is not None:
        if preset not in available_presets():
            raise ConfigError(f"unknown preset {preset!r}; choose one of {available_presets()}")
        preset_path = PRESETS_DIR / f"{preset}.yaml"
        merge_layer(merged, read_yaml(preset_path), f"preset '{preset}' ({preset_path})", origins)
    if path is not None:
        merge_layer(merged, read_yaml(Path(path)), str(path), origins)
    for item in overrides:
        merge_layer(merged, parse_override(item), f"override '{one_line(item)}'", origins)
    return merged, "", origins


#: Settings that say where a run lives, not what it does (and may hold credentials): never shown as changes.
_NOT_CHANGES = ("state_dir", "tracking.tracking_uri")


def changed_settings(config: PipelineConfig, preset: str | None) -> dict[str, str]:
    """The settings of ``config`` that differ from ``preset`` (from the code defaults when None), as
    ``{'ppo.kl.coef': '0.2'}``: what tells one run of a preset from another."""
    base = flatten_for_params(load_config(None, preset) if preset in available_presets() else PipelineConfig())
    mine = flatten_for_params(config)
    return {k: v for k, v in mine.items() if base.get(k) != v and k not in _NOT_CHANGES}


def config_from_dict(data: Mapping[str, Any], source: str = "serialised config") -> PipelineConfig:
    """The config ``config_to_dict`` turned into ``data`` (e.g. in a job file), converted as strictly as
    ``load_config``; a bad key is reported as coming from ``source``."""
    return build(PipelineConfig, dict(data), "", {str(key): source for key in data})
