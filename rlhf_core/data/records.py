"""Plain record types: what the reader (tasks/sources.py) passes to the pure data-prep logic, and the preference
pairs the reward model, DPO and the annotators work on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rlhf_core.data.reasons import QuarantineReason
from rlhf_core.data.schema import COLUMN, DETAIL, RAW, REASON, SOURCE_FILE, SOURCE_ROW

EXCERPT_CHARS = 200
"""Longest `raw` excerpt kept in the quarantine table."""


@dataclass(frozen=True)
class SourceRow:
    """One record as read from an input file, before any validation."""

    source_file: str
    """Path or URI of the file, as the user gave it."""
    source_row: int
    """0-based row index (JSONL: line number, so blank lines leave gaps)."""
    values: Mapping[str, object] | None
    """Column -> value; None when the record itself could not be parsed (see `parse_error`)."""
    parse_error: str = ""
    """Why the record could not be parsed (e.g. the JSON error); empty for parsed records."""
    raw: str = ""
    """The unparsed text of a record that could not be parsed."""


@dataclass(frozen=True)
class SourceFile:
    """All records of one input file plus the columns it declares."""

    path: str
    """Path or URI, as the user gave it."""
    columns: tuple[str, ...]
    """Columns found: Parquet schema, CSV header, or the union of JSONL keys, in first-seen order."""
    rows: Sequence[SourceRow]
    """Records in file order."""


@dataclass(frozen=True)
class Rejection:
    """Why one input row is not usable; becomes one quarantine-table row."""

    reason: QuarantineReason
    """Reason code."""
    column: str
    """Offending column, or '*' for the whole record."""
    value: object = None
    """The offending value (only an escaped excerpt is stored)."""
    detail: str = ""
    """Specifics appended to the reason's message (lengths, earlier duplicate row...)."""

    def to_record(self, source_file: str, source_row: int) -> dict[str, object]:
        """The quarantine-table row for this rejection (see schema.QUARANTINE)."""
        message = self.reason.message + (f" ({self.detail})" if self.detail else "")
        return {
            SOURCE_FILE: source_file,
            SOURCE_ROW: source_row,
            COLUMN: self.column,
            REASON: self.reason.value,
            DETAIL: message,
            RAW: excerpt(self.value),
        }


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """A printable, valid-UTF-8 excerpt of any value: control characters and surrogates are escaped."""
    if value is None:
        return ""
    if isinstance(value, str):
        text = "".join(ch if ch.isprintable() or ch == " " else _escape_char(ch) for ch in value)
    else:
        try:
            text = repr(value)  # repr escapes non-printable characters inside containers too
        except (RecursionError, ValueError):  # nested about as deep as JSON allows, or an int over 4300 digits
            text = f"<{type(value).__name__} too deeply nested or too large to show>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _escape_char(ch: str) -> str:
    return repr(ch)[1:-1] if ch not in "\n\t" else {"\n": "\\n", "\t": "\\t"}[ch]


@dataclass(frozen=True)
class PreferencePair:
    """One human (or simulated) judgement: ``chosen`` was preferred to ``rejected`` for ``prompt``."""

    prompt: str
    chosen: str
    rejected: str
    margin: float | None = None
