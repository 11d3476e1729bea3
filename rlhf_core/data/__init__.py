"""Preference data: canonical schemas, validation with reasoned quarantine, dedupe and a stable split.

Pure: works on lists of dict records (no pandas, pyarrow or prefect). Reading files is `tasks/sources.py`'s
job and writing tables `tasks/io.py`'s; the entry point here is `prepare_data`.
"""

from rlhf_core.data.chat import ChatRenderer, render_plain_prompt, render_plain_response
from rlhf_core.data.config import DataPrepConfig
from rlhf_core.data.errors import DataError
from rlhf_core.data.detect import Detection, detect, detect_format
from rlhf_core.data.formats import InputFormat, PairText, split_dialogues
from rlhf_core.data.prep import PrepTables, check_outcome, prepare_data
from rlhf_core.data.reasons import QuarantineReason
from rlhf_core.data.records import Rejection, SourceFile, SourceRow
from rlhf_core.data.report import DataPrepCounts, format_counts
from rlhf_core.data.schema import PPO_PROMPTS, PREFERENCE_PAIRS, QUARANTINE, Column, DType, TableSchema
from rlhf_core.data.split import Split, assign_split, pair_id, prompt_id

__all__ = [
    "PPO_PROMPTS",
    "PREFERENCE_PAIRS",
    "QUARANTINE",
    "ChatRenderer",
    "Column",
    "DType",
    "DataError",
    "DataPrepConfig",
    "DataPrepCounts",
    "Detection",
    "InputFormat",
    "PairText",
    "PrepTables",
    "QuarantineReason",
    "Rejection",
    "SourceFile",
    "SourceRow",
    "Split",
    "TableSchema",
    "assign_split",
    "check_outcome",
    "detect",
    "detect_format",
    "format_counts",
    "pair_id",
    "prepare_data",
    "prompt_id",
    "render_plain_prompt",
    "render_plain_response",
    "split_dialogues",
]
