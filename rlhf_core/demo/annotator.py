"""A simulated human annotator: Bradley-Terry sampling from the hidden gold scores.

``P(a preferred over b) = sigmoid((gold(a) - gold(b)) / temperature)``. The noise means no reward model can
agree with every label, and the labels are the only thing training sees of gold.

Expected agreement with gold (share of pairs, gold ties excluded, where the annotator prefers the reply with
the higher gold score), measured on 2000 ``generator.generate_preference_pairs`` rows for each of seeds 0-3:

=============  ===============
temperature    agreement
=============  ===============
0.01           0.999 - 1.000
1.0            0.884 - 0.897
1.5 (default)  0.835 - 0.862
100            0.500 - 0.533
=============  ===============

About 6% of pairs are gold ties (two replies with the same parts); those are coin flips at any temperature.
"""

from __future__ import annotations

import math
import random

from rlhf_core.demo.gold import gold_score

#: Noise of the default annotator: gold scores span about -8 .. 5 and a typical pair gap is 3 points, so
#: about one label in six goes against gold.
DEFAULT_TEMPERATURE = 1.5


def preference_probability(gold_a: float, gold_b: float, temperature: float = DEFAULT_TEMPERATURE) -> float:
    """``sigmoid((gold_a - gold_b) / temperature)``, stable for any temperature > 0."""
    if temperature <= 0:
        raise ValueError(f"annotator temperature must be > 0, got {temperature}; use e.g. 0.01 for a near-perfect one")
    x = (gold_a - gold_b) / temperature
    # Only ever exponentiate a non-positive number, so tiny temperatures cannot overflow.
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


class SimulatedAnnotator:
    """Labels reply pairs by Bradley-Terry sampling from gold; seeded, so a run is reproducible."""

    def __init__(self, temperature: float = DEFAULT_TEMPERATURE, seed: int = 0) -> None:
        """``temperature``: label noise (smaller = closer to gold); ``seed``: the annotator's own stream."""
        preference_probability(0.0, 0.0, temperature)  # validates the temperature
        self.temperature = temperature
        self._rng = random.Random(f"demo-annotator:{seed}")

    def prefers_first(self, prompt: str, reply_a: str, reply_b: str) -> bool:
        """True when this draw prefers ``reply_a`` to ``reply_b``."""
        p = preference_probability(gold_score(prompt, reply_a), gold_score(prompt, reply_b), self.temperature)
        return self._rng.random() < p

    def label(self, prompt: str, reply_a: str, reply_b: str) -> tuple[str, str]:
        """``(chosen, rejected)`` for one pair."""
        if self.prefers_first(prompt, reply_a, reply_b):
            return reply_a, reply_b
        return reply_b, reply_a
