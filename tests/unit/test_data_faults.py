"""Fault injection on data prep: every file-level fault is one DataError naming the file, every row-level fault is
one quarantined row with a reason, and the summary and errors say which setting to change."""

from __future__ import annotations

import bz2
import csv
import errno
import gzip
import json
import os
import random
from pathlib import Path

import pytest

import tasks.sources
from rlhf_core.data import (DataError, DataPrepConfig, InputFormat, SourceFile, SourceRow, check_outcome,
                            format_counts, prepare_data)
from rlhf_core.data import QuarantineReason as R
from rlhf_core.data.records import excerpt
from tasks.sources import read_source

ALL_TRAIN = dict(train_fraction=1.0, heldout_fraction=0.0, ppo_fraction=0.0, max_quarantine_fraction=1.0)


def good(i: int) -> dict[str, object]:
    return {"prompt": f"User: question {i}?\nAssistant:", "chosen": f" helpful {i}", "rejected": f" rude {i}"}


def jsonl_text(records: list[object]) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def write(path: Path, data: str | bytes) -> str:
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return str(path)


def prep(*uris: str, **config: object):
    return prepare_data([read_source(u) for u in uris], DataPrepConfig(**{**ALL_TRAIN, **config}))


def reasons(tables) -> list[tuple[int, str, str]]:
    return [(q["source_row"], q["reason"], q["column"]) for q in tables.quarantine]


def data_error(uri: str) -> str:
    """The DataError message read_source raises for `uri` (fails the test if it raises anything else)."""
    with pytest.raises(DataError) as err:
        read_source(uri)
    message = str(err.value)
    assert uri in message and "\n" not in message
    return message


# ------------------------------------------------------------------------------------------- nesting depth


def test_too_deep_json_line_is_quarantined_and_the_rest_is_read(tmp_path: Path) -> None:
    deep = '{"prompt": "p", "chosen": ' + "[" * 100_000 + "]" * 100_000 + ', "rejected": "r"}'
    tables = prep(write(tmp_path / "deep.jsonl", jsonl_text([good(0), deep, good(2)])))
    assert reasons(tables) == [(1, R.MALFORMED_RECORD.value, "*")]
    assert "nested too deeply" in tables.quarantine[0]["detail"]
    assert tables.counts.rows_accepted == 2


def test_file_of_only_too_deep_json_is_one_data_error(tmp_path: Path) -> None:
    deep_lines = write(tmp_path / "deep.jsonl", '{"chosen": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    deep_array = write(tmp_path / "deep.json", "[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in data_error(deep_array)
    with pytest.raises(DataError, match=r"deep\.jsonl: none of its 1 records could be parsed .*nested too deeply"):
        prep(deep_lines)


def test_too_deep_chat_json_string_is_quarantined() -> None:
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    rows = [SourceRow("c.csv", 0, {"chosen": json.dumps(chat), "rejected": json.dumps(chat[:1] + [chat[0]])}),
            SourceRow("c.csv", 1, {"chosen": "[" * 100_000, "rejected": json.dumps(chat)})]
    tables = prepare_data([SourceFile("c.csv", ("chosen", "rejected"), rows)],
                          DataPrepConfig(input_format=InputFormat.CHAT, **ALL_TRAIN))
    assert (1, R.CHAT_NOT_A_LIST.value, "chosen") in reasons(tables)
    assert "nested too deeply" in tables.quarantine[-1]["detail"]


def test_excerpt_of_unprintable_values_does_not_raise() -> None:
    nested: list[object] = []
    for _ in range(100_000):
        nested = [nested]
    assert excerpt(nested) == "<list too deeply nested or too large to show>"


# ------------------------------------------------------------------------------------------- the file itself


def test_directory_named_like_a_file_is_one_data_error(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").mkdir()
    (tmp_path / "x.parquet").mkdir()
    assert "is a directory" in data_error(str(tmp_path / "x.jsonl"))
    assert "is a directory" in data_error(str(tmp_path / "x.parquet"))


def test_symlink_loop_is_one_data_error(tmp_path: Path) -> None:
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop)
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.symlink_to(b)
    b.symlink_to(a)
    assert "symlink loop" in data_error(str(loop))
    assert "symlink loop" in data_error(str(a))


def test_fifo_is_refused_instead_of_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    assert "not a regular file" in data_error(str(fifo))


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file_is_one_data_error(tmp_path: Path) -> None:
    path = write(tmp_path / "locked.jsonl", jsonl_text([good(0)]))
    os.chmod(path, 0)
    assert "permission denied" in data_error(path)


def test_permission_error_names_the_file_and_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "locked.jsonl", jsonl_text([good(0)]))

    def denied(p: str) -> bytes:
        raise PermissionError(errno.EACCES, "Permission denied", p)

    monkeypatch.setattr(tasks.sources, "_read_local", denied)
    assert "permission denied; make it readable" in data_error(path)


def test_remote_transient_errors_propagate_for_retry_and_permanent_ones_do_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fsspec = pytest.importorskip("fsspec")
    with fsspec.open("memory://faults/prefs.jsonl", "w") as handle:
        handle.write(jsonl_text([good(0)]))

    def reset(fs: object, path: str) -> bytes:
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    monkeypatch.setattr(tasks.sources, "_read_remote", reset)
    with pytest.raises(ConnectionResetError):
        read_source("memory://faults/prefs.jsonl")
    monkeypatch.setattr(tasks.sources, "_read_remote", lambda fs, path: (_ for _ in ()).throw(PermissionError()))
    assert "permission denied" in data_error("memory://faults/prefs.jsonl")
    assert "no such file" in data_error("memory://faults/absent.jsonl")


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [("garbage.jsonl.gz", b"\x1f\x8b\x08\x00garbage-after-the-header", "is not valid gzip data"),
     ("truncated.jsonl.gz", gzip.compress(jsonl_text([good(i) for i in range(50)]).encode())[:60],
      "is not valid gzip data"),
     ("plain.jsonl.gz", jsonl_text([good(0)]).encode(), "drop the compression suffix"),
     ("broken.csv.bz2", b"BZh91AY&SYnot really bzip2", "is not valid bz2 data")],
)
def test_corrupt_compression_is_one_data_error(tmp_path: Path, name: str, content: bytes, needle: str) -> None:
    assert needle in data_error(write(tmp_path / name, content))


def test_valid_compression_still_reads(tmp_path: Path) -> None:
    text = jsonl_text([good(i) for i in range(3)])
    packed = prep(write(tmp_path / "a.jsonl.gz", gzip.compress(text.encode())),
                  write(tmp_path / "b.jsonl.bz2", bz2.compress(text.encode())))
    assert (packed.counts.rows_accepted, packed.counts.rows_quarantined) == (3, 3)  # b duplicates a
    assert {q["reason"] for q in packed.quarantine} == {R.DUPLICATE_PAIR.value}


# ------------------------------------------------------------------------------------------- encodings


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-8-sig"])
@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_text_with_a_byte_order_mark_is_decoded(tmp_path: Path, encoding: str, suffix: str) -> None:
    records = [good(0), {**good(1), "chosen": " héllo ✓ 你好"}]
    if suffix == ".csv":
        text = "prompt,chosen,rejected\n" + "".join(
            ",".join(json.dumps(r[c], ensure_ascii=False) for c in ("prompt", "chosen", "rejected")) + "\n"
            for r in records)
    else:
        text = jsonl_text(records)
    bom = {"utf-16-le": b"\xff\xfe", "utf-16-be": b"\xfe\xff"}.get(encoding, b"")
    tables = prep(write(tmp_path / f"prefs{suffix}", bom + text.encode(encoding)))
    assert tables.counts.rows_quarantined == 0
    assert [p["chosen"] for p in tables.train_pairs] == [" helpful 0", " héllo ✓ 你好"]


@pytest.mark.parametrize(("encoding", "order"), [("utf-16-le", "LE"), ("utf-16-be", "BE")])
def test_utf16_without_a_mark_is_named_not_guessed(tmp_path: Path, encoding: str, order: str) -> None:
    path = write(tmp_path / "prefs.csv", "prompt,chosen,rejected\np,a,b\n".encode(encoding))
    message = data_error(path)
    assert f"is not UTF-8 text (looks like UTF-16-{order}" in message and "re-save it as UTF-8" in message


def test_broken_utf16_after_a_mark_is_one_data_error(tmp_path: Path) -> None:
    path = write(tmp_path / "prefs.jsonl", b"\xff\xfe" + '{"a": 1}'.encode("utf-16-le") + b"\x00\xd8")
    assert "UTF-16 byte-order mark but is not valid UTF-16" in data_error(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".json"])
def test_binary_files_are_refused_as_not_text(tmp_path: Path, suffix: str) -> None:
    noise = random.Random(7).randbytes(4096)
    assert "is not UTF-8 text (looks like binary data" in data_error(write(tmp_path / f"noise{suffix}", noise))


@pytest.mark.parametrize(("content", "needle"), [
    (gzip.compress(b'{"a": 1}\n'), "gzip-compressed data; add .gz"),
    (b"PK\x03\x04" + bytes(40), "zip archive"),
    (b"PAR1" + bytes(range(256)) + b"PAR1", "Parquet; name it .parquet"),
])
def test_known_binary_formats_get_a_hint(tmp_path: Path, content: bytes, needle: str) -> None:
    assert needle in data_error(write(tmp_path / "prefs.jsonl", content))


def test_a_few_bad_bytes_stay_row_level(tmp_path: Path) -> None:
    lines = [json.dumps(good(i)).encode() for i in range(20)]
    lines[3] = '{"prompt": "p", "chosen": " caf\u00e9", "rejected": " r"}'.encode("latin-1")
    lines[5] = b'{"prompt": "p\x00", "chosen": " a", "rejected": " r"}'  # a raw NUL is invalid JSON
    tables = prep(write(tmp_path / "mixed.jsonl", b"\n".join(lines)))
    assert reasons(tables) == [(3, R.UNDECODABLE_BYTES.value, "chosen"), (5, R.MALFORMED_RECORD.value, "*")]


def test_empty_and_unparseable_files_say_so(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"empty\.jsonl: has no records"):
        prep(write(tmp_path / "empty.jsonl", "\n\n"))
    with pytest.raises(DataError, match=r"pretty\.jsonl: none of its 3 records could be parsed \(row 0: invalid"):
        prep(write(tmp_path / "pretty.jsonl", '{\n  "prompt": "p"\n}\n'))


# ------------------------------------------------------------------------------------------- per-row format


def test_one_chat_shaped_row_does_not_flip_a_trl_file() -> None:
    rows = [good(i) for i in range(5)] + [{"prompt": "p", "chosen": ["x"], "rejected": "b"}]
    tables = prepare_data([source(rows)], DataPrepConfig(**ALL_TRAIN))
    assert tables.counts.formats == {"in.jsonl": "trl"}
    assert reasons(tables) == [(5, R.FORMAT_MISMATCH.value, "chosen")]
    assert "looks like chat" in tables.quarantine[0]["detail"] and "5 of 6 rows" in tables.quarantine[0]["detail"]
    assert tables.counts.rows_accepted == 5


def test_one_row_with_a_prompt_does_not_flip_an_hh_file() -> None:
    hh = [{"chosen": f"User: q{i}\nAssistant: yes", "rejected": f"User: q{i}\nAssistant: no"} for i in range(4)]
    tables = prepare_data([source([*hh, good(9)])], DataPrepConfig(**ALL_TRAIN))
    assert tables.counts.formats == {"in.jsonl": "hh"}
    assert reasons(tables) == [(4, R.FORMAT_MISMATCH.value, "prompt")]


def test_one_text_row_does_not_flip_a_chat_file() -> None:
    def chat(i: int) -> dict[str, object]:
        user = {"role": "user", "content": f"q{i}"}
        return {"chosen": [user, {"role": "assistant", "content": "yes"}],
                "rejected": [user, {"role": "assistant", "content": "no"}]}
    tables = prepare_data([source([chat(0), chat(1), chat(2), good(3)])], DataPrepConfig(**ALL_TRAIN))
    assert tables.counts.formats == {"in.jsonl": "chat"}
    assert reasons(tables) == [(3, R.CHAT_NOT_A_LIST.value, "chosen")]


def test_a_forced_format_reads_every_row_in_it() -> None:
    rows = [good(0), {"prompt": "p", "chosen": ["x"], "rejected": "b"}]
    tables = prepare_data([source(rows)], DataPrepConfig(input_format=InputFormat.TRL, **ALL_TRAIN))
    assert reasons(tables) == [(1, R.NON_TEXT.value, "chosen")]


def source(records: list[dict[str, object]], path: str = "in.jsonl") -> SourceFile:
    columns = tuple(dict.fromkeys(k for rec in records for k in rec))
    return SourceFile(path, columns, [SourceRow(path, i, rec) for i, rec in enumerate(records)])


# ------------------------------------------------------------------------------------------- lengths


def test_csv_with_a_400kb_field_is_read_and_the_row_quarantined(tmp_path: Path) -> None:
    path = write(tmp_path / "long.csv", f"prompt,chosen,rejected\np0,{'x' * 400_000},b\np1,a,b\n")
    limit = csv.field_size_limit()
    tables = prep(path)
    assert reasons(tables) == [(0, R.FIELD_TOO_LONG.value, "chosen")]
    assert "400000 characters > 100000" in tables.quarantine[0]["detail"]
    assert csv.field_size_limit() == limit  # the reader restores the process-wide limit
    assert prep(path, max_chars=None).counts.rows_accepted == 2


def test_a_10mb_row_is_quarantined_by_the_default_cap(tmp_path: Path) -> None:
    assert DataPrepConfig().max_chars == 100_000
    huge = {**good(1), "rejected": " " + "y" * 10_000_000}
    tables = prep(write(tmp_path / "huge.jsonl", jsonl_text([good(0), huge])))
    assert reasons(tables) == [(1, R.FIELD_TOO_LONG.value, "rejected")]
    assert len(tables.quarantine[0]["raw"]) <= 200


def test_cap_applies_to_prompts_files_and_to_hh_and_chat_text(tmp_path: Path) -> None:
    prompts = write(tmp_path / "prompts.jsonl", jsonl_text([{"prompt": "short"}, {"prompt": "z" * 50}]))
    pairs = write(tmp_path / "hh.jsonl", jsonl_text([
        {"chosen": "User: hi\nAssistant: yes", "rejected": "User: hi\nAssistant: no"},
        {"chosen": "User: hi\nAssistant: " + "w" * 50, "rejected": "User: hi\nAssistant: no"}]))
    tables = prepare_data([read_source(pairs)], DataPrepConfig(max_chars=40, **ALL_TRAIN),
                          prompt_files=[read_source(prompts)])
    assert [(Path(q["source_file"]).name, q["source_row"], q["reason"]) for q in tables.quarantine] == [
        ("hh.jsonl", 1, R.FIELD_TOO_LONG.value), ("prompts.jsonl", 1, R.FIELD_TOO_LONG.value)]


def test_max_chars_must_be_positive() -> None:
    with pytest.raises(ValueError, match="data.prep.max_chars must be >= 1, got 0"):
        DataPrepConfig(max_chars=0)


def test_huge_integer_margin_is_a_bad_margin() -> None:
    tables = prepare_data([source([good(0), {**good(1), "margin": 10**400}])], DataPrepConfig(**ALL_TRAIN))
    assert reasons(tables) == [(1, R.BAD_MARGIN.value, "margin")]


class WordTokenizer:
    """Counts whitespace-separated words as tokens."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))


def test_summary_says_what_lengths_count() -> None:
    rows = [good(0)]
    by_chars = prepare_data([source(rows)], DataPrepConfig(**ALL_TRAIN)).counts
    by_tokens = prepare_data([source(rows)], DataPrepConfig(max_length=64, **ALL_TRAIN), WordTokenizer()).counts
    chars_lines, token_lines = format_counts(by_chars).splitlines(), format_counts(by_tokens).splitlines()
    assert [" ".join(line.split()) for line in chars_lines[-3:]] == [
        "lengths counted in characters", "max_length no limit", "max_chars 100000 characters"]
    assert [" ".join(line.split()) for line in token_lines[-3:]] == [
        "lengths counted in tokens", "max_length 64 tokens", "max_chars 100000 characters"]


# ------------------------------------------------------------------------------------------- what to change


def test_quarantine_fraction_error_names_the_flag_and_the_config_key() -> None:
    counts = prepare_data([source([good(0), good(1), {**good(2), "chosen": ""}])], DataPrepConfig(**ALL_TRAIN)).counts
    with pytest.raises(DataError) as err:
        check_outcome(counts, 0.1, "out/quarantine.parquet")
    message = str(err.value)
    assert "quarantined fraction 0.333 exceeds max_quarantine_fraction 0.100" in message
    assert "--max-quarantine-fraction" in message and "data.prep.max_quarantine_fraction" in message
    assert "out/quarantine.parquet" in message and "\n" not in message


@pytest.mark.parametrize("fault", ["directory", "symlink_loop", "corrupt_gzip", "binary", "utf16_no_mark",
                                   "deep_array"])
def test_cli_prints_file_faults_as_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], fault: str) -> None:
    from flows.cli import main  # deferred: imports the CLI only for this test

    path = tmp_path / {"corrupt_gzip": "f.jsonl.gz", "deep_array": "f.json"}.get(fault, "f.jsonl")
    if fault == "directory":
        path.mkdir()
    elif fault == "symlink_loop":
        path.symlink_to(path)
    else:
        path.write_bytes({"corrupt_gzip": b"\x1f\x8b\x08\x00junk", "binary": random.Random(3).randbytes(2048),
                          "utf16_no_mark": jsonl_text([good(0)]).encode("utf-16-le"),
                          "deep_array": b"[" * 100_000}[fault])
    code = main(["prep", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"rlhf prep: error: {path}: ") and err.count("\n") == 1 and "Traceback" not in err
