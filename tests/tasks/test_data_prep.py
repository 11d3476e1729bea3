"""The data-prep stage end to end on tiny files: tables, quarantine, failures, the stage in a run and the CLI."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient
from prefect.states import Failed

from flows.cli import main
from rlhf_core.data import PPO_PROMPTS, PREFERENCE_PAIRS, QUARANTINE, DataError, DataPrepCounts
from rlhf_core.data import QuarantineReason as R
from tasks import data_prep
from tasks.config import load_config
from tasks.io import read_parquet
from tasks.retries import retry_on_transient_io
from tests.stage_harness import StageHarness

ALL_REASONS_OK = ("data.prep.max_quarantine_fraction=1.0",)


def good(i: int, k: int = 0) -> dict[str, object]:
    return {"prompt": f"User: question {i}?\nAssistant:", "chosen": f" helpful {k}", "rejected": f" rude {k}"}


def write_jsonl(path: Path, lines: list[object]) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def files_config(files: Sequence[str], *overrides: str, prompts: str | None = None) -> data_prep.Config:
    """The stage's slice of a pipeline config that reads ``files`` (as ``rlhf prep`` and ``rlhf run`` build it)."""
    settings = ["data.source=files", f"data.files={json.dumps(list(files))}", "refresh.enabled=false", *overrides]
    if prompts is not None:
        settings.append(f"data.prompts_file={json.dumps(prompts)}")
    return data_prep.Config.of(load_config(None, None, settings))


def prepare(files: Sequence[str], out: Path, *overrides: str, prompts: str | None = None) -> data_prep.Result:
    out.mkdir(parents=True, exist_ok=True)
    return data_prep.prepare(files_config(files, *overrides, prompts=prompts), out)


def counts_of(out: Path, result: data_prep.Result) -> DataPrepCounts:
    saved = json.loads((out / result.counts).read_text())
    return DataPrepCounts(**{k: v for k, v in saved.items() if k != "quarantine_fraction"})


def malformed_sample(tmp_path: Path) -> str:
    """12 good rows and 6 bad ones, one of each kind below."""
    bad = [
        {**good(100), "chosen": ""},                      # empty_text
        {**good(101), "rejected": " helpful 0"},          # identical_pair
        good(0),                                          # duplicate_pair
        '{"prompt": "User: broken',                       # malformed_record
        '{"prompt": "p", "chosen": NaN, "rejected": "r"}',  # nan_value
        {**good(102), "margin": "very"},                  # bad_margin
    ]
    return write_jsonl(tmp_path / "sample.jsonl", [good(i) for i in range(12)] + bad)


def test_config_slice_of_user_files_has_no_demo_settings(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [good(0)])
    cfg = files_config([source], "seed=5", prompts=source)
    assert (cfg.source, cfg.files, cfg.prompts_file, cfg.demo, cfg.seed) == ("files", (source,), source, None, None)
    demo = data_prep.Config.of(load_config(None, None, ["seed=5", "data.demo.n_pairs=30"]))
    assert (demo.source, demo.files, demo.seed, demo.demo.n_pairs) == ("demo", (), 5, 30)


def test_stage_writes_canonical_tables_that_reconcile(tmp_path: Path) -> None:
    rows = [good(i, k) for i in range(40) for k in range(2)] + [{**good(0), "chosen": " "}]
    out = tmp_path / "out"
    result = prepare([write_jsonl(tmp_path / "in.jsonl", rows)], out, *ALL_REASONS_OK)
    train = read_parquet(out / result.train_pairs, PREFERENCE_PAIRS)
    heldout = read_parquet(out / result.heldout_pairs, PREFERENCE_PAIRS)
    prompts = read_parquet(out / result.ppo_prompts, PPO_PROMPTS)
    quarantine = read_parquet(out / result.quarantine, QUARANTINE)
    counts = counts_of(out, result)
    assert (counts.rows_in, counts.rows_accepted, counts.rows_quarantined) == (81, 80, 1)
    assert (len(train), len(heldout), len(prompts)) == (counts.train_pairs, counts.heldout_pairs, counts.ppo_prompts)
    assert len(train) + len(heldout) + counts.ppo_split_pairs == 80 and len(train) > len(heldout)
    assert [(q["source_row"], q["reason"]) for q in quarantine] == [(80, R.EMPTY_TEXT.value)]
    splits = [{p["prompt"] for p in table} for table in (train, heldout, prompts)]
    assert not (splits[0] & splits[1] or splits[0] & splits[2] or splits[1] & splits[2])
    assert json.loads((out / result.counts).read_text())["rows_in"] == 81
    assert result.metrics["data/rows_in"] == 81 and result.metrics["data/quarantined/empty_text"] == 1
    assert pq.read_schema(out / result.train_pairs).field("margin").type == "double"
    # user data: evaluation prompts are the held-out pairs' prompts; no SFT demonstrations
    eval_prompts = [r["prompt"] for r in read_parquet(out / result.eval_prompts, PPO_PROMPTS)]
    assert eval_prompts == list(dict.fromkeys(r["prompt"] for r in heldout))
    assert (result.sft_train, result.sft_eval) == (None, None)


def test_stage_is_deterministic(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [good(i) for i in range(60)])
    first = prepare([source], tmp_path / "a")
    second = prepare([source], tmp_path / "b")
    for name in ("train_pairs", "heldout_pairs", "ppo_prompts"):
        a, b = getattr(first, name), getattr(second, name)
        assert pq.read_table(tmp_path / "a" / a).equals(pq.read_table(tmp_path / "b" / b)), name


def test_wrong_columns_and_unreadable_file_raise_data_error(tmp_path: Path) -> None:
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r"wrong\.jsonl: found columns \['question', 'answer'\]"):
        prepare([wrong], tmp_path / "out")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"\x00garbage")
    with pytest.raises(DataError, match=r"junk\.parquet: cannot be read"):
        prepare([str(junk)], tmp_path / "out")


def test_too_many_quarantined_rows_fail_and_point_at_the_quarantine(tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare([write_jsonl(tmp_path / "ok.jsonl", [good(i) for i in range(20)])], out)
    assert (out / "train_pairs.parquet").exists()
    source = write_jsonl(tmp_path / "bad.jsonl", [good(0), good(1), {"prompt": "p", "chosen": 1, "rejected": "r"},
                                                  "nope"])
    with pytest.raises(DataError) as err:
        prepare([source], out, "data.prep.max_quarantine_fraction=0.25")
    message = str(err.value)
    assert "0.500" in message and "0.250" in message and str(out / "quarantine.parquet") in message
    assert [q["reason"] for q in read_parquet(out / "quarantine.parquet", QUARANTINE)] == [
        R.NON_TEXT.value, R.MALFORMED_RECORD.value]
    assert not (out / "train_pairs.parquet").exists()  # no stale tables from the earlier run


def test_prompts_file_feeds_ppo_and_pairs_go_to_train_and_heldout(tmp_path: Path) -> None:
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [good(i) for i in range(50)])
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [
        {"prompt": "User: new 1\nAssistant:"}, {"prompt": [{"role": "user", "content": "new 2"}]},
        {"prompt": "User: new 1\nAssistant:"}, {"prompt": ""}])
    out = tmp_path / "out"
    result = prepare([pairs], out, "data.prep.max_quarantine_fraction=0.1", prompts=prompts)
    counts = counts_of(out, result)
    assert [p["prompt"] for p in read_parquet(out / result.ppo_prompts, PPO_PROMPTS)] == [
        "User: new 1\nAssistant:", "User: new 2\nAssistant:"]
    assert (counts.prompt_rows_in, counts.prompt_rows_accepted, counts.prompt_rows_quarantined) == (4, 2, 2)
    assert counts.quarantined_by_reason == {R.DUPLICATE_PROMPT.value: 1, R.EMPTY_TEXT.value: 1}
    assert counts.ppo_split_pairs == 0 and counts.train_pairs + counts.heldout_pairs == 50


def test_the_stage_in_a_run_publishes_the_tables_and_retries_only_transient_io(tmp_path: Path) -> None:
    source = Path(write_jsonl(tmp_path / "in.jsonl", [good(i) for i in range(10)]))
    harness = StageHarness(tmp_path / "state")
    try:
        art = harness.run(data_prep, "data-prep", files_config([str(source)]), data_prep.Inputs())
        assert art.result["metrics"]["data/rows_accepted"] == 10
        # the same tables as `rlhf prep` writes
        plain = prepare([str(source)], tmp_path / "plain")
        for name in ("train_pairs", "heldout_pairs", "ppo_prompts", "eval_prompts"):
            assert pq.read_table(art.path(art.result[name])).equals(
                pq.read_table(tmp_path / "plain" / getattr(plain, name))), name
        run = harness.mlflow_run("data-prep")
        assert run.data.metrics["data/rows_in"] == 10 and run.data.params["source"] == "files"
        logged = {Path(a.path).name for a in MlflowClient().list_artifacts(run.info.run_id, "data")}
        assert logged == {"data_prep_counts.json", "quarantine.parquet"}
        # the files' content is part of the key: an edited file is prepared again
        source.write_text(source.read_text() + json.dumps(good(10)) + "\n")
        edited = harness.run(data_prep, "data-prep", files_config([str(source)]), data_prep.Inputs())
        assert edited.key != art.key and edited.result["metrics"]["data/rows_accepted"] == 11
    finally:
        harness.close()
    task = data_prep.data_prep_task
    assert task.retries == 2 and task.retry_condition_fn is retry_on_transient_io
    decisions = {type(e).__name__: retry_on_transient_io(data_prep.data_prep_task, None, Failed(data=e))
                 for e in (TimeoutError("slow"), ConnectionError("reset"), DataError("bad"),
                           FileNotFoundError("x"), ValueError("bug"))}
    assert decisions == {"TimeoutError": True, "ConnectionError": True, "DataError": False,
                         "FileNotFoundError": False, "ValueError": False}


def table_value(stdout: str, label: str) -> str:
    (line,) = [line for line in stdout.splitlines() if line.strip().startswith(label + "  ")]
    return line.split()[-1]


def test_cli_prep_prints_counts_for_malformed_sample(tmp_path: Path, capsys) -> None:
    sample = malformed_sample(tmp_path)
    code = main(["prep", sample, "--out", str(tmp_path / "out"), "--max-quarantine-fraction", "0.5",
                 "--max-length", "500"])
    stdout = capsys.readouterr().out
    assert code == 0
    assert (table_value(stdout, "rows in"), table_value(stdout, "accepted"), table_value(stdout, "quarantined")) == (
        "18", "12", "6")
    for reason in ("empty_text", "identical_pair", "duplicate_pair", "malformed_record", "nan_value", "bad_margin"):
        assert table_value(stdout, reason) == "1"
    splits = sum(int(table_value(stdout, label)) for label in ("train pairs", "held-out pairs", "ppo-split pairs"))
    assert splits == 12
    assert str(tmp_path / "out" / "quarantine.parquet") in stdout


@pytest.mark.parametrize(
    ("extra", "needle"),
    [([], "quarantined fraction 0.333 exceeds max_quarantine_fraction 0.100"),
     (["--max-quarantine-fraction", "3"], "bad value 3 for 'data.prep.max_quarantine_fraction' (from override 'data.prep.max_quarantine_fraction=3'): must be in [0, 1]"),
     (["--format", "trl", "--prompts", "missing.csv"], "missing.csv: no such file")],
)
def test_cli_data_errors_exit_2_with_one_line(tmp_path: Path, capsys, extra: list[str], needle: str) -> None:
    code = main(["prep", malformed_sample(tmp_path), "--out", str(tmp_path / "out"), *extra])
    captured = capsys.readouterr()
    assert code == 2
    assert needle in captured.err and captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("rlhf prep: error: ")


def test_a_split_that_holds_out_nothing_names_fractions_that_work(tmp_path: Path, capsys) -> None:
    """Four pairs with four prompts: the default fractions hold none of them out. The refusal names fractions
    that do (summing to 1 with PPO's), and running with exactly those succeeds."""
    sample = write_jsonl(tmp_path / "four.jsonl", [good(i) for i in (0, 1, 2, 4)])
    assert main(["prep", sample, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "has no held-out pairs" in err and "sum to 1" in err and err.count("\n") == 1
    suggested = err.split("e.g. ")[1].split(" (")[0].split()
    assert [s.partition("=")[0] for s in suggested] == ["data.prep.train_fraction", "data.prep.heldout_fraction",
                                                        "data.prep.ppo_fraction"]
    again = [arg for setting in suggested for arg in ("--set", setting)]
    assert main(["prep", sample, "--out", str(tmp_path / "out"), *again]) == 0, capsys.readouterr().err
    assert read_parquet(tmp_path / "out" / data_prep.HELDOUT_FILE, PREFERENCE_PAIRS)


def test_fractions_that_do_not_sum_to_one_name_a_value_that_does() -> None:
    with pytest.raises(ValueError, match=r"sum 1.1\): raising one means lowering another, e.g. "
                                         r"data.prep.train_fraction=0.7"):
        files_config(["x.jsonl"], "data.prep.heldout_fraction=0.2")
