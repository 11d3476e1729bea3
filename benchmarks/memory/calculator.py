"""Predicted peak memory per GPU, per PPO phase, for a model given as numbers (no torch needed).

    .venv/bin/python -m benchmarks.memory.calculator --model qwen2.5-7b              # JSON, every setup
    .venv/bin/python -m benchmarks.memory.calculator --model qwen2.5-7b --markdown   # the docs/scaling.md tables
    .venv/bin/python -m benchmarks.memory.calculator --shape '{"name": "x", "architecture": "llama", ...}' \
        --run '{"micro_batch": 8, "zero_stage": 3, "gpus": 8}'

Bytes are decimal GB in tables (1 GB = 1e9 bytes). Sources of each formula:

- **Trained state** (ZeRO paper, Rajbhandari et al. 2020, sec. 3.1: 2 + 2 + K=12 bytes per parameter for fp16
  weights, fp16 gradients, fp32 master + Adam m, v). DeepSpeed's bf16 mode also makes an fp32 gradient: a
  persistent buffer of all of it without ZeRO (``runtime/bf16_optimizer.py``, ``fp32_groups_gradients_flat``: 20
  bytes per parameter); under ZeRO-1/2/3 the rank's partition, cast to fp32 for the optimizer step after the bf16
  one is freed, and freed after it (``zero/stage_1_and_2.py``, ``zero/stage3.py _release_sub_group``). torch AdamW
  in one process keeps weights, gradients and both moments in the parameters' dtype (16 bytes in fp32); LoRA
  adapters are fp32 (peft), so 16 bytes each. See :mod:`benchmarks.memory.states`.
- **ZeRO-2** shards gradients and optimizer state over N ranks: 2Ψ + 14Ψ/N while accumulating, 2Ψ + 16Ψ/N at the
  step; **ZeRO-3** the weights too: 16Ψ/N plus the layers gathered for the current forward/backward (estimated as
  the largest tensor + one block, in bf16), 18Ψ/N at the step.
- **Offload** (``infra/deepspeed/zero3_offload.json``, ``pin_memory: true``): bf16 weights (2Ψ), the fp32 gradient
  partition (4Ψ, ``stage_1_and_2.py`` pins it on the host) and fp32 master + Adam (12Ψ) live in pinned host RAM:
  18Ψ per node in all; the GPU keeps the gathered working set.
- **Activations** (Korthikanti et al. 2022, "Reducing Activation Recomputation", sec. 4.1: 34·s·h + 5·a·s² bytes
  per layer and sequence for GPT-3 blocks) recounted tensor by tensor for the blocks as Hugging Face runs them
  here: no dropout (PPO disables it), SDPA (no s² scores; a float32 log-sum-exp per head), K/V repeated to every
  head before SDPA when a padding mask is passed (``transformers.integrations.sdpa_attention.use_gqa_in_sdpa``),
  RMSNorm that upcasts to fp32, a gated MLP of width I (4 saved tensors of I). See :func:`stored_per_token`.
- **Gradient checkpointing** (Chen et al. 2016; HF checkpoints each block): each block's input (e·h per token) plus
  one block's stored activations, recomputed in the backward pass.
- **Vocabulary** (``rlhf_core/models/roles.py vocab_outputs``): the output layer and the fp32 log-softmax (and
  entropy) over V run at most ``VOCAB_CHUNK_ELEMENTS`` = 2^26 logits at a time; see :func:`vocab_bytes`.
- **KV cache**: 2 (K and V) x L x kv_heads x head_dim x e bytes per token (Pope et al. 2022, "Efficiently Scaling
  Transformer Inference", sec. 2).
- **Memory features** (``docs/scaling.md``, "Features that bound each peak"): ``max_tokens_per_forward`` /
  ``rm_max_tokens_per_forward`` bound the rows of scoring and reward-model forwards (``rlhf_core/models/budget.py``;
  :func:`benchmarks.memory.shapes.budget_rows`); ``offload_frozen`` takes the frozen weights that share nothing
  with a trained model off the GPU for training and the step (``rlhf_core/models/offload.py``; ``Roles.parked``);
  ZeRO-3 workers load every trained model (policy, critic) partitioned (``zero.partitioned_loading``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

from benchmarks.memory.shapes import (
    MODELS,
    VOCAB_CHUNK_ELEMENTS,
    ModelShape,
    RunShape,
    block_parameters,
    causal_lm_parameters,
    lora_parameters,
    reward_model_parameters,
)
from benchmarks.memory.states import (
    TrainedState,
    adapter_state,
    reward_model_state,
    roles,
    trained_state,
)

__all__ = ["FEATURE_SETUPS", "GPU_7B", "PPO_PHASES", "VOCAB_CHUNK_ELEMENTS", "RunShape", "TrainedState", "adapter_state",
           "feature_setups", "kv_cache_bytes", "phases", "roles", "setups", "stored_per_token", "summary",
           "trained_state", "training_activations", "vocab_bytes"]

def stored_per_token(shape: ModelShape, run: RunShape) -> int:
    """Bytes one block keeps for backward per token (no checkpointing); e = ``run.act_bytes``.

    Llama: 2 RMSNorms x (fp32 input 4h + normalised e·h); attention e·(h input + h Q + 2h K/V repeated to all heads
    + h SDPA output + h o_proj input) + 4·a log-sum-exp; MLP e·(h input + 4I: gate, SiLU out, up, down input).
    GPT-2: 2 LayerNorm inputs e·h; attention e·(h + 3h qkv + h + h) + 4·a; MLP e·(h + 2I) fused GELU, e·(h + 5I)
    with the five-op tanh GELU. Korthikanti's 34h for GPT-3 = this GPT-2 count (32h fused) + 2 dropout masks.
    """
    h, i, e, a = shape.hidden, shape.intermediate, run.act_bytes, shape.heads
    if shape.architecture == "gpt2":
        norms = 2 * e * h
        attention = e * 6 * h + 4 * a
        mlp = e * (h + (2 if run.fused_gelu else 5) * i)
    else:
        norms = 2 * (4 * h + e * h)
        attention = e * 6 * h + 4 * a
        mlp = e * (h + 4 * i)
    return norms + attention + mlp


def transient_per_token(shape: ModelShape, run: RunShape) -> int:
    """Bytes alive at once per token in a forward without gradients (scoring, prefill): the residual stream and
    the widest step, the MLP (Llama: gate, up and their product, 3I; GPT-2: 2I)."""
    e = run.act_bytes
    width = 3 * shape.intermediate if shape.architecture == "llama" else 2 * shape.intermediate
    return e * (2 * shape.hidden + max(width, 4 * shape.hidden))


def mask_bytes(batch: int, tokens: int) -> int:
    """The (B, 1, T, T) boolean attention mask Hugging Face builds once per forward for padded batches."""
    return batch * tokens * tokens


def training_activations(shape: ModelShape, run: RunShape, batch: int, tokens: int) -> int:
    """Activations of one model's training forward kept for backward: all blocks, or with checkpointing each
    block's input plus one block recomputed; plus the final norm, the mask and the autocast weight copies."""
    n = batch * tokens
    per_block = stored_per_token(shape, run) * n
    kept = shape.layers * run.act_bytes * shape.hidden * n + per_block if run.gradient_checkpointing \
        else shape.layers * per_block
    final_norm = (4 + run.act_bytes) * shape.hidden * n
    return kept + final_norm + mask_bytes(batch, tokens) + autocast_weight_copies(shape, run)


def autocast_weight_copies(shape: ModelShape, run: RunShape) -> int:
    """bf16 autocast of fp32 trained weights keeps a bf16 copy of each linear weight from forward to backward
    (torch's autocast weight cache): the whole model, or one block under checkpointing. 0 otherwise."""
    if not (run.weight_bytes == 4 and run.autocast and run.lora_rank == 0):
        return 0
    blocks = 1 if run.gradient_checkpointing else shape.layers
    return 2 * blocks * block_parameters(shape)


def vocab_bytes(shape: ModelShape, run: RunShape, rows: int, entropy: bool) -> int:
    """Peak of the vocabulary term: one chunk of ``min(rows, chunk_elements // V)`` rows x V.

    Bytes per logit: the output layer's logits (e), the fp32 scaled copy and its log-softmax (8); the entropy adds
    a second log-softmax, a where() copy and exp() (12) and a bool mask (1). With gradients the chunk is recomputed
    in backward, whose gradient buffers replace the saved tensors they consume rather than adding to them:
    measured on CPU (fp32, V 32768, one and two chunks), 12.2 bytes per logit without and 25.2 with the entropy,
    with or without gradients (this formula: 12 and 25; ``benchmarks/memory/predict.py`` reruns the probe).
    """
    chunk_rows = min(rows, max(1, run.vocab_chunk_elements // shape.vocab))
    return chunk_rows * shape.vocab * (run.act_bytes + 8 + (13 if entropy else 0))


def kv_cache_bytes(shape: ModelShape, run: RunShape, batch: int, tokens: int) -> int:
    """K and V of every layer for ``batch`` sequences of ``tokens``: 2 x L x kv_heads x head_dim x e each."""
    return 2 * shape.layers * shape.kv_dim * run.act_bytes * batch * tokens


def phases(shape: ModelShape, run: RunShape) -> dict[str, dict[str, int]]:
    """Predicted bytes per GPU of each phase: its components and ``peak`` (their sum).

    Steady state: the optimizer state of the previous update is allocated through the next rollout, and so are
    the gradients that outlive a step (:class:`TrainedState`). The optimizer step is a phase of its own: the
    activations are freed by then, DeepSpeed's fp32 gradient partition is allocated. ``load`` is a worker's start:
    every model built and the engines started (under ZeRO-3 the trained models load partitioned, so no rank holds
    one whole; a bound: the states of both engines are counted). Training and the step
    hold the frozen weights less what ``offload_frozen`` parks; scoring and PPO training forwards hold
    ``run.scoring_rows`` sequences and reward-model forwards ``run.rm_pairs`` pairs (the token budgets).
    """
    r = roles(shape, run)
    rollout_resident = r.frozen + r.policy.idle + r.value.idle + r.rollout_copies
    training_frozen = r.frozen - r.parked  # ppo.offload_frozen: parked in host memory for training and the step
    per_rank_rollouts = min(run.generation_batch, -(-run.rollout_batch // run.gpus))
    scoring_rows = run.scoring_rows  # ppo.max_tokens_per_forward bounds the experience passes and training alike
    rows = scoring_rows * run.response_length
    prefill = kv_cache_bytes(shape, run, per_rank_rollouts, run.prompt_length) + \
        transient_per_token(shape, run) * per_rank_rollouts * run.prompt_length
    decode = kv_cache_bytes(shape, run, per_rank_rollouts, run.sequence) + \
        per_rank_rollouts * shape.vocab * (run.act_bytes + 8)
    scoring = mask_bytes(scoring_rows, run.sequence) + transient_per_token(shape, run) * scoring_rows * run.sequence \
        + vocab_bytes(shape, run, scoring_rows * run.response_length, False)
    policy_act = training_activations(shape, run, scoring_rows, run.sequence)
    critic_act = training_activations(shape, run, scoring_rows, run.sequence) if run.value_model == "critic" else 0
    rm_training, rm_step = reward_model_state(shape, run)
    out = {
        "load": {"weights_and_states": r.frozen + r.policy.idle + r.value.idle},
        "rollout": {"weights_and_states": rollout_resident, "kv_cache_and_step": max(prefill, decode)},
        "scoring": {"weights_and_states": rollout_resident, "forward": scoring},
        "training": {"weights_and_states": training_frozen + r.policy.training + r.value.training,
                     "policy_activations": policy_act, "critic_activations": critic_act,
                     "vocabulary": vocab_bytes(shape, run, rows, True)},
        "optimizer_step": {"weights_and_states": training_frozen + r.policy.step + r.value.step},
        "reward_model_training": {"weights_and_states": rm_training,
                                  "activations": training_activations(shape, run, 2 * run.rm_pairs, run.rm_length)},
        "reward_model_step": {"weights_and_states": rm_step},
    }
    for parts in out.values():
        parts["peak"] = sum(parts.values())
    return out


PPO_PHASES = ("load", "rollout", "scoring", "training", "optimizer_step")
"""The phases of a PPO iteration, and its workers' start (the reward-model stage runs before, in its own process)."""


def summary(shape: ModelShape, run: RunShape) -> dict[str, object]:
    """Everything the calculator knows about one setup, JSON-able (bytes as ints)."""
    r = roles(shape, run)
    per_phase = phases(shape, run)
    host = r.policy.host + r.value.host
    ranks_per_node = min(run.gpus, run.gpus_per_node)
    return {
        "model": asdict(shape),
        "run": asdict(run),
        "parameters": {"policy": causal_lm_parameters(shape), "reward_model": reward_model_parameters(shape),
                       "lora": lora_parameters(shape, run.lora_rank) if run.lora_rank else 0},
        "per_gpu": {"frozen_weights": r.frozen, "policy_state": asdict(r.policy), "value_state": asdict(r.value),
                    "rollout_copies": r.rollout_copies, "parked_in_training": r.parked},
        "phases": per_phase,
        "peak": max(per_phase[name]["peak"] for name in PPO_PHASES),
        "reward_model_peak": max(per_phase[name]["peak"] for name in ("reward_model_training", "reward_model_step")),
        "host_offload_per_node": host * ranks_per_node,
        "host_parked_per_rank": r.parked,
        "host_parked_per_node": r.parked * ranks_per_node,
        "kv_cache_per_token": kv_cache_bytes(shape, run, 1, 1),
        "activations_per_token_per_layer": stored_per_token(shape, run),
    }


SETUPS: dict[str, dict[str, object]] = {
    "lora, critic": {"lora_rank": 16, "value_model": "critic", "zero_stage": 0},
    "lora, head": {"lora_rank": 16, "value_model": "head", "zero_stage": 0},
    "full ZeRO-2, critic": {"lora_rank": 0, "value_model": "critic", "zero_stage": 2},
    "full ZeRO-2, head": {"lora_rank": 0, "value_model": "head", "zero_stage": 2},
    "full ZeRO-3, critic": {"lora_rank": 0, "value_model": "critic", "zero_stage": 3},
    "full ZeRO-3, head": {"lora_rank": 0, "value_model": "head", "zero_stage": 3},
    "full ZeRO-3 offload, critic": {"lora_rank": 0, "value_model": "critic", "zero_stage": 3, "offload": True},
}
"""The setups of the doc's tables (``RunShape`` overrides), each on 1 and on 8 GPUs."""

GPU_7B = {"lora_rank": 16, "value_model": "critic", "zero_stage": 0, "max_tokens_per_forward": 16384,
          "rm_micro_batch": 16, "rm_max_tokens_per_forward": 16384, "offload_frozen": True, "gpus": 1}
"""``infra/presets/gpu-7b.yaml`` as shipped, as ``RunShape`` overrides (its lengths and batches are the defaults)."""

FEATURE_SETUPS: dict[str, dict[str, object]] = {
    "gpu-7b preset (lora, critic, token budgets, offload_frozen), 1 GPU": GPU_7B,
    "gpu-7b preset without token budgets (16 pairs per RM forward), 1 GPU":
        {**GPU_7B, "max_tokens_per_forward": None, "rm_max_tokens_per_forward": None},
    "lora, head, offload_frozen, 1 GPU": {"lora_rank": 16, "value_model": "head", "zero_stage": 0,
                                          "offload_frozen": True, "gpus": 1},
    "full ZeRO-2, critic, offload_frozen, 8 GPUs": {"lora_rank": 0, "value_model": "critic", "zero_stage": 2,
                                                    "offload_frozen": True, "gpus": 8},
    "full ZeRO-2, head, offload_frozen, 8 GPUs": {"lora_rank": 0, "value_model": "head", "zero_stage": 2,
                                                  "offload_frozen": True, "gpus": 8},
    "full ZeRO-3, critic, offload_frozen, 8 GPUs": {"lora_rank": 0, "value_model": "critic", "zero_stage": 3,
                                                    "offload_frozen": True, "gpus": 8},
    "full ZeRO-3 offload, critic, offload_frozen, 1 GPU": {"lora_rank": 0, "value_model": "critic", "zero_stage": 3,
                                                           "offload": True, "offload_frozen": True, "gpus": 1},
    "full ZeRO-3 offload, critic, offload_frozen, 8 GPUs": {"lora_rank": 0, "value_model": "critic",
                                                            "zero_stage": 3, "offload": True,
                                                            "offload_frozen": True, "gpus": 8},
}
"""Setups with the memory features (``ppo.offload_frozen``, ``*.max_tokens_per_forward``), GPU count included."""


def setups(shape: ModelShape, base: RunShape, gpus: tuple[int, ...] = (1, 8)) -> dict[str, dict[str, object]]:
    """:func:`summary` of every setup in :data:`SETUPS` on each GPU count (LoRA: one GPU only)."""
    out = {}
    for name, overrides in SETUPS.items():
        for n in (1,) if overrides["lora_rank"] else gpus:
            out[f"{name}, {n} GPU{'s' if n > 1 else ''}"] = summary(shape, replace(base, **overrides, gpus=n))
    return out


def feature_setups(shape: ModelShape, base: RunShape) -> dict[str, dict[str, object]]:
    """:func:`summary` of every setup in :data:`FEATURE_SETUPS`."""
    return {name: summary(shape, replace(base, **overrides)) for name, overrides in FEATURE_SETUPS.items()}


def main() -> None:
    from benchmarks.memory.tables import markdown

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), help="a published shape (as numbers in shapes.py)")
    parser.add_argument("--shape", help="JSON of ModelShape fields instead of --model")
    parser.add_argument("--run", default="{}", help="JSON of RunShape fields (default: the gpu-7b preset's)")
    parser.add_argument("--all-setups", action="store_true", help="every setup of the doc's tables")
    parser.add_argument("--markdown", action="store_true", help="print the doc's tables (implies --all-setups)")
    args = parser.parse_args()
    if (args.model is None) == (args.shape is None):
        parser.error("give exactly one of --model or --shape")
    shape = MODELS[args.model] if args.model else ModelShape(**json.loads(args.shape))
    run = RunShape(**json.loads(args.run))
    if args.markdown:
        print(markdown(shape, setups(shape, run), feature_setups(shape, run)))
    elif args.all_setups:
        print(json.dumps({**setups(shape, run), **feature_setups(shape, run)}, indent=1))
    else:
        print(json.dumps(summary(shape, run), indent=1))


if __name__ == "__main__":
    main()
