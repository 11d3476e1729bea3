"""Annotators: who says which of two replies to a prompt is better, behind one small protocol.

The rm-refresh stage draws fresh pairs from the current policy (:func:`sample_reply_pairs`: two replies per
prompt) and asks an :class:`Annotator` which reply of each :class:`ReplyPair` is preferred:

- :class:`PerPairAnnotator` adapts anything with ``label(prompt, reply_a, reply_b) -> (chosen, rejected)``,
  e.g. the demo task's ``SimulatedAnnotator``, the stand-in for human labellers;
- :class:`RewardModelJudge`: a (larger, or independently trained) reward model prefers the higher-scoring reply;
- people, through a file round-trip (export, label, import): ``tasks/labelling.py``, since it touches files.

:func:`preference_pairs` turns the answers into ``PreferencePair`` rows for reward-model training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import GenerationConfig
from rlhf_core.data.split import pair_id
from rlhf_core.models.families import score_prefix
from rlhf_core.models.scoring import decode_rollout
from rlhf_core.models.text import (
    encode_pair,
    encode_prompt,
    keep_tail,
    pad_id,
)
from rlhf_core.training.reward_training import score_pairs
from rlhf_core.data.records import PreferencePair
from rlhf_core.training.rollout import generate_in_batches


@dataclass(frozen=True)
class ReplyPair:
    """Two replies to one prompt, not yet judged."""

    prompt: str
    reply_a: str
    reply_b: str

    @property
    def pair_id(self) -> str:
        """Stable id of (prompt, reply_a, reply_b): ties a label to the exact texts that were shown."""
        return pair_id(self.prompt, self.reply_a, self.reply_b)


class Annotator(Protocol):
    """Judges reply pairs: one bool per pair, True when ``reply_a`` is preferred to ``reply_b``."""

    def label(self, pairs: Sequence[ReplyPair]) -> list[bool]: ...


class PairLabeller(Protocol):
    """One judgement at a time, as the demo's ``SimulatedAnnotator`` gives it."""

    def label(self, prompt: str, reply_a: str, reply_b: str) -> tuple[str, str]: ...


class PerPairAnnotator:
    """An :class:`Annotator` from a :class:`PairLabeller` that returns ``(chosen, rejected)`` texts."""

    def __init__(self, labeller: PairLabeller) -> None:
        self.labeller = labeller

    def label(self, pairs: Sequence[ReplyPair]) -> list[bool]:
        """Ask the labeller about each pair in order; refuses answers that are not the two replies shown."""
        prefers_a = []
        for index, pair in enumerate(pairs):
            if pair.reply_a == pair.reply_b:
                raise ValueError(f"pair {index} has two identical replies; there is nothing to prefer (drop it first)")
            answer = tuple(self.labeller.label(pair.prompt, pair.reply_a, pair.reply_b))
            if answer not in ((pair.reply_a, pair.reply_b), (pair.reply_b, pair.reply_a)):
                raise ValueError(f"{type(self.labeller).__name__}.label returned {answer!r} for pair {index}; "
                                 "it must return (chosen, rejected): the two replies it was given, in order")
            prefers_a.append(answer[0] == pair.reply_a)
        return prefers_a


class RewardModelJudge:
    """An :class:`Annotator` that prefers the reply its reward model scores higher (ties go to ``reply_a``).

    Each side is scored as ``prompt + reply + eos`` behind the model's prefix (an encoder's ``[CLS]``): the reward
    model's training layout, cut to its last ``max_length`` tokens. Both sides of ``batch_size`` pairs (at most
    ``max_tokens`` tokens, when set) go in one forward (``reward_training.score_pairs``).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_length: int = 1024,
                 batch_size: int = 32, max_tokens: int | None = None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.prefix = score_prefix(model, tokenizer)

    @torch.no_grad()
    def scores(self, pairs: Sequence[ReplyPair]) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores of every ``reply_a`` and every ``reply_b``, in pair order. -> (N,), (N,) on the CPU."""
        rows_a = [self._encode(p.prompt, p.reply_a) for p in pairs]
        rows_b = [self._encode(p.prompt, p.reply_b) for p in pairs]
        a_scores, b_scores = score_pairs(self.model, rows_a, rows_b, pad_id(self.tokenizer), self.batch_size,
                                         self.max_tokens)
        return a_scores.cpu(), b_scores.cpu()

    def label(self, pairs: Sequence[ReplyPair]) -> list[bool]:
        """True where ``reply_a`` scores at least as high as ``reply_b``."""
        a_scores, b_scores = self.scores(pairs)
        return (a_scores >= b_scores).tolist()

    def _encode(self, prompt: str, reply: str) -> list[int]:
        return keep_tail(encode_pair(self.tokenizer, prompt, reply), self.max_length, self.prefix)[0]


def preference_pairs(pairs: Sequence[ReplyPair], prefers_a: Sequence[bool]) -> list[PreferencePair]:
    """``PreferencePair(prompt, chosen, rejected)`` per judged pair, in order."""
    if len(prefers_a) != len(pairs):
        raise ValueError(f"the annotator returned {len(prefers_a)} labels for {len(pairs)} pairs; it must label "
                         "every pair it is given, in order")
    return [PreferencePair(p.prompt, p.reply_a, p.reply_b) if a else PreferencePair(p.prompt, p.reply_b, p.reply_a)
            for p, a in zip(pairs, prefers_a)]


@torch.no_grad()
def sample_reply_pairs(policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str],
                       generation: GenerationConfig, seed: int) -> list[ReplyPair]:
    """Two independent replies of ``policy`` to each prompt (on-policy pairs), in prompt order.

    Both replies are sampled in the same batch (rows ``2i`` and ``2i + 1``) with one ``torch.Generator``
    seeded with ``seed``; ``generation.batch_size`` counts rows, so ``batch_size // 2`` prompts go at once.
    """
    if not prompts:
        raise ValueError("no prompts to sample reply pairs for")
    prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
    _check_room(policy, prompt_ids, generation.max_new_tokens)
    generator = torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)
    rows = [ids for ids in prompt_ids for _ in range(2)]  # both replies of a prompt always share a batch
    per_batch = replace(generation, batch_size=2 * max(1, generation.batch_size // 2))
    replies = [reply for rollout in generate_in_batches(policy, rows, per_batch, [tokenizer.eos_token_id],
                                                        pad_id(tokenizer), generator)
               for reply in decode_rollout(rollout, tokenizer)[1]]
    return [ReplyPair(prompt, replies[2 * i], replies[2 * i + 1]) for i, prompt in enumerate(prompts)]


def _check_room(policy: PreTrainedModel, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """Refuse prompts that leave no room for a full reply within the policy's positions."""
    positions = getattr(policy.config, "max_position_embeddings", None)
    longest = max(len(ids) for ids in prompt_ids)
    if positions is not None and longest + max_new_tokens > positions:
        raise ValueError(f"the longest prompt has {longest} tokens; with ppo.generation.max_new_tokens="
                         f"{max_new_tokens} it exceeds the policy's {positions} positions. Lower max_new_tokens or "
                         "filter long prompts in data-prep (data.prep.max_length)")
