"""The data-prep stage: read preference files, validate / dedupe / split them in rlhf_core.data, write Parquet.

`run_data_prep` is the plain function (used by the CLI and tests); `data_prep_task` wraps it for Prefect.
The returned DataPrepResult carries the counts (`counts.as_metrics()`): the seam for MLflow logging.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prefect import task

from rlhf_core.data import (PPO_PROMPTS, PREFERENCE_PAIRS, QUARANTINE, DataError, DataPrepConfig, DataPrepCounts,
                            check_outcome, format_counts, prepare_data)
from tasks.io import read_source, write_json, write_parquet
from tasks.retries import retry_on_transient_io

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TRAIN_FILE = "train_pairs.parquet"
HELDOUT_FILE = "heldout_pairs.parquet"
PPO_PROMPTS_FILE = "ppo_prompts.parquet"
QUARANTINE_FILE = "quarantine.parquet"
COUNTS_FILE = "data_prep_counts.json"


@dataclass(frozen=True)
class DataPrepResult:
    """Where the stage wrote its tables, and the reconciled counts."""

    train_pairs: str
    """Reward-model training pairs (schema.PREFERENCE_PAIRS)."""
    heldout_pairs: str
    """Held-out pairs (schema.PREFERENCE_PAIRS)."""
    ppo_prompts: str
    """PPO prompts (schema.PPO_PROMPTS)."""
    quarantine: str
    """Rejected rows with reasons (schema.QUARANTINE)."""
    counts_json: str
    """The counts as JSON."""
    counts: DataPrepCounts
    """Rows in / accepted / quarantined (by reason) / split sizes."""

    def paths(self) -> dict[str, str]:
        """Output name -> path."""
        return {k: v for k, v in asdict(self).items() if k != "counts"}

    def summary(self) -> str:
        """Counts table followed by the output paths."""
        return format_counts(self.counts) + "\n" + "\n".join(f"{k:<14} {v}" for k, v in self.paths().items())


def run_data_prep(
    inputs: str | Sequence[str],
    out_dir: str | Path,
    config: DataPrepConfig | None = None,
    prompts_file: str | None = None,
    tokenizer: PreTrainedTokenizerBase | str | None = None,
) -> DataPrepResult:
    """Read `inputs` (Parquet / JSONL / CSV paths or URIs), prepare them, write the tables under `out_dir`.

    `tokenizer` (object, or name/path for AutoTokenizer) switches max_length to tokens and renders chat
    data with its chat template. The quarantine table is written first, so a DataError for too many bad
    rows can point at it; the other tables (and stale ones from an earlier run) exist only after success.
    """
    config = config or DataPrepConfig()
    sources = [read_source(uri) for uri in ([inputs] if isinstance(inputs, str) else inputs)]
    prompt_sources = [read_source(prompts_file)] if prompts_file else []
    tables = prepare_data(sources, config, _load_tokenizer(tokenizer), prompt_sources)
    out = Path(out_dir)
    _remove_stale_outputs(out)
    quarantine = write_parquet(tables.quarantine, QUARANTINE, out / QUARANTINE_FILE)
    check_outcome(tables.counts, config.max_quarantine_fraction, quarantine)
    counts_json = {**asdict(tables.counts), "quarantine_fraction": tables.counts.quarantine_fraction}
    return DataPrepResult(
        train_pairs=write_parquet(tables.train_pairs, PREFERENCE_PAIRS, out / TRAIN_FILE),
        heldout_pairs=write_parquet(tables.heldout_pairs, PREFERENCE_PAIRS, out / HELDOUT_FILE),
        ppo_prompts=write_parquet(tables.ppo_prompts, PPO_PROMPTS, out / PPO_PROMPTS_FILE),
        quarantine=quarantine,
        counts_json=write_json(counts_json, out / COUNTS_FILE),
        counts=tables.counts,
    )


def _remove_stale_outputs(out: Path) -> None:
    """Delete this stage's tables from an earlier run, so a failed run cannot leave a stale mix behind."""
    for name in (TRAIN_FILE, HELDOUT_FILE, PPO_PROMPTS_FILE, COUNTS_FILE):
        (out / name).unlink(missing_ok=True)


def _load_tokenizer(tokenizer: PreTrainedTokenizerBase | str | None) -> PreTrainedTokenizerBase | None:
    if not isinstance(tokenizer, str):
        return tokenizer
    from transformers import AutoTokenizer  # imported only when asked for: it is slow to import

    try:
        return AutoTokenizer.from_pretrained(tokenizer)
    except OSError as err:
        raise DataError(
            f"tokenizer {tokenizer!r} cannot be loaded ({err}); give a local path or a cached model id"
        ) from err


@task(name="data-prep", retries=2, retry_delay_seconds=[5, 30], retry_condition_fn=retry_on_transient_io,
      log_prints=True)
def data_prep_task(
    inputs: list[str],
    out_dir: str,
    config: DataPrepConfig | None = None,
    prompts_file: str | None = None,
    tokenizer: str | None = None,
) -> DataPrepResult:
    """Prefect task around run_data_prep; prints the counts table into the run log."""
    result = run_data_prep(inputs, out_dir, config, prompts_file, tokenizer)
    print(result.summary())
    return result
