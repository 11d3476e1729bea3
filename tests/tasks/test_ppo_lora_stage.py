"""The ppo-iteration stage with ``ppo.lora.enabled``: adapter-only checkpoints, a second iteration that
continues from them, and a registered policy that is a plain Hugging Face model equal to base + adapter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, load_model
from transformers import GPT2LMHeadModel

from rlhf_core.models.lora import lora_policy
from rlhf_core.training.checkpoint import trainable_view
from tasks import tracking
from tasks.config import load_config
from tasks.ppo import run_ppo_iteration
from tasks.state import StateDir
from tests.stage_tracking import module_tracking
from tests.tiny_models import save_ppo_inputs

PROMPTS = ["hello the cat", "why the dog ran", "how big is the sun", "q red box", "the moon sat on a mat",
           "a small star", "fast blue tree", "q slow dog"]


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StateDir]:
    with module_tracking(tmp_path_factory.mktemp("ppo-lora-tracking")) as state:
        yield state


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return save_ppo_inputs(tmp_path_factory.mktemp("ppo-lora-inputs"), PROMPTS)


def test_lora_ppo_stage_saves_plain_policies_and_adapter_checkpoints(state: StateDir, inputs: dict[str, str],
                                                                       tmp_path: Path) -> None:
    config = load_config(preset="tiny", overrides=[
        "device=cpu", "ppo.lora.enabled=true", "ppo.lora.rank=4", "ppo.value_model=critic",
        "ppo.learning_rate=1e-2", "ppo.generation.max_new_tokens=6",
        "tracking.policy_model=rlhf-policy-lora-test"])
    with tracking.pipeline_run(config.tracking.experiment, "ppo-lora-test") as parent:
        pass
    out = tmp_path / "ppo"
    first = run_ppo_iteration(config, 1, inputs["sft"], inputs["rm"], inputs["prompts"], str(out),
                              parent.info.run_id)
    second = run_ppo_iteration(config, 2, inputs["sft"], inputs["rm"], inputs["prompts"], str(out),
                               parent.info.run_id, init_checkpoint=first.checkpoint)
    assert (first.steps_done, second.steps_done) == (2, 4)

    adapter = load_file(str(Path(second.checkpoint) / "policy.safetensors"))
    assert adapter and all("lora_" in key for key in adapter)  # the SFT base is not copied into checkpoints
    value = load_file(str(Path(second.checkpoint) / "value.safetensors"))
    assert value and all("lora_" in key or key.startswith("head/") for key in value)

    saved = GPT2LMHeadModel.from_pretrained(second.policy_dir)  # plain: from_pretrained loads it unchanged
    assert not any("lora" in key for key in load_file(str(Path(second.policy_dir) / "model.safetensors")))
    expected, _ = lora_policy(GPT2LMHeadModel.from_pretrained(inputs["sft"]), config.ppo.lora)
    load_model(trainable_view(expected), str(Path(second.checkpoint) / "policy.safetensors"))
    sft = GPT2LMHeadModel.from_pretrained(inputs["sft"])
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        adapted = expected(input_ids=ids).logits
        torch.testing.assert_close(saved(input_ids=ids).logits, adapted, rtol=0, atol=1e-5)
        assert not torch.allclose(sft(input_ids=ids).logits, adapted, atol=1e-4)  # the adapter learned something
