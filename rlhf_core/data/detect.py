"""Which format a file is in, decided by its rows' majority, so one odd row cannot flip the whole file.

Each row says on its own which format it looks like (`row_format`); the file takes the format most of its rows
agree on. A row that looks like another format than its file's is quarantined as format_mismatch, while the
rest of the file is read as it should be. A forced format (`--format`) skips the vote and the mismatch check:
every row is read in that format and fails its checks if it does not fit.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from rlhf_core.data.errors import DataError
from rlhf_core.data.formats import InputFormat
from rlhf_core.data.reasons import QuarantineReason as R
from rlhf_core.data.records import Rejection, SourceFile
from rlhf_core.data.schema import CHOSEN, PROMPT, REJECTED

EXPECTED_COLUMNS = (
    "TRL (prompt, chosen, rejected text [, margin]), HH (chosen, rejected dialogues) "
    "or chat (chosen, rejected [, prompt] as lists of {role, content})"
)


@dataclass(frozen=True)
class Detection:
    """A file's format and, when it was detected rather than forced, how many rows looked like each format."""

    format: InputFormat
    """The format every row of the file is read in (never AUTO)."""
    votes: Mapping[InputFormat, int] = field(default_factory=dict)
    """Rows that looked like each format; empty when the format was forced."""

    def odd_row(self, values: Mapping[str, object] | None) -> Rejection | None:
        """FORMAT_MISMATCH when the format was detected and this row looks like chat in a text file, or has a
        prompt in an HH file; None otherwise (a text row in a chat file fails the chat checks on its own)."""
        own = row_format(values) if self.votes and values is not None else None
        if own is None or own is self.format or self.format is InputFormat.CHAT:
            return None
        if own is InputFormat.HH:  # a TRL row without its prompt: missing_value says it better
            return None
        agreeing, total = self.votes.get(self.format, 0), sum(self.votes.values())
        column = PROMPT if own is InputFormat.TRL else CHOSEN if _is_list(values.get(CHOSEN)) else REJECTED
        hint = "has a prompt" if own is InputFormat.TRL else f"{column} is a list of chat messages"
        detail = (f"{hint}, so it looks like {own.value}, but the file reads as {self.format.value} "
                  f"({agreeing} of {total} rows that show a format)")
        return Rejection(R.FORMAT_MISMATCH, column, values.get(column), detail)


def row_format(values: Mapping[str, object]) -> InputFormat | None:
    """The format one record looks like on its own: CHAT when `chosen` or `rejected` is a list, TRL when they are
    text and a prompt is given, HH when they are text without one; None when they are neither (nulls, numbers)."""
    responses = (values.get(CHOSEN), values.get(REJECTED))
    if any(_is_list(v) for v in responses):
        return InputFormat.CHAT
    if not any(isinstance(v, (str, bytes)) for v in responses):
        return None
    return InputFormat.HH if _absent(values.get(PROMPT)) else InputFormat.TRL


def detect(source: SourceFile, forced: InputFormat = InputFormat.AUTO) -> Detection:
    """The file's format: `forced` unless AUTO; else chat when more rows look like chat than like text, else TRL
    when the file has a `prompt` column and at least as many text rows have a prompt as lack one, else HH.

    Raises DataError when the needed columns are absent (saying so when no record could be parsed at all).
    """
    _check_columns(source, forced)
    if forced is not InputFormat.AUTO:
        return Detection(forced)
    votes = Counter(f for r in source.rows if r.values is not None and (f := row_format(r.values)) is not None)
    text = votes[InputFormat.TRL] + votes[InputFormat.HH]
    if votes[InputFormat.CHAT] > text:
        fmt = InputFormat.CHAT
    elif PROMPT in source.columns and votes[InputFormat.TRL] >= votes[InputFormat.HH]:
        fmt = InputFormat.TRL
    else:
        fmt = InputFormat.HH
    return Detection(fmt, {f: votes[f] for f in InputFormat if f is not InputFormat.AUTO})


def detect_format(source: SourceFile, forced: InputFormat = InputFormat.AUTO) -> InputFormat:
    """The file's format (see `detect`). Raises DataError when the needed columns are absent."""
    return detect(source, forced).format


def _check_columns(source: SourceFile, forced: InputFormat) -> None:
    found = list(source.columns)
    missing = [c for c in (CHOSEN, REJECTED) if c not in found]
    if missing and not source.rows:
        raise DataError(f"{source.path}: has no records; expected {EXPECTED_COLUMNS}")
    if missing and all(r.values is None for r in source.rows):
        first = source.rows[0]
        raise DataError(f"{source.path}: none of its {len(source.rows)} records could be parsed (row "
                        f"{first.source_row}: {first.parse_error}); expected {EXPECTED_COLUMNS}")
    if missing:
        raise DataError(f"{source.path}: found columns {found}, missing {missing}; expected {EXPECTED_COLUMNS}")
    if forced is InputFormat.TRL and PROMPT not in found:
        raise DataError(f"{source.path}: format 'trl' needs a 'prompt' column; found columns {found}")


def _is_list(value: object) -> bool:
    return isinstance(value, (list, tuple))


def _absent(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))
