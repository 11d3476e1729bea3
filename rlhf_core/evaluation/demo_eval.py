"""Evaluation helpers of the demo task: sample replies from a policy and judge them with the hidden gold scorer.

This is the one module outside ``rlhf_core/demo/`` that may read gold (``tests/unit/test_gold_isolation.py``
enforces it). Training code must never import it: its numbers are for reports, never for losses or labels.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import GenerationConfig
from rlhf_core.demo.gold import gold_breakdown, gold_score
from rlhf_core.demo.prompts import PromptRecord
from rlhf_core.demo.replies import best_reply
from rlhf_core.evaluation.policy_eval import fit_max_new_tokens, sample_replies
from rlhf_core.models.text import encode_prompt
from rlhf_core.data.records import PreferencePair

@dataclass(frozen=True)
class GoldSummary:
    """Gold judgement of a set of (prompt, reply) pairs."""

    n: int
    """Pairs judged."""
    mean_gold: float
    """Mean gold score (higher is better; a best-possible reply scores 4.5 - 5.0)."""
    correct_action_fraction: float
    """Share of replies that perform at least one action that solves the customer's intent."""


@dataclass(frozen=True)
class AgreementStats:
    """How often the annotator's choice agrees with gold on preference pairs."""

    n: int
    """Pairs looked at."""
    ties: int
    """Pairs whose two replies have the same gold score (excluded from ``agreement``)."""
    agreement: float
    """Share of non-tied pairs where ``chosen`` has the higher gold score."""


def has_correct_action(prompt: str, reply: str) -> bool:
    """True when ``reply`` performs an action that solves the intent of ``prompt`` (gold's rule)."""
    return gold_breakdown(prompt, reply)["correct_action"] > 0


def gold_summary(prompts: Sequence[str], replies: Sequence[str]) -> GoldSummary:
    """Mean gold score and correct-action share of ``replies[i]`` answering ``prompts[i]``."""
    if len(prompts) != len(replies) or not prompts:
        raise ValueError(f"need as many replies as prompts (at least one), got {len(prompts)} and {len(replies)}")
    scores = [gold_score(p, r) for p, r in zip(prompts, replies)]
    actions = [has_correct_action(p, r) for p, r in zip(prompts, replies)]
    return GoldSummary(len(scores), statistics.fmean(scores), sum(actions) / len(actions))


def best_replies(records: Iterable[PromptRecord], seed: int = 0) -> list[str]:
    """The gold ceiling: a reply with every good part once and nothing bad, for each record."""
    rng = random.Random(f"demo-best:{seed}")
    return [best_reply(rng, record) for record in records]


def record_from_row(row: Mapping[str, object]) -> PromptRecord:
    """A ``PromptRecord`` from an evaluation-prompt row holding its fields (extra keys are ignored)."""
    missing = [f.name for f in fields(PromptRecord) if f.name not in row]
    if missing:
        raise ValueError(f"evaluation prompt row lacks {missing}; regenerate eval_prompts.parquet with `rlhf prep --demo`")
    return PromptRecord(**{f.name: row[f.name] for f in fields(PromptRecord)})  # type: ignore[arg-type]


def annotator_agreement(rows: Iterable[Mapping[str, str]]) -> AgreementStats:
    """Share of ``{prompt, chosen, rejected}`` rows where chosen has the higher gold score (ties excluded)."""
    agree = ties = n = 0
    for row in rows:
        n += 1
        gap = gold_score(row["prompt"], row["chosen"]) - gold_score(row["prompt"], row["rejected"])
        ties += gap == 0
        agree += gap > 0
    decided = n - ties
    return AgreementStats(n, ties, agree / decided if decided else float("nan"))


def gold_judged(pairs: Iterable[PreferencePair]) -> list[PreferencePair]:
    """``pairs`` relabelled by gold: ``chosen`` is the reply with the higher gold score; gold ties are dropped.

    A reward model's accuracy on these is its agreement with the hidden judge, free of annotator noise
    (a report only: these labels must never reach training).
    """
    judged = []
    for pair in pairs:
        gap = gold_score(pair.prompt, pair.chosen) - gold_score(pair.prompt, pair.rejected)
        if gap:
            better, worse = (pair.chosen, pair.rejected) if gap > 0 else (pair.rejected, pair.chosen)
            judged.append(PreferencePair(pair.prompt, better, worse))
    return judged


@dataclass(frozen=True)
class PolicyGoldReport:
    """A policy's replies on evaluation prompts, judged by gold next to the demonstrations and the ceiling."""

    greedy: GoldSummary
    """Greedy (argmax) replies of the policy."""
    sampled: GoldSummary
    """Replies sampled at the report's temperature."""
    demonstrations: GoldSummary
    """The held-out demonstration replies the policy imitates."""
    best: GoldSummary
    """Best-possible replies for the evaluation prompts (the gold ceiling)."""
    greedy_stopped: float
    """Share of greedy replies that ended with eos."""
    sampled_stopped: float
    """Share of sampled replies that ended with eos."""
    samples: tuple[tuple[str, str, str], ...]
    """(prompt, greedy reply, sampled reply) for every evaluation prompt."""

    def as_metrics(self, prefix: str = "eval") -> dict[str, float]:
        """Flat ``{prefix}/gold_<who>``, ``{prefix}/correct_action_<who>`` and stop-rate metrics."""
        metrics: dict[str, float] = {}
        for who in ("greedy", "sampled", "demonstrations", "best"):
            summary: GoldSummary = getattr(self, who)
            metrics[f"{prefix}/gold_{who}"] = summary.mean_gold
            metrics[f"{prefix}/correct_action_{who}"] = summary.correct_action_fraction
        metrics[f"{prefix}/stopped_greedy"] = self.greedy_stopped
        metrics[f"{prefix}/stopped_sampled"] = self.sampled_stopped
        return metrics


def gold_report(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[PromptRecord],
    demonstrations: Sequence[tuple[str, str]],
    generation: GenerationConfig,
    seed: int = 0,
) -> PolicyGoldReport:
    """Greedy and sampled replies of ``model`` on ``records``' prompts, judged by gold.

    ``generation`` sets the sampling temperature / top-k / top-p, the batch size and the reply budget (cut to
    the model's positions); the greedy pass uses the same budget with ``top_k=1``.
    """
    if not records or not demonstrations:
        raise ValueError(f"need evaluation prompts and demonstrations, got {len(records)} and {len(demonstrations)}")
    prompts = [r.prompt for r in records]
    budget = fit_max_new_tokens(model, [encode_prompt(tokenizer, p) for p in prompts], generation.max_new_tokens)
    sampling = replace(generation, max_new_tokens=budget)
    greedy_config = replace(generation, max_new_tokens=budget, temperature=1.0, top_k=1, top_p=1.0)
    greedy = sample_replies(model, tokenizer, prompts, greedy_config, seed)
    sampled = sample_replies(model, tokenizer, prompts, sampling, seed)
    return PolicyGoldReport(
        greedy=gold_summary(prompts, greedy.replies),
        sampled=gold_summary(prompts, sampled.replies),
        demonstrations=gold_summary([p for p, _ in demonstrations], [r for _, r in demonstrations]),
        best=gold_summary(prompts, best_replies(records, seed)),
        greedy_stopped=greedy.stopped_fraction,
        sampled_stopped=sampled.stopped_fraction,
        samples=tuple(zip(prompts, greedy.replies, sampled.replies)),
    )
