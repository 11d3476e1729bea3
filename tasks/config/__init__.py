"""One typed configuration for the whole pipeline, loaded from a preset, a YAML file and dotted overrides.

The stage settings reuse the frozen dataclasses of ``rlhf_core.config``: ``PPOSection`` IS a ``PPOConfig``,
``SFTSection`` an ``SFTConfig`` and ``DPOSection`` a ``DPOConfig`` (each adds the pipeline's own fields),
``reward_model.training`` is a ``RewardTrainingConfig``; ``data.prep`` is a ``DataPrepConfig`` and ``data.demo`` a
``DemoDataConfig``. This package adds the sections around them (``stages.py``; MLflow, Prefect and DeepSpeed in
``operations.py``), the whole run's ``PipelineConfig`` (``pipeline.py``) and a strict loader (``loading.py``):

    cfg = load_config("my.yaml", preset="tiny", overrides=["ppo.kl.coef=0.1", "data.demo.n_pairs=500"])

Layers apply in that order (preset, then the file, then each override). Conversion is driven by the
dataclasses' type hints (``tasks.typed_yaml``): an unknown key or a value of the wrong type fails with a
``ConfigError`` that names the dotted key and the layer it came from.
"""

from tasks.config.loading import (PRESETS_DIR, available_presets, changed_settings, config_from_dict, load_config,
                                  load_config_with_origins)
from tasks.config.operations import DistributedSection, OrchestrationSection, TrackingSection
from tasks.config.pipeline import PipelineConfig
from tasks.config.stages import (DataSection, DPOSection, EvalSection, PPOSection, RefreshSection, RewardModelSection,
                                 SFTSection)
from tasks.typed_yaml import ConfigError

__all__ = ["PRESETS_DIR", "ConfigError", "DPOSection", "DataSection", "DistributedSection", "EvalSection",
           "OrchestrationSection", "PPOSection", "PipelineConfig", "RefreshSection", "RewardModelSection",
           "SFTSection", "TrackingSection", "available_presets", "changed_settings", "config_from_dict", "load_config",
           "load_config_with_origins"]
