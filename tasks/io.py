"""File I/O for the stages: read preference/prompt files (Parquet, JSONL, CSV; local paths or URIs) into
rlhf_core records, and write canonical tables as Parquet atomically (temp file in the same dir + os.replace).

Reading is tolerant per record (a bad JSON line or a ragged CSV row becomes a SourceRow with a parse
error, later quarantined) and strict per file (unreadable file -> DataError naming it).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rlhf_core.data import PREFERENCE_PAIRS, DataError, DType, SourceFile, SourceRow, TableSchema

if TYPE_CHECKING:
    from rlhf_core.training.reward_training import PreferencePair

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
CSV_SUFFIXES = (".csv",)
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".zst", ".lz4")
"""Stripped before the format suffix is read; pyarrow decompresses JSONL/CSV streams by extension."""

_ARROW_TYPES = {DType.STRING: pa.string(), DType.FLOAT64: pa.float64(), DType.INT64: pa.int64()}
_ESCAPED_BYTE = range(0xDC80, 0xDD00)  # what errors="surrogateescape" turns undecodable bytes into


def read_source(uri: str) -> SourceFile:
    """All records of one Parquet / JSONL / CSV file (local path or any pyarrow/fsspec URI).

    Raises DataError when the file is missing, has an unknown suffix, or cannot be parsed at all.
    Other OSErrors (network, permissions) propagate so a caller may retry them.
    """
    suffix = _format_suffix(uri)
    fs, path = _filesystem(uri)
    try:
        if suffix in PARQUET_SUFFIXES:
            return _read_parquet(uri, fs, path)
        with fs.open_input_stream(path) as stream:  # compression is detected from the extension
            data = stream.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as err:
        raise DataError(f"{uri}: no such file ({type(err).__name__}: {err})") from err
    except pa.ArrowInvalid as err:
        raise DataError(f"{uri}: cannot be read ({err})") from err
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    return _parse_csv(uri, data) if suffix in CSV_SUFFIXES else _parse_json(uri, data)


def _format_suffix(uri: str) -> str:
    name = uri.rstrip("/").rsplit("/", 1)[-1].lower()
    for compression in COMPRESSION_SUFFIXES:
        name = name.removesuffix(compression)
    suffix = os.path.splitext(name)[1]
    if suffix not in (*PARQUET_SUFFIXES, *JSONL_SUFFIXES, *CSV_SUFFIXES):
        raise DataError(
            f"{uri}: unsupported file type {suffix or '(no suffix)'!r}; expected one of "
            f"{', '.join((*PARQUET_SUFFIXES, *JSONL_SUFFIXES, *CSV_SUFFIXES))} (optionally compressed)"
        )
    return suffix


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow filesystem + path: local paths directly, URIs via pyarrow, else via fsspec if installed."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as arrow_err:
        try:
            import fsspec  # optional: only for schemes pyarrow does not know (memory://, http://, ...)
        except ImportError:
            raise DataError(f"{uri}: pyarrow cannot open this URI ({arrow_err}) and fsspec is not installed") from None
        try:
            fs, path = fsspec.core.url_to_fs(uri)
        except (ValueError, ImportError) as err:
            raise DataError(f"{uri}: no filesystem for this URI (pyarrow: {arrow_err}; fsspec: {err})") from err
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def _read_parquet(uri: str, fs: pafs.FileSystem, path: str) -> SourceFile:
    table = pq.read_table(path, filesystem=fs)
    rows = [SourceRow(uri, i, values) for i, values in enumerate(table.to_pylist())]
    return SourceFile(uri, tuple(table.column_names), rows)


def _parse_json(uri: str, data: bytes) -> SourceFile:
    """JSON Lines (one object per line; blank lines skipped), or one JSON array of objects."""
    if data.lstrip()[:1] == b"[":
        try:
            items = json.loads(data.decode("utf-8"))
        except ValueError as err:
            raise DataError(f"{uri}: not valid JSON ({err}); expected JSON Lines or an array of objects") from err
        rows = [_json_row(uri, i, item) for i, item in enumerate(items)]
    else:
        rows = [_json_line(uri, i, line) for i, line in enumerate(data.split(b"\n")) if line.strip()]
    return SourceFile(uri, _columns(r.values for r in rows), rows)


def _json_line(uri: str, line_number: int, line: bytes) -> SourceRow:
    try:
        text, valid_utf8 = line.decode("utf-8"), True
    except UnicodeDecodeError:
        text, valid_utf8 = line.decode("utf-8", errors="surrogateescape"), False
    try:
        item = json.loads(text)
    except ValueError as err:
        return SourceRow(uri, line_number, None, f"invalid JSON: {err}", text)
    if not valid_utf8 and isinstance(item, dict):
        item = {key: _restore_bytes(value) for key, value in item.items()}
    return _json_row(uri, line_number, item, text)


def _json_row(uri: str, index: int, item: object, raw: str | None = None) -> SourceRow:
    if not isinstance(item, dict):
        raw = json.dumps(item)[:200] if raw is None else raw
        return SourceRow(uri, index, None, f"expected a JSON object, got {type(item).__name__}", raw)
    return SourceRow(uri, index, item)


def _parse_csv(uri: str, data: bytes) -> SourceFile:
    """CSV with a header row; every cell is a string; a row with the wrong field count is malformed."""
    reader = csv.reader(io.StringIO(data.decode("utf-8", errors="surrogateescape"), newline=""))
    try:
        header = next(reader, None)
        if not header:
            raise DataError(f"{uri}: empty CSV; expected a header row such as prompt,chosen,rejected")
        rows = [_csv_row(uri, i, header, fields) for i, fields in enumerate(reader) if fields]
    except csv.Error as err:
        raise DataError(f"{uri}: cannot be parsed as CSV near line {reader.line_num} ({err})") from err
    return SourceFile(uri, tuple(header), rows)


def _csv_row(uri: str, index: int, header: list[str], fields: list[str]) -> SourceRow:
    if len(fields) != len(header):
        reason = f"row has {len(fields)} fields, the header has {len(header)}"
        return SourceRow(uri, index, None, reason, ",".join(fields))
    return SourceRow(uri, index, {name: _restore_bytes(value) for name, value in zip(header, fields)})


def _restore_bytes(value: object) -> object:
    """A string that carries undecodable bytes (as escape surrogates) back to bytes, so validation can
    quarantine it as undecodable_bytes; anything else unchanged."""
    if isinstance(value, str) and any(ord(ch) in _ESCAPED_BYTE for ch in value):
        return value.encode("utf-8", errors="surrogateescape")
    return value


def _columns(records: Iterable[Mapping[str, object] | None]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for record in records:
        seen.update(dict.fromkeys(record or ()))
    return tuple(seen)


def arrow_schema(table: TableSchema) -> pa.Schema:
    """The pyarrow schema of a canonical table (column docs kept as field metadata)."""
    return pa.schema(
        [pa.field(c.name, _ARROW_TYPES[c.dtype], nullable=c.nullable, metadata={"doc": c.doc}) for c in table.columns]
    )


def write_parquet(records: Iterable[Mapping[str, object]], table: TableSchema, path: str | Path) -> str:
    """Write records as a Parquet file with the canonical schema, atomically; returns the path."""
    arrow = pa.Table.from_pylist(list(records), schema=arrow_schema(table))
    for column in table.columns:
        if not column.nullable and arrow.column(column.name).null_count:
            raise ValueError(f"{table.name}.{column.name} is not nullable but has nulls; writing {path}")
    return atomic_write(path, lambda tmp: pq.write_table(arrow, tmp))


def read_parquet(path: str | Path, table: TableSchema) -> list[dict[str, object]]:
    """Records of a canonical Parquet table; DataError if its columns are not the expected ones."""
    arrow = pq.read_table(str(path))
    if tuple(arrow.column_names) != table.names:
        raise DataError(f"{path}: columns {arrow.column_names}, expected {list(table.names)} ({table.name})")
    return arrow.to_pylist()


def write_json(obj: object, path: str | Path) -> str:
    """Write an object as indented JSON, atomically; returns the path."""
    text = json.dumps(obj, indent=2, sort_keys=True)
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text + "\n", encoding="utf-8"))


def atomic_write(path: str | Path, write: Callable[[str], object]) -> str:
    """Run `write(tmp)` on a temp file in the target's directory, then os.replace it onto `path`, so
    readers see the old file or the whole new one, never a partial one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return str(target)


def read_frame(path: str | Path, columns: Sequence[str] = ()) -> pd.DataFrame:
    """A Parquet table as a DataFrame; names the file and the missing columns when ``columns`` are absent."""
    if not Path(path).exists():
        raise FileNotFoundError(f"table {path} does not exist; run the stage that writes it first")
    frame = pd.read_parquet(path)
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"table {path} lacks column(s) {missing}; it has {list(frame.columns)}")
    return frame


def write_frame(frame: pd.DataFrame, path: str | Path) -> str:
    """Write a DataFrame as Parquet atomically (temp file, then rename)."""
    return atomic_write(path, lambda tmp: frame.to_parquet(tmp, index=False))


def atomic_write_dir(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Run ``write(tmp_dir)`` (e.g. ``model.save_pretrained``) in a temp folder beside ``path``, then swap it
    into place: readers see the old folder or the whole new one, never a partial or a missing one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        write(staging)
        if target.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            os.replace(target, retired / target.name)
            os.replace(staging, target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


# --------------------------------------------------------------------------------------------- stage tables


def read_pairs(path: str | Path) -> list[PreferencePair]:
    """The rows of a PREFERENCE_PAIRS Parquet table as PreferencePair (a null or NaN margin becomes None)."""
    from rlhf_core.training.reward_training import PreferencePair  # torch: only the stages that train need it

    if not Path(path).is_file():
        raise FileNotFoundError(f"preference table {path} does not exist; run the data-prep stage first")
    rows = read_parquet(path, PREFERENCE_PAIRS)
    if not rows:
        raise ValueError(f"preference table {path} has no rows; the reward model needs (prompt, chosen, rejected) "
                         "pairs: check the data-prep counts (quarantine, split fractions) or add data")
    return [PreferencePair(str(r["prompt"]), str(r["chosen"]), str(r["rejected"]), optional_margin(r["margin"]))
            for r in rows]


def optional_margin(value: object) -> float | None:
    """A PREFERENCE_PAIRS margin cell as a float, or None for a null or NaN."""
    return None if value is None or math.isnan(float(value)) else float(value)


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """The ``prompt`` column of a Parquet table (its first ``limit`` rows); names the file when it has none."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"prompt table {path} does not exist; run data-prep first")
    columns = pq.read_schema(str(path)).names
    if "prompt" not in columns:
        raise ValueError(f"{path} has columns {columns} but no 'prompt' column")
    prompts = [str(p) for p in pq.read_table(str(path), columns=["prompt"]).column("prompt").to_pylist()]
    return prompts if limit is None else prompts[:limit]
