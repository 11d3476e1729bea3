"""Markdown tables of the calculator's predictions (what docs/scaling.md shows), from :mod:`calculator`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from benchmarks.memory.calculator import (
    RunShape,
    kv_cache_bytes,
    stored_per_token,
    summary,
    training_activations,
    vocab_bytes,
)
from benchmarks.memory.shapes import ModelShape

GPU_BYTES = 80e9
"""One 80 GB GPU, as 80e9 bytes: below the 85.9e9 an H100 80GB has, leaving room for the CUDA context, NCCL
buffers and the allocator's fragmentation, none of which the calculator counts."""


def fits(peak: float) -> str:
    """'yes', 'tight' (above 90% of 80 GB: fragmentation and the CUDA context may not leave room) or 'no'."""
    return "no" if peak > GPU_BYTES else "tight" if peak > 0.9 * GPU_BYTES else "yes"


def gb(value: float) -> str:
    """Bytes as decimal GB with one decimal (two below 1 GB)."""
    return f"{value / 1e9:.2f}" if value < 1e9 else f"{value / 1e9:.1f}"


def sizes(shape: ModelShape, run: RunShape) -> str:
    """Parameters, and the per-token and per-sequence terms that set activations, KV cache and the vocabulary."""
    one = summary(shape, run)
    params = one["parameters"]
    seq = run.sequence
    no_ckpt = training_activations(shape, replace(run, gradient_checkpointing=False), 1, seq)
    ckpt = training_activations(shape, replace(run, gradient_checkpointing=True), 1, seq)
    rows = run.micro_batch * run.response_length
    lines = [
        (f"| {shape.name} (h {shape.hidden}, L {shape.layers}, a {shape.heads}, kv {shape.kv_heads}, I "
         f"{shape.intermediate}, V {shape.vocab}{', tied' if shape.tied_embeddings else ''}) | value |"),
        "|---|---|",
        (f"| parameters: policy / reward model / LoRA r={run.lora_rank} | {params['policy'] / 1e9:.3f}B / "
         f"{params['reward_model'] / 1e9:.3f}B / {params['lora'] / 1e6:.1f}M |"),
        f"| bf16 weights: policy / reward model | {gb(2 * params['policy'])} / {gb(2 * params['reward_model'])} GB |",
        f"| activations kept for backward, per token and layer | {stored_per_token(shape, run) / 1e3:.0f} kB |",
        f"| one {seq}-token sequence, no checkpointing / checkpointing | {gb(no_ckpt)} / {gb(ckpt)} GB |",
        (f"| KV cache per token / per {seq}-token sequence | {kv_cache_bytes(shape, run, 1, 1) / 1e3:.0f} kB / "
         f"{gb(kv_cache_bytes(shape, run, 1, seq))} GB |"),
        (f"| vocabulary chunk ({run.vocab_chunk_elements // shape.vocab} rows), training / scoring | "
         f"{gb(vocab_bytes(shape, run, rows, True))} / {gb(vocab_bytes(shape, run, rows, False))} GB |"),
    ]
    return "\n".join(lines)


def setup_table(results: dict[str, dict[str, Any]]) -> str:
    """One row per setup: per-GPU states, each phase's peak, the peak, whether it fits 80 GB, host RAM per node."""
    lines = [("| setup | weights + states (training) | load | rollout | scoring | PPO training | optimizer step | "
              "**peak** | fits 80 GB | host RAM per node: ZeRO offload / parked frozen |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, one in results.items():
        phases = one["phases"]
        peak = one["peak"]
        host, parked = one["host_offload_per_node"], one["host_parked_per_node"]
        lines.append(
            f"| {name} | {gb(phases['training']['weights_and_states'])} | {gb(phases['load']['peak'])} | "
            f"{gb(phases['rollout']['peak'])} | {gb(phases['scoring']['peak'])} | {gb(phases['training']['peak'])} | "
            f"{gb(phases['optimizer_step']['peak'])} | **{gb(peak)}** | {fits(peak)} | "
            f"{gb(host) if host else '-'} / {gb(parked) if parked else '-'} |")
    return "\n".join(lines)


RM_FIELDS = ("lora_rank", "zero_stage", "offload", "gpus", "rm_micro_batch", "rm_length", "rm_max_tokens_per_forward")
"""The ``RunShape`` fields the reward-model stage depends on (not the value model, nor ``offload_frozen``)."""


def reward_model_rows(results: dict[str, dict[str, Any]]) -> dict[tuple[object, ...], tuple[str, dict[str, Any]]]:
    """One (label, summary) per distinct reward-model setup, first name wins."""
    rows: dict[tuple[object, ...], tuple[str, dict[str, Any]]] = {}
    for name, one in results.items():
        key = tuple(one["run"][field] for field in RM_FIELDS)
        label = name.replace(", critic", "").replace(", head", "").replace(", offload_frozen", "")
        rows.setdefault(key, (label, one))
    return rows


def reward_model_table(results: dict[str, dict[str, Any]], shown: dict[tuple[object, ...], Any] | None = None) -> str:
    """The reward-model stage, one row per distinct reward-model setup not already in ``shown``."""
    lines = ["| reward-model training | weights + states | activations | optimizer step | **peak** | fits 80 GB |",
             "|---|---|---|---|---|---|"]
    for key, (label, one) in reward_model_rows(results).items():
        if shown and key in shown:
            continue
        rm, step, peak = one["phases"]["reward_model_training"], one["phases"]["reward_model_step"], one["reward_model_peak"]
        lines.append(f"| {label} | {gb(rm['weights_and_states'])} | {gb(rm['activations'])} | {gb(step['peak'])} | "
                     f"**{gb(peak)}** | {fits(peak)} |")
    return "\n".join(lines)


def run_line(run: RunShape) -> str:
    """The run's lengths, batches, budgets and precision, as one sentence."""
    budget = f", at most {run.max_tokens_per_forward} tokens" if run.max_tokens_per_forward else ""
    rm_budget = f" (at most {run.rm_max_tokens_per_forward} tokens)" if run.rm_max_tokens_per_forward else ""
    return (f"Run: prompts {run.prompt_length} + responses {run.response_length} tokens, micro-batch "
            f"{run.micro_batch} (scoring forwards {run.scoring_rows} sequences{budget}), {run.rollout_batch} rollouts "
            f"generated {run.generation_batch} at a time per GPU, reward model {run.rm_micro_batch} pairs{rm_budget} x "
            f"{run.rm_length} tokens, bf16 weights{', autocast' if run.autocast else ''}"
            f"{', gradient checkpointing' if run.gradient_checkpointing else ''}.")


def markdown(shape: ModelShape, results: dict[str, dict[str, Any]],
             features: dict[str, dict[str, Any]] | None = None) -> str:
    """The tables for one model shape: sizes, setups, reward model; then the setups with the memory features."""
    run = RunShape(**next(iter(results.values()))["run"])
    parts = [run_line(run), sizes(shape, run), setup_table(results), reward_model_table(results)]
    if features:
        intro = ("With the memory features (`ppo.offload_frozen`, `*.max_tokens_per_forward`; each row's settings in "
                 "`calculator.FEATURE_SETUPS`):")
        parts += [intro, setup_table(features), reward_model_table(features, reward_model_rows(results))]
    return "\n\n".join(parts)
