"""``PipelineConfig``: every setting of one run, one field per section, and the rules that span sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlhf_core.models.lm import model_size
from rlhf_core.ranges import Count
from tasks.config.operations import DistributedSection, OrchestrationSection, TrackingSection
from tasks.config.stages import (DataSection, DPOSection, EvalSection, PPOSection, RefreshSection, RewardModelSection,
                                 SFTSection)


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
