"""rm-refresh's noise-free check on the demo task: on-policy pairs relabelled by the gold scorer.

The refresh trains and is judged on labels from its annotator, which are noisy (the demo's simulated annotator
agrees with gold on ~75-85% of pairs). On the demo task the stage also reports the RM's accuracy on the on-policy
eval pairs *as gold would label them* (``refresh/onpolicy_gold_accuracy_{before,after}``), so the effect of a
refresh is visible without annotator noise. Gold labels never reach training: this module only builds the
measurement set, and ``tests/unit/test_gold_isolation.py`` keeps gold out of every training module.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlhf_core.evaluation.demo_eval import gold_judged
from rlhf_core.data.records import PreferencePair


def gold_judged_onpolicy(gold: bool, onpolicy: Sequence[PreferencePair]) -> list[PreferencePair]:
    """The on-policy eval pairs relabelled by gold (gold ties dropped); empty unless the task is the demo."""
    return gold_judged(onpolicy) if gold else []
