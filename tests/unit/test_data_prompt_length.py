"""``DataPrepConfig.max_prompt_length``: prompts longer than the cap are quarantined (pairs and prompts-file rows)
as prompt_too_long, before the prompt + response limit, and the counts reconcile. Lengths here are characters
(no tokenizer); tests/tasks/test_data_prep_tokens.py counts tokens."""

from __future__ import annotations

import pytest

from rlhf_core.data import DataPrepConfig, SourceFile, SourceRow, format_counts, prepare_data
from rlhf_core.data import QuarantineReason as R
from rlhf_core.data.schema import PROMPT, REASON

ALL_TRAIN = dict(train_fraction=1.0, heldout_fraction=0.0, ppo_fraction=0.0, max_quarantine_fraction=1.0)


def source(records: list[dict[str, object]], path: str = "in.jsonl") -> SourceFile:
    columns = tuple(dict.fromkeys(k for rec in records for k in rec))
    return SourceFile(path, columns, [SourceRow(path, i, rec) for i, rec in enumerate(records)])


def pair(prompt: str, chosen: str = " yes") -> dict[str, object]:
    return {"prompt": prompt, "chosen": chosen, "rejected": " no"}


def test_prompts_over_the_cap_are_quarantined_with_the_limit_and_counted() -> None:
    pairs = [pair("P" * 10), pair("P" * 11), pair("P" * 11, " " + "y" * 30), pair("Q" * 10, " " + "y" * 30)]
    prompts = [{"prompt": "R" * 10}, {"prompt": "R" * 11}]
    config = DataPrepConfig(max_length=20, max_prompt_length=10, **ALL_TRAIN)
    tables = prepare_data([source(pairs)], config, prompt_files=[source(prompts, "prompts.jsonl")])
    rows = [(q["source_file"], q["source_row"], q[REASON]) for q in tables.quarantine]
    # the prompt cap is checked first: row 2 is over both limits and is quarantined for its prompt
    assert rows == [("in.jsonl", 1, R.PROMPT_TOO_LONG.value), ("in.jsonl", 2, R.PROMPT_TOO_LONG.value),
                    ("in.jsonl", 3, R.TOO_LONG.value), ("prompts.jsonl", 1, R.PROMPT_TOO_LONG.value)]
    assert "prompt is 11 characters > max_prompt_length 10" in tables.quarantine[0]["detail"]
    assert R.PROMPT_TOO_LONG.message in tables.quarantine[0]["detail"]
    assert [p[PROMPT] for p in tables.ppo_prompts] == ["R" * 10]
    counts = tables.counts
    assert counts.quarantined_by_reason == {R.PROMPT_TOO_LONG.value: 3, R.TOO_LONG.value: 1}
    assert (counts.rows_accepted, counts.rows_quarantined, counts.prompt_rows_quarantined) == (1, 3, 1)
    assert counts.max_prompt_length == 10
    lines = [" ".join(line.split()) for line in format_counts(counts).splitlines()]
    assert "max_prompt_length 10 characters" in lines


def test_no_cap_by_default_and_a_cap_below_max_length_only() -> None:
    tables = prepare_data([source([pair("P" * 5000)])], DataPrepConfig(**ALL_TRAIN))
    assert tables.quarantine == [] and tables.counts.max_prompt_length is None
    assert not any("max_prompt_length" in line for line in format_counts(tables.counts).splitlines())
    with pytest.raises(ValueError, match=r"^data.prep.max_prompt_length \(20\) must be < data.prep.max_length \(20\)"):
        DataPrepConfig(max_length=20, max_prompt_length=20)
    with pytest.raises(ValueError, match="data.prep.max_prompt_length"):
        DataPrepConfig(max_prompt_length=0)
    assert DataPrepConfig(max_prompt_length=30).max_length is None  # a cap without max_length is fine
