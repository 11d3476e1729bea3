"""Format detection, HH prefix splitting and chat rendering (plain template and tokenizer templates)."""

from __future__ import annotations

import pytest

from rlhf_core.data import (ChatRenderer, DataError, DataPrepConfig, InputFormat, PairText, QuarantineReason as R,
                            Rejection, SourceFile, SourceRow, detect_format, prepare_data, render_plain_prompt,
                            split_dialogues)

U, A, S = "user", "assistant", "system"


def source(records: list[dict[str, object]], path: str = "in.jsonl") -> SourceFile:
    columns = tuple(dict.fromkeys(k for rec in records for k in rec))
    return SourceFile(path, columns, [SourceRow(path, i, rec) for i, rec in enumerate(records)])


def only_pair(records: list[dict[str, object]], tokenizer: object = None, fmt=InputFormat.AUTO) -> dict:
    config = DataPrepConfig(input_format=fmt, train_fraction=1.0, heldout_fraction=0.0, ppo_fraction=0.0)
    tables = prepare_data([source(records)], config, tokenizer)
    assert tables.counts.rows_quarantined == 0, tables.quarantine
    (pair,) = tables.train_pairs
    return pair


class FakeChatTokenizer:
    """Minimal stand-in for a HF tokenizer with a chat template."""

    chat_template = "<fake>"

    def __init__(self, cue: str = "<|assistant|>") -> None:
        self.cue = cue

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False) -> str:
        text = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
        return text + (self.cue if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))


def test_plain_template_is_documented_shape() -> None:
    messages = [{"role": S, "content": "Be kind."}, {"role": U, "content": "Hi"},
                {"role": A, "content": "Hey"}, {"role": U, "content": "Refund?"}]
    assert render_plain_prompt(messages) == "System: Be kind.\nUser: Hi\nAssistant: Hey\nUser: Refund?\nAssistant:"


@pytest.mark.parametrize(
    ("chosen", "rejected", "expected"),
    [
        ("User: Hi\nAssistant: Hello!", "User: Hi\nAssistant: Go away.",
         PairText("User: Hi\nAssistant:", " Hello!", " Go away.")),
        # Anthropic HH markers; the shared "Sure, " stays in the responses: the cut is at the turn boundary
        ("\n\nHuman: Hi\n\nAssistant: Sure, yes", "\n\nHuman: Hi\n\nAssistant: Sure, no",
         PairText("\n\nHuman: Hi\n\nAssistant:", " Sure, yes", " Sure, no")),
        # multi-turn: the cut is after the LAST assistant marker in the shared prefix
        ("User: a\nAssistant: b\nUser: c\nAssistant: d1", "User: a\nAssistant: b\nUser: c\nAssistant: e2",
         PairText("User: a\nAssistant: b\nUser: c\nAssistant:", " d1", " e2")),
        # no turn marker: cut at the last whitespace of the common prefix
        ("What is 2+2? The answer is 4", "What is 2+2? The answer is 5",
         PairText("What is 2+2? The answer is", " 4", " 5")),
        ("Q? Answer A", "Q? Ansible", PairText("Q?", " Answer A", " Ansible")),
    ],
)
def test_split_dialogues(chosen: str, rejected: str, expected: PairText) -> None:
    assert split_dialogues(chosen, rejected) == expected


@pytest.mark.parametrize(
    ("chosen", "rejected", "reason"),
    [("abc", "abd", R.HH_NO_SHARED_PREFIX), ("Hello", "Bye", R.HH_NO_SHARED_PREFIX),
     ("Q? A", "Q? A", R.IDENTICAL_PAIR), ("User: x\nAssistant: y", "User: x\nAssistant:  ", R.EMPTY_RESPONSE)],
)
def test_split_dialogues_rejections(chosen: str, rejected: str, reason: R) -> None:
    result = split_dialogues(chosen, rejected)
    assert isinstance(result, Rejection) and result.reason is reason


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        ([{"prompt": "p", "chosen": "c", "rejected": "r"}], InputFormat.TRL),
        ([{"chosen": "p c", "rejected": "p r"}], InputFormat.HH),
        ([{"chosen": None, "rejected": None}, {"chosen": float("nan"), "rejected": None},
          {"chosen": [{"role": A, "content": "x"}], "rejected": []}], InputFormat.CHAT),
        ([{"prompt": [{"role": U, "content": "q"}], "chosen": [], "rejected": []}], InputFormat.CHAT),
    ],
)
def test_detect_format(records: list[dict[str, object]], expected: InputFormat) -> None:
    assert detect_format(source(records)) is expected


def test_detect_format_honours_forced_format() -> None:
    assert detect_format(source([{"prompt": "p", "chosen": "c", "rejected": "r"}]), InputFormat.HH) is InputFormat.HH


@pytest.mark.parametrize(
    ("records", "forced", "needle"),
    [([{"text": "a", "label": 1}], InputFormat.AUTO, "missing ['chosen', 'rejected']"),
     ([{"prompt": "a", "chosen": "b"}], InputFormat.AUTO, "missing ['rejected']"),
     ([{"chosen": "a", "rejected": "b"}], InputFormat.TRL, "needs a 'prompt' column")],
)
def test_missing_columns_raise_data_error_naming_file(records, forced, needle) -> None:
    with pytest.raises(DataError) as err:
        detect_format(source(records, "s3://bucket/prefs.parquet"), forced)
    assert "s3://bucket/prefs.parquet" in str(err.value) and needle in str(err.value)
    assert "found columns" in str(err.value)


def test_chat_with_prompt_column_and_string_prompt_match_full_conversation() -> None:
    full = {"chosen": [{"role": U, "content": "Hi"}, {"role": A, "content": "Yo"}],
            "rejected": [{"role": U, "content": "Hi"}, {"role": A, "content": "No"}]}
    split = {"prompt": [{"role": U, "content": "Hi"}], "chosen": [{"role": A, "content": "Yo"}],
             "rejected": [{"role": A, "content": "No"}]}
    as_text = {**split, "prompt": "Hi"}
    as_json_strings = {"chosen": '[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]',
                       "rejected": '[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "No"}]'}
    pairs = [only_pair([full]), only_pair([split]), only_pair([as_text]),
             only_pair([as_json_strings], fmt=InputFormat.CHAT)]
    assert {(p["prompt"], p["chosen"], p["rejected"]) for p in pairs} == {("User: Hi\nAssistant:", " Yo", " No")}


def test_tokenizer_chat_template_is_used_when_present() -> None:
    record = {"chosen": [{"role": U, "content": "Hi"}, {"role": A, "content": "Yo"}],
              "rejected": [{"role": U, "content": "Hi"}, {"role": A, "content": "No"}]}
    pair = only_pair([record], FakeChatTokenizer())
    assert (pair["prompt"], pair["chosen"], pair["rejected"]) == (
        "<|user|>Hi<|end|><|assistant|>", "Yo<|end|>", "No<|end|>")


def test_tokenizer_without_template_falls_back_to_plain() -> None:
    tokenizer = FakeChatTokenizer()
    tokenizer.chat_template = None
    assert not ChatRenderer(tokenizer).uses_tokenizer_template
    assert ChatRenderer(FakeChatTokenizer()).uses_tokenizer_template


def test_template_that_breaks_prefix_is_quarantined() -> None:
    record = {"chosen": [{"role": U, "content": "Hi"}, {"role": A, "content": "Yo"}],
              "rejected": [{"role": U, "content": "Hi"}, {"role": A, "content": "No"}]}
    config = DataPrepConfig(max_quarantine_fraction=1.0)
    tables = prepare_data([source([record])], config, FakeChatTokenizer(cue="<|assistant|>\n"))
    assert [q["reason"] for q in tables.quarantine] == [R.CHAT_TEMPLATE_MISMATCH.value]


def test_max_length_counts_tokens_when_tokenizer_given() -> None:
    record = {"prompt": "one two", "chosen": " three four five", "rejected": " six"}
    config = DataPrepConfig(max_length=4, max_quarantine_fraction=1.0)
    by_tokens = prepare_data([source([record])], config, FakeChatTokenizer())
    by_chars = prepare_data([source([record])], config)
    assert [q["column"] for q in by_tokens.quarantine] == ["chosen"]  # 5 tokens > 4
    assert "5 tokens > max_length 4" in by_tokens.quarantine[0]["detail"]
    assert "23 characters > max_length 4" in by_chars.quarantine[0]["detail"]  # len("one two three four five")
    assert (by_tokens.counts.length_unit, by_chars.counts.length_unit) == ("tokens", "characters")


def test_real_transformers_tokenizer_template_and_token_lengths() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "hi", "yo", "no", "user", "assistant"]
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    record = {"chosen": [{"role": U, "content": "hi"}, {"role": A, "content": "yo"}],
              "rejected": [{"role": U, "content": "hi"}, {"role": A, "content": "no"}]}
    pair = only_pair([record], tokenizer)
    assert (pair["prompt"], pair["chosen"], pair["rejected"]) == ("<user>hi</s><assistant>", "yo</s>", "no</s>")
