"""Data sets of the demo task, deterministic for a seed: preference pairs, SFT demonstrations, tokenizer text.

Rows carry text only (TRL column names). Gold scores, intents and quality levels never appear in them:
training must learn from the simulated annotator's labels alone.
"""

from __future__ import annotations

import random
from typing import TypedDict

from rlhf_core.demo.annotator import DEFAULT_TEMPERATURE, SimulatedAnnotator
from rlhf_core.demo.prompts import PromptRecord, sample_prompt
from rlhf_core.demo.replies import Quality, compose_reply

QUALITIES: tuple[Quality, ...] = ("good", "mediocre", "bad")
#: Quality mix of each reply in a preference pair: pairs range from clear-cut to near ties.
PAIR_QUALITY_WEIGHTS: tuple[float, float, float] = (0.35, 0.40, 0.25)
#: Quality mix of SFT demonstrations: mostly mediocre, so the SFT policy is imperfect and PPO has room.
SFT_QUALITY_WEIGHTS: tuple[float, float, float] = (0.20, 0.60, 0.20)


class PreferenceRow(TypedDict):
    """One TRL-style preference row."""

    prompt: str
    chosen: str
    rejected: str


class Demonstration(TypedDict):
    """One SFT row: a prompt and a reply to imitate."""

    prompt: str
    reply: str


def _quality(rng: random.Random, weights: tuple[float, float, float]) -> Quality:
    return rng.choices(QUALITIES, weights=weights)[0]


def _two_replies(rng: random.Random, record: PromptRecord) -> tuple[str, str]:
    """Two different replies of independently drawn quality (redrawn while they coincide)."""
    first = compose_reply(rng, record, _quality(rng, PAIR_QUALITY_WEIGHTS))
    for _ in range(20):
        second = compose_reply(rng, record, _quality(rng, PAIR_QUALITY_WEIGHTS))
        if second != first:
            return first, second
    raise RuntimeError(f"could not draw two different replies for {record.prompt!r}; widen the phrase book")


def _check_n(n: int) -> None:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")


def generate_preference_pairs(
    n: int, seed: int, temperature: float = DEFAULT_TEMPERATURE
) -> list[PreferenceRow]:
    """``n`` pairs ``{prompt, chosen, rejected}`` labelled by a ``SimulatedAnnotator(temperature, seed)``."""
    _check_n(n)
    rng = random.Random(f"demo-pairs:{seed}")
    annotator = SimulatedAnnotator(temperature=temperature, seed=seed)
    rows: list[PreferenceRow] = []
    for _ in range(n):
        record = sample_prompt(rng)
        chosen, rejected = annotator.label(record.prompt, *_two_replies(rng, record))
        rows.append(PreferenceRow(prompt=record.prompt, chosen=chosen, rejected=rejected))
    return rows


def generate_sft_demonstrations(n: int, seed: int) -> list[Demonstration]:
    """``n`` rows ``{prompt, reply}`` of mixed quality (``SFT_QUALITY_WEIGHTS``)."""
    _check_n(n)
    rng = random.Random(f"demo-sft:{seed}")
    rows: list[Demonstration] = []
    for _ in range(n):
        record = sample_prompt(rng)
        reply = compose_reply(rng, record, _quality(rng, SFT_QUALITY_WEIGHTS))
        rows.append(Demonstration(prompt=record.prompt, reply=reply))
    return rows


def task_texts(seed: int, n: int) -> list[str]:
    """``n`` full dialogues (prompt + reply) of every quality, e.g. to train the task's BPE tokenizer on."""
    _check_n(n)
    rng = random.Random(f"demo-texts:{seed}")
    texts: list[str] = []
    for _ in range(n):
        record = sample_prompt(rng)
        texts.append(record.prompt + compose_reply(rng, record, _quality(rng, PAIR_QUALITY_WEIGHTS)))
    return texts
