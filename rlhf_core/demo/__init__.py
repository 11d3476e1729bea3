"""The embedded demo task: customer-support replies (pure, deterministic Python; no downloads).

- ``prompts``: customer messages over twelve intents and ``render_prompt`` (``"Customer: {message}\\nAgent:"``).
- ``replies``: replies of controllable quality assembled from the phrase book (``phrases``).
- ``gold``: the hidden gold scorer (evaluation only; the rules table is ``gold.RULES``).
- ``annotator``: the simulated annotator, Bradley-Terry samples of gold with a noise temperature.
- ``generator``: preference pairs, SFT demonstrations and tokenizer text, deterministic for a seed.
- ``config``: ``DemoDataConfig``, the sizes of the generated data (``data.demo`` in the pipeline config).
"""

from rlhf_core.demo.annotator import DEFAULT_TEMPERATURE, SimulatedAnnotator, preference_probability
from rlhf_core.demo.config import DemoDataConfig
from rlhf_core.demo.generator import (
    Demonstration,
    PreferenceRow,
    generate_preference_pairs,
    generate_sft_demonstrations,
    task_texts,
)
from rlhf_core.demo.gold import RULES, gold_breakdown, gold_score, parse_prompt
from rlhf_core.demo.intents import INTENTS
from rlhf_core.demo.prompts import PromptRecord, generate_prompts, message_of, render_prompt
from rlhf_core.demo.replies import ReplySpec, best_reply, compose_reply, render_reply

__all__ = [
    "DEFAULT_TEMPERATURE",
    "INTENTS",
    "RULES",
    "DemoDataConfig",
    "Demonstration",
    "PreferenceRow",
    "PromptRecord",
    "ReplySpec",
    "SimulatedAnnotator",
    "best_reply",
    "compose_reply",
    "generate_preference_pairs",
    "generate_prompts",
    "generate_sft_demonstrations",
    "gold_breakdown",
    "gold_score",
    "message_of",
    "parse_prompt",
    "preference_probability",
    "render_prompt",
    "render_reply",
    "task_texts",
]
