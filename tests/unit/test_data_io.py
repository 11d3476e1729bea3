"""Reading every supported file type and format into the same canonical rows; atomic Parquet writes."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_core.data import PREFERENCE_PAIRS, QUARANTINE, DataError, DataPrepConfig, prepare_data
from rlhf_core.data import QuarantineReason as R
from tasks.io import arrow_schema, atomic_write, read_parquet, read_source, write_parquet

# Logical data: (conversation before the reply, chosen reply, rejected reply, margin)
LOGICAL = [
    ([("user", "Hi")], "Hello!", "Go away.", 1.5),
    ([("user", "My order 123 is late.")], "Sorry, it ships today.", "Check the website.", 0.25),
    ([("system", "Be kind."), ("user", "Refund?"), ("assistant", "Which order?"), ("user", "Order 7,\n\"blue\"")],
     "Refund issued for order 7.", "No.", 2.0),
]
LABEL = {"system": "System", "user": "User", "assistant": "Assistant"}


def plain(turns: list[tuple[str, str]]) -> str:
    return "".join(f"{LABEL[role]}: {text}\n" for role, text in turns) + "Assistant:"


def trl_records() -> list[dict[str, object]]:
    return [{"prompt": plain(t), "chosen": " " + c, "rejected": " " + r, "margin": m} for t, c, r, m in LOGICAL]


def hh_records() -> list[dict[str, object]]:
    return [{"chosen": plain(t) + " " + c, "rejected": plain(t) + " " + r, "margin": m} for t, c, r, m in LOGICAL]


def chat_records() -> list[dict[str, object]]:
    def conv(turns, reply):
        return [{"role": role, "content": text} for role, text in turns] + [{"role": "assistant", "content": reply}]
    return [{"chosen": conv(t, c), "rejected": conv(t, r), "margin": m} for t, c, r, m in LOGICAL]


def write_jsonl(path: Path, records: list[dict[str, object]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def write_csv(path: Path, records: list[dict[str, object]]) -> str:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    return str(path)


def write_pq(path: Path, records: list[dict[str, object]]) -> str:
    pq.write_table(pa.Table.from_pylist(records), path)
    return str(path)


def canonical(uri: str) -> list[tuple[object, ...]]:
    config = DataPrepConfig(train_fraction=1.0, heldout_fraction=0.0, ppo_fraction=0.0)
    tables = prepare_data([read_source(uri)], config)
    assert tables.counts.rows_quarantined == 0, tables.quarantine
    return [(p["prompt"], p["chosen"], p["rejected"], p["margin"], p["pair_id"]) for p in tables.train_pairs]


def test_every_format_and_file_type_gives_the_same_canonical_rows(tmp_path: Path) -> None:
    files = {
        "trl.parquet": write_pq(tmp_path / "trl.parquet", trl_records()),
        "trl.jsonl": write_jsonl(tmp_path / "trl.jsonl", trl_records()),
        "trl.csv": write_csv(tmp_path / "trl.csv", trl_records()),
        "hh.jsonl": write_jsonl(tmp_path / "hh.jsonl", hh_records()),
        "hh.csv": write_csv(tmp_path / "hh.csv", hh_records()),
        "chat.jsonl": write_jsonl(tmp_path / "chat.jsonl", chat_records()),
        "chat.parquet": write_pq(tmp_path / "chat.parquet", chat_records()),
    }
    results = {name: canonical(uri) for name, uri in files.items()}
    expected = [(plain(t), " " + c, " " + r, m) for t, c, r, m in LOGICAL]
    for name, rows in results.items():
        assert [row[:4] for row in rows] == expected, name
    assert len({tuple(rows) for rows in results.values()}) == 1  # pair ids identical too


def test_json_array_gzip_and_fsspec_uri(tmp_path: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    array = tmp_path / "trl.json"
    array.write_text(json.dumps(trl_records()), encoding="utf-8")
    packed = tmp_path / "trl.jsonl.gz"
    packed.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in trl_records()).encode()))
    with fsspec.open("memory://prefs/trl.jsonl", "w") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in trl_records()))
    expected = canonical(write_jsonl(tmp_path / "plain.jsonl", trl_records()))
    assert canonical(str(array)) == canonical(str(packed)) == canonical("memory://prefs/trl.jsonl") == expected
    assert canonical(f"file://{tmp_path / 'plain.jsonl'}") == expected


def test_record_level_damage_in_files_is_quarantined_not_fatal(tmp_path: Path) -> None:
    good = json.dumps(trl_records()[0]).encode()
    jsonl = tmp_path / "damaged.jsonl"
    jsonl.write_bytes(b"\n".join([good, b"", b'{"prompt": "p", "chosen": "\xff\xfe", "rejected": "r"}',
                                  b'{"prompt": "p", ', b"[1, 2]"]) + b"\n")
    ragged = tmp_path / "ragged.csv"
    ragged.write_bytes(b"prompt,chosen,rejected\nq,a,b\nq,a\nq,a,b,extra\nq2,\xffbad,b\n")
    config = DataPrepConfig(max_quarantine_fraction=1.0)
    tables = prepare_data([read_source(str(jsonl)), read_source(str(ragged))], config)
    found = [(Path(q["source_file"]).name, q["source_row"], q["column"], q["reason"]) for q in tables.quarantine]
    assert found == [
        ("damaged.jsonl", 2, "chosen", R.UNDECODABLE_BYTES.value),  # line 1 is blank: JSONL rows are line numbers
        ("damaged.jsonl", 3, "*", R.MALFORMED_RECORD.value),
        ("damaged.jsonl", 4, "*", R.MALFORMED_RECORD.value),
        ("ragged.csv", 1, "*", R.MALFORMED_RECORD.value),
        ("ragged.csv", 2, "*", R.MALFORMED_RECORD.value),
        ("ragged.csv", 3, "chosen", R.UNDECODABLE_BYTES.value),
    ]
    assert tables.counts.rows_in == 8 and tables.counts.rows_accepted == 2


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [("junk.parquet", b"not parquet at all", "cannot be read"), ("missing.jsonl", None, "no such file"),
     ("array.json", b"[{broken", "not valid JSON"), ("empty.csv", b"", "empty CSV"),
     ("prefs.xlsx", b"x", "unsupported file type '.xlsx'")],
)
def test_unreadable_files_raise_data_error_naming_the_file(tmp_path: Path, name: str, content, needle: str) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError) as err:
        read_source(str(path))
    assert str(path) in str(err.value) and needle in str(err.value)


def test_unknown_uri_scheme_is_a_data_error() -> None:
    with pytest.raises(DataError, match="nosuchscheme://x/prefs.jsonl"):
        read_source("nosuchscheme://x/prefs.jsonl")


def test_write_parquet_is_atomic_and_typed(tmp_path: Path) -> None:
    row = {"source_file": "f", "source_row": 3, "column": "*", "reason": "x", "detail": "d", "raw": "r"}
    target = tmp_path / "deep" / "quarantine.parquet"
    write_parquet([row], QUARANTINE, target)
    assert read_parquet(target, QUARANTINE) == [row]
    assert pq.read_schema(target).equals(arrow_schema(QUARANTINE), check_metadata=False)
    with pytest.raises(ValueError, match="not nullable"):
        write_parquet([{**row, "reason": None}], QUARANTINE, target)
    assert read_parquet(target, QUARANTINE) == [row]


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    target = tmp_path / "table.parquet"
    target.write_text("old")

    def crash_midway(tmp: str) -> None:
        Path(tmp).write_text("half-written")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, crash_midway)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["table.parquet"]  # temp file removed
    atomic_write(target, lambda tmp: Path(tmp).write_text("new"))
    assert target.read_text() == "new" and len(list(tmp_path.iterdir())) == 1


def test_schema_dtypes() -> None:
    schema = arrow_schema(PREFERENCE_PAIRS)
    assert schema.names == ["prompt", "chosen", "rejected", "margin", "source_file", "source_row", "pair_id"]
    assert schema.field("margin").type == pa.float64() and schema.field("margin").nullable
    assert schema.field("source_row").type == pa.int64() and not schema.field("prompt").nullable
