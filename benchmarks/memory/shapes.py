"""Model and run shapes as numbers, and the model's exact parameter counts (no torch, no downloads).

A :class:`ModelShape` is what a Hugging Face config says about size: hidden size, layers, heads, KV heads, MLP
width, vocabulary, tied embeddings. :func:`causal_lm_parameters` / :func:`reward_model_parameters` /
:func:`lora_parameters` count what ``AutoModelForCausalLM`` / ``AutoModelForSequenceClassification(num_labels=1)``
/ this project's LoRA adapters (``rlhf_core/models/lora.py``) hold, exactly
(``tests/benchmarks/test_memory_calculator.py`` compares them with ``sum(p.numel())`` of real tiny models).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Architecture = Literal["llama", "gpt2"]


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only model's config that decide its memory."""

    name: str
    """A label for tables (e.g. 'qwen2.5-7b')."""
    architecture: Architecture
    """'llama': Llama / Mistral / Qwen2 (RMSNorm, RoPE, gated SiLU MLP); 'gpt2': GPT-2 (LayerNorm, learned
    positions, GELU MLP, Conv1D layers with biases)."""
    hidden: int
    """h: hidden size (``hidden_size`` / ``n_embd``)."""
    layers: int
    """L: decoder blocks (``num_hidden_layers`` / ``n_layer``)."""
    heads: int
    """a: attention heads; head_dim = h / a."""
    kv_heads: int
    """Key/value heads (grouped-query attention; = heads without it)."""
    intermediate: int
    """I: MLP width (``intermediate_size``; GPT-2: 4h)."""
    vocab: int
    """V: vocabulary size (rows of the embedding and of the output layer)."""
    tied_embeddings: bool
    """The output layer reuses the embedding matrix (GPT-2, Llama-3.2-1B, Qwen2.5-1.5B)."""
    qkv_bias: bool = False
    """q/k/v projections have biases (Qwen2)."""
    max_positions: int = 0
    """GPT-2 only: rows of the learned position embedding (``n_positions``)."""

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values) of one token: kv_heads x head_dim."""
        return self.kv_heads * self.head_dim


ValueModel = Literal["critic", "head", "none"]
Optimizer = Literal["deepspeed", "torch"]
VOCAB_CHUNK_ELEMENTS = 1 << 26
"""As ``rlhf_core.models.roles.VOCAB_CHUNK_ELEMENTS`` (a test keeps them equal; this module imports no torch)."""


@dataclass(frozen=True)
class RunShape:
    """What a PPO run does with the model: lengths, batch sizes, precision, trained parts, sharding."""

    prompt_length: int = 1536
    """Tq: prompt tokens (left-padded to the longest of a batch)."""
    response_length: int = 512
    """Tr: ``ppo.generation.max_new_tokens``."""
    micro_batch: int = 4
    """``ppo.micro_batch_size``: sequences per training forward (and at most per scoring forward)."""
    max_tokens_per_forward: int | None = None
    """``ppo.max_tokens_per_forward``: tokens per scoring forward (old / reference log-probs, values, RM scores)
    on top of ``micro_batch`` rows, PPO training micro-batches included. None = rows only (gpu-7b: 16384)."""
    generation_batch: int = 64
    """``ppo.generation.batch_size``: sequences sampled together (each holds a KV cache)."""
    rollout_batch: int = 128
    """``ppo.rollout_batch_size``: each of N ranks generates its share, ``generation_batch`` at a time."""
    rm_micro_batch: int = 4
    """``reward_model.training.micro_batch_size``: preference pairs per forward (2 sequences each; gpu-7b: 16)."""
    rm_length: int = 2048
    """``reward_model.training.max_length``: tokens per reward-model sequence."""
    rm_max_tokens_per_forward: int | None = None
    """``reward_model.training.max_tokens_per_forward``: tokens per reward-model forward (both sides of its pairs)
    on top of ``rm_micro_batch``; None = rows only (gpu-7b: 16384 = 4 pairs of 2 x 2048)."""
    weight_bytes: int = 2
    """Bytes per weight element: 2 (``dtype: bfloat16``) or 4 (float32)."""
    autocast: bool = True
    """``*.autocast: bf16``: activations and logits in bf16 even when the weights are fp32."""
    lora_rank: int = 16
    """LoRA rank of policy and critic (``ppo.lora``); 0 = full fine-tuning."""
    gradient_checkpointing: bool = True
    """``ppo.gradient_checkpointing`` / ``reward_model.training.gradient_checkpointing``."""
    optimizer: Optimizer = "deepspeed"
    """Who trains full models: 'deepspeed' (bf16 mixed precision, ZeRO) or 'torch' (AdamW in the weights' dtype)."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage: 0, 2 or 3 (with optimizer='deepspeed')."""
    gpus: int = 1
    """N: data-parallel ranks (``distributed.num_processes`` x ``num_nodes``)."""
    gpus_per_node: int = 8
    """Ranks per node (host RAM of offload is per node)."""
    offload: bool = False
    """ZeRO-3 with weights and optimizer in pinned host RAM (``infra/deepspeed/zero3_offload.json``)."""
    value_model: ValueModel = "critic"
    """``ppo.value_model``: a separate critic (the reward model's shape), a value head on the policy, or none."""
    offload_frozen: bool = False
    """``ppo.offload_frozen``: the reference and reward model wait in host memory during PPO training and the
    optimizer step, unless they share weights with a trained model (LoRA reference, RM under a LoRA critic)."""
    vocab_chunk_elements: int = VOCAB_CHUNK_ELEMENTS
    """Logits per chunk of the vocabulary term."""
    fused_gelu: bool = True
    """GPT-2 only: the pipeline fuses GELU (``roles.fuse_activations``: 2 saved tensors of I instead of 5)."""

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 2, 3):
            raise ValueError(f"zero_stage must be 0, 2 or 3, got {self.zero_stage}")
        if self.offload and self.zero_stage != 3:
            raise ValueError("offload needs zero_stage=3 (infra/deepspeed/zero3_offload.json)")
        if self.lora_rank and self.zero_stage == 3 and self.optimizer == "deepspeed":
            raise ValueError("LoRA under ZeRO-3 is not supported by the pipeline; use zero_stage 2 or 0")
        if self.max_tokens_per_forward is not None and self.max_tokens_per_forward < self.sequence:
            raise ValueError(f"max_tokens_per_forward={self.max_tokens_per_forward} cannot hold one "
                             f"{self.sequence}-token rollout (prompt_length + response_length)")
        if self.rm_max_tokens_per_forward is not None and self.rm_max_tokens_per_forward < 2 * self.rm_length:
            raise ValueError(f"rm_max_tokens_per_forward={self.rm_max_tokens_per_forward} is below 2 x rm_length="
                             f"{2 * self.rm_length} (one pair, both sides)")

    @property
    def act_bytes(self) -> int:
        """e: bytes per activation element (2 under bf16 weights or bf16 autocast, else 4)."""
        return 2 if self.weight_bytes == 2 or self.autocast else 4

    @property
    def sequence(self) -> int:
        """T = Tq + Tr: tokens of one PPO sequence."""
        return self.prompt_length + self.response_length

    @property
    def scoring_rows(self) -> int:
        """Sequences in the widest scoring forward: ``micro_batch``, fewer where the token budget binds."""
        return budget_rows(self.micro_batch, self.sequence, self.max_tokens_per_forward)

    @property
    def rm_pairs(self) -> int:
        """Pairs in the widest reward-model training forward: ``rm_micro_batch``, fewer where the budget binds."""
        return budget_rows(self.rm_micro_batch, 2 * self.rm_length, self.rm_max_tokens_per_forward)


def budget_rows(max_rows: int, longest: int, max_tokens: int | None) -> int:
    """Rows of the worst forward under ``rlhf_core.models.budget.token_chunks``: every row of the longest length,
    padded (rows x longest <= max_tokens; a row longer than the budget goes alone). A packed forward holds at most
    ``max_tokens`` (the same when the budget is a multiple of ``longest``), without the padded forward's mask."""
    if max_tokens is None:
        return max_rows
    return max(1, min(max_rows, max_tokens // longest))


def _linears(shape: ModelShape) -> list[tuple[int, int, bool]]:
    """(d_in, d_out, bias) of every linear layer of one block: what LoRA adapts."""
    h, i = shape.hidden, shape.intermediate
    if shape.architecture == "gpt2":
        return [(h, 3 * h, True), (h, h, True), (h, i, True), (i, h, True)]  # c_attn, attn c_proj, c_fc, mlp c_proj
    kv, b = shape.kv_dim, shape.qkv_bias
    return [(h, h, b), (h, kv, b), (h, kv, b), (h, h, False), (h, i, False), (h, i, False), (i, h, False)]


def block_parameters(shape: ModelShape) -> int:
    """Parameters of one decoder block: its linear layers and its two norms (LayerNorm: weight + bias)."""
    linear = sum(d_in * d_out + (d_out if bias else 0) for d_in, d_out, bias in _linears(shape))
    norms = 2 * (2 if shape.architecture == "gpt2" else 1) * shape.hidden
    return linear + norms


def backbone_parameters(shape: ModelShape) -> int:
    """Embeddings + blocks + final norm: the model without its output layer (``model.model`` / ``transformer``)."""
    h = shape.hidden
    embeddings = shape.vocab * h + (shape.max_positions * h if shape.architecture == "gpt2" else 0)
    final_norm = (2 if shape.architecture == "gpt2" else 1) * h
    return embeddings + shape.layers * block_parameters(shape) + final_norm


def causal_lm_parameters(shape: ModelShape) -> int:
    """Ψ of ``AutoModelForCausalLM``: the backbone plus an untied (V, h) output layer (no bias)."""
    return backbone_parameters(shape) + (0 if shape.tied_embeddings else shape.vocab * shape.hidden)


def reward_model_parameters(shape: ModelShape) -> int:
    """``AutoModelForSequenceClassification(num_labels=1)``: the backbone plus a (1, h) score layer (no bias)."""
    return backbone_parameters(shape) + shape.hidden


def lora_parameters(shape: ModelShape, rank: int) -> int:
    """LoRA of rank r on every linear layer of the blocks: r x (d_in + d_out) each (A and B, no biases)."""
    return shape.layers * sum(rank * (d_in + d_out) for d_in, d_out, _ in _linears(shape))


def largest_tensor(shape: ModelShape) -> int:
    """Elements of the largest single weight (the embedding, or an MLP matrix): ZeRO-3 gathers it whole."""
    return max(shape.vocab * shape.hidden, shape.hidden * shape.intermediate)


MODELS: dict[str, ModelShape] = {
    "llama-3.2-1b": ModelShape("llama-3.2-1b", "llama", hidden=2048, layers=16, heads=32, kv_heads=8,
                               intermediate=8192, vocab=128256, tied_embeddings=True),
    "qwen2.5-0.5b": ModelShape("qwen2.5-0.5b", "llama", hidden=896, layers=24, heads=14, kv_heads=2,
                               intermediate=4864, vocab=151936, tied_embeddings=True, qkv_bias=True),
    "qwen2.5-1.5b": ModelShape("qwen2.5-1.5b", "llama", hidden=1536, layers=28, heads=12, kv_heads=2,
                               intermediate=8960, vocab=151936, tied_embeddings=True, qkv_bias=True),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", "llama", hidden=3584, layers=28, heads=28, kv_heads=4,
                             intermediate=18944, vocab=152064, tied_embeddings=False, qkv_bias=True),
    "llama-2-7b": ModelShape("llama-2-7b", "llama", hidden=4096, layers=32, heads=32, kv_heads=32,
                             intermediate=11008, vocab=32000, tied_embeddings=False),
}
"""Published configs (config.json of each model on the Hugging Face Hub), as numbers: nothing is downloaded."""


def gpt2_shape(size: dict[str, int], name: str = "gpt2") -> ModelShape:
    """The shape of ``GPT2Config(**size)`` as the memory worker builds it (``benchmarks/memory/worker.py``)."""
    h = size["n_embd"]
    return ModelShape(name, "gpt2", hidden=h, layers=size["n_layer"], heads=size["n_head"], kv_heads=size["n_head"],
                      intermediate=4 * h, vocab=size["vocab_size"], tied_embeddings=True,
                      max_positions=size["n_positions"])
