"""The demo task's own tables (beside the preference pairs): SFT demonstrations and evaluation prompts.

Pure: schemas and row logic on lists of dicts; the data-prep stage writes them as Parquet. The evaluation prompts
carry the hidden metadata (intent, tone, ...) and share no prompt with the PPO prompts; only evaluation reads them.

Why disjoint from the PPO prompts only: two intents have tiny prompt spaces (password_reset 120 distinct
messages, app_crash 160), which a few thousand generated pairs and demonstrations cover completely; excluding
every training prompt would drop those intents from evaluation altogether.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict

from rlhf_core.data import Column, DataError, DType, TableSchema
from rlhf_core.data.schema import CHOSEN, PROMPT, PROMPT_ID, REJECTED
from rlhf_core.data.split import prompt_id, prompt_position
from rlhf_core.demo.prompts import PromptRecord, generate_prompts

REPLY = "reply"
#: Draw at most this many times the requested evaluation prompts before giving up on disjointness.
MAX_EVAL_DRAW_FACTOR = 64

_S = DType.STRING
RAW_PAIRS = TableSchema(
    "demo_pairs",
    (Column(PROMPT, _S, doc="Customer message rendered as a policy prompt."),
     Column(CHOSEN, _S, doc="Reply the simulated annotator preferred."),
     Column(REJECTED, _S, doc="The other reply.")),
)
SFT_DEMONSTRATIONS = TableSchema(
    "sft_demonstrations",
    (Column(PROMPT, _S, doc="Prompt text, exactly as the policy will see it."),
     Column(REPLY, _S, doc="Reply to imitate; continues the prompt (starts with a space)."),
     Column(PROMPT_ID, _S, doc="Stable hash of the prompt (decides its SFT split).")),
)
#: Evaluation only: the hidden facts about each prompt. Training stages must never read this table.
EVAL_PROMPTS = TableSchema(
    "eval_prompts",
    (Column(PROMPT, _S, doc="Prompt text; never a PPO prompt."),
     Column(PROMPT_ID, _S, doc="Stable hash of the prompt."),
     Column("message", _S, doc="The customer's message inside the prompt."),
     Column("intent", _S, doc="Hidden intent of the message (evaluation only)."),
     Column("tone", _S, doc="polite / neutral / angry (evaluation only)."),
     Column("product", _S, nullable=True, doc="Product the message names, if any."),
     Column("other_product", _S, nullable=True, doc="Product received by mistake (wrong_item), if named."),
     Column("order", _S, nullable=True, doc="Order number the message gives, if any."),
     Column("device", _S, nullable=True, doc="Device the message names, if any.")),
)


def split_demonstrations(
    demos: Sequence[Mapping[str, str]], eval_fraction: float, salt: str
) -> tuple[list[dict[str, str]], list[dict[str, str]], int]:
    """(train rows, eval rows, duplicates dropped): exact repeats dropped, split by a stable prompt hash.

    Every row of one prompt lands on the same side, so no prompt is in both tables.
    """
    seen: set[tuple[str, str]] = set()
    train: list[dict[str, str]] = []
    held_out: list[dict[str, str]] = []
    for demo in demos:
        key = (demo[PROMPT], demo[REPLY])
        if key in seen:
            continue
        seen.add(key)
        row = {PROMPT: demo[PROMPT], REPLY: demo[REPLY], PROMPT_ID: prompt_id(demo[PROMPT])}
        is_eval = prompt_position(demo[PROMPT], salt + ":sft") < eval_fraction
        (held_out if is_eval else train).append(row)
    if not train or not held_out:
        raise DataError(
            f"SFT split is empty ({len(train)} train, {len(held_out)} eval demonstrations); raise data.demo.n_sft "
            f"or move data.demo.sft_eval_fraction ({eval_fraction}) away from 0 and 1"
        )
    return train, held_out, len(demos) - len(seen)


def draw_eval_prompts(n: int, seed: int, taken: set[str]) -> tuple[list[PromptRecord], int]:
    """``n`` distinct evaluation prompts, none in ``taken``, and how many drawn prompts were skipped.

    Deterministic: draws are a prefix of ``generate_prompts(k, seed)`` for a growing ``k``.
    """
    drawn = max(n, 1)
    while n > 0:
        kept: dict[str, PromptRecord] = {}
        for index, record in enumerate(generate_prompts(drawn, seed)):
            if record.prompt not in taken:
                kept.setdefault(record.prompt, record)
            if len(kept) == n:
                return list(kept.values()), index + 1 - n
        if drawn >= MAX_EVAL_DRAW_FACTOR * n:
            raise DataError(
                f"only {len(kept)} of {drawn} drawn evaluation prompts are distinct and not PPO prompts; "
                f"lower data.demo.n_eval_prompts ({n}) or generate fewer pairs"
            )
        drawn *= 2
    return [], 0


def eval_row(record: PromptRecord) -> dict[str, object]:
    """One EVAL_PROMPTS row: the record's fields plus the prompt id."""
    return {**asdict(record), PROMPT_ID: prompt_id(record.prompt)}
