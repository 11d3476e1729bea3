"""File I/O for the stages: write canonical tables as Parquet atomically (temp file in the same dir + os.replace)
and read them back.

Reading user preference/prompt files (Parquet, JSONL, CSV; local paths or URIs) lives in ``tasks.sources``;
``read_source`` and the suffix tuples are re-exported here for the stages that import them from this module.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core.data import PREFERENCE_PAIRS, DataError, DType, TableSchema
from rlhf_core.data.records import PreferencePair
from tasks.sources import (COMPRESSION_SUFFIXES, CSV_SUFFIXES, JSONL_SUFFIXES, PARQUET_SUFFIXES,  # noqa: F401
                           read_source)

_ARROW_TYPES = {DType.STRING: pa.string(), DType.FLOAT64: pa.float64(), DType.INT64: pa.int64()}


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
