"""The simulated annotator: Bradley-Terry sampling from gold with a noise temperature."""

from __future__ import annotations

import math

import pytest

from rlhf_core.demo import (
    DEFAULT_TEMPERATURE,
    SimulatedAnnotator,
    generate_preference_pairs,
    gold_score,
    preference_probability,
    render_prompt,
)


def _agreement(temperature: float, n: int, seed: int = 0) -> float:
    """Share of pairs (gold ties excluded) whose chosen reply has the higher gold score."""
    pairs = [
        (gold_score(r["prompt"], r["chosen"]), gold_score(r["prompt"], r["rejected"]))
        for r in generate_preference_pairs(n, seed=seed, temperature=temperature)
    ]
    decided = [(c, r) for c, r in pairs if c != r]
    assert len(decided) > 0.8 * n
    return sum(c > r for c, r in decided) / len(decided)


def test_preference_probability_matches_hand_computed_values() -> None:
    assert preference_probability(1.0, 0.0, temperature=1.0) == pytest.approx(1 / (1 + math.exp(-1)))
    assert preference_probability(0.0, 3.0, temperature=2.0) == pytest.approx(1 / (1 + math.exp(1.5)))
    assert preference_probability(2.0, 2.0) == 0.5
    assert preference_probability(5.0, 0.0, 1.0) + preference_probability(0.0, 5.0, 1.0) == pytest.approx(1.0)


def test_tiny_temperature_does_not_overflow_and_bad_temperature_is_refused() -> None:
    assert preference_probability(1.0, 0.0, temperature=1e-12) == 1.0
    assert preference_probability(0.0, 1.0, temperature=1e-12) == 0.0
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SimulatedAnnotator(temperature=0.0)


def test_annotator_is_seeded_and_returns_the_pair_in_some_order() -> None:
    prompt = render_prompt("My lamp arrived broken.")
    a, b = " I have emailed you a free return label.", " Check the website."
    labels = [SimulatedAnnotator(temperature=5.0, seed=7).label(prompt, a, b) for _ in range(2)]
    assert labels[0] == labels[1]
    assert set(labels[0]) == {a, b}
    many = SimulatedAnnotator(temperature=5.0, seed=7)
    # gold gap 2.0 - (-1.5 - 0.45) = 3.95 -> P(a) = sigmoid(0.79) = 0.69; 2000 draws land well inside 0.62-0.76
    share = sum(many.prefers_first(prompt, a, b) for _ in range(2000)) / 2000
    assert 0.62 < share < 0.76


def test_default_annotator_agrees_with_gold_often_but_not_always() -> None:
    # Measured: 0.835 (seed 0) and about 0.85 on other seeds, on 2000 pairs at temperature 1.5.
    assert DEFAULT_TEMPERATURE == 1.5
    assert 0.75 < _agreement(DEFAULT_TEMPERATURE, n=2000) < 0.92


def test_near_zero_temperature_follows_gold_and_huge_temperature_is_a_coin_flip() -> None:
    assert _agreement(0.01, n=1000) > 0.99
    assert 0.43 < _agreement(100.0, n=1000) < 0.57
