"""DeepSpeed configs: "auto" fields filled from our settings, settings the loops cannot honour refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GPT2LMHeadModel

from rlhf_core.distributed.deepspeed_config import check_config, load_deepspeed_config, offloads_optimizer, resolve_deepspeed_config
from rlhf_core.models.roles import ValueHead
from tests.tiny_models import gpt2_config

INFRA = Path(__file__).resolve().parents[2] / "infra" / "deepspeed"


@pytest.mark.parametrize("name", ["zero2.json", "zero3_offload.json"])
def test_shipped_configs_load(name):
    config = load_deepspeed_config(INFRA / name)
    assert config["zero_optimization"]["stage"] in (2, 3)
    assert offloads_optimizer(config) is (name == "zero3_offload.json")


def test_auto_fields_come_from_our_settings_and_the_model():
    config = load_deepspeed_config(INFRA / "zero3_offload.json")
    policy = GPT2LMHeadModel(gpt2_config(24))  # hidden size 32
    resolved = resolve_deepspeed_config(config, policy, micro_batch_size=4, max_grad_norm=0.5, world_size=8)
    assert resolved["train_micro_batch_size_per_gpu"] == 4
    assert resolved["train_batch_size"] == 32
    assert resolved["gradient_accumulation_steps"] == 1 and resolved["managed_gradient_accumulation"] is False
    assert resolved["gradient_clipping"] == 0.5
    assert resolved["bf16"]["enabled"] is False  # fp32 weights
    zero = resolved["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (32 * 32, int(0.9 * 32 * 32), 320)
    assert config["gradient_clipping"] == "auto"  # the loaded config itself is left as it was

    bf16 = resolve_deepspeed_config(config, policy.to(torch.bfloat16), 4, 1.0, 1)
    assert bf16["bf16"]["enabled"] is True  # DeepSpeed then keeps fp32 master weights and moments
    head = resolve_deepspeed_config(config, ValueHead(32), 4, 1.0, 1)  # no transformer inside: DeepSpeed's own buckets
    assert "reduce_bucket_size" not in head["zero_optimization"]


@pytest.mark.parametrize(("change", "message"), [
    ({"optimizer": {"type": "AdamW"}}, "remove 'optimizer'"),
    ({"scheduler": {"type": "WarmupLR"}}, "remove 'scheduler'"),
    ({"zero_optimization": {"stage": 1}}, "stage must be 2 or 3"),
    ({"gradient_accumulation_steps": 4}, "mini_batch_size / micro_batch_size"),
    ({"managed_gradient_accumulation": True}, "must be false"),
    ({"fp16": {"enabled": True}}, "use bf16"),
])
def test_settings_the_loops_cannot_honour_are_refused(change, message):
    config = {**json.loads((INFRA / "zero2.json").read_text()), **change}
    with pytest.raises(ValueError, match=message):
        check_config(config, "zero2.json")


def test_missing_config_file_points_at_the_shipped_ones(tmp_path):
    with pytest.raises(FileNotFoundError, match="infra/deepspeed"):
        load_deepspeed_config(tmp_path / "nope.json")
