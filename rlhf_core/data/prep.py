"""The pure data-prep pipeline: records in -> validated, deduplicated, split tables (lists of dicts) out.

Every input row ends up in exactly one place: a canonical pair (train / held-out / PPO split) or the
quarantine table. Checks run in a fixed order and the first failure is the row's reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlhf_core.data.chat import ChatRenderer, check_messages
from rlhf_core.data.config import DataPrepConfig
from rlhf_core.data.errors import DataError
from rlhf_core.data.detect import Detection, detect
from rlhf_core.data.formats import InputFormat, record_to_text
from rlhf_core.data.reasons import QuarantineReason as R
from rlhf_core.data.records import Rejection, SourceFile, SourceRow
from rlhf_core.data.report import DataPrepCounts
from rlhf_core.data.schema import (CHOSEN, MARGIN, PAIR_ID, PROMPT, PROMPT_ID, REASON, REJECTED, ROW_LEVEL,
                                   SOURCE_FILE, SOURCE_ROW)
from rlhf_core.data.split import Split, assign_split, pair_id, prompt_id
from rlhf_core.data.text import (Measure, check_chars, check_length, check_margin, check_prompt_length, check_string,
                                 check_text, make_measure)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Record = dict[str, object]

MAX_QUARANTINE_FRACTION_KEY = "data.prep.max_quarantine_fraction"
"""Config key of DataPrepConfig.max_quarantine_fraction (`rlhf prep --max-quarantine-fraction` sets it)."""


@dataclass(frozen=True)
class PrepTables:
    """The stage's output tables (rows follow rlhf_core.data.schema) and their counts."""

    train_pairs: list[Record]
    """Reward-model training pairs (schema.PREFERENCE_PAIRS)."""
    heldout_pairs: list[Record]
    """Held-out pairs (schema.PREFERENCE_PAIRS)."""
    ppo_prompts: list[Record]
    """PPO prompts (schema.PPO_PROMPTS)."""
    quarantine: list[Record]
    """Rejected rows with reasons (schema.QUARANTINE)."""
    counts: DataPrepCounts
    """Reconciled counts."""


@dataclass(frozen=True)
class PrepContext:
    """What every row check needs: the settings, the chat renderer and the length measure."""

    config: DataPrepConfig
    renderer: ChatRenderer
    measure: Measure


def prepare_data(
    files: Sequence[SourceFile],
    config: DataPrepConfig,
    tokenizer: PreTrainedTokenizerBase | None = None,
    prompt_files: Sequence[SourceFile] = (),
) -> PrepTables:
    """Validate, dedupe and split preference records; PPO prompts come from `prompt_files` if any given,
    else from the PPO split. Raises DataError for files without the needed columns or with no rows.

    With input_format AUTO each file's format is its rows' majority, and a row laid out as another format is
    quarantined as format_mismatch (see rlhf_core.data.detect)."""
    ctx = PrepContext(config, ChatRenderer(tokenizer), make_measure(tokenizer))
    detections = {f.path: detect(f, config.input_format) for f in files}
    formats = {path: d.format for path, d in detections.items()}
    rows_in = sum(len(f.rows) for f in files)
    if rows_in == 0:
        raise DataError(f"no rows in {[f.path for f in files]}: expected at least one preference pair")
    pairs, quarantine = collect_pairs(files, formats, ctx, detections)
    splits = split_pairs(pairs, config, ppo_from_pairs=not prompt_files)
    if prompt_files:
        prompts, prompt_quarantine = collect_prompts(prompt_files, ctx)
    else:
        prompts, prompt_quarantine = distinct_prompts(splits[Split.PPO]), []
    counts = DataPrepCounts(
        rows_in=rows_in, rows_accepted=len(pairs), rows_quarantined=len(quarantine),
        train_pairs=len(splits[Split.TRAIN]), heldout_pairs=len(splits[Split.HELDOUT]),
        ppo_split_pairs=len(splits[Split.PPO]), ppo_prompts=len(prompts),
        quarantined_by_reason=dict(Counter(str(q[REASON]) for q in (*quarantine, *prompt_quarantine))),
        prompt_rows_in=sum(len(f.rows) for f in prompt_files), prompt_rows_accepted=len(prompts) if prompt_files else 0,
        prompt_rows_quarantined=len(prompt_quarantine), formats={p: f.value for p, f in formats.items()},
        length_unit=ctx.measure.unit, max_length=config.max_length, max_prompt_length=config.max_prompt_length,
        max_chars=config.max_chars,
    )
    return PrepTables(splits[Split.TRAIN], splits[Split.HELDOUT], prompts, quarantine + prompt_quarantine, counts)


def collect_pairs(
    files: Sequence[SourceFile], formats: Mapping[str, InputFormat], ctx: PrepContext,
    detections: Mapping[str, Detection] | None = None,
) -> tuple[list[Record], list[Record]]:
    """Canonical pairs and quarantine rows, in input order; later exact duplicates are quarantined, and so are rows
    laid out as another format than their file's detected one (`detections`; none given = no such check)."""
    pairs: list[Record] = []
    quarantine: list[Record] = []
    first_seen: dict[tuple[object, object, object], str] = {}
    for source in files:
        detection = (detections or {}).get(source.path)
        for row in source.rows:
            odd = detection.odd_row(row.values) if detection is not None else None
            result = odd or validate_row(row, formats[source.path], ctx)
            if isinstance(result, dict):
                key = (result[PROMPT], result[CHOSEN], result[REJECTED])
                if key in first_seen:
                    result = Rejection(R.DUPLICATE_PAIR, ROW_LEVEL, result[CHOSEN], f"first seen at {first_seen[key]}")
                else:
                    first_seen[key] = f"{row.source_file} row {row.source_row}"
            if isinstance(result, Rejection):
                quarantine.append(result.to_record(row.source_file, row.source_row))
            else:
                pairs.append(result)
    return pairs, quarantine


def validate_row(row: SourceRow, fmt: InputFormat, ctx: PrepContext) -> Record | Rejection:
    """One canonical pair record (schema.PREFERENCE_PAIRS) from a source row, or the first reason it fails."""
    if row.values is None:
        return Rejection(R.MALFORMED_RECORD, ROW_LEVEL, row.raw, row.parse_error)
    text = record_to_text(row.values, fmt, ctx.renderer)
    if isinstance(text, Rejection):
        return text
    too_many_chars = check_chars(*text, ctx.config.max_chars)
    if too_many_chars is not None:
        return too_many_chars
    for column, value in zip((PROMPT, CHOSEN, REJECTED), text):
        checked = check_string(value, column)
        if isinstance(checked, Rejection):
            return checked
    if text.chosen.strip() == text.rejected.strip():
        return Rejection(R.IDENTICAL_PAIR, REJECTED, text.rejected)
    margin = check_margin(row.values.get(MARGIN), MARGIN)
    if isinstance(margin, Rejection):
        return margin
    too_long = (check_prompt_length(text.prompt, ctx.config.max_prompt_length, ctx.measure)
                or check_length(*text, ctx.config.max_length, ctx.measure))
    if too_long is not None:
        return too_long
    return {
        PROMPT: text.prompt, CHOSEN: text.chosen, REJECTED: text.rejected, MARGIN: margin,
        SOURCE_FILE: row.source_file, SOURCE_ROW: row.source_row, PAIR_ID: pair_id(*text),
    }


def split_pairs(pairs: Iterable[Record], config: DataPrepConfig, ppo_from_pairs: bool) -> dict[Split, list[Record]]:
    """Pairs by split of their prompt (so one prompt never lands in two splits); input order kept."""
    splits: dict[Split, list[Record]] = {s: [] for s in Split}
    for pair in pairs:
        splits[assign_split(str(pair[PROMPT]), config, ppo_from_pairs)].append(pair)
    return splits


def distinct_prompts(pairs: Iterable[Record]) -> list[Record]:
    """PPO prompt records (schema.PPO_PROMPTS) for the distinct prompts of `pairs`, first-seen order."""
    seen: dict[str, Record] = {}
    for pair in pairs:
        prompt = str(pair[PROMPT])
        seen.setdefault(prompt, {PROMPT: prompt, PROMPT_ID: prompt_id(prompt)})
    return list(seen.values())


def collect_prompts(files: Sequence[SourceFile], ctx: PrepContext) -> tuple[list[Record], list[Record]]:
    """PPO prompt records from prompts files (`prompt` column: text or chat messages) and their quarantine."""
    prompts: list[Record] = []
    quarantine: list[Record] = []
    first_seen: dict[str, str] = {}
    for source in files:
        if PROMPT not in source.columns:
            found = list(source.columns)
            raise DataError(f"{source.path}: prompts file needs a 'prompt' column; found columns {found}")
        for row in source.rows:
            result = _validate_prompt(row, ctx)
            if isinstance(result, str) and result in first_seen:
                result = Rejection(R.DUPLICATE_PROMPT, PROMPT, result, f"first seen at {first_seen[result]}")
            if isinstance(result, Rejection):
                quarantine.append(result.to_record(row.source_file, row.source_row))
                continue
            first_seen[result] = f"{row.source_file} row {row.source_row}"
            prompts.append({PROMPT: result, PROMPT_ID: prompt_id(result)})
    return prompts, quarantine


def _validate_prompt(row: SourceRow, ctx: PrepContext) -> str | Rejection:
    if row.values is None:
        return Rejection(R.MALFORMED_RECORD, ROW_LEVEL, row.raw, row.parse_error)
    value = row.values.get(PROMPT)
    if isinstance(value, (list, tuple)):
        messages = check_messages(value, PROMPT)
        if isinstance(messages, Rejection):
            return messages
        value = ctx.renderer.prompt(messages) if messages else None
    text = check_text(value, PROMPT)
    if isinstance(text, Rejection):
        return text
    cap = ctx.config.max_chars
    if cap is not None and len(text) > cap:
        return Rejection(R.FIELD_TOO_LONG, PROMPT, text, f"prompt is {len(text)} characters > {cap}")
    too_long = check_prompt_length(text, ctx.config.max_prompt_length, ctx.measure)
    if too_long is not None:
        return too_long
    limit = ctx.config.max_length
    if limit is not None and (length := ctx.measure(text)) > limit:
        return Rejection(R.TOO_LONG, PROMPT, text, f"prompt is {length} {ctx.measure.unit} > max_length {limit}")
    return text


def check_outcome(counts: DataPrepCounts, max_quarantine_fraction: float, quarantine_path: str) -> None:
    """Raise DataError when too many rows were quarantined, or no training pair is left."""
    fraction = counts.quarantine_fraction
    if fraction > max_quarantine_fraction:
        raise DataError(
            f"quarantined fraction {fraction:.3f} exceeds max_quarantine_fraction {max_quarantine_fraction:.3f} "
            f"({counts.rows_quarantined + counts.prompt_rows_quarantined} of "
            f"{counts.rows_in + counts.prompt_rows_in} rows); see reasons in {quarantine_path}; fix those rows, "
            f"or allow more with `rlhf prep --max-quarantine-fraction F` (config key {MAX_QUARANTINE_FRACTION_KEY})"
        )
    if counts.train_pairs == 0:
        raise DataError(
            f"no reward-model training pairs left ({counts.rows_accepted} accepted of {counts.rows_in}); "
            f"add data or raise train_fraction; rejected rows are in {quarantine_path}"
        )
