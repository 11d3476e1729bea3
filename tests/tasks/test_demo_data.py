"""The data-prep stage on the generated demo task: pairs through the real data-prep path, SFT tables, evaluation
prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.cli import build_parser, main
from rlhf_core.data import PPO_PROMPTS, PREFERENCE_PAIRS, DataError, DataPrepConfig, DataPrepCounts
from rlhf_core.demo import INTENTS
from rlhf_core.demo.config import DemoDataConfig
from rlhf_core.demo.tables import EVAL_PROMPTS, RAW_PAIRS, SFT_DEMONSTRATIONS, draw_eval_prompts
from rlhf_core.evaluation.demo_eval import annotator_agreement
from tasks import data_prep
from tasks.config import PipelineConfig, load_config
from tasks.io import read_parquet
from tests.stage_harness import StageHarness

SMALL = DemoDataConfig(n_pairs=400, n_sft=300, n_eval_prompts=40)
SEED = 7
TABLES = ("train_pairs", "heldout_pairs", "ppo_prompts", "quarantine", "raw_pairs", "sft_train", "sft_eval",
          "eval_prompts")


def demo_config(demo: DemoDataConfig = DemoDataConfig(), seed: int = 0,
                prep: DataPrepConfig = DataPrepConfig()) -> data_prep.Config:
    return data_prep.Config("demo", prep, demo=demo, seed=seed)


def prepare(out: Path, demo: DemoDataConfig = DemoDataConfig(), seed: int = 0) -> data_prep.Result:
    out.mkdir(parents=True, exist_ok=True)
    return data_prep.prepare(demo_config(demo, seed), out)


def paths(out: Path, result: data_prep.Result) -> dict[str, Path]:
    """Table name -> path, the raw generated pairs included."""
    return {name: out / (data_prep.RAW_PAIRS_FILE if name == "raw_pairs" else getattr(result, name))
            for name in TABLES}


def demo_counts(out: Path) -> dict[str, object]:
    return json.loads((out / "demo_data_counts.json").read_text())


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo")


@pytest.fixture(scope="module")
def small(small_dir: Path) -> data_prep.Result:
    return prepare(small_dir, SMALL, SEED)


def prompts_of(path: Path) -> set[str]:
    return set(pq.read_table(path, columns=["prompt"]).column("prompt").to_pylist())


def test_the_config_slice_carries_the_demo_sizes_and_the_seed() -> None:
    config = load_config(None, None, [f"seed={SEED}", "data.demo.n_pairs=400", "data.demo.n_sft=300",
                                      "data.demo.n_eval_prompts=40"])
    assert data_prep.Config.of(config) == demo_config(SMALL, SEED)


def test_counts_reconcile_with_the_written_tables(small: data_prep.Result, small_dir: Path) -> None:
    tables = paths(small_dir, small)
    saved = json.loads((small_dir / small.counts).read_text())
    counts = DataPrepCounts(**{k: v for k, v in saved.items() if k != "quarantine_fraction"})
    demo = demo_counts(small_dir)
    assert len(read_parquet(tables["raw_pairs"], RAW_PAIRS)) == counts.rows_in == SMALL.n_pairs
    assert counts.rows_in == counts.rows_accepted + counts.rows_quarantined
    assert counts.rows_accepted == counts.train_pairs + counts.heldout_pairs + counts.ppo_split_pairs
    assert len(read_parquet(tables["train_pairs"], PREFERENCE_PAIRS)) == counts.train_pairs > 0
    assert len(read_parquet(tables["heldout_pairs"], PREFERENCE_PAIRS)) == counts.heldout_pairs > 0
    assert len(read_parquet(tables["ppo_prompts"], PPO_PROMPTS)) == counts.ppo_prompts > 0
    assert counts.formats == {data_prep.RAW_PAIRS_FILE: "trl"}  # named as the artifact holds it, wherever it was written
    c = demo["counts"]
    assert c["sft_rows_in"] == SMALL.n_sft == c["sft_duplicates"] + c["sft_train"] + c["sft_eval"]
    assert len(read_parquet(tables["sft_train"], SFT_DEMONSTRATIONS)) == c["sft_train"] > c["sft_eval"]
    assert len(read_parquet(tables["sft_eval"], SFT_DEMONSTRATIONS)) == c["sft_eval"] > 0
    assert len(read_parquet(tables["eval_prompts"], EVAL_PROMPTS)) == c["eval_prompts"] == SMALL.n_eval_prompts
    assert demo["seed"] == SEED and demo["config"]["n_pairs"] == SMALL.n_pairs
    assert small.metrics["demo/sft_train"] == c["sft_train"] and small.metrics["data/rows_in"] == SMALL.n_pairs


def test_no_prompt_is_in_two_splits(small: data_prep.Result, small_dir: Path) -> None:
    tables = paths(small_dir, small)
    train, heldout, ppo = (prompts_of(tables[name]) for name in ("train_pairs", "heldout_pairs", "ppo_prompts"))
    assert not (train & heldout or train & ppo or heldout & ppo)
    assert not prompts_of(tables["sft_train"]) & prompts_of(tables["sft_eval"])


def test_eval_prompts_are_distinct_not_ppo_prompts_and_carry_metadata(small: data_prep.Result,
                                                                      small_dir: Path) -> None:
    rows = read_parquet(small_dir / small.eval_prompts, EVAL_PROMPTS)
    eval_prompts = {r["prompt"] for r in rows}
    assert len(eval_prompts) == len(rows) == SMALL.n_eval_prompts
    assert not eval_prompts & prompts_of(small_dir / small.ppo_prompts)
    assert {r["intent"] for r in rows} <= {i.name for i in INTENTS} and len({r["intent"] for r in rows}) >= 8
    assert all(r["message"] in r["prompt"] for r in rows)


def test_eval_prompts_cover_every_intent_at_default_sizes(tmp_path: Path) -> None:
    # password_reset has only 120 distinct prompts: excluding more than the PPO prompts would lose it
    result = prepare(tmp_path, DemoDataConfig(n_pairs=4000, n_sft=100, n_eval_prompts=256))
    rows = read_parquet(tmp_path / result.eval_prompts, EVAL_PROMPTS)
    assert {r["intent"] for r in rows} == {i.name for i in INTENTS}
    assert not {r["prompt"] for r in rows} & prompts_of(tmp_path / result.ppo_prompts)


def test_draw_eval_prompts_skips_taken_prompts_deterministically() -> None:
    first, _ = draw_eval_prompts(5, seed=1, taken=set())
    records, skipped = draw_eval_prompts(5, seed=1, taken={first[0].prompt, first[2].prompt})
    assert skipped == 2 and [r.prompt for r in records][:3] == [first[1].prompt, first[3].prompt, first[4].prompt]
    with pytest.raises(DataError, match="lower data.demo.n_eval_prompts"):
        draw_eval_prompts(3, seed=1, taken={r.prompt for r in draw_eval_prompts(400, seed=1, taken=set())[0]})


def test_same_seed_gives_identical_tables(small: data_prep.Result, small_dir: Path, tmp_path: Path) -> None:
    before_tables = {name: pq.read_table(path) for name, path in paths(small_dir, small).items()}
    again = prepare(small_dir, SMALL, SEED)  # same folder: same source_file
    other_dir = prepare(tmp_path / "b", SMALL, SEED)
    other_seed = prepare(tmp_path / "c", SMALL, SEED + 1)
    for name in TABLES:
        before = before_tables[name]
        assert before.equals(pq.read_table(paths(small_dir, again)[name])), name
        moved = pq.read_table(paths(tmp_path / "b", other_dir)[name])
        keep = [c for c in before.column_names if c != "source_file"]  # the input path differs by folder
        assert before.select(keep).equals(moved.select(keep)), name
    for name in ("train_pairs", "sft_train", "eval_prompts"):
        assert not before_tables[name].equals(pq.read_table(paths(tmp_path / "c", other_seed)[name])), name


def test_annotator_temperature_reaches_the_labels(tmp_path: Path) -> None:
    prepare(tmp_path / "noisy", DemoDataConfig(n_pairs=600, n_sft=20, n_eval_prompts=1))
    prepare(tmp_path / "exact", DemoDataConfig(n_pairs=600, n_sft=20, n_eval_prompts=1, annotator_temperature=0.01))
    noisy_agreement = annotator_agreement(read_parquet(tmp_path / "noisy" / data_prep.RAW_PAIRS_FILE,
                                                       RAW_PAIRS)).agreement
    assert annotator_agreement(read_parquet(tmp_path / "exact" / data_prep.RAW_PAIRS_FILE,
                                            RAW_PAIRS)).agreement > 0.99
    assert 0.75 < noisy_agreement < 0.93  # default temperature 1.5: about one label in six against gold


def test_bad_sizes_fail_with_the_setting_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data.demo.n_pairs"):
        DemoDataConfig(n_pairs=0)
    with pytest.raises(ValueError, match="data.demo.sft_eval_fraction"):
        DemoDataConfig(sft_eval_fraction=1.0)
    with pytest.raises(DataError, match="raise data.demo.n_sft"):
        prepare(tmp_path, DemoDataConfig(n_pairs=50, n_sft=1, n_eval_prompts=1))


def test_the_stage_in_a_run_publishes_the_demo_tables(tmp_path: Path) -> None:
    cfg = demo_config(DemoDataConfig(n_pairs=60, n_sft=40, n_eval_prompts=5), prep=DataPrepConfig(
        max_quarantine_fraction=0.5))
    harness = StageHarness(tmp_path / "state")
    try:
        art = harness.run(data_prep, "data-prep", cfg, data_prep.Inputs())
        run = harness.mlflow_run("data-prep")
    finally:
        harness.close()
    result = data_prep.STAGE.result(art)
    assert (result.sft_train, result.sft_eval) == ("sft_train.parquet", "sft_eval.parquet")
    assert result.metrics["data/rows_in"] == 60 and result.metrics["demo/eval_prompts"] == 5
    assert len(read_parquet(art.path(result.eval_prompts), EVAL_PROMPTS)) == 5
    assert art.record.config["seed"] == 0 and art.record.config["demo"]["n_pairs"] == 60
    assert run.data.metrics["demo/eval_prompts"] == 5 and run.data.params["demo.n_pairs"] == "60"


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
    assert demo_counts(out)["seed"] == 3


def test_cli_rejects_mixing_demo_and_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prep", "--demo", "in.jsonl", "--out", str(tmp_path)]) == 2
    assert "drop INPUT or drop --demo" in capsys.readouterr().err
    assert main(["prep", "--out", str(tmp_path)]) == 2
    assert "or --demo" in capsys.readouterr().err
    assert main(["prep", "--demo", "--pairs", "0", "--out", str(tmp_path)]) == 2
    assert "bad value 0 for 'data.demo.n_pairs'" in (err := capsys.readouterr().err) and "must be >= 1" in err


def test_cli_help_states_the_real_defaults() -> None:
    prep = build_parser()._subparsers._group_actions[0].choices["prep"]  # type: ignore[union-attr]
    helps = {flag: action.help for action in prep._actions for flag in action.option_strings}
    defaults, pipeline = DemoDataConfig(), PipelineConfig()
    for flag, value in (("--pairs", defaults.n_pairs), ("--sft-demos", defaults.n_sft),
                        ("--eval-prompts", defaults.n_eval_prompts), ("--seed", pipeline.seed)):
        assert f"default {value})" in helps[flag], flag
