"""Held-out evaluation of a policy against its reference: replies, per-sequence KL, and the comparison metrics.

Pure torch/transformers helpers for the heldout-eval stage (``tasks/heldout_eval.py``). No gold here: judges are
passed in as :class:`~rlhf_core.models.scoring.Scorer` objects, and text-only judges (the demo's gold scorer) are
added by the caller with :func:`with_scores`.

Conventions:
- Greedy decoding (eval temperature 0) is ``top_k=1`` sampling at temperature 1: the multinomial draw over a
  one-token support is the argmax, and ``generate`` stays the one sampling path.
- KL is ``KL(policy || reference)`` of the *actual* next-token distributions (temperature 1.0, full softmax),
  estimated on the policy's own replies and summed over ``response_mask`` (k1 and k3). The sampling
  temperature and top-k only decide which replies are drawn, not the distributions being compared.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import GenerationConfig
from rlhf_core.evaluation.metrics import (distinct_n, mean_repetition_rate, self_similarity, sequence_kl,
                                          sequence_kl_k3, spearman, win_rate)
from rlhf_core.models.budget import row_chunks
from rlhf_core.models.packing import supports_packing
from rlhf_core.models.roles import policy_forward
from rlhf_core.models.scoring import Scorer, decode_rollout
from rlhf_core.models.sequences import Rollout
from rlhf_core.models.text import encode_prompt, pad_id
from rlhf_core.training.rollout import generate_in_batches

#: Temperature at which policy and reference log-probs are compared: the models' own distributions.
KL_TEMPERATURE = 1.0


@dataclass(frozen=True)
class ReplySet:
    """One model's replies to the evaluation prompts; every field holds one entry per prompt, in prompt order."""

    replies: tuple[str, ...]
    """Decoded reply text, special tokens (pad, eos) removed."""
    lengths: tuple[int, ...]
    """Response tokens under ``response_mask`` (the stop token included)."""
    stopped: tuple[bool, ...]
    """True when the reply ended with a stop token (False = cut at max_new_tokens)."""
    kl: tuple[float, ...]
    """Per-sequence k1 KL(model || reference), nats summed over response tokens (0 for the reference)."""
    kl_k3: tuple[float, ...]
    """Per-sequence k3 KL (non-negative), nats summed over response tokens."""
    scores: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """Judge name ('proxy', 'heldout', 'gold') -> one score per reply."""


def with_scores(replies: ReplySet, name: str, scores: Sequence[float]) -> ReplySet:
    """``replies`` with one more judge's scores (e.g. gold, computed on text by the caller)."""
    if len(scores) != len(replies.replies):
        raise ValueError(f"judge {name!r} gave {len(scores)} scores for {len(replies.replies)} replies")
    return replace(replies, scores={**replies.scores, name: tuple(float(s) for s in scores)})


def evaluation_generation(base: GenerationConfig, temperature: float, batch_size: int,
                          max_new_tokens: int | None = None) -> GenerationConfig:
    """The sampling settings of evaluation: ``base`` (the PPO rollout settings) at ``temperature``.

    ``temperature == 0`` means greedy: ``top_k=1`` at temperature 1 (see the module docstring). Otherwise
    ``base``'s top-k / top-p are kept, so the policy is judged as PPO samples it.
    """
    budget = base.max_new_tokens if max_new_tokens is None else max_new_tokens
    if temperature == 0:
        return replace(base, temperature=1.0, top_k=1, top_p=1.0, batch_size=batch_size, max_new_tokens=budget)
    return replace(base, temperature=temperature, batch_size=batch_size, max_new_tokens=budget)


def fit_max_new_tokens(model: PreTrainedModel, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """``max_new_tokens`` cut so the longest prompt plus its reply fits the model's positions."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is None:
        return max_new_tokens
    longest = max(len(ids) for ids in prompt_ids)
    if positions - longest < 1:
        raise ValueError(
            f"the longest evaluation prompt has {longest} tokens and leaves no room for a reply in the model's "
            f"{positions} positions; use shorter evaluation prompts or a model with more positions"
        )
    return min(max_new_tokens, positions - longest)


def response_logprobs(model: PreTrainedModel, rollout: Rollout) -> torch.Tensor:
    """Log-probs of the rollout's response tokens under ``model`` at :data:`KL_TEMPERATURE`. -> (B, Tr)."""
    out = policy_forward(model, rollout.input_ids, rollout.attention_mask, rollout.query_ids.shape[1],
                         KL_TEMPERATURE)
    return out.logprobs


@torch.no_grad()
def rollout_kl(policy: PreTrainedModel, reference: PreTrainedModel, rollout: Rollout,
               max_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence (k1, k3) KL(policy || reference) on the policy's ``rollout``, at most ``max_tokens`` tokens per
    forward (``budget.row_chunks``; None = the whole batch at once). -> (B,), (B,)."""
    rows = rollout.query_ids.shape[0]
    k1, k3 = [], []
    for chunk in row_chunks(rollout.attention_mask, rows, max_tokens, supports_packing(policy)):
        part = rollout.select(slice(chunk.start, chunk.stop))
        logprobs = response_logprobs(policy, part)  # (b, Tr)
        ref_logprobs = response_logprobs(reference, part)  # (b, Tr)
        k1.append(sequence_kl(logprobs, ref_logprobs, part.response_mask))
        k3.append(sequence_kl_k3(logprobs, ref_logprobs, part.response_mask))
    return torch.cat(k1), torch.cat(k3)


@dataclass
class _Collected:
    """Per-reply lists filled batch by batch; frozen into a :class:`ReplySet` at the end."""

    replies: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    stopped: list[bool] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    kl_k3: list[float] = field(default_factory=list)
    scores: dict[str, list[float]] = field(default_factory=dict)

    def add(self, rollout: Rollout, tokenizer: PreTrainedTokenizerBase, scorers: Mapping[str, Scorer],
            kl: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.replies += decode_rollout(rollout, tokenizer)[1]
        self.lengths += rollout.response_mask.sum(dim=1).tolist()
        self.stopped += rollout.stopped.tolist()
        k1, k3 = kl if kl is not None else (torch.zeros(len(rollout.stopped)),) * 2
        self.kl += k1.tolist()
        self.kl_k3 += k3.tolist()
        for name, scorer in scorers.items():
            self.scores.setdefault(name, []).extend(scorer(rollout).float().tolist())

    def freeze(self) -> ReplySet:
        return ReplySet(tuple(self.replies), tuple(int(n) for n in self.lengths), tuple(bool(s) for s in self.stopped),
                        tuple(self.kl), tuple(self.kl_k3), {k: tuple(v) for k, v in self.scores.items()})


def sample_and_judge(
    policy: PreTrainedModel,
    reference: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[Sequence[int]],
    generation: GenerationConfig,
    scorers: Mapping[str, Scorer],
    seed: int,
    max_tokens: int | None = None,
) -> tuple[ReplySet, ReplySet]:
    """Replies of the policy and of the reference to every prompt, scored by every judge; KL on the policy's.

    Prompts go ``generation.batch_size`` at a time; the KL forwards take at most ``max_tokens`` tokens each. Each model samples with its own ``torch.Generator``
    seeded with ``seed``, so the reference's replies are the same in every iteration, and a policy equal to
    the reference draws exactly the reference's replies.
    """
    if not prompt_ids:
        raise ValueError("no evaluation prompts to sample replies for")
    device = next(policy.parameters()).device
    stop, pad = [tokenizer.eos_token_id], pad_id(tokenizer)
    policy_chunks, reference_chunks = (
        generate_in_batches(model, prompt_ids, generation, stop, pad, torch.Generator(device=device).manual_seed(seed))
        for model in (policy, reference)
    )
    collected = {"policy": _Collected(), "reference": _Collected()}
    for policy_rollout, reference_rollout in zip(policy_chunks, reference_chunks, strict=True):
        collected["policy"].add(policy_rollout, tokenizer, scorers,
                                  rollout_kl(policy, reference, policy_rollout, max_tokens))
        collected["reference"].add(reference_rollout, tokenizer, scorers, None)
    return collected["policy"].freeze(), collected["reference"].freeze()


# --- metrics ------------------------------------------------------------------------------------------


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def reply_summary(replies: ReplySet, prefix: str) -> dict[str, float]:
    """Means of one reply set: ``{prefix}/<judge>/mean``, ``/kl/mean``, ``/kl/k3_mean``, ``/length/mean``,
    diversity (``distinct_1``, ``distinct_2``, ``self_similarity``), ``repetition_rate`` and ``stop_rate``."""
    texts = list(replies.replies)
    metrics = {f"{prefix}/{name}/mean": _mean(scores) for name, scores in replies.scores.items()}
    metrics.update({
        f"{prefix}/kl/mean": _mean(replies.kl),
        f"{prefix}/kl/k3_mean": _mean(replies.kl_k3),
        f"{prefix}/length/mean": _mean(replies.lengths),
        f"{prefix}/distinct_1": distinct_n(texts, 1),
        f"{prefix}/distinct_2": distinct_n(texts, 2),
        f"{prefix}/self_similarity": self_similarity(texts),
        f"{prefix}/repetition_rate": mean_repetition_rate(texts),
        f"{prefix}/stop_rate": _mean([float(s) for s in replies.stopped]),
    })
    return metrics


def comparison_metrics(policy: ReplySet, reference: ReplySet, prefix: str = "eval") -> dict[str, float]:
    """The policy's summary, its paired win rate against the reference per judge (ties count half), the
    proxy/held-out rank agreement on the policy's replies, and the reference's own means under
    ``{prefix}/reference/...``."""
    metrics = reply_summary(policy, prefix)
    for name, scores in policy.scores.items():
        if name in reference.scores:
            metrics[f"{prefix}/win_rate/{name}"] = win_rate(scores, reference.scores[name])
    if {"proxy", "heldout"} <= policy.scores.keys() and len(policy.replies) >= 2:
        metrics[f"{prefix}/spearman_proxy_heldout"] = spearman(policy.scores["proxy"], policy.scores["heldout"])
    ref = reply_summary(reference, f"{prefix}/reference")
    metrics.update({k: v for k, v in ref.items() if "/kl/" not in k})  # the reference's KL to itself is 0
    return metrics


@dataclass(frozen=True)
class SampledReplies:
    """Decoded replies of a policy, one per prompt, in prompt order."""

    replies: tuple[str, ...]
    """Reply text without special tokens (pad, eos)."""
    stopped: tuple[bool, ...]
    """True when the reply ended with the eos token (False = cut at max_new_tokens)."""

    @property
    def stopped_fraction(self) -> float:
        """Share of replies that ended with eos."""
        return sum(self.stopped) / max(len(self.stopped), 1)


def sample_replies(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    generation: GenerationConfig,
    seed: int = 0,
) -> SampledReplies:
    """One reply per prompt from ``model``, ``generation.batch_size`` prompts at a time; stops on eos.

    Prompts are tokenized without special tokens, as in SFT and PPO; ``top_k=1`` gives argmax decoding.
    """
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    replies: list[str] = []
    stopped: list[bool] = []
    prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
    for rollout in generate_in_batches(model, prompt_ids, generation, [tokenizer.eos_token_id], pad_id(tokenizer),
                                       generator):
        for row in range(rollout.response_ids.shape[0]):
            ids = rollout.response_ids[row][rollout.response_mask[row]]
            replies.append(tokenizer.decode(ids, skip_special_tokens=True))
        stopped.extend(bool(s) for s in rollout.stopped)
    return SampledReplies(tuple(replies), tuple(stopped))
