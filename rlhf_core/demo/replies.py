"""Agent replies of controllable quality, assembled from the phrase book.

A ``ReplySpec`` says which parts a reply has (greeting, apologies, a right/wrong/no action, a timeline, the
order number, a closing, and the bad parts: filler, padding, dismissiveness, blame, a repeated sentence);
``render_reply`` turns it into text for one customer message. ``QUALITY_PROFILES`` are the distributions
the generators draw specs from. Replies start with a space: they continue ``render_prompt(message)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from rlhf_core.demo import phrases
from rlhf_core.demo.intents import INTENTS_BY_NAME
from rlhf_core.demo.prompts import PromptRecord

Quality = Literal["good", "mediocre", "bad"]
ActionKind = Literal["correct", "wrong", "none"]


@dataclass(frozen=True)
class ReplySpec:
    """Which parts a reply contains (counts are numbers of sentences)."""

    greeting: bool = False
    empathy: int = 0
    action: ActionKind = "none"
    info: bool = False
    order_ref: bool = False
    closing: bool = False
    filler: int = 0
    padding: int = 0
    dismissive: int = 0
    blame: int = 0
    repeat: bool = False
    """Say one sentence twice."""


#: What the gold scorer likes best: every good part once, nothing bad.
BEST_SPEC = ReplySpec(greeting=True, empathy=1, action="correct", info=True, order_ref=True, closing=True)


@dataclass(frozen=True)
class QualityProfile:
    """Probabilities of each part for one quality level (weights are over counts 0, 1, 2, ...)."""

    p_greeting: float
    empathy_weights: tuple[float, ...]
    action_weights: tuple[float, float, float]
    """Weights of correct / wrong / none."""
    p_info: float
    p_order_ref: float
    p_closing: float
    filler_weights: tuple[float, ...]
    padding_weights: tuple[float, ...]
    p_dismissive: float
    p_blame: float
    p_repeat: float


# Apologies and length both rise with quality here, and three or more apologies never occur: a reward model
# fitted on these pairs can learn "more apology / longer is better", which gold punishes when overdone.
QUALITY_PROFILES: dict[Quality, QualityProfile] = {
    "good": QualityProfile(0.9, (0.05, 0.8, 0.15), (0.9, 0.0, 0.1), 0.8, 0.7, 0.9,
                           (0.95, 0.05), (0.75, 0.2, 0.05), 0.0, 0.0, 0.02),
    "mediocre": QualityProfile(0.6, (0.45, 0.5, 0.05), (0.5, 0.3, 0.2), 0.4, 0.3, 0.5,
                               (0.7, 0.3), (0.7, 0.2, 0.1), 0.1, 0.05, 0.1),
    "bad": QualityProfile(0.3, (0.85, 0.15), (0.1, 0.5, 0.4), 0.1, 0.05, 0.2,
                          (0.7, 0.25, 0.05), (0.9, 0.1), 0.6, 0.4, 0.3),
}


def _count(rng: random.Random, weights: tuple[float, ...]) -> int:
    return rng.choices(range(len(weights)), weights=weights)[0]


def sample_spec(rng: random.Random, quality: Quality) -> ReplySpec:
    """Draw the parts of one reply of the given quality level."""
    prof = QUALITY_PROFILES[quality]
    action: ActionKind = rng.choices(("correct", "wrong", "none"), weights=prof.action_weights)[0]
    return ReplySpec(
        greeting=rng.random() < prof.p_greeting,
        empathy=_count(rng, prof.empathy_weights),
        action=action,
        info=rng.random() < prof.p_info,
        order_ref=rng.random() < prof.p_order_ref,
        closing=rng.random() < prof.p_closing,
        filler=_count(rng, prof.filler_weights),
        padding=_count(rng, prof.padding_weights),
        dismissive=int(rng.random() < prof.p_dismissive),
        blame=int(rng.random() < prof.p_blame),
        repeat=rng.random() < prof.p_repeat,
    )


def _pick(rng: random.Random, pool: tuple[str, ...], k: int) -> list[str]:
    """``k`` phrases, distinct while the pool lasts."""
    picked = rng.sample(pool, min(k, len(pool)))
    return picked + [rng.choice(pool) for _ in range(k - len(picked))]


def _action_sentence(rng: random.Random, record: PromptRecord, kind: ActionKind) -> str | None:
    """A sentence performing a correct or wrong action for the record's intent (None for 'none')."""
    if kind == "none":
        return None
    intent = INTENTS_BY_NAME[record.intent]
    if kind == "correct":
        name = rng.choice(intent.correct_actions)
    elif rng.random() < 0.8:
        name = rng.choice(intent.wrong_actions)
    else:
        name = rng.choice([a for a in phrases.ACTIONS if a not in intent.correct_actions])
    options = [p for p in phrases.ACTIONS[name].phrasings if "{product}" not in p or record.product]
    return rng.choice(options).format(product=record.product)


def render_reply(rng: random.Random, record: PromptRecord, spec: ReplySpec) -> str:
    """The reply text for ``record`` with exactly the parts in ``spec`` (leading space included)."""
    empathy = _pick(rng, phrases.EMPATHY, spec.empathy)
    intent = INTENTS_BY_NAME[record.intent]
    body: list[str | None] = [
        *empathy[:1],
        *_pick(rng, phrases.FILLER, spec.filler),
        _action_sentence(rng, record, spec.action),
        *_pick(rng, phrases.BLAME, spec.blame),
        rng.choice(intent.info) if spec.info else None,
        rng.choice(phrases.ORDER_REFS).format(order=record.order) if spec.order_ref and record.order else None,
        *_pick(rng, phrases.DISMISSIVE, spec.dismissive),
        *_pick(rng, phrases.PADDING, spec.padding),
        *empathy[1:],
    ]
    sentences = [s for s in body if s]
    if spec.repeat and sentences:
        i = rng.randrange(len(sentences))
        sentences.insert(i + 1, sentences[i])
    if spec.greeting:
        sentences.insert(0, rng.choice(phrases.GREETINGS))
    if spec.closing:
        sentences.append(rng.choice(phrases.CLOSINGS))
    if not sentences:
        sentences.append(rng.choice(phrases.DISMISSIVE))
    return " " + " ".join(sentences)


def compose_reply(rng: random.Random, record: PromptRecord, quality: Quality) -> str:
    """A reply of the given quality level for ``record`` (parts drawn from ``QUALITY_PROFILES``)."""
    return render_reply(rng, record, sample_spec(rng, quality))


def best_reply(rng: random.Random, record: PromptRecord) -> str:
    """A reply with every good part once and nothing bad (``BEST_SPEC``): the gold ceiling for a prompt."""
    return render_reply(rng, record, BEST_SPEC)
