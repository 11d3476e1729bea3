"""Every malformed kind lands in quarantine with exactly the expected reason, and counts reconcile."""

from __future__ import annotations

from collections import Counter

import pytest

from rlhf_core.data import (DataPrepConfig, InputFormat, QuarantineReason as R, SourceFile, SourceRow,
                            prepare_data)

U, A = "user", "assistant"
GOOD = {
    InputFormat.TRL: {"prompt": "User: Hi\nAssistant:", "chosen": " Hello!", "rejected": " Go away."},
    InputFormat.HH: {"chosen": "User: Hi\nAssistant: Hello!", "rejected": "User: Hi\nAssistant: Go away."},
    InputFormat.CHAT: {
        "chosen": [{"role": U, "content": "Hi"}, {"role": A, "content": "Hello!"}],
        "rejected": [{"role": U, "content": "Hi"}, {"role": A, "content": "Go away."}],
    },
}
MAX_LENGTH = 60


def trl(**overrides: object) -> dict[str, object]:
    return {**GOOD[InputFormat.TRL], **overrides}


def chat(chosen: object, rejected: object = None) -> dict[str, object]:
    return {"chosen": chosen, "rejected": GOOD[InputFormat.CHAT]["rejected"] if rejected is None else rejected}


NO_PROMPT = {k: v for k, v in GOOD[InputFormat.TRL].items() if k != "prompt"}
T, H, C = InputFormat.TRL, InputFormat.HH, InputFormat.CHAT

# (kind, format, bad record (None = unparseable), expected reason, expected column)
MALFORMED = [
    ("absent_prompt_key", T, NO_PROMPT, R.MISSING_VALUE, "prompt"),
    ("null_chosen", T, trl(chosen=None), R.MISSING_VALUE, "chosen"),
    ("empty_chosen", T, trl(chosen=""), R.EMPTY_TEXT, "chosen"),
    ("whitespace_rejected", T, trl(rejected=" \n\t "), R.EMPTY_TEXT, "rejected"),
    ("nan_chosen", T, trl(chosen=float("nan")), R.NAN_VALUE, "chosen"),
    ("int_chosen", T, trl(chosen=42), R.NON_TEXT, "chosen"),
    ("dict_rejected", T, trl(rejected={"text": "x"}), R.NON_TEXT, "rejected"),
    ("bool_prompt", T, trl(prompt=True), R.NON_TEXT, "prompt"),
    ("list_in_trl", T, trl(chosen=["Hello"]), R.NON_TEXT, "chosen"),
    ("invalid_utf8_bytes", T, trl(rejected=b"\xff\xfe bad"), R.UNDECODABLE_BYTES, "rejected"),
    ("lone_surrogate", T, trl(chosen=" Hel\ud800lo"), R.INVALID_UNICODE, "chosen"),
    ("nul_byte", T, trl(prompt="User: Hi\x00\nAssistant:"), R.CONTROL_CHARACTER, "prompt"),
    ("escape_control", T, trl(rejected=" Go \x1b[31maway"), R.CONTROL_CHARACTER, "rejected"),
    ("identical", T, trl(rejected=" Hello!"), R.IDENTICAL_PAIR, "rejected"),
    ("identical_modulo_space", T, trl(rejected="Hello!  "), R.IDENTICAL_PAIR, "rejected"),
    ("too_long", T, trl(chosen=" " + "very " * 20), R.TOO_LONG, "chosen"),
    ("duplicate_pair", T, trl(), R.DUPLICATE_PAIR, "*"),
    ("margin_text", T, trl(margin="high"), R.BAD_MARGIN, "margin"),
    ("margin_inf", T, trl(margin=float("inf")), R.BAD_MARGIN, "margin"),
    ("margin_bool", T, trl(margin=True), R.BAD_MARGIN, "margin"),
    ("unparseable_record", T, None, R.MALFORMED_RECORD, "*"),
    ("hh_no_shared_prefix", H, {"chosen": "Hello there", "rejected": "Go away"}, R.HH_NO_SHARED_PREFIX, "chosen"),
    ("hh_empty_response", H, {"chosen": "User: Hi\nAssistant:", "rejected": "User: Hi\nAssistant: Yo"},
     R.EMPTY_RESPONSE, "chosen"),
    ("hh_identical", H, {"chosen": "User: Hi\nAssistant: Yo", "rejected": "User: Hi\nAssistant: Yo"},
     R.IDENTICAL_PAIR, "rejected"),
    ("chat_string", C, chat("User: Hi"), R.CHAT_NOT_A_LIST, "chosen"),
    ("chat_bad_json_string", C, chat("[{'role': 'user'"), R.CHAT_NOT_A_LIST, "chosen"),
    ("chat_missing_content", C, chat([{"role": U, "content": "Hi"}, {"role": A}]), R.CHAT_MALFORMED_MESSAGE, "chosen"),
    ("chat_message_not_object", C, chat(["Hi", {"role": A, "content": "x"}]), R.CHAT_MALFORMED_MESSAGE, "chosen"),
    ("chat_unknown_role", C, chat([{"role": "human", "content": "Hi"}, {"role": A, "content": "Yo"}]),
     R.CHAT_UNKNOWN_ROLE, "chosen"),
    ("chat_ends_with_user", C, chat([{"role": A, "content": "Yo"}, {"role": U, "content": "Hi"}]),
     R.CHAT_NO_FINAL_ASSISTANT, "chosen"),
    ("chat_empty_list", C, chat([]), R.CHAT_NO_FINAL_ASSISTANT, "chosen"),
    ("chat_prompt_mismatch", C, chat(GOOD[C]["chosen"], [{"role": U, "content": "Bye"}, {"role": A, "content": "x"}]),
     R.CHAT_PROMPT_MISMATCH, "rejected"),
    ("chat_blank_reply", C, chat([{"role": U, "content": "Hi"}, {"role": A, "content": "  "}]),
     R.EMPTY_RESPONSE, "chosen"),
    ("chat_no_prompt_turns", C, chat([{"role": A, "content": "Yo"}], [{"role": A, "content": "No"}]),
     R.MISSING_VALUE, "prompt"),
]


def run_rows(fmt: InputFormat, records: list[dict[str, object] | None]):
    rows = [SourceRow("bad.jsonl", i, rec, "" if rec else "invalid JSON", "{oops") for i, rec in enumerate(records)]
    columns = tuple(dict.fromkeys(k for rec in records if rec for k in rec)) or ("prompt", "chosen", "rejected")
    source = SourceFile("bad.jsonl", columns, rows)
    # everything in train, so every accepted row is visible in one table
    config = DataPrepConfig(input_format=fmt, max_length=MAX_LENGTH, max_quarantine_fraction=1.0,
                            train_fraction=1.0, heldout_fraction=0.0, ppo_fraction=0.0)
    return prepare_data([source], config)


def test_corpus_has_at_least_20_kinds_and_covers_most_reasons() -> None:
    assert len({kind for kind, *_ in MALFORMED}) == len(MALFORMED) >= 20
    assert len({reason for *_, reason, _ in MALFORMED}) >= 18


@pytest.mark.parametrize(("kind", "fmt", "record", "reason", "column"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_each_malformed_kind_yields_its_reason(kind, fmt, record, reason, column) -> None:
    tables = run_rows(fmt, [GOOD[fmt], record])
    assert [(q["source_row"], q["reason"], q["column"]) for q in tables.quarantine] == [(1, reason.value, column)]
    assert q_raw_is_printable(tables.quarantine[0]["raw"])
    counts = tables.counts
    assert (counts.rows_in, counts.rows_accepted, counts.rows_quarantined) == (2, 1, 1)
    assert counts.quarantined_by_reason == {reason.value: 1}
    assert tables.quarantine[0]["detail"].startswith(reason.message)


def q_raw_is_printable(raw: str) -> bool:
    raw.encode("utf-8")  # would raise on a lone surrogate, which Parquet cannot store
    return "\x00" not in raw and len(raw) <= 200


def test_whole_trl_corpus_reconciles_by_reason() -> None:
    bad = [rec for _, fmt, rec, *_ in MALFORMED if fmt is T]
    good = [trl(prompt=f"User: question {i}?\nAssistant:") for i in range(5)]
    tables = run_rows(T, [GOOD[T], *good, *bad])
    counts = tables.counts
    expected = Counter(reason.value for _, fmt, _, reason, _ in MALFORMED if fmt is T)
    assert counts.rows_in == 1 + len(good) + len(bad) == counts.rows_accepted + counts.rows_quarantined
    assert counts.rows_accepted == 1 + len(good)
    assert counts.quarantined_by_reason == dict(expected)
    every_row = sorted([p["source_row"] for p in tables.train_pairs] + [q["source_row"] for q in tables.quarantine])
    assert every_row == list(range(counts.rows_in))  # each input row in exactly one place


def test_valid_margin_forms_are_accepted() -> None:
    margins = ["2.5", None, float("nan"), 3]
    tables = run_rows(T, [trl(prompt=f"User: {i}\nAssistant:", margin=m) for i, m in enumerate(margins)])
    assert tables.counts.rows_quarantined == 0
    assert [p["margin"] for p in tables.train_pairs] == [2.5, None, None, 3.0]
