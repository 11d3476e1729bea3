"""The demo data-prep stage: generated pairs through the real data-prep path, SFT tables, evaluation prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.cli import build_parser, main
from rlhf_core.data import PPO_PROMPTS, PREFERENCE_PAIRS, DataError, DataPrepConfig
from rlhf_core.demo import INTENTS
from rlhf_core.evaluation.demo_eval import annotator_agreement
from rlhf_core.demo.config import DemoDataConfig
from tasks.config import PipelineConfig
from tasks.demo_data import (EVAL_PROMPTS, RAW_PAIRS, SFT_DEMONSTRATIONS, DemoDataResult, demo_data_task,
                             draw_eval_prompts, run_demo_data_prep)
from tasks.io import read_parquet

SMALL = DemoDataConfig(n_pairs=400, n_sft=300, n_eval_prompts=40)
SEED = 7
TABLES = ("train_pairs", "heldout_pairs", "ppo_prompts", "quarantine", "raw_pairs", "sft_train", "sft_eval",
          "eval_prompts")


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> DemoDataResult:
    return run_demo_data_prep(tmp_path_factory.mktemp("demo"), SMALL, seed=SEED)


def prompts_of(path: str) -> set[str]:
    return set(pq.read_table(path, columns=["prompt"]).column("prompt").to_pylist())


def test_counts_reconcile_with_the_written_tables(small: DemoDataResult) -> None:
    counts, demo = small.prep.counts, small.counts
    assert len(read_parquet(small.raw_pairs, RAW_PAIRS)) == counts.rows_in == SMALL.n_pairs
    assert counts.rows_in == counts.rows_accepted + counts.rows_quarantined
    assert counts.rows_accepted == counts.train_pairs + counts.heldout_pairs + counts.ppo_split_pairs
    assert len(read_parquet(small.prep.train_pairs, PREFERENCE_PAIRS)) == counts.train_pairs > 0
    assert len(read_parquet(small.prep.heldout_pairs, PREFERENCE_PAIRS)) == counts.heldout_pairs > 0
    assert len(read_parquet(small.prep.ppo_prompts, PPO_PROMPTS)) == counts.ppo_prompts > 0
    assert counts.formats == {small.raw_pairs: "trl"}
    assert demo.sft_rows_in == SMALL.n_sft == demo.sft_duplicates + demo.sft_train + demo.sft_eval
    assert len(read_parquet(small.sft_train, SFT_DEMONSTRATIONS)) == demo.sft_train > demo.sft_eval
    assert len(read_parquet(small.sft_eval, SFT_DEMONSTRATIONS)) == demo.sft_eval > 0
    assert len(read_parquet(small.eval_prompts, EVAL_PROMPTS)) == demo.eval_prompts == SMALL.n_eval_prompts
    saved = json.loads(Path(small.counts_json).read_text())
    assert saved["counts"]["sft_train"] == demo.sft_train and saved["seed"] == SEED


def test_no_prompt_is_in_two_splits(small: DemoDataResult) -> None:
    train, heldout, ppo = (prompts_of(p) for p in (small.prep.train_pairs, small.prep.heldout_pairs,
                                                     small.prep.ppo_prompts))
    assert not (train & heldout or train & ppo or heldout & ppo)
    assert not prompts_of(small.sft_train) & prompts_of(small.sft_eval)


def test_eval_prompts_are_distinct_not_ppo_prompts_and_carry_metadata(small: DemoDataResult) -> None:
    rows = read_parquet(small.eval_prompts, EVAL_PROMPTS)
    eval_prompts = {r["prompt"] for r in rows}
    assert len(eval_prompts) == len(rows) == SMALL.n_eval_prompts
    assert not eval_prompts & prompts_of(small.prep.ppo_prompts)
    assert {r["intent"] for r in rows} <= {i.name for i in INTENTS} and len({r["intent"] for r in rows}) >= 8
    assert all(r["message"] in r["prompt"] for r in rows)


def test_eval_prompts_cover_every_intent_at_default_sizes(tmp_path: Path) -> None:
    # password_reset has only 120 distinct prompts: excluding more than the PPO prompts would lose it
    result = run_demo_data_prep(tmp_path, DemoDataConfig(n_pairs=4000, n_sft=100, n_eval_prompts=256))
    rows = read_parquet(result.eval_prompts, EVAL_PROMPTS)
    assert {r["intent"] for r in rows} == {i.name for i in INTENTS}
    assert not {r["prompt"] for r in rows} & prompts_of(result.prep.ppo_prompts)


def test_draw_eval_prompts_skips_taken_prompts_deterministically() -> None:
    first, _ = draw_eval_prompts(5, seed=1, taken=set())
    records, skipped = draw_eval_prompts(5, seed=1, taken={first[0].prompt, first[2].prompt})
    assert skipped == 2 and [r.prompt for r in records][:3] == [first[1].prompt, first[3].prompt, first[4].prompt]
    with pytest.raises(DataError, match="lower data.demo.n_eval_prompts"):
        draw_eval_prompts(3, seed=1, taken={r.prompt for r in draw_eval_prompts(400, seed=1, taken=set())[0]})


def test_same_seed_gives_identical_tables(small: DemoDataResult, tmp_path: Path) -> None:
    again = run_demo_data_prep(Path(small.raw_pairs).parents[1], SMALL, seed=SEED)  # same folder: same source_file
    other_dir = run_demo_data_prep(tmp_path / "b", SMALL, seed=SEED)
    other_seed = run_demo_data_prep(tmp_path / "c", SMALL, seed=SEED + 1)
    for name in TABLES:
        before = pq.read_table(small.paths()[name])
        assert before.equals(pq.read_table(again.paths()[name])), name
        moved = pq.read_table(other_dir.paths()[name])
        keep = [c for c in before.column_names if c != "source_file"]  # the input path differs by directory
        assert before.select(keep).equals(moved.select(keep)), name
    for name in ("train_pairs", "sft_train", "eval_prompts"):
        assert not pq.read_table(small.paths()[name]).equals(pq.read_table(other_seed.paths()[name])), name


def test_annotator_temperature_reaches_the_labels(tmp_path: Path) -> None:
    noisy = run_demo_data_prep(tmp_path / "noisy", DemoDataConfig(n_pairs=600, n_sft=20, n_eval_prompts=1))
    exact = run_demo_data_prep(tmp_path / "exact", DemoDataConfig(n_pairs=600, n_sft=20, n_eval_prompts=1,
                                                                  annotator_temperature=0.01))
    noisy_agreement = annotator_agreement(read_parquet(noisy.raw_pairs, RAW_PAIRS)).agreement
    assert annotator_agreement(read_parquet(exact.raw_pairs, RAW_PAIRS)).agreement > 0.99
    assert 0.75 < noisy_agreement < 0.93  # default temperature 1.5: about one label in six against gold


def test_bad_sizes_fail_with_the_setting_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data.demo.n_pairs"):
        DemoDataConfig(n_pairs=0)
    with pytest.raises(ValueError, match="data.demo.sft_eval_fraction"):
        DemoDataConfig(sft_eval_fraction=1.0)
    with pytest.raises(DataError, match="raise data.demo.n_sft"):
        run_demo_data_prep(tmp_path, DemoDataConfig(n_pairs=50, n_sft=1, n_eval_prompts=1))


def test_prefect_task_wraps_the_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = DemoDataConfig(n_pairs=60, n_sft=40, n_eval_prompts=5)
    result = demo_data_task.fn(str(tmp_path), config, DataPrepConfig(max_quarantine_fraction=0.5), seed=0)
    assert result.prep.counts.rows_in == 60 and result.counts.eval_prompts == 5
    assert "eval prompts" in capsys.readouterr().out


def test_cli_prep_demo_prints_the_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    argv = ["prep", "--demo", "--out", str(out), "--seed", "3", "--pairs", "150", "--sft-demos", "60",
            "--eval-prompts", "9"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    lines = dict(line.rsplit(None, 1) for line in printed.splitlines() if line.strip())
    assert lines["rows in"] == "150" and lines["eval prompts"] == "9" and lines["sft demos"] == "60"
    counts = json.loads((out / "data_prep_counts.json").read_text())
    assert lines["train pairs"] == str(counts["train_pairs"]) and (out / "eval_prompts.parquet").exists()


def test_cli_rejects_mixing_demo_and_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prep", "--demo", "in.jsonl", "--out", str(tmp_path)]) == 2
    assert "drop INPUT or drop --demo" in capsys.readouterr().err
    assert main(["prep", "--out", str(tmp_path)]) == 2
    assert "or --demo" in capsys.readouterr().err
    assert main(["prep", "--demo", "--pairs", "0", "--out", str(tmp_path)]) == 2
    assert "data.demo.n_pairs must be >= 1" in capsys.readouterr().err


def test_cli_help_states_the_real_defaults() -> None:
    prep = build_parser()._subparsers._group_actions[0].choices["prep"]  # type: ignore[union-attr]
    helps = {flag: action.help for action in prep._actions for flag in action.option_strings}
    defaults, pipeline = DemoDataConfig(), PipelineConfig()
    for flag, value in (("--pairs", defaults.n_pairs), ("--sft-demos", defaults.n_sft),
                        ("--eval-prompts", defaults.n_eval_prompts), ("--seed", pipeline.seed)):
        assert f"default {value})" in helps[flag], flag
