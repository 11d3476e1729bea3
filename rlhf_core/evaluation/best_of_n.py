"""Best-of-N sampling: the standard baseline that PPO's reward-vs-KL curve is compared against.

Sample ``n_max`` replies per prompt from the base (SFT) policy once, score every one with the proxy reward
model, and for each ``n`` keep the proxy's favourite among the FIRST ``n`` samples of each prompt. The
subsets are nested (the n=4 pool holds the n=2 pool), so one sampling pass serves every ``n``, and the proxy
score of the chosen reply can only grow with ``n``.

KL: best-of-n needs no KL estimate. Its distance from the sampling distribution is analytic,
``KL(best-of-n || base) = log(n) - (n - 1) / n`` nats (:func:`rlhf_core.evaluation.metrics.best_of_n_kl`; Stiennon et
al. 2020, Gao et al. 2022). Two caveats when reading it next to PPO's measured KL:
- it is exact when the n samples are almost surely distinct and an upper bound otherwise (Beirami et al. 2024);
  short replies from a small model do repeat, so the true KL sits at or below the plotted one;
- "base" is the *sampling* distribution. It is the SFT policy itself only when sampling at temperature 1
  without top-k / top-p; at other settings the KL is to the tempered / truncated SFT policy.

Pure torch/transformers. Judges are :class:`~rlhf_core.models.scoring.Scorer` objects; text-only judges (the demo's
gold scorer) are applied by the caller on :attr:`Candidates.replies` and passed in as a ``(P, N)`` tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import GenerationConfig
from rlhf_core.evaluation.metrics import best_of_n_kl
from rlhf_core.models.scoring import Scorer, decode_rollout
from rlhf_core.models.sequences import Rollout
from rlhf_core.models.text import pad_id
from rlhf_core.training.rollout import generate_in_batches

__all__ = ["BestOfNPoint", "Candidates", "best_of_n_curve", "best_of_n_indices", "best_of_n_kl", "check_ns",
           "sample_candidates", "score_candidates", "take"]


def check_ns(ns: Sequence[int], n_max: int | None = None) -> tuple[int, ...]:
    """``ns`` sorted and deduplicated; ValueError unless every n is >= 1 (and <= ``n_max`` when given)."""
    if not ns:
        raise ValueError("best-of-n needs at least one n, e.g. ns=(1, 2, 4, 8, 16)")
    bad = [n for n in ns if int(n) != n or n < 1 or (n_max is not None and n > n_max)]
    if bad:
        limit = f" and <= {n_max} (the samples drawn per prompt)" if n_max is not None else ""
        raise ValueError(f"best-of-n sizes must be integers >= 1{limit}; got {bad} in ns={list(ns)}")
    return tuple(sorted({int(n) for n in ns}))


def best_of_n_indices(scores: torch.Tensor, ns: Sequence[int]) -> dict[int, torch.Tensor]:
    """For each n, the index of the best of the FIRST n samples of every prompt. (P, N_max) -> {n: (P,) long}.

    Ties go to the earliest sample (``torch.argmax`` returns the first maximum), so the choice for n is
    also the choice for every larger n whose extra samples score no higher.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be (prompts, samples), got shape {tuple(scores.shape)}")
    return {n: scores[:, :n].argmax(dim=1) for n in check_ns(ns, scores.shape[1])}


def take(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``values[p, indices[p]]`` for every prompt p. (P, N), (P,) -> (P,)."""
    return values.gather(1, indices.unsqueeze(1)).squeeze(1)


@dataclass(frozen=True)
class Candidates:
    """``n_max`` sampled replies per prompt. Flat fields are prompt-major: entry ``p * n_max + i`` is sample
    ``i`` of prompt ``p``; :meth:`grid` folds such a flat sequence into ``(P, n_max)``."""

    n_max: int
    """Samples drawn per prompt."""
    replies: tuple[str, ...]
    """Decoded reply text, special tokens (pad, eos) removed. (P * n_max,)"""
    lengths: tuple[int, ...]
    """Response tokens under ``response_mask`` (the stop token included). (P * n_max,)"""
    stopped: tuple[bool, ...]
    """True when the reply ended with a stop token. (P * n_max,)"""
    rollouts: tuple[Rollout, ...]
    """The generation batches in row order, for token-level scorers (reward models)."""

    @property
    def n_prompts(self) -> int:
        """P, the number of prompts."""
        return len(self.replies) // self.n_max

    def grid(self, flat: Sequence[float] | torch.Tensor) -> torch.Tensor:
        """A flat per-candidate sequence as a float tensor. (P * n_max,) -> (P, n_max)."""
        values = torch.as_tensor(flat, dtype=torch.float32)
        if values.numel() != len(self.replies):
            raise ValueError(f"got {values.numel()} values for {len(self.replies)} candidates")
        return values.reshape(self.n_prompts, self.n_max)


def sample_candidates(
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[Sequence[int]],
    n_max: int,
    generation: GenerationConfig,
    seed: int,
) -> Candidates:
    """Sample ``n_max`` replies to every prompt from ``policy``.

    Each prompt is repeated ``n_max`` times in a row and the rows are generated ``generation.batch_size`` at a
    time (rows, not prompts) with one ``torch.Generator`` seeded with ``seed``, so the same inputs give the
    same candidates. Sampling uses ``generation`` as it is: pass the evaluation settings
    (``policy_eval.evaluation_generation``) so best-of-n and PPO's eval draw replies the same way.
    """
    if not prompt_ids:
        raise ValueError("no prompts to sample best-of-n candidates for")
    if n_max < 1:
        raise ValueError(f"best-of-n needs n_max >= 1 samples per prompt, got {n_max}")
    generator = torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)
    rows = [ids for ids in prompt_ids for _ in range(n_max)]
    rollouts, replies, lengths, stopped = [], [], [], []
    for rollout in generate_in_batches(policy, rows, generation, [tokenizer.eos_token_id], pad_id(tokenizer),
                                       generator):
        rollouts.append(rollout)
        replies += decode_rollout(rollout, tokenizer)[1]
        lengths += rollout.response_mask.sum(dim=1).tolist()
        stopped += rollout.stopped.tolist()
    return Candidates(n_max, tuple(replies), tuple(int(n) for n in lengths), tuple(bool(s) for s in stopped),
                      tuple(rollouts))


def score_candidates(candidates: Candidates, scorers: Mapping[str, Scorer]) -> dict[str, torch.Tensor]:
    """Every candidate scored by every judge: name -> (P, n_max) float, on the CPU."""
    return {name: candidates.grid(torch.cat([scorer(r).float().cpu() for r in candidates.rollouts]))
            for name, scorer in scorers.items()}


@dataclass(frozen=True)
class BestOfNPoint:
    """One n of the best-of-n curve: means over prompts of the chosen replies."""

    n: int
    """Samples the choice was made among."""
    kl: float
    """Analytic KL(best-of-n || sampling distribution), nats: :func:`best_of_n_kl`."""
    means: Mapping[str, float]
    """Judge name -> mean score of the chosen replies (the selecting judge included)."""


def best_of_n_curve(select_by: torch.Tensor, judges: Mapping[str, torch.Tensor],
                    ns: Sequence[int]) -> tuple[dict[int, torch.Tensor], list[BestOfNPoint]]:
    """Choose by ``select_by`` (P, N_max) among the first n samples, judge the choice with every ``judges``
    tensor (P, N_max) each. Returns the chosen indices {n: (P,)} and one point per n, ascending."""
    for name, values in judges.items():
        if values.shape != select_by.shape:
            raise ValueError(f"judge {name!r} has shape {tuple(values.shape)}, the selection scores "
                             f"{tuple(select_by.shape)}; score every candidate with every judge")
    chosen = best_of_n_indices(select_by, ns)
    points = [BestOfNPoint(n, best_of_n_kl(n), {name: float(take(values, index).mean())
                                                for name, values in judges.items()})
              for n, index in chosen.items()]
    return chosen, points
