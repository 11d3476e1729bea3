"""The human labelling round-trip of rm-refresh: export unlabelled reply pairs, import the labels back.

How to label an exported file (``unlabelled_pairs.csv`` opens in any spreadsheet; ``.parquet`` in pandas):

1. Each row is one prompt with two replies, ``reply_a`` and ``reply_b``.
2. Write ``a`` in the ``label`` column when ``reply_a`` is the better reply, ``b`` when ``reply_b`` is. Case and
   surrounding spaces do not matter; nothing else is accepted (not 1/2, not 0/1, not "A is better"), so a
   shifted column or a 0/1 mix-up is quarantined instead of silently flipping labels.
3. Leave ``label`` empty to skip a pair: it is quarantined as ``missing_label`` and not used. Deleting the row
   works too; the import counts exported pairs that did not come back.
4. Never edit ``pair_id``: it ties a label to the exact texts that were exported. Edits to the text columns
   are ignored (labels always apply to the exported texts), and extra columns (notes) are fine.
5. Save as CSV or Parquet under any name and rerun with ``refresh.labels_file=<that file>``.

Every labelled row ends up either as a preference pair or in the quarantine table (schema
``rlhf_core.data.QUARANTINE``) with its row number, column and reason: ``rows_in == accepted + quarantined``.
Accepted labels then pass the same validation as any preference data (``rlhf_core.data``: empty or
identical replies, control characters, length limit, duplicates).
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core.data import DataError, DataPrepConfig, InputFormat, SourceFile, SourceRow
from rlhf_core.data.chat import ChatRenderer
from rlhf_core.data.prep import PrepContext, collect_pairs
from rlhf_core.data.records import excerpt
from rlhf_core.data.schema import (CHOSEN, COLUMN, DETAIL, MARGIN, PROMPT, RAW, REASON, REJECTED, ROW_LEVEL,
                                   SOURCE_FILE, SOURCE_ROW)
from rlhf_core.data.text import make_measure
from rlhf_core.evaluation.annotators import ReplyPair
from rlhf_core.data.records import PreferencePair
from tasks.io import CSV_SUFFIXES, PARQUET_SUFFIXES, atomic_write, optional_margin, read_source

PAIR_ID, REPLY_A, REPLY_B, LABEL = "pair_id", "reply_a", "reply_b", "label"
EXPORT_COLUMNS = (PAIR_ID, PROMPT, REPLY_A, REPLY_B, LABEL)
LABELS = {"a": True, "b": False}
"""Accepted label values (after strip + lower) -> whether reply_a is preferred."""

Record = dict[str, object]


class LabelReason(str, Enum):
    """Quarantine reasons of the label import (the data-validation reasons are ``QuarantineReason``)."""

    MALFORMED_ROW = "malformed_record"
    MISSING_PAIR_ID = "missing_pair_id"
    UNKNOWN_PAIR_ID = "unknown_pair_id"
    MISSING_LABEL = "missing_label"
    BAD_LABEL = "bad_label"
    DUPLICATE_LABEL = "duplicate_label"

    @property
    def message(self) -> str:
        """What is wrong with the row and how to fix it."""
        return _MESSAGES[self]


_MESSAGES = {
    LabelReason.MALFORMED_ROW: "the row could not be parsed (a CSV row with the wrong number of fields?)",
    LabelReason.MISSING_PAIR_ID: "pair_id is empty; keep the pair_id column exactly as exported",
    LabelReason.UNKNOWN_PAIR_ID: "pair_id is not one of the exported pairs (edited, or from another export)",
    LabelReason.MISSING_LABEL: "no label: write 'a' or 'b' (empty = pair skipped)",
    LabelReason.BAD_LABEL: "label must be 'a' (reply_a is better) or 'b' (reply_b is better)",
    LabelReason.DUPLICATE_LABEL: "this pair_id was already labelled in an earlier row; the first label is kept",
}


@dataclass(frozen=True)
class ImportedLabels:
    """What came back from the labellers: valid preference pairs and the reasoned rejects."""

    pairs: list[PreferencePair]
    """Accepted pairs (labels applied to the exported texts), in file order."""
    records: list[Record]
    """The same pairs as ``rlhf_core.data.PREFERENCE_PAIRS`` rows (source_file = the labels file)."""
    quarantine: list[Record]
    """Rejected rows (``rlhf_core.data.QUARANTINE`` schema): label problems first, then data-validation ones."""
    rows_in: int
    """Rows read from the labels file: ``rows_in == len(pairs) + len(quarantine)``."""
    n_exported: int
    """Pairs in the exported file."""
    n_not_returned: int
    """Exported pairs with no row at all in the labels file."""

    def counts(self) -> dict[str, float]:
        """``labels/rows_in``, ``labels/accepted``, ``labels/quarantined``, ``labels/quarantined/<reason>``..."""
        by_reason = Counter(str(q[REASON]) for q in self.quarantine)
        return {"labels/rows_in": float(self.rows_in), "labels/accepted": float(len(self.pairs)),
                "labels/quarantined": float(len(self.quarantine)), "labels/exported": float(self.n_exported),
                "labels/not_returned": float(self.n_not_returned),
                **{f"labels/quarantined/{reason}": float(n) for reason, n in sorted(by_reason.items())}}


# --------------------------------------------------------------------------------------------- export


def export_unlabelled(pairs: Sequence[ReplyPair], path: str | Path) -> str:
    """Write pairs for labelling (columns ``pair_id, prompt, reply_a, reply_b, label``; label empty) as CSV or
    Parquet by ``path``'s suffix, atomically. Returns the path. See the module docstring for the instructions."""
    suffix = Path(path).suffix.lower()
    if suffix not in (*CSV_SUFFIXES, *PARQUET_SUFFIXES):
        raise ValueError(f"cannot export labelling pairs to {path}: use a .csv or .parquet file name")
    ids = Counter(p.pair_id for p in pairs)
    repeated = [i for i, n in ids.items() if n > 1]
    if repeated:
        raise ValueError(f"{len(repeated)} pairs are exported twice (pair_id {repeated[0]}); drop exact duplicates "
                         "first so every label maps to one pair")
    rows = [{PAIR_ID: p.pair_id, PROMPT: p.prompt, REPLY_A: p.reply_a, REPLY_B: p.reply_b, LABEL: None} for p in pairs]
    if suffix in CSV_SUFFIXES:
        return atomic_write(path, lambda tmp: _write_csv(rows, tmp))
    schema = pa.schema([pa.field(name, pa.string()) for name in EXPORT_COLUMNS])
    table = pa.Table.from_pylist(rows, schema=schema)
    return atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def _write_csv(rows: Sequence[Mapping[str, object]], path: str) -> None:
    with open(path, "w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=EXPORT_COLUMNS)
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in rows)


# --------------------------------------------------------------------------------------------- import


def import_labels(path: str, exported_path: str, prep: DataPrepConfig | None = None) -> ImportedLabels:
    """Labelled rows of ``path`` applied to the pairs exported to ``exported_path``, checked row by row.

    Raises FileNotFoundError when either file is missing and DataError when a needed column is absent;
    every row-level problem is quarantined with a reason instead. ``prep`` sets the data validation
    (``data.prep``: max_length...); None = the defaults.
    """
    exported = _exported_pairs(exported_path)
    labels = _read(path, (PAIR_ID, LABEL), f"the labels file (a labelled copy of {exported_path})")
    accepted_rows, quarantine, first_row = [], [], {}
    for row in labels.rows:
        verdict = _check_row(row, exported, first_row)
        if isinstance(verdict, dict):
            quarantine.append(verdict)
            continue
        pair, prefers_a = verdict
        first_row[pair.pair_id] = row.source_row
        chosen, rejected = (pair.reply_a, pair.reply_b) if prefers_a else (pair.reply_b, pair.reply_a)
        accepted_rows.append(SourceRow(path, row.source_row, {PROMPT: pair.prompt, CHOSEN: chosen, REJECTED: rejected}))
    records, rejected_rows = validate_preferences(path, accepted_rows, prep)
    returned = {str(row.values.get(PAIR_ID)).strip() for row in labels.rows if row.values is not None}
    result = ImportedLabels(to_pairs(records), records, quarantine + rejected_rows, len(labels.rows), len(exported),
                            sum(1 for pid in exported if pid not in returned))
    assert result.rows_in == len(result.pairs) + len(result.quarantine), "label import counts do not reconcile"
    return result


def _exported_pairs(exported_path: str) -> dict[str, ReplyPair]:
    """pair_id -> pair of the exported file (written by export_unlabelled, so it is trusted)."""
    source = _read(exported_path, EXPORT_COLUMNS[:-1], "the exported pairs file (written by rm-refresh)")
    return {str(r.values[PAIR_ID]): ReplyPair(str(r.values[PROMPT]), str(r.values[REPLY_A]), str(r.values[REPLY_B]))
            for r in source.rows if r.values is not None}


def _read(path: str, columns: Sequence[str], what: str) -> SourceFile:
    if "://" not in path and not Path(path).is_file():
        raise FileNotFoundError(f"{what} {path} does not exist; check refresh.labels_file, or rerun rm-refresh "
                                "without it to export the pairs to label")
    source = read_source(path)
    missing = [c for c in columns if c not in source.columns]
    if missing:
        raise DataError(f"{path}: {what} lacks column(s) {missing}; found {list(source.columns)}. Keep the exported "
                        f"columns {list(EXPORT_COLUMNS)} and fill in '{LABEL}'")
    return source


def _check_row(row: SourceRow, exported: Mapping[str, ReplyPair],
               first_row: Mapping[str, int]) -> tuple[ReplyPair, bool] | Record:
    """(exported pair, prefers_a) for a good row, else its quarantine record; the first failing check wins."""
    if row.values is None:
        return _reject(row, LabelReason.MALFORMED_ROW, ROW_LEVEL, row.raw, row.parse_error)
    pid = row.values.get(PAIR_ID)
    if _blank(pid):
        return _reject(row, LabelReason.MISSING_PAIR_ID, PAIR_ID, pid)
    pid = str(pid).strip()
    if pid not in exported:
        return _reject(row, LabelReason.UNKNOWN_PAIR_ID, PAIR_ID, pid)
    label = row.values.get(LABEL)
    if _blank(label):
        return _reject(row, LabelReason.MISSING_LABEL, LABEL, label)
    if not isinstance(label, str) or label.strip().lower() not in LABELS:
        return _reject(row, LabelReason.BAD_LABEL, LABEL, label)
    if pid in first_row:
        return _reject(row, LabelReason.DUPLICATE_LABEL, PAIR_ID, pid, f"first labelled at row {first_row[pid]}")
    return exported[pid], LABELS[label.strip().lower()]


def _blank(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or (isinstance(value, str)
                                                                                and not value.strip())


def _reject(row: SourceRow, reason: LabelReason, column: str, value: object, detail: str = "") -> Record:
    return {SOURCE_FILE: row.source_file, SOURCE_ROW: row.source_row, COLUMN: column, REASON: reason.value,
            DETAIL: reason.message + (f" ({detail})" if detail else ""), RAW: excerpt(value)}


# --------------------------------------------------------------------------------------------- validation


def validate_preferences(source: str, rows: Sequence[SourceRow],
                         prep: DataPrepConfig | None = None) -> tuple[list[Record], list[Record]]:
    """(PREFERENCE_PAIRS records, QUARANTINE records) of labelled ``prompt/chosen/rejected`` rows, checked by
    the data-prep validation (``rlhf_core.data``) exactly as user preference files are."""
    if not rows:
        return [], []
    config = prep or DataPrepConfig()
    context = PrepContext(config, ChatRenderer(None), make_measure(None))
    file = SourceFile(source, (PROMPT, CHOSEN, REJECTED), list(rows))
    return collect_pairs([file], {source: InputFormat.TRL}, context)


def preference_rows(source: str, pairs: Sequence[PreferencePair]) -> list[SourceRow]:
    """Source rows (row = index) of judged pairs, for :func:`validate_preferences`."""
    return [SourceRow(source, i, {PROMPT: p.prompt, CHOSEN: p.chosen, REJECTED: p.rejected})
            for i, p in enumerate(pairs)]


def to_pairs(records: Sequence[Mapping[str, object]]) -> list[PreferencePair]:
    """PreferencePair of each PREFERENCE_PAIRS record (margin: a NaN or null becomes None)."""
    return [PreferencePair(str(r[PROMPT]), str(r[CHOSEN]), str(r[REJECTED]), optional_margin(r.get(MARGIN)))
            for r in records]
