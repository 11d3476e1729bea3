"""Properties of reading + preparing arbitrary rows: each row is accepted or quarantined with a reason, the counts
reconcile with the rows written, and the only exception is the documented one-line DataError naming the file."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf_core.data import DataError, DataPrepConfig, QuarantineReason, SourceFile, SourceRow, prepare_data
from tasks.sources import read_source

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
CONFIG = DataPrepConfig(max_length=2_000, max_quarantine_fraction=1.0, train_fraction=1.0, heldout_fraction=0.0,
                        ppo_fraction=0.0)
"""Everything accepted lands in train_pairs, so accepted rows are visible."""
REASONS = {r.value for r in QuarantineReason}
COLUMNS = ("prompt", "chosen", "rejected", "margin", "extra")

unicode_text = st.text(st.characters(blacklist_categories=("Cc",)), max_size=30)
odd_text = st.one_of(
    unicode_text,
    st.sampled_from(["", " ", "\n\t ", "\x00", "\x1b[31m", "\ud800", "caf\u00e9", "你好", "\u202e", "🙂" * 3]),
    st.builds(lambda ch, n: ch * n, st.sampled_from("xé🙂 "), st.integers(100_001, 250_000)),  # over max_chars
    st.builds(lambda ch, n: ch * n, st.sampled_from("ab"), st.integers(2_001, 5_000)),  # over max_length only
)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "human", ""]),
                                 "content": odd_text})
json_value = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=10**300, max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True), odd_text,
    st.lists(message, max_size=4), st.lists(st.integers(), max_size=3),
    st.dictionaries(unicode_text, st.integers(), max_size=2),
    st.builds(lambda n: json.loads("[" * n + "]" * n), st.integers(1, 900)),  # deep, yet parseable
)
odd_record = st.dictionaries(st.sampled_from(COLUMNS), json_value, max_size=5)


def good_record(i: int) -> dict[str, object]:
    return {"prompt": f"User: question {i}?\nAssistant:", "chosen": f" helpful {i}", "rejected": f" rude {i}"}


# An odd row as written to a JSON Lines file: ("record", dict), ("json", non-object), ("garbage", line), ("deep", n).
odd_jsonl_row = st.one_of(
    st.tuples(st.just("record"), odd_record),
    st.tuples(st.just("record"), st.builds(lambda chat: {"prompt": "p", "chosen": chat, "rejected": "r"},
                                           st.lists(message, max_size=3))),  # a chat-shaped row
    st.tuples(st.just("json"), st.one_of(st.integers(), st.lists(st.integers(), max_size=3), unicode_text)),
    st.tuples(st.just("garbage"), unicode_text.filter(lambda s: s.strip() and "\n" not in s)),
    st.tuples(st.just("deep"), st.integers(2_000, 50_000)),
)


def mixed(odd_row: st.SearchStrategy) -> st.SearchStrategy:
    """Good rows ("good", None) and odd rows in any order; often mostly good, often mostly odd."""
    rows = st.tuples(st.lists(st.just(("good", None)), max_size=12), st.lists(odd_row, min_size=1, max_size=10))
    return rows.flatmap(lambda pair: st.permutations(pair[0] + pair[1]))


def jsonl_line(index: int, kind: str, payload: object, ascii_only: bool) -> str:
    if kind == "good":
        return json.dumps(good_record(index))
    if kind == "garbage":
        return "#" + str(payload)  # never valid JSON, never blank
    if kind == "deep":
        return '{"chosen": ' + "[" * payload + "]" * payload + "}"
    try:
        return json.dumps(payload, ensure_ascii=ascii_only)
    except ValueError:  # an integer too long for str(): write it as a string instead
        return json.dumps(str(payload)[:50])


def check_reconciled(tables, rows_written: int, good_rows: set[int]) -> None:
    counts = tables.counts
    assert counts.rows_in == rows_written == counts.rows_accepted + counts.rows_quarantined
    accepted = [p["source_row"] for p in tables.train_pairs]
    quarantined = [q["source_row"] for q in tables.quarantine]
    assert sorted(accepted + quarantined) == sorted(set(accepted) | set(quarantined))  # no row in two places
    assert len(accepted) + len(quarantined) == rows_written
    for q in tables.quarantine:
        assert q["reason"] in REASONS and q["detail"].strip() and q["column"]
        q["raw"].encode("utf-8")  # storable in Parquet: no lone surrogates
        assert len(q["raw"]) <= 200
    if set(counts.formats.values()) == {"trl"} or 2 * len(good_rows) > rows_written:
        assert good_rows <= set(accepted)  # odd rows never cost a good row, nor flip a mostly good file


@SETTINGS
@given(rows=mixed(odd_jsonl_row), ascii_only=st.booleans())
def test_jsonl_rows_are_each_accepted_or_quarantined(tmp_path: Path, rows, ascii_only: bool) -> None:
    lines = [json.dumps(good_record(-1))]  # an object first: the file is JSON Lines, with the needed columns
    lines += [jsonl_line(i, kind, payload, ascii_only) for i, (kind, payload) in enumerate(rows, start=1)]
    path = tmp_path / "rows.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8", errors="surrogatepass"))
    good_rows = {0} | {i for i, (kind, _) in enumerate(rows, start=1) if kind == "good"}
    try:
        tables = prepare_data([read_source(str(path))], CONFIG)
    except DataError as err:  # lone surrogates written raw may make the file more junk than text
        assert not ascii_only and "is not UTF-8 text" in str(err) and "\n" not in str(err)
        return
    check_reconciled(tables, len(lines), good_rows)


def csv_cell(value: object) -> str:
    return "" if value is None else value if isinstance(value, str) else json.dumps(value)[:1000]


odd_csv_row = st.tuples(st.just("cells"), st.lists(st.one_of(odd_text, json_value.map(csv_cell)), min_size=1,
                                                  max_size=6))


@SETTINGS
@given(rows=mixed(odd_csv_row))
def test_csv_rows_are_each_accepted_or_quarantined(tmp_path: Path, rows) -> None:
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer)
    writer.writerow(["prompt", "chosen", "rejected"])
    for i, (kind, cells) in enumerate(rows):
        record = good_record(i)
        writer.writerow([record[c] for c in ("prompt", "chosen", "rejected")] if kind == "good" else cells)
    path = tmp_path / "rows.csv"
    path.write_bytes(buffer.getvalue().encode("utf-8", errors="surrogatepass"))
    good_rows = {i for i, (kind, _) in enumerate(rows) if kind == "good"}
    try:
        tables = prepare_data([read_source(str(path))], CONFIG)
    except DataError as err:
        message = str(err)
        assert str(path) in message and "\n" not in message
        assert "is not UTF-8 text" in message
        return
    check_reconciled(tables, len(rows), good_rows)


@SETTINGS
@given(data=st.one_of(st.binary(max_size=3_000),
                      unicode_text.map(lambda text: text.encode("utf-8", errors="surrogatepass")),
                      st.lists(odd_record, max_size=5).map(lambda rs: "\n".join(map(json.dumps, rs)).encode())),
       suffix=st.sampled_from([".jsonl", ".json", ".csv", ".jsonl.gz", ".parquet"]))
def test_any_bytes_give_a_result_or_one_line_naming_the_file(tmp_path: Path, data: bytes, suffix: str) -> None:
    path = tmp_path / f"any{suffix}"
    path.write_bytes(data)
    try:
        source = read_source(str(path))
        tables = prepare_data([source], CONFIG)
    except DataError as err:
        message = str(err)
        assert "\n" not in message and (str(path) in message or message.startswith("no rows in"))
        return
    assert tables.counts.rows_in == len(source.rows) == tables.counts.rows_accepted + tables.counts.rows_quarantined


python_value = st.one_of(json_value, st.binary(max_size=20), st.tuples(st.integers()), st.complex_numbers(),
                         st.lists(st.dictionaries(st.sampled_from(["role", "content"]), json_value), max_size=3))


@SETTINGS
@given(records=st.lists(st.one_of(st.none(), st.dictionaries(st.sampled_from(COLUMNS), python_value, max_size=5)),
                        min_size=1, max_size=25))
def test_in_memory_rows_of_any_python_type_reconcile(records) -> None:
    rows = [SourceRow("mem.parquet", 0, good_record(-1))]
    rows += [SourceRow("mem.parquet", i, r, "" if r is not None else "unparseable", "raw")
             for i, r in enumerate(records, start=1)]
    tables = prepare_data([SourceFile("mem.parquet", COLUMNS, rows)], CONFIG)
    check_reconciled(tables, len(rows), {0})
