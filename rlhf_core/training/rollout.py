"""Rollout generation: batched sampling with a KV cache from any causal LM, left-padded prompts, into a
:class:`~rlhf_core.models.sequences.Rollout` (the layout is described there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from rlhf_core.compat import CACHE
from rlhf_core.config import GenerationConfig
from rlhf_core.models.lm_head import split_lm_head
from rlhf_core.models.sequences import Rollout, left_pad, positions_from_mask
from rlhf_core.ppo.masking import ended_with_stop, response_mask_from_stop

if TYPE_CHECKING:
    from transformers import StaticCache

STATIC_WIDTH_STEP = 64
"""A static cache's length is the rollout's (prompt width + max_new_tokens) rounded up to this, so that chunks with
slightly different prompt widths reuse one cache and one compiled decode step."""
COMPILED_DEVICES = frozenset({"cuda"})
"""Device types on which the static path compiles its decode step (benchmarks/generation measures CPU both ways)."""


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus to -inf. (B, V) -> (B, V). Sampling only: log-probs
    are always taken from the full softmax so the training-time recomputation matches them."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already exceeds top_p (the top token always stays).
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) > top_p
        drop = drop_sorted.scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs`` (B, V) -> (B,), by inverting the cumulative distribution.

    Same distribution as ``torch.multinomial(probs, 1)``, which draws B x V exponentials per call (8% of
    a small model's sampling time on CPU); this draws B uniforms. The CDF is summed in float64 so that
    rounding never reaches a zero-probability token: ``right=True`` skips the flat steps they leave.
    """
    cdf = probs.double().cumsum(dim=-1)  # (B, V)
    # Drawn where the generator lives (a CPU generator also serves a CUDA model, with the same numbers).
    where = generator.device if generator is not None else probs.device
    uniform = torch.rand((probs.shape[0], 1), generator=generator, dtype=torch.float64, device=where).to(probs.device)
    index = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)  # (B, 1)
    return index.clamp(max=probs.shape[-1] - 1).squeeze(1)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    config: GenerationConfig,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator | None = None,
) -> Rollout:
    """Sample responses for a batch of left-padded prompts with a KV cache.

    query_ids, query_mask: (B, Tq). Stops early once every row has produced a stop token.
    The model is put in eval mode (dropout off) for the duration and restored afterwards.
    """
    was_training = model.training
    model.eval()
    try:
        tokens, logprobs = _sample_loop(model, query_ids, query_mask, config, stop_token_ids, pad_token_id, generator)
    finally:
        model.train(was_training)
    response_ids, response_mask = response_mask_from_stop(tokens, stop_token_ids, pad_token_id)
    return Rollout(
        query_ids=query_ids,
        query_mask=query_mask.bool(),
        response_ids=response_ids,
        response_mask=response_mask,
        logprobs=torch.where(response_mask, logprobs, torch.zeros_like(logprobs)),
        stopped=ended_with_stop(response_ids, response_mask, stop_token_ids),
    )


def _sample_loop(
    model: torch.nn.Module,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    config: GenerationConfig,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-by-token loop (vectorised over the batch). Returns ids and log-probs, (B, Tr) each."""
    device = query_ids.device
    batch, query_len = query_ids.shape
    decoder = _Decoder(model, config, query_mask)
    # Only the last prompt position's logits are used; models with a plain output layer skip the others.
    last_only = {"logits_to_keep": 1} if split_lm_head(model) is not None else {}
    positions = positions_from_mask(query_mask.long())
    next_logits = decoder.prefill(query_ids, positions, last_only)
    next_position = positions[:, -1:] + 1  # (B, 1)
    stops = torch.as_tensor(list(stop_token_ids), device=device, dtype=torch.long)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    tokens = torch.full((batch, config.max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((batch, config.max_new_tokens), dtype=torch.float32, device=device)
    for step in range(config.max_new_tokens):
        scaled = next_logits.float() / config.temperature  # (B, V)
        probs = filter_logits(scaled, config.top_k, config.top_p).softmax(dim=-1)
        token = sample_tokens(probs, generator)  # (B,)
        token = torch.where(done, torch.full_like(token, pad_token_id), token)
        logprobs[:, step] = F.log_softmax(scaled, dim=-1).gather(1, token.unsqueeze(1)).squeeze(1)
        tokens[:, step] = token
        done = done | torch.isin(token, stops)
        if bool(done.all()) or step + 1 == config.max_new_tokens:
            return tokens[:, : step + 1], logprobs[:, : step + 1]
        next_logits = decoder.step(token.unsqueeze(1), next_position, query_len + step + 1)
        next_position = next_position + 1
    raise AssertionError("unreachable: the loop returns at its last step")


class _Decoder:
    """The model calls of one rollout batch, with a dynamic or a static KV cache (``config.cache``).

    The attention mask of the whole rollout is built up front: finished rows keep feeding pad, whose tail is masked
    out afterwards, so attending to it is harmless. The dynamic path passes the columns seen so far; the static path
    passes every column of its preallocated cache at every step (causal masking hides the ones not written yet), so
    the decode step has one shape and compiles once. Its cache and compiled step live on the model, as in
    transformers' own generate: reused by the next batch of the same shape, and kept allocated while the model lives.
    """

    def __init__(self, model: torch.nn.Module, config: GenerationConfig, query_mask: torch.Tensor) -> None:
        batch, query_len = query_mask.shape
        width = query_len + config.max_new_tokens
        if config.cache == "static":
            width = -(-width // STATIC_WIDTH_STEP) * STATIC_WIDTH_STEP
        self.attention = torch.cat([query_mask.long(), query_mask.new_ones((batch, width - query_len)).long()], dim=1)
        self.model, self.static = model, config.cache == "static"
        self.cache = _static_cache(model, batch, width) if self.static else None
        self.compiled = self.static and query_mask.device.type in COMPILED_DEVICES
        self.decode = _compiled_call(model) if self.compiled else model

    def prefill(self, query_ids: torch.Tensor, positions: torch.Tensor, extra: dict) -> torch.Tensor:
        """Run the prompts through the model; the next-token logits, (B, V)."""
        mask = self.attention if self.static else self.attention[:, : query_ids.shape[1]]
        out = self.model(input_ids=query_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **({CACHE: self.cache} if self.static else {}), **extra)
        self.cache = getattr(out, CACHE)
        return out.logits[:, -1, :]

    def step(self, token: torch.Tensor, position: torch.Tensor, seen: int) -> torch.Tensor:
        """One token per row (B, 1) at ``position`` (B, 1), ``seen`` columns written before it; logits (B, V)."""
        mask = self.attention if self.static else self.attention[:, :seen]
        if self.compiled:
            torch.compiler.cudagraph_mark_step_begin()
        out = self.decode(input_ids=token, attention_mask=mask, position_ids=position, use_cache=True,
                          **{CACHE: self.cache})
        self.cache = getattr(out, CACHE)
        return out.logits[:, -1, :].clone() if self.compiled else out.logits[:, -1, :]  # CUDA graphs reuse outputs


def _static_cache(model: torch.nn.Module, batch: int, width: int) -> StaticCache:
    """The model's static cache for ``batch`` rows of ``width`` positions, emptied; made anew for another shape."""
    from transformers import StaticCache

    device = next(model.parameters()).device
    shape = (batch, width, device, torch.is_autocast_enabled(device.type))  # autocast changes the cache's dtype
    held = model.__dict__.get("_rlhf_static_cache")
    if held is not None and held[0] == shape:
        held[1].reset()
        return held[1]
    lm = getattr(model, "module", model)  # a DeepSpeed engine holds the model as .module
    cache = StaticCache(config=lm.config, max_cache_len=width)
    model.__dict__["_rlhf_static_cache"] = (shape, cache)  # not a submodule: never in a state dict
    return cache


def _compiled_call(model: torch.nn.Module) -> Callable[..., Any]:
    """``model.__call__`` compiled once per model for the fixed-shape decode step (CUDA graphs: 'reduce-overhead')."""
    compiled = model.__dict__.get("_rlhf_compiled_decode")
    if compiled is None:
        compiled = torch.compile(model.__call__, mode="reduce-overhead", dynamic=False)
        model.__dict__["_rlhf_compiled_decode"] = compiled
    return compiled


def generate_in_batches(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator | None = None,
) -> Iterator[Rollout]:
    """:func:`generate` over token-id prompts, ``config.batch_size`` at a time, on the model's device.

    Yields one :class:`Rollout` per chunk, in prompt order; one ``generator`` serves every chunk, so the same
    prompts, settings and seed give the same replies.
    """
    device = next(model.parameters()).device
    for start in range(0, len(prompts), config.batch_size):
        query_ids, query_mask = left_pad(prompts[start : start + config.batch_size], pad_token_id)
        yield generate(model, query_ids.to(device), query_mask.to(device), config, stop_token_ids, pad_token_id,
                       generator)
