"""The demo data-prep stage: generate the customer-support task's data and prepare it exactly like user data.

Preference pairs are written as a raw input file (``raw/demo_pairs.parquet``) and go through the same
``run_data_prep`` validation / dedupe / split path as user files, so their counts reconcile the same way.
Beside those tables the stage writes SFT demonstrations (``sft_train`` / ``sft_eval``, split by prompt) and
an evaluation prompt set (``eval_prompts.parquet``) that carries the hidden metadata (intent, tone, ...) and
shares no prompt with the PPO prompts. Gold scores reach no table; the metadata lives only in the evaluation
file, which training stages never read.

Why disjoint from the PPO prompts only: two intents have tiny prompt spaces (password_reset 120 distinct
messages, app_crash 160), which a few thousand generated pairs and demonstrations cover completely; excluding
every training prompt would drop those intents from evaluation altogether.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prefect import task

from rlhf_core.data import PPO_PROMPTS, Column, DataError, DataPrepConfig, DType, TableSchema
from rlhf_core.data.schema import CHOSEN, PROMPT, PROMPT_ID, REJECTED
from rlhf_core.data.split import prompt_id, prompt_position
from rlhf_core.demo import PromptRecord, generate_preference_pairs, generate_prompts, generate_sft_demonstrations
from rlhf_core.demo.config import DemoDataConfig
from tasks.data_prep import DataPrepResult, run_data_prep
from tasks.retries import retry_on_transient_io
from tasks.io import read_parquet, write_json, write_parquet

RAW_DIR = "raw"
RAW_PAIRS_FILE = "demo_pairs.parquet"
SFT_TRAIN_FILE = "sft_train.parquet"
SFT_EVAL_FILE = "sft_eval.parquet"
EVAL_PROMPTS_FILE = "eval_prompts.parquet"
DEMO_COUNTS_FILE = "demo_data_counts.json"
REPLY = "reply"
#: Draw at most this many times the requested evaluation prompts before giving up on disjointness.
MAX_EVAL_DRAW_FACTOR = 64

_S = DType.STRING
RAW_PAIRS = TableSchema(
    "demo_pairs",
    (Column(PROMPT, _S, doc="Customer message rendered as a policy prompt."),
     Column(CHOSEN, _S, doc="Reply the simulated annotator preferred."),
     Column(REJECTED, _S, doc="The other reply.")),
)
SFT_DEMONSTRATIONS = TableSchema(
    "sft_demonstrations",
    (Column(PROMPT, _S, doc="Prompt text, exactly as the policy will see it."),
     Column(REPLY, _S, doc="Reply to imitate; continues the prompt (starts with a space)."),
     Column(PROMPT_ID, _S, doc="Stable hash of the prompt (decides its SFT split).")),
)
#: Evaluation only: the hidden facts about each prompt. Training stages must never read this table.
EVAL_PROMPTS = TableSchema(
    "eval_prompts",
    (Column(PROMPT, _S, doc="Prompt text; never a PPO prompt."),
     Column(PROMPT_ID, _S, doc="Stable hash of the prompt."),
     Column("message", _S, doc="The customer's message inside the prompt."),
     Column("intent", _S, doc="Hidden intent of the message (evaluation only)."),
     Column("tone", _S, doc="polite / neutral / angry (evaluation only)."),
     Column("product", _S, nullable=True, doc="Product the message names, if any."),
     Column("other_product", _S, nullable=True, doc="Product received by mistake (wrong_item), if named."),
     Column("order", _S, nullable=True, doc="Order number the message gives, if any."),
     Column("device", _S, nullable=True, doc="Device the message names, if any.")),
)


@dataclass(frozen=True)
class DemoDataCounts:
    """Rows of the demo-only tables (the pair counts are in ``DataPrepResult.counts``)."""

    sft_rows_in: int
    """Demonstrations generated."""
    sft_duplicates: int
    """Exact (prompt, reply) repeats dropped."""
    sft_train: int
    """Rows in sft_train."""
    sft_eval: int
    """Rows in sft_eval."""
    eval_prompts: int
    """Rows in eval_prompts."""
    eval_prompts_skipped: int = 0
    """Drawn evaluation prompts dropped because they are PPO prompts or repeat an earlier draw."""

    def __post_init__(self) -> None:
        if self.sft_rows_in != self.sft_duplicates + self.sft_train + self.sft_eval:
            raise AssertionError(f"demo SFT counts do not reconcile: {self}")

    def as_metrics(self) -> dict[str, float]:
        """Flat ``demo/...`` metric names -> values."""
        return {f"demo/{name}": float(value) for name, value in asdict(self).items()}


@dataclass(frozen=True)
class DemoDataResult:
    """Where the demo data stage wrote its tables, and the counts."""

    prep: DataPrepResult
    """The data-prep outputs for the generated pairs (train / held-out pairs, PPO prompts, quarantine)."""
    raw_pairs: str
    """The generated pairs as the stage's input file (RAW_PAIRS)."""
    sft_train: str
    """SFT training demonstrations (SFT_DEMONSTRATIONS)."""
    sft_eval: str
    """Held-out SFT demonstrations (SFT_DEMONSTRATIONS); no prompt is also in sft_train."""
    eval_prompts: str
    """Evaluation prompts with hidden metadata (EVAL_PROMPTS), none a PPO prompt; evaluation stages only."""
    counts_json: str
    """The demo counts, config and seed as JSON."""
    counts: DemoDataCounts = field(repr=False)
    """Rows of the demo-only tables."""

    def paths(self) -> dict[str, str]:
        """Output name -> path, data-prep outputs included."""
        own = {k: v for k, v in asdict(self).items() if k not in ("prep", "counts")}
        return {**self.prep.paths(), **own}

    def summary(self) -> str:
        """Data-prep counts, demo counts, then every output path."""
        c = self.counts
        rows = [("sft demos", c.sft_rows_in), ("  duplicates", c.sft_duplicates), ("sft train", c.sft_train),
                ("sft eval", c.sft_eval), ("eval prompts", c.eval_prompts)]
        return "\n".join([self.prep.summary(), *(f"{k:<19}  {v}" for k, v in rows),
                          *(f"{k:<14} {v}" for k, v in self.paths().items() if k not in self.prep.paths())])


def run_demo_data_prep(
    out_dir: str | Path, config: DemoDataConfig = DemoDataConfig(), prep_config: DataPrepConfig | None = None,
    seed: int = 0,
) -> DemoDataResult:
    """Generate the demo task's pairs, demonstrations and evaluation prompts; prepare and write them.

    ``seed`` (the pipeline's ``seed``) seeds every generator and the simulated annotator: the same seed gives
    the same tables. Raises DataError when the data-prep checks fail or the sizes leave a table empty.
    """
    prep_config = prep_config or DataPrepConfig()
    out = Path(out_dir)
    for name in (SFT_TRAIN_FILE, SFT_EVAL_FILE, EVAL_PROMPTS_FILE, DEMO_COUNTS_FILE):  # no stale mix after a failure
        (out / name).unlink(missing_ok=True)
    pairs = generate_preference_pairs(config.n_pairs, seed, config.annotator_temperature)
    raw = write_parquet(pairs, RAW_PAIRS, out / RAW_DIR / RAW_PAIRS_FILE)
    prep = run_data_prep([raw], out, prep_config)
    demos = generate_sft_demonstrations(config.n_sft, seed)
    train, held_out, duplicates = split_demonstrations(demos, config.sft_eval_fraction, prep_config.split_salt)
    ppo_prompts = {str(row[PROMPT]) for row in read_parquet(prep.ppo_prompts, PPO_PROMPTS)}
    records, skipped = draw_eval_prompts(config.n_eval_prompts, seed, ppo_prompts)
    counts = DemoDataCounts(len(demos), duplicates, len(train), len(held_out), len(records), skipped)
    return DemoDataResult(
        prep=prep,
        raw_pairs=raw,
        sft_train=write_parquet(train, SFT_DEMONSTRATIONS, out / SFT_TRAIN_FILE),
        sft_eval=write_parquet(held_out, SFT_DEMONSTRATIONS, out / SFT_EVAL_FILE),
        eval_prompts=write_parquet([eval_row(r) for r in records], EVAL_PROMPTS, out / EVAL_PROMPTS_FILE),
        counts_json=write_json({"config": asdict(config), "seed": seed, "counts": asdict(counts)},
                               out / DEMO_COUNTS_FILE),
        counts=counts,
    )


def split_demonstrations(
    demos: Sequence[Mapping[str, str]], eval_fraction: float, salt: str
) -> tuple[list[dict[str, str]], list[dict[str, str]], int]:
    """(train rows, eval rows, duplicates dropped): exact repeats dropped, split by a stable prompt hash.

    Every row of one prompt lands on the same side, so no prompt is in both tables.
    """
    seen: set[tuple[str, str]] = set()
    train: list[dict[str, str]] = []
    held_out: list[dict[str, str]] = []
    for demo in demos:
        key = (demo[PROMPT], demo[REPLY])
        if key in seen:
            continue
        seen.add(key)
        row = {PROMPT: demo[PROMPT], REPLY: demo[REPLY], PROMPT_ID: prompt_id(demo[PROMPT])}
        is_eval = prompt_position(demo[PROMPT], salt + ":sft") < eval_fraction
        (held_out if is_eval else train).append(row)
    if not train or not held_out:
        raise DataError(
            f"SFT split is empty ({len(train)} train, {len(held_out)} eval demonstrations); raise data.demo.n_sft "
            f"or move data.demo.sft_eval_fraction ({eval_fraction}) away from 0 and 1"
        )
    return train, held_out, len(demos) - len(seen)


def draw_eval_prompts(n: int, seed: int, taken: set[str]) -> tuple[list[PromptRecord], int]:
    """``n`` distinct evaluation prompts, none in ``taken``, and how many drawn prompts were skipped.

    Deterministic: draws are a prefix of ``generate_prompts(k, seed)`` for a growing ``k``.
    """
    drawn = max(n, 1)
    while n > 0:
        kept: dict[str, PromptRecord] = {}
        for index, record in enumerate(generate_prompts(drawn, seed)):
            if record.prompt not in taken:
                kept.setdefault(record.prompt, record)
            if len(kept) == n:
                return list(kept.values()), index + 1 - n
        if drawn >= MAX_EVAL_DRAW_FACTOR * n:
            raise DataError(
                f"only {len(kept)} of {drawn} drawn evaluation prompts are distinct and not PPO prompts; "
                f"lower data.demo.n_eval_prompts ({n}) or generate fewer pairs"
            )
        drawn *= 2
    return [], 0


def eval_row(record: PromptRecord) -> dict[str, object]:
    """One EVAL_PROMPTS row: the record's fields plus the prompt id."""
    return {**asdict(record), PROMPT_ID: prompt_id(record.prompt)}


@task(name="demo-data", retries=2, retry_delay_seconds=[5, 30], retry_condition_fn=retry_on_transient_io,
      log_prints=True)
def demo_data_task(
    out_dir: str, config: DemoDataConfig = DemoDataConfig(), prep_config: DataPrepConfig | None = None,
    seed: int = 0,
) -> DemoDataResult:
    """Prefect task around run_demo_data_prep; prints the counts table into the run log."""
    result = run_demo_data_prep(out_dir, config, prep_config, seed)
    print(result.summary())
    return result
