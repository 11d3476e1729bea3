"""rm-refresh's labelling round trip for people (tasks/labelling.py): the stage exports the on-policy pairs it needs
labelled, a person fills in the label column, and the import turns each label into a preference pair, quarantining
every row it cannot use with its row, column and reason."""

from __future__ import annotations

import csv
from pathlib import Path

import pandas as pd
import pytest

from rlhf_core.data import DataError
from rlhf_core.data.records import PreferencePair
from rlhf_core.evaluation.annotators import ReplyPair
from tasks.labelling import export_unlabelled, import_labels

EXPORTED = [ReplyPair("q cat", " good dog", " bad tree"), ReplyPair("q sun", " red", " blue box"),
            ReplyPair("q why", " the mat", " a slow moon"), ReplyPair("q how", " fast\x00", " slow"),
            ReplyPair("q sat", " big", " small")]


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_label_round_trip_applies_labels_to_the_exported_texts(tmp_path: Path, suffix: str) -> None:
    exported = export_unlabelled(EXPORTED, tmp_path / f"unlabelled{suffix}")
    frame = pd.read_csv(exported, keep_default_na=False) if suffix == ".csv" else pd.read_parquet(exported)
    assert list(frame.columns) == ["pair_id", "prompt", "reply_a", "reply_b", "label"]
    assert frame["pair_id"].tolist() == [p.pair_id for p in EXPORTED] and frame["label"].fillna("").eq("").all()
    frame["label"] = [" A", "b", "a", "a", "B"]
    frame.loc[0, "reply_a"] = " edited text is ignored"
    labelled = tmp_path / f"labelled{suffix}"
    frame.to_csv(labelled, index=False) if suffix == ".csv" else frame.to_parquet(labelled, index=False)
    result = import_labels(str(labelled), exported)
    assert result.pairs == [PreferencePair("q cat", " good dog", " bad tree"),
                            PreferencePair("q sun", " blue box", " red"),
                            PreferencePair("q why", " the mat", " a slow moon"),
                            PreferencePair("q sat", " small", " big")]
    # the 4th label is fine, but its pair fails the ordinary data validation (a NUL byte in a reply)
    assert [(q["source_row"], q["column"], q["reason"]) for q in result.quarantine] == [(3, "chosen",
                                                                                         "control_character")]
    assert result.rows_in == 5 == len(result.pairs) + len(result.quarantine)
    assert {r["pair_id"] for r in result.records} >= {EXPORTED[0].pair_id}  # chosen = reply_a keeps the export id


def test_bad_rows_are_quarantined_with_row_column_and_reason(tmp_path: Path) -> None:
    exported = export_unlabelled(EXPORTED, tmp_path / "unlabelled.csv")
    ids = [p.pair_id for p in EXPORTED]
    labelled = tmp_path / "labelled.csv"
    with open(labelled, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["pair_id", "label", "note"])
        writer.writerows([[ids[0], "a", ""], [ids[1], "", "skipped"], [ids[2], "1", ""], ["deadbeef", "a", ""],
                          ["", "b", ""], [ids[0], "b", "second opinion"], [ids[4], "a", "x", "extra field"],
                          [ids[4], "maybe", ""]])
    result = import_labels(str(labelled), exported)
    reasons = [(q["source_row"], q["column"], q["reason"]) for q in result.quarantine]
    assert reasons == [(1, "label", "missing_label"), (2, "label", "bad_label"), (3, "pair_id", "unknown_pair_id"),
                       (4, "pair_id", "missing_pair_id"), (5, "pair_id", "duplicate_label"),
                       (6, "*", "malformed_record"), (7, "label", "bad_label")]
    assert "first labelled at row 0" in result.quarantine[4]["detail"] and result.quarantine[1]["raw"] == "1"
    assert result.pairs == [PreferencePair("q cat", " good dog", " bad tree")]
    counts = result.counts()
    assert counts["labels/rows_in"] == 8 == counts["labels/accepted"] + counts["labels/quarantined"]
    assert counts["labels/quarantined/bad_label"] == 2 and counts["labels/not_returned"] == 1  # ids[3]


def test_missing_files_and_columns_say_what_to_do(tmp_path: Path) -> None:
    exported = export_unlabelled(EXPORTED, tmp_path / "unlabelled.csv")
    with pytest.raises(FileNotFoundError, match="labels file .*nope.csv does not exist"):
        import_labels(str(tmp_path / "nope.csv"), exported)
    pd.DataFrame({"pair_id": ["x"], "choice": ["a"]}).to_csv(tmp_path / "wrong.csv", index=False)
    with pytest.raises(DataError, match=r"lacks column\(s\) \['label'\]"):
        import_labels(str(tmp_path / "wrong.csv"), exported)
    with pytest.raises(ValueError, match="use a .csv or .parquet"):
        export_unlabelled(EXPORTED, tmp_path / "pairs.xlsx")
    with pytest.raises(ValueError, match="exported twice"):
        export_unlabelled(EXPORTED[:1] * 2, tmp_path / "twice.csv")
