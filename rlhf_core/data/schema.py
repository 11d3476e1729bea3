"""The canonical tables of the data-prep stage: column names and dtypes, defined once.

`tasks/io.py` turns these into pyarrow schemas; everything else refers to the column-name constants below.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

PROMPT = "prompt"
CHOSEN = "chosen"
REJECTED = "rejected"
MARGIN = "margin"
SOURCE_FILE = "source_file"
SOURCE_ROW = "source_row"
PAIR_ID = "pair_id"
PROMPT_ID = "prompt_id"
COLUMN = "column"
REASON = "reason"
DETAIL = "detail"
RAW = "raw"

ROW_LEVEL = "*"
"""Value of the quarantine `column` field when the whole record (not one column) is bad."""


class DType(str, Enum):
    """Logical column types; `tasks/io.py` maps each to one pyarrow type."""

    STRING = "string"
    FLOAT64 = "float64"
    INT64 = "int64"


@dataclass(frozen=True)
class Column:
    """One column of a canonical table."""

    name: str
    """Column name in the Parquet file."""
    dtype: DType
    """Logical type (see DType)."""
    nullable: bool = False
    """Whether the column may hold nulls."""
    doc: str = ""
    """What the column holds."""


@dataclass(frozen=True)
class TableSchema:
    """An ordered set of columns with a table name."""

    name: str
    """Table name, also the Parquet file stem."""
    columns: tuple[Column, ...]
    """Columns in file order."""

    @property
    def names(self) -> tuple[str, ...]:
        """Column names in file order."""
        return tuple(c.name for c in self.columns)


_S, _F, _I = DType.STRING, DType.FLOAT64, DType.INT64

PREFERENCE_PAIRS = TableSchema(
    "preference_pairs",
    (
        Column(PROMPT, _S, doc="Prompt text, exactly as the policy will see it (chat template applied)."),
        Column(CHOSEN, _S, doc="Preferred response; continues the prompt (usually starts with a space)."),
        Column(REJECTED, _S, doc="Dispreferred response to the same prompt."),
        Column(MARGIN, _F, nullable=True, doc="Optional preference strength for a margin loss; null if absent."),
        Column(SOURCE_FILE, _S, doc="Input file (path or URI as given) the row came from."),
        Column(SOURCE_ROW, _I, doc="0-based row in that file (JSONL: line number)."),
        Column(PAIR_ID, _S, doc="Stable hash of prompt + chosen + rejected."),
    ),
)

PPO_PROMPTS = TableSchema(
    "ppo_prompts",
    (
        Column(PROMPT, _S, doc="Prompt text for PPO rollouts."),
        Column(PROMPT_ID, _S, doc="Stable hash of the prompt (also decides its split)."),
    ),
)

QUARANTINE = TableSchema(
    "quarantine",
    (
        Column(SOURCE_FILE, _S, doc="Input file the rejected row came from."),
        Column(SOURCE_ROW, _I, doc="0-based row in that file (JSONL: line number)."),
        Column(COLUMN, _S, doc="Offending column, or '*' when the whole record is bad."),
        Column(REASON, _S, doc="QuarantineReason code."),
        Column(DETAIL, _S, doc="Human message with specifics (lengths, the earlier duplicate...)."),
        Column(RAW, _S, doc="Escaped excerpt of the offending value (repr, at most 200 characters)."),
    ),
)
