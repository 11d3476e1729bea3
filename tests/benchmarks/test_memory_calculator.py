"""The memory calculator (benchmarks/memory/calculator.py): exact parameter counts against real tiny Hugging Face
models, byte counts computed by hand for a tiny shape, checkpointing lowering activations, the CLI's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from transformers import (
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from benchmarks.memory import calculator
from benchmarks.memory.calculator import (
    RunShape,
    kv_cache_bytes,
    phases,
    roles,
    stored_per_token,
    trained_state,
    training_activations,
)
from benchmarks.memory.shapes import (
    MODELS,
    ModelShape,
    budget_rows,
    causal_lm_parameters,
    gpt2_shape,
    lora_parameters,
    reward_model_parameters,
)
from rlhf_core.config import LoRAConfig
from rlhf_core.models.lora import lora_policy
from rlhf_core.models.roles import VOCAB_CHUNK_ELEMENTS

REPO = Path(__file__).resolve().parents[2]
GPT2_SIZE = {"vocab_size": 96, "n_positions": 24, "n_embd": 16, "n_layer": 2, "n_head": 2}
LLAMA = ModelShape("tiny-llama", "llama", hidden=16, layers=2, heads=4, kv_heads=2, intermediate=40, vocab=96,
                   tied_embeddings=False)
TINY = ModelShape("hand", "llama", hidden=8, layers=2, heads=2, kv_heads=1, intermediate=16, vocab=32,
                  tied_embeddings=False)
"""Hand-computed: block = q 64 + k 32 + v 32 + o 64 + gate/up/down 3 x 128 + 2 norms x 8 = 592; backbone =
embedding 256 + 2 x 592 + final norm 8 = 1448; causal LM = 1448 + output layer 256 = 1704; RM = 1448 + 8 = 1456."""


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def llama_config(shape: ModelShape) -> LlamaConfig:
    return LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                       num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                       intermediate_size=shape.intermediate, tie_word_embeddings=shape.tied_embeddings,
                       num_labels=1, pad_token_id=0)


def test_gpt2_parameters_exact_tied_embeddings() -> None:
    config = GPT2Config(**GPT2_SIZE, num_labels=1, pad_token_id=0)
    shape = gpt2_shape(GPT2_SIZE)
    assert causal_lm_parameters(shape) == count(GPT2LMHeadModel(config))
    assert reward_model_parameters(shape) == count(GPT2ForSequenceClassification(config))


def test_llama_parameters_exact_untied_with_grouped_query_attention() -> None:
    config = llama_config(LLAMA)
    assert causal_lm_parameters(LLAMA) == count(LlamaForCausalLM(config))
    assert reward_model_parameters(LLAMA) == count(LlamaForSequenceClassification(config))
    tied = replace(LLAMA, tied_embeddings=True)
    assert causal_lm_parameters(tied) == count(LlamaForCausalLM(llama_config(tied)))


def test_qwen2_parameters_exact_with_qkv_biases() -> None:
    shape = replace(LLAMA, qkv_bias=True, tied_embeddings=True)
    config = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         intermediate_size=shape.intermediate, tie_word_embeddings=True)
    assert causal_lm_parameters(shape) == count(Qwen2ForCausalLM(config))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_lora_parameters_exact(kind: str) -> None:
    if kind == "gpt2":
        shape, model = gpt2_shape(GPT2_SIZE), GPT2LMHeadModel(GPT2Config(**GPT2_SIZE))
    else:
        shape, model = LLAMA, LlamaForCausalLM(llama_config(LLAMA))
    policy, _ = lora_policy(model, LoRAConfig(enabled=True, rank=4, alpha=8.0))
    assert lora_parameters(shape, 4) == sum(p.numel() for p in policy.parameters() if p.requires_grad)


def test_published_shapes_match_published_parameter_counts() -> None:
    assert causal_lm_parameters(MODELS["qwen2.5-7b"]) == 7_615_616_512
    assert causal_lm_parameters(MODELS["llama-2-7b"]) == 6_738_415_616
    assert causal_lm_parameters(MODELS["llama-3.2-1b"]) == 1_235_814_400
    assert causal_lm_parameters(MODELS["qwen2.5-1.5b"]) == 1_543_714_304
    assert causal_lm_parameters(MODELS["qwen2.5-0.5b"]) == 494_032_768


def test_hand_computed_parameters_and_trained_state_bytes() -> None:
    assert (causal_lm_parameters(TINY), reward_model_parameters(TINY)) == (1704, 1456)
    psi = 1704
    torch_fp32 = trained_state(psi, TINY, RunShape(weight_bytes=4, optimizer="torch", lora_rank=0))
    assert (torch_fp32.weights, torch_fp32.gradients, torch_fp32.optimizer) == (4 * psi, 4 * psi, 8 * psi)
    plain = trained_state(psi, TINY, RunShape(zero_stage=0, lora_rank=0))  # bf16 + fp32 grads + master + m + v
    assert (plain.weights, plain.gradients, plain.optimizer) == (2 * psi, 6 * psi, 12 * psi)
    # ZeRO-2 over 4 ranks: whole bf16 weights; the rank's bf16 gradient partition while accumulating (2 x 1704 / 4),
    # its fp32 partition only during the step (4 x 1704 / 4), none between updates; master + m + v 12 x 1704 / 4
    zero2 = trained_state(psi, TINY, RunShape(zero_stage=2, gpus=4, lora_rank=0))
    assert (zero2.weights, zero2.gradients, zero2.step_gradients, zero2.idle_gradients, zero2.optimizer,
            zero2.gathered) == (2 * psi, 852, 1704, 0, 5112, 0)
    assert (zero2.training, zero2.step, zero2.idle) == (3408 + 852 + 5112, 3408 + 1704 + 5112, 3408 + 5112)
    zero3 = trained_state(psi, TINY, RunShape(zero_stage=3, gpus=4, lora_rank=0))
    # weights sharded too; gathered: bf16 x (largest tensor: the 32 x 8 embedding, + one block of 592)
    assert (zero3.weights, zero3.gradients, zero3.step_gradients, zero3.optimizer, zero3.gathered) == \
        (852, 852, 1704, 5112, 2 * (256 + 592))
    offload = trained_state(psi, TINY, RunShape(zero_stage=3, offload=True, gpus=4, lora_rank=0))
    assert offload.weights == offload.optimizer == 0 and offload.host * 4 == 18 * psi


def test_hand_computed_kv_cache_and_activations() -> None:
    run = RunShape()  # bf16: e = 2
    assert kv_cache_bytes(TINY, run, batch=3, tokens=5) == 2 * 2 * 4 * 2 * 3 * 5  # K,V x L x kv_dim x e x B x T
    # norms 2 x (fp32 4h + e h) = 96; attention e x 6h + 4a = 104; MLP e x (h + 4I) = 144
    assert stored_per_token(TINY, run) == 96 + 104 + 144


def test_checkpointing_lowers_training_activations() -> None:
    for shape in (MODELS["qwen2.5-7b"], MODELS["llama-3.2-1b"], gpt2_shape(GPT2_SIZE)):
        run = RunShape(gradient_checkpointing=False)
        full = training_activations(shape, run, 4, 2048)
        ckpt = training_activations(shape, replace(run, gradient_checkpointing=True), 4, 2048)
        assert ckpt < (full / 4 if shape.layers >= 16 else full)  # ~1/L of the blocks' activations, plus one block
        assert phases(shape, replace(run, gradient_checkpointing=True))["training"]["peak"] < \
            phases(shape, run)["training"]["peak"]


def test_zero_sharding_lowers_per_gpu_state_and_offload_moves_it_to_the_host() -> None:
    shape = MODELS["qwen2.5-7b"]
    base = RunShape(lora_rank=0, zero_stage=2)
    one, eight = calculator.summary(shape, replace(base, gpus=1)), calculator.summary(shape, replace(base, gpus=8))
    assert eight["peak"] < one["peak"]
    offload = calculator.summary(shape, replace(base, zero_stage=3, offload=True, gpus=8))
    psi = causal_lm_parameters(shape) + reward_model_parameters(shape)
    assert offload["host_offload_per_node"] == pytest.approx(18 * psi, rel=1e-6)


def test_bad_run_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="offload needs zero_stage=3"):
        RunShape(offload=True, zero_stage=2)
    with pytest.raises(ValueError, match="LoRA under ZeRO-3"):
        RunShape(lora_rank=16, zero_stage=3)


def test_vocab_chunk_matches_the_pipeline() -> None:
    assert calculator.VOCAB_CHUNK_ELEMENTS == VOCAB_CHUNK_ELEMENTS


def test_cli_prints_valid_json_and_markdown() -> None:
    command = [sys.executable, "-m", "benchmarks.memory.calculator", "--model", "qwen2.5-7b"]
    done = subprocess.run(command, cwd=REPO, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["parameters"]["policy"] == 7_615_616_512
    assert result["peak"] == max(result["phases"][k]["peak"] for k in calculator.PPO_PHASES)
    done = subprocess.run([*command, "--markdown"], cwd=REPO, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "| lora, critic, 1 GPU |" in done.stdout
    assert "| gpu-7b preset (lora, critic, token budgets, offload_frozen), 1 GPU |" in done.stdout


def full(**overrides: object) -> RunShape:
    return RunShape(**{"lora_rank": 0, "zero_stage": 2, "gpus": 4, **overrides})


def test_offload_frozen_parks_reference_and_reward_model_during_training_only() -> None:
    # bf16: reference 2 x 1704 + reward model 2 x 1456 = 6320 bytes leave the GPU for training and the step
    kept, parked = phases(TINY, full()), phases(TINY, full(offload_frozen=True))
    for phase in ("training", "optimizer_step"):
        assert kept[phase]["weights_and_states"] - parked[phase]["weights_and_states"] == 6320
    for phase in ("load", "rollout", "scoring", "reward_model_training"):
        assert parked[phase] == kept[phase]
    one = calculator.summary(TINY, full(offload_frozen=True))
    assert (one["host_parked_per_rank"], one["host_parked_per_node"]) == (6320, 4 * 6320)
    assert calculator.summary(TINY, full())["host_parked_per_node"] == 0


@pytest.mark.parametrize(("value_model", "moved"), [("critic", 0), ("head", 2 * 1456), ("none", 2 * 1456)])
def test_offload_frozen_keeps_what_shares_weights_with_a_trained_model(value_model: str, moved: int) -> None:
    # LoRA: the reference is the policy's base (never moves); the reward model moves unless a LoRA critic adapts it
    run = RunShape(lora_rank=4, zero_stage=0, value_model=value_model)
    assert roles(TINY, replace(run, offload_frozen=True)).parked == moved
    assert phases(TINY, run)["training"]["peak"] - phases(TINY, replace(run, offload_frozen=True))["training"]["peak"] \
        == moved


def test_load_holds_every_trained_model_partitioned_under_zero3() -> None:
    # ZeRO-3 over 4 ranks: frozen 6320 + policy shard 2 x 1704 / 4 = 852 + its master and moments 12 x 1704 / 4 = 5112
    # + the critic loaded partitioned too (zero.partitioned_loading): (2 + 12) x 1456 / 4 = 5096
    assert phases(TINY, full(zero_stage=3))["load"]["peak"] == 6320 + 852 + 5112 + 5096
    # ZeRO-2: the whole bf16 policy 3408 + 5112, the critic started too: 2912 + 12 x 1456 / 4 = 4368
    assert phases(TINY, full())["load"]["peak"] == 6320 + 3408 + 5112 + 2912 + 4368


def test_token_budget_bounds_the_scoring_forward() -> None:
    # T = 6 + 2 = 8 tokens; budget 16 -> 2 sequences of 8 instead of 4
    run = RunShape(prompt_length=6, response_length=2, micro_batch=4, rm_length=8)
    budget = replace(run, max_tokens_per_forward=16)
    assert (run.scoring_rows, budget.scoring_rows) == (4, 2)
    # mask B x T x T + (residual 2h + widest 3I) x e per token + the vocabulary chunk: B x Tr rows x V x (e + 8)
    assert phases(TINY, budget)["scoring"]["forward"] == 2 * 8 * 8 + 2 * (16 + 48) * 2 * 8 + 2 * 2 * 32 * 10
    assert phases(TINY, run)["scoring"]["forward"] == 4 * 8 * 8 + 2 * (16 + 48) * 4 * 8 + 4 * 2 * 32 * 10
    # PPO training micro-batches are bounded the same way: half the rows, half the activations and vocabulary term
    trained, whole = phases(TINY, budget)["training"], phases(TINY, run)["training"]
    for part in ("policy_activations", "critic_activations", "vocabulary"):
        assert 2 * trained[part] == whole[part], part


def test_token_budget_bounds_the_reward_model_forward() -> None:
    run = RunShape(rm_micro_batch=4, rm_length=8)
    budget = replace(run, rm_max_tokens_per_forward=32)  # a pair is 2 x 8 tokens: 2 pairs, 4 sequences
    assert budget.rm_pairs == 2
    assert phases(TINY, budget)["reward_model_training"]["activations"] == training_activations(TINY, run, 4, 8)
    assert phases(TINY, run)["reward_model_training"]["activations"] == training_activations(TINY, run, 8, 8)
    assert (budget_rows(4, 8, None), budget_rows(4, 8, 100), budget_rows(4, 8, 7)) == (4, 4, 1)


def test_budgets_too_small_for_one_sequence_are_refused() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_forward=2000 cannot hold one 2048-token rollout"):
        RunShape(max_tokens_per_forward=2000)
    with pytest.raises(ValueError, match="rm_max_tokens_per_forward=4000 is below 2 x rm_length=4096"):
        RunShape(rm_max_tokens_per_forward=4000)


def test_gpu_7b_setup_is_the_shipped_preset() -> None:
    preset = yaml.safe_load((REPO / "infra/presets/gpu-7b.yaml").read_text())
    ppo, rm = preset["ppo"], preset["reward_model"]["training"]
    run = replace(RunShape(), **calculator.GPU_7B)
    assert (run.prompt_length, run.response_length) == (preset["data"]["prep"]["max_prompt_length"],
                                                        ppo["generation"]["max_new_tokens"])
    assert (run.micro_batch, run.generation_batch, run.rollout_batch, run.max_tokens_per_forward) == \
        (ppo["micro_batch_size"], ppo["generation"]["batch_size"], ppo["rollout_batch_size"],
         ppo["max_tokens_per_forward"])
    assert (run.rm_micro_batch, run.rm_length, run.rm_max_tokens_per_forward) == \
        (rm["micro_batch_size"], rm["max_length"], rm["max_tokens_per_forward"])
    assert (run.lora_rank, run.offload_frozen, run.value_model) == (ppo["lora"]["rank"], ppo["offload_frozen"],
                                                                     ppo["value_model"])
    # its budget holds the old worst forward (4 pairs of 2 x 2048), and offload_frozen moves nothing under a LoRA critic
    shape = MODELS["qwen2.5-7b"]
    old = RunShape(lora_rank=16, zero_stage=0)
    assert run.rm_pairs == 4 and phases(shape, run) == phases(shape, old)
    assert calculator.summary(shape, replace(run, rm_max_tokens_per_forward=None))["reward_model_peak"] > \
        calculator.summary(shape, run)["reward_model_peak"]
