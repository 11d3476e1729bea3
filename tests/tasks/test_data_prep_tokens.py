"""data-prep counts lengths in the policy's tokens whenever ``sft.base_model`` gives a tokenizer before training, in
the pipeline and in ``rlhf prep`` alike; ``data.prep.max_prompt_length`` caps prompts in the same unit.

The tokenizer is the tiny byte-level GPT-2 one of tests/model_families.py: a repeated common word is one token a word
(" the the the" = 12 characters, 3 tokens) while an emoji is 4 byte tokens ("😀" = 1 character, 4 tokens), so
characters and tokens rank the rows below in opposite orders.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.cli import main
from rlhf_core.data import PPO_PROMPTS, QUARANTINE, DataError, DataPrepCounts
from rlhf_core.data import QuarantineReason as R
from tasks import data_prep
from tasks.config import ConfigError, load_config
from tasks.io import read_parquet
from tasks.preflight import resolve_config
from tasks.run_store.keys import stage_key
from tests.model_families import build_tokenizer, save_policy
from tests.stage_harness import StageHarness

EMOJI = {"prompt": "Q:", "chosen": " 😀😀😀😀😀", "rejected": " ok"}
"""8 characters but 23 tokens (prompt + chosen): too long only in tokens."""
WORDS = {"prompt": "Q:", "chosen": " the the the the the the", "rejected": " ok"}
"""26 characters but 8 tokens (prompt + chosen): too long only in characters."""
MAX_LENGTH = "data.prep.max_length=16"
LENIENT = ("data.prep.max_quarantine_fraction=1.0", "data.prep.train_fraction=0.5", "data.prep.heldout_fraction=0.5",
           "data.prep.ppo_fraction=0.0")
"""No quarantined row fails the run; half the prompts train, half are held out."""


def good(i: int) -> dict[str, str]:
    return {"prompt": f"Q{i}:", "chosen": " yes", "rejected": " no"}


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> str:
    folder = tmp_path / "policy-tokenizer"
    build_tokenizer("gpt2").save_pretrained(folder)
    return str(folder)


def settings(files: list[str], *overrides: str, base_model: str | None = None) -> list[str]:
    found = ["data.source=files", f"data.files={json.dumps(files)}", "refresh.enabled=false", *overrides]
    return found + ([f"sft.base_model={base_model}", "sft.enabled=false"] if base_model else [])


def stage_config(files: list[str], *overrides: str, base_model: str | None = None) -> data_prep.Config:
    """The data-prep slice exactly as flows/pipeline.py builds it."""
    return data_prep.Config.of(load_config(None, None, settings(files, *overrides, base_model=base_model)))


def counts_of(folder: Path, result: data_prep.Result) -> DataPrepCounts:
    saved = json.loads((folder / result.counts).read_text())
    return DataPrepCounts(**{k: v for k, v in saved.items() if k != "quarantine_fraction"})


def quarantined(folder: Path, result: data_prep.Result) -> list[tuple[str, str, str]]:
    """(column, reason, the row's own detail: the bracketed end of the table's message) of each quarantined row."""
    return [(str(q["column"]), str(q["reason"]), str(q["detail"]).rsplit(" (", 1)[-1].removesuffix(")"))
            for q in read_parquet(folder / result.quarantine, QUARANTINE)]


def test_sft_base_model_makes_lengths_count_its_tokens(tmp_path: Path, tokenizer_dir: str) -> None:
    files = [write_jsonl(tmp_path / "in.jsonl", [good(i) for i in range(10)] + [EMOJI, WORDS])]
    by_tokens = stage_config(files, MAX_LENGTH, *LENIENT, base_model=tokenizer_dir)
    by_chars = stage_config(files, MAX_LENGTH, *LENIENT)
    assert (by_tokens.tokenizer, by_tokens.length_unit) == (tokenizer_dir, "tokens")
    assert (by_chars.tokenizer, by_chars.length_unit) == (None, "characters")

    results = {}
    for name, cfg in (("tokens", by_tokens), ("characters", by_chars)):
        (tmp_path / name).mkdir()
        results[name] = data_prep.prepare(cfg, tmp_path / name)
    assert quarantined(tmp_path / "tokens", results["tokens"]) == [
        ("chosen", R.TOO_LONG.value, "prompt + chosen is 23 tokens > max_length 16")]
    assert quarantined(tmp_path / "characters", results["characters"]) == [
        ("chosen", R.TOO_LONG.value, "prompt + chosen is 26 characters > max_length 16")]
    counts = counts_of(tmp_path / "tokens", results["tokens"])
    assert (counts.length_unit, counts.max_length, counts.rows_accepted) == ("tokens", 16, 11)
    assert counts_of(tmp_path / "characters", results["characters"]).length_unit == "characters"


def test_demo_data_counts_tokens_too_when_the_policy_is_given(tokenizer_dir: str) -> None:
    cfg = data_prep.Config.of(load_config(None, None, [f"sft.base_model={tokenizer_dir}", "sft.tokens.pad=Q"]))
    assert (cfg.source, cfg.tokenizer, cfg.tokens.pad, cfg.length_unit) == ("demo", tokenizer_dir, "Q", "tokens")
    assert data_prep.Config.of(load_config(None, None, ["sft.tokens.pad=Q"])).tokens.pad is None  # unread: unkeyed


def test_the_tokenizer_and_its_special_tokens_are_in_the_key(tmp_path: Path, tokenizer_dir: str) -> None:
    files = [write_jsonl(tmp_path / "in.jsonl", [good(0)])]

    def key(*overrides: str, base_model: str | None = tokenizer_dir) -> str:
        return stage_key(data_prep.NAME, stage_config(files, MAX_LENGTH, *overrides, base_model=base_model), {})

    first = key()
    assert key() == first
    assert key(base_model=None) != first
    assert key("sft.tokens.pad=Q") != first
    build_tokenizer("llama").save_pretrained(tokenizer_dir)  # another tokenizer in the same folder
    assert key() != first


def test_rlhf_prep_writes_the_tables_the_pipeline_stage_writes(tmp_path: Path, tokenizer_dir: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    rows = [good(i) for i in range(12)] + [EMOJI, WORDS, {**good(20), "prompt": "Q: 😀😀😀😀"}]
    files = [write_jsonl(tmp_path / "in.jsonl", rows)]
    overrides = [MAX_LENGTH, "data.prep.max_prompt_length=12", "data.prep.max_quarantine_fraction=1.0"]
    harness = StageHarness(tmp_path / "state")
    try:
        art = harness.run(data_prep, "data-prep", stage_config(files, *overrides, base_model=tokenizer_dir),
                          data_prep.Inputs())
        params = harness.mlflow_run("data-prep").data.params
    finally:
        harness.close()
    argv = [*files, "--out", str(tmp_path / "cli"), "--max-length", "16", "--max-prompt-length", "12",
            "--max-quarantine-fraction", "1.0", "--set", f"sft.base_model={tokenizer_dir}", "--set", "sft.enabled=false"]
    assert main(["prep", *argv]) == 0
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert "max_prompt_length 12 tokens" in lines and "lengths counted in tokens" in lines
    for name in ("train_pairs", "heldout_pairs", "ppo_prompts", "quarantine"):
        expected = pq.read_table(art.path(art.result[name]))
        assert pq.read_table(tmp_path / "cli" / art.result[name]).equals(expected), name
    reasons = [q["reason"] for q in read_parquet(art.path(art.result["quarantine"]), QUARANTINE)]
    assert sorted(reasons) == [R.PROMPT_TOO_LONG.value, R.TOO_LONG.value]
    assert (params["length_unit"], params["tokenizer"], params["prep.max_prompt_length"]) == (
        "tokens", tokenizer_dir, "12")


def test_prompt_cap_quarantines_pairs_and_ppo_prompts_and_the_counts_reconcile(tmp_path: Path,
                                                                              tokenizer_dir: str) -> None:
    long_prompt = "Q: 😀😀😀"  # 6 characters, 15 tokens
    files = [write_jsonl(tmp_path / "in.jsonl", [good(i) for i in range(10)] + [{**good(19), "prompt": long_prompt}])]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Q: the"}, {"prompt": long_prompt}])
    overrides = [*LENIENT, "data.prep.max_prompt_length=12", f"data.prompts_file={json.dumps(prompts)}"]
    out = tmp_path / "out"
    out.mkdir()
    result = data_prep.prepare(stage_config(files, *overrides, base_model=tokenizer_dir), out)
    detail = "prompt is 15 tokens > max_prompt_length 12"
    assert quarantined(out, result) == [("prompt", R.PROMPT_TOO_LONG.value, detail)] * 2
    counts = counts_of(out, result)
    assert counts.quarantined_by_reason == {R.PROMPT_TOO_LONG.value: 2}
    assert (counts.rows_in, counts.rows_accepted, counts.prompt_rows_in, counts.prompt_rows_accepted) == (11, 10, 2, 1)
    assert [p["prompt"] for p in read_parquet(out / result.ppo_prompts, PPO_PROMPTS)] == ["Q: the"]
    assert counts.max_prompt_length == 12 and result.metrics["data/quarantined/prompt_too_long"] == 2.0
    # the same 6-character prompt is within the cap when lengths count characters
    (tmp_path / "chars").mkdir()
    by_chars = data_prep.prepare(stage_config(files, *overrides), tmp_path / "chars")
    assert quarantined(tmp_path / "chars", by_chars) == []


def test_a_policy_without_a_usable_tokenizer_is_one_data_error(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    files = [write_jsonl(tmp_path / "in.jsonl", [good(i) for i in range(10)])]
    bare = tmp_path / "weights-only"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    for base_model, needle in ((str(bare), "holds none of tokenizer.json, tokenizer_config.json"),
                               (str(tmp_path / "missing"), "cannot be loaded")):
        with pytest.raises(DataError, match="sft.base_model, or `rlhf prep --tokenizer`") as info:
            data_prep.prepare(stage_config(files, base_model=base_model), tmp_path)
        assert needle in str(info.value) and base_model in str(info.value)
    assert main(["prep", *files, "--out", str(tmp_path / "o"), "--set", f"sft.base_model={bare}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlhf prep: error: the tokenizer of") and err.count("\n") == 1


def test_max_prompt_length_must_leave_room_within_max_length() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, None, ["data.prep.max_length=64", "data.prep.max_prompt_length=64"])
    message = str(info.value)
    assert "data.prep.max_prompt_length (64) must be < data.prep.max_length (64)" in message and "\n" not in message
    assert load_config(None, None, ["data.prep.max_prompt_length=64"]).data.prep.max_prompt_length == 64
    with pytest.raises(ConfigError, match="data.prep.max_prompt_length"):
        load_config(None, None, ["data.prep.max_prompt_length=0"])


def test_prompt_cap_plus_reply_must_fit_the_policy_positions(tmp_path: Path) -> None:
    policy = save_policy("gpt2", tmp_path / "policy")  # 128 positions
    common = [f"sft.base_model={policy}", "ppo.generation.max_new_tokens=40"]
    with pytest.raises(ConfigError) as info:
        resolve_config(None, "tiny", [*common, "data.prep.max_prompt_length=89"])
    message = str(info.value)
    assert message.startswith("bad value 89 for 'data.prep.max_prompt_length'") and "128 positions" in message
    assert "ppo.generation.max_new_tokens (40)" in message
    assert resolve_config(None, "tiny", [*common, "data.prep.max_prompt_length=88"]).data.prep.max_prompt_length == 88
    # without a base model the cap counts characters, which positions do not bound
    assert resolve_config(None, "tiny", ["data.prep.max_prompt_length=5000"]).sft.base_model is None
