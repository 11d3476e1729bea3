"""The small public API of README's "PPO in a few lines": re-exported by the subpackages, loaded on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

import rlhf_core.models
import rlhf_core.training
from rlhf_core.models.roles import Critic, ValueHead, load_policy, load_reward_model, make_reference
from rlhf_core.models.scoring import RewardModelScorer
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.ppo_loop import train_ppo


def test_re_exports_are_the_module_objects() -> None:
    models = {"Critic": Critic, "RewardModelScorer": RewardModelScorer, "ValueHead": ValueHead,
              "load_policy": load_policy, "load_reward_model": load_reward_model, "make_reference": make_reference}
    assert {name: getattr(rlhf_core.models, name) for name in rlhf_core.models.__all__} == models
    training = {"PPOModels": PPOModels, "train_ppo": train_ppo}
    assert {name: getattr(rlhf_core.training, name) for name in rlhf_core.training.__all__} == training


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="rlhf_core.models.*no attribute 'PPOModels'"):
        rlhf_core.models.PPOModels  # noqa: B018


def test_importing_the_snippet_first_has_no_import_cycle() -> None:
    snippet = ("from rlhf_core.models import load_policy, load_reward_model, make_reference, ValueHead, "
               "RewardModelScorer\nfrom rlhf_core.training import PPOModels, train_ppo\n")
    subprocess.run([sys.executable, "-c", snippet], check=True, capture_output=True)
