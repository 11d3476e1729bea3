"""Customer messages of the demo task and the one template that turns a message into a policy prompt.

``render_prompt`` is the only place the prompt format is defined: ``"Customer: {message}\\nAgent:"``.
Replies are continuations of that prompt and start with a space (``" Hello! I'm sorry ..."``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlhf_core.demo.intents import CLOSERS, INTENTS, OPENERS, TONES, Intent, Tone
from rlhf_core.demo.phrases import DEVICES, PRODUCTS

PROMPT_PREFIX = "Customer: "
PROMPT_SUFFIX = "\nAgent:"


def render_prompt(message: str) -> str:
    """The policy's prompt for a customer message: ``"Customer: {message}\\nAgent:"``."""
    return f"{PROMPT_PREFIX}{message}{PROMPT_SUFFIX}"


def message_of(prompt: str) -> str:
    """Inverse of ``render_prompt``; text that is not a rendered prompt is returned stripped, as is."""
    text = prompt.strip()
    if text.startswith(PROMPT_PREFIX.strip()):
        text = text[len(PROMPT_PREFIX.strip()):]
    if text.endswith(PROMPT_SUFFIX.strip()):
        text = text[: -len(PROMPT_SUFFIX.strip())]
    return text.strip()


@dataclass(frozen=True)
class PromptRecord:
    """One customer message with its hidden metadata.

    Only ``prompt`` may reach training; ``intent`` and the details are for evaluation (and for building
    replies of a chosen quality in the generators).
    """

    prompt: str
    """The rendered policy prompt (``render_prompt(message)``)."""
    message: str
    """The customer's message."""
    intent: str
    """Name of the intent (``intents.INTENTS``)."""
    tone: Tone
    """polite / neutral / angry."""
    product: str | None = None
    """The product the message is about, when it names one."""
    other_product: str | None = None
    """The product received by mistake (wrong_item only), when named."""
    order: str | None = None
    """Order number such as ``#48213``, when the message gives one."""
    device: str | None = None
    """Device the app runs on (app_crash, password_reset), when named."""


def _fill_template(rng: random.Random, template: str) -> dict[str, str | None]:
    """Sample values for the slots a template uses; unused slots stay None."""
    product = rng.choice(PRODUCTS)
    other = rng.choice([p for p in PRODUCTS if p != product])
    return {
        "product": product if "{product}" in template else None,
        "other_product": other if "{other}" in template else None,
        "order": f"#{rng.randint(10000, 99999)}" if "{order}" in template else None,
        "device": rng.choice(DEVICES) if "{device}" in template else None,
    }


def sample_prompt(rng: random.Random, intent: Intent | None = None) -> PromptRecord:
    """One customer message (of ``intent``, or of a uniformly drawn intent)."""
    intent = intent if intent is not None else rng.choice(INTENTS)
    template = rng.choice(intent.templates)
    tone: Tone = rng.choice(TONES)
    slots = _fill_template(rng, template)
    core = template.format(
        product=slots["product"], other=slots["other_product"], order=slots["order"], device=slots["device"]
    )
    message = " ".join(part for part in (rng.choice(OPENERS[tone]), core, rng.choice(CLOSERS[tone])) if part)
    return PromptRecord(prompt=render_prompt(message), message=message, intent=intent.name, tone=tone, **slots)


def generate_prompts(n: int, seed: int) -> list[PromptRecord]:
    """``n`` customer messages, the same for the same seed; intents are drawn uniformly."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"demo-prompts:{seed}")
    return [sample_prompt(rng) for _ in range(n)]
