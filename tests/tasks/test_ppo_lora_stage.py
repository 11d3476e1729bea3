"""The ppo-iteration stage with ``ppo.lora.enabled``: adapter-only checkpoints, a second iteration that
continues from them, and a registered policy that is a plain Hugging Face model equal to base + adapter."""

from __future__ import annotations

import json

from collections.abc import Iterator

import pyarrow.parquet as pq
import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file, load_model
from transformers import GPT2LMHeadModel

from rlhf_core.models.lora import lora_policy
from rlhf_core.training.checkpoint import trainable_view
from tasks import ppo_iteration
from tasks.config import load_config
from tests.stage_harness import StageHarness
from tests.tiny_models import save_ppo_inputs

PROMPTS = ["hello the cat", "why the dog ran", "how big is the sun", "q red box", "the moon sat on a mat",
           "a small star", "fast blue tree", "q slow dog"]


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StageHarness]:
    harness = StageHarness(tmp_path_factory.mktemp("ppo-lora") / "state")
    yield harness
    harness.close()


def test_lora_ppo_stage_saves_plain_policies_and_adapter_checkpoints(
        harness: StageHarness, tmp_path_factory: pytest.TempPathFactory) -> None:
    saved = save_ppo_inputs(tmp_path_factory.mktemp("ppo-lora-inputs"), PROMPTS)
    config = load_config(preset="tiny", overrides=[
        "device=cpu", "ppo.lora.enabled=true", "ppo.lora.rank=4", "ppo.value_model=critic",
        "ppo.learning_rate=1e-2", "ppo.generation.max_new_tokens=6"])
    data = harness.artifact("data-prep", {"ppo_prompts.parquet": saved["prompts"]},
                            {"ppo_prompts": "ppo_prompts.parquet"})
    reference, reward = harness.model("sft", saved["sft"]), harness.model("reward-model", saved["rm"])
    first = harness.run(ppo_iteration, "ppo-iteration-1", ppo_iteration.Config.of(config, 1),
                        ppo_iteration.Inputs(data, reference, reward))
    second = harness.run(ppo_iteration, "ppo-iteration-2", ppo_iteration.Config.of(config, 2),
                         ppo_iteration.Inputs(data, reference, reward, first))
    results = [ppo_iteration.STAGE.result(art) for art in (first, second)]
    histories = [json.loads(ppo_iteration.resume_state_checkpoint(harness.store, art).joinpath("state.json").read_text())
                 ["history"] for art in (first, second)]
    assert [(r.iteration, r.steps_done, len(h)) for r, h in zip(results, histories)] == [(1, 2, 2), (2, 4, 4)]
    assert histories[1][:2] == histories[0]  # one continuous run: iteration 2 carries 1's curve
    assert second.record.inputs["previous"] == first.identity()

    checkpoint = ppo_iteration.resume_state_checkpoint(harness.store, second)
    adapter = load_file(str(checkpoint / "policy.safetensors"))
    assert adapter and all("lora_" in key for key in adapter)  # the SFT base is not copied into checkpoints
    value = load_file(str(checkpoint / "value.safetensors"))
    assert value and all("lora_" in key or key.startswith("head/") for key in value)

    policy_dir = ppo_iteration.model_input(second).path
    plain = GPT2LMHeadModel.from_pretrained(policy_dir)  # plain: from_pretrained loads it unchanged
    assert not any("lora" in key for key in load_file(str(second.path("policy") / "model.safetensors")))
    expected, _ = lora_policy(GPT2LMHeadModel.from_pretrained(saved["sft"]), config.ppo.lora)
    load_model(trainable_view(expected), str(checkpoint / "policy.safetensors"))
    sft = GPT2LMHeadModel.from_pretrained(saved["sft"])
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        adapted = expected(input_ids=ids).logits
        torch.testing.assert_close(plain(input_ids=ids).logits, adapted, rtol=0, atol=1e-5)
        assert not torch.allclose(sft(input_ids=ids).logits, adapted, atol=1e-4)  # the adapter learned something

    # Each iteration registers its policy; the sample table comes from the trained policy's replies.
    name = harness.names.policy_model
    assert [harness.active.stage(f"ppo-iteration-{k}").models for k in (1, 2)] == [
        {"policy": f"models:/{name}/1"}, {"policy": f"models:/{name}/2"}]
    assert MlflowClient().get_model_version(name, "2").tags["rlhf.artifact_key"] == second.identity()
    samples = pq.read_table(second.path(results[1].samples)).to_pylist()
    assert [s["prompt"] for s in samples][:2] == PROMPTS[:2] and len(samples) == len(PROMPTS)
    assert all(1 <= s["length"] <= 6 for s in samples)  # ppo.generation.max_new_tokens
