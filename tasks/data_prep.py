"""The data-prep stage: preference files (or the generated demo task) -> validated, deduped, split Parquet tables.

User files (Parquet / JSONL / CSV; TRL, HH or chat format) are read by ``tasks.sources`` and prepared by
``rlhf_core.data``: every rejected row goes to ``quarantine.parquet`` with its file, row, column and reason, and
``rows_in == accepted + quarantined``; a file that cannot be used at all is one DataError naming it. The demo
task's pairs are written as a raw input file and go through the same path; beside them the stage writes SFT
demonstrations and an evaluation prompt set with hidden metadata (``rlhf_core.demo.tables``). ``rlhf prep`` runs
:func:`prepare` alone.

Lengths (``data.prep.max_length``, ``data.prep.max_prompt_length``) count the policy's tokens whenever its tokenizer
exists before training (``sft.base_model`` set, loaded with ``sft.tokens`` as every stage loads it), so they mean what
the reward model's and PPO's token limits mean; without one (the demo's tokenizer is trained in the sft stage) they
count characters. The tokenizer is part of this stage's config slice, so a different tokenizer is a different key.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rlhf_core.data import (PPO_PROMPTS, PREFERENCE_PAIRS, QUARANTINE, DataError, DataPrepConfig, DataPrepCounts,
                            SourceFile, check_outcome, format_counts, prepare_data)
from rlhf_core.data.schema import PROMPT, PROMPT_ID
from rlhf_core.data.split import fractions_with_heldout, prompt_id
from rlhf_core.demo import generate_preference_pairs, generate_sft_demonstrations
from rlhf_core.demo.config import DemoDataConfig
from rlhf_core.demo.tables import (EVAL_PROMPTS, RAW_PAIRS, SFT_DEMONSTRATIONS, draw_eval_prompts, eval_row,
                                   split_demonstrations)
from rlhf_core.models.tokenizer import SpecialTokens
from tasks.io import read_parquet, read_source, write_json, write_parquet
from tasks.run_store import LocalPath
from tasks.run_store.keys import ModelSource
from tasks.stage import Publication, Stage, StageContext, stage_task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tasks.config import PipelineConfig

NAME = "data-prep"
TRAIN_FILE, HELDOUT_FILE, PPO_PROMPTS_FILE = "train_pairs.parquet", "heldout_pairs.parquet", "ppo_prompts.parquet"
QUARANTINE_FILE, COUNTS_FILE, EVAL_PROMPTS_FILE = "quarantine.parquet", "data_prep_counts.json", "eval_prompts.parquet"
RAW_PAIRS_FILE, SFT_TRAIN_FILE, SFT_EVAL_FILE = "raw/demo_pairs.parquet", "sft_train.parquet", "sft_eval.parquet"


@dataclass(frozen=True)
class Config:
    """What data-prep is given: the data section, and the seed only when it generates the demo task."""

    source: Literal["demo", "files"]
    """'demo': generate the embedded task; 'files': read ``files``."""
    prep: DataPrepConfig
    """Validation, dedupe and split settings."""
    files: tuple[LocalPath, ...] = ()
    """Preference files (their content is part of the key)."""
    prompts_file: LocalPath | None = None
    """Optional separate PPO prompts file."""
    demo: DemoDataConfig | None = None
    """Sizes of the generated task (demo only)."""
    seed: int | None = None
    """Seed of the generated task (demo only: user files are split by a salted hash, not a seed)."""
    tokenizer: ModelSource | None = None
    """The policy's tokenizer (``sft.base_model``: a local folder, ``models:/`` URI or cached hub id): lengths count
    its tokens and chat data is rendered with its template. None = lengths count characters."""
    tokens: SpecialTokens = field(default_factory=SpecialTokens)
    """``sft.tokens`` applied to ``tokenizer`` (the default when there is none): special tokens change counting."""

    @classmethod
    def of(cls, config: PipelineConfig, tokenizer: str | None = None) -> Config:
        """The slice of ``config``; ``tokenizer`` (``rlhf prep --tokenizer``) stands in for ``sft.base_model``."""
        data, source = config.data, tokenizer or config.sft.base_model
        counting = {"tokenizer": source, "tokens": config.sft.tokens} if source is not None else {}
        if data.source == "demo":
            return cls("demo", data.prep, demo=data.demo, seed=config.seed, **counting)
        return cls("files", data.prep, files=tuple(data.files), prompts_file=data.prompts_file, **counting)

    @property
    def length_unit(self) -> str:
        """What ``prep.max_length`` and ``prep.max_prompt_length`` count: 'tokens' or 'characters'."""
        return "characters" if self.tokenizer is None else "tokens"


@dataclass(frozen=True)
class Inputs:
    """data-prep reads no artifacts (its files are in its config)."""


@dataclass(frozen=True)
class Result:
    """The tables (paths relative to the artifact) and the reconciled counts."""

    train_pairs: str
    heldout_pairs: str
    ppo_prompts: str
    quarantine: str
    eval_prompts: str
    """The fixed evaluation prompts (demo: with hidden metadata; user data: the held-out pairs' prompts)."""
    counts: str
    sft_train: str | None = None
    """SFT demonstrations (demo only; user data needs ``sft.base_model``)."""
    sft_eval: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    """``data/...`` counts (and ``demo/...`` for the generated task)."""


@dataclass(frozen=True)
class DemoDataCounts:
    """Rows of the demo-only tables (the pair counts are the data-prep counts)."""

    sft_rows_in: int
    sft_duplicates: int
    sft_train: int
    sft_eval: int
    eval_prompts: int
    eval_prompts_skipped: int = 0

    def __post_init__(self) -> None:
        if self.sft_rows_in != self.sft_duplicates + self.sft_train + self.sft_eval:
            raise AssertionError(f"demo SFT counts do not reconcile: {self}")

    def as_metrics(self) -> dict[str, float]:
        return {f"demo/{name}": float(value) for name, value in asdict(self).items()}


def compute(cfg: Config, inputs: Inputs, ctx: StageContext) -> Result:
    return prepare(cfg, ctx.out)


def prepare(cfg: Config, out: Path) -> Result:
    """Generate or read the data, validate, dedupe and split it, and write every table under ``out``.

    ``cfg.tokenizer`` makes the length limits count its tokens and renders chat data with its template. Raises
    DataError naming the file (and the quarantine table) when the data cannot be used, or the tokenizer when it
    cannot be loaded.
    """
    for name in (TRAIN_FILE, HELDOUT_FILE, PPO_PROMPTS_FILE, COUNTS_FILE, EVAL_PROMPTS_FILE, SFT_TRAIN_FILE,
                 SFT_EVAL_FILE):
        (out / name).unlink(missing_ok=True)  # `rlhf prep` into a used folder: no stale mix after a failure
    tokenizer = length_tokenizer(cfg)
    if cfg.source == "demo":
        return _prepare_demo(cfg, out, tokenizer)
    sources = [read_source(uri) for uri in cfg.files]
    prompt_sources = [read_source(cfg.prompts_file)] if cfg.prompts_file else []
    tables, counts = _prepare_pairs(cfg, sources, prompt_sources, out, tokenizer)
    prompts = dict.fromkeys(str(r[PROMPT]) for r in read_parquet(out / HELDOUT_FILE, PREFERENCE_PAIRS))
    heldout = [{PROMPT: p, PROMPT_ID: prompt_id(p)} for p in prompts]
    if not heldout:
        raise DataError(f"{out / HELDOUT_FILE} has no held-out pairs, so there is nothing to evaluate on; "
                        + _heldout_hint(cfg, out))
    write_parquet(heldout, PPO_PROMPTS, out / EVAL_PROMPTS_FILE)
    return Result(**tables, eval_prompts=EVAL_PROMPTS_FILE, metrics=counts.as_metrics())


def _heldout_hint(cfg: Config, out: Path) -> str:
    """Fractions that hold out some of these prompts (the train, held-out and PPO fractions sum to 1)."""
    ppo_from_pairs = not cfg.prompts_file
    prompts = [str(r[PROMPT]) for r in read_parquet(out / TRAIN_FILE, PREFERENCE_PAIRS)]
    if ppo_from_pairs:
        prompts += [str(r[PROMPT]) for r in read_parquet(out / PPO_PROMPTS_FILE, PPO_PROMPTS)]
    fractions = fractions_with_heldout(prompts, cfg.prep, ppo_from_pairs)
    rule = "the train, held-out and PPO fractions sum to 1"
    if fractions is None:
        return f"{len(set(prompts))} distinct prompt(s) cannot be split three ways: add pairs with other prompts"
    train, heldout, ppo = fractions
    return (f"with these {len(set(prompts))} distinct prompts, e.g. data.prep.train_fraction={train:g} "
            f"data.prep.heldout_fraction={heldout:g} data.prep.ppo_fraction={ppo:g} ({rule})")


def _prepare_pairs(cfg: Config, sources: Sequence[SourceFile], prompt_sources: Sequence[SourceFile], out: Path,
                   tokenizer: PreTrainedTokenizerBase | None) -> tuple[dict[str, str], DataPrepCounts]:
    tables = prepare_data(sources, cfg.prep, tokenizer, prompt_sources)
    quarantine = write_parquet(tables.quarantine, QUARANTINE, out / QUARANTINE_FILE)
    check_outcome(tables.counts, cfg.prep.max_quarantine_fraction, quarantine)
    write_parquet(tables.train_pairs, PREFERENCE_PAIRS, out / TRAIN_FILE)
    write_parquet(tables.heldout_pairs, PREFERENCE_PAIRS, out / HELDOUT_FILE)
    write_parquet(tables.ppo_prompts, PPO_PROMPTS, out / PPO_PROMPTS_FILE)
    write_json({**asdict(tables.counts), "quarantine_fraction": tables.counts.quarantine_fraction}, out / COUNTS_FILE)
    return {"train_pairs": TRAIN_FILE, "heldout_pairs": HELDOUT_FILE, "ppo_prompts": PPO_PROMPTS_FILE,
            "quarantine": QUARANTINE_FILE, "counts": COUNTS_FILE}, tables.counts


def _prepare_demo(cfg: Config, out: Path, tokenizer: PreTrainedTokenizerBase | None) -> Result:
    """The generated pairs go through the user-data path; demonstrations and evaluation prompts are written beside."""
    demo, seed = cfg.demo or DemoDataConfig(), cfg.seed or 0
    pairs = generate_preference_pairs(demo.n_pairs, seed, demo.annotator_temperature)
    raw = read_source(write_parquet(pairs, RAW_PAIRS, out / RAW_PAIRS_FILE))
    # Quarantine rows name the generated file as the artifact holds it, not where it was written.
    raw = SourceFile(RAW_PAIRS_FILE, raw.columns, [replace(row, source_file=RAW_PAIRS_FILE) for row in raw.rows])
    tables, counts = _prepare_pairs(cfg, [raw], [], out, tokenizer)
    demos = generate_sft_demonstrations(demo.n_sft, seed)
    train, held_out, duplicates = split_demonstrations(demos, demo.sft_eval_fraction, cfg.prep.split_salt)
    ppo_prompts = {str(row[PROMPT]) for row in read_parquet(out / PPO_PROMPTS_FILE, PPO_PROMPTS)}
    records, skipped = draw_eval_prompts(demo.n_eval_prompts, seed, ppo_prompts)
    demo_counts = DemoDataCounts(len(demos), duplicates, len(train), len(held_out), len(records), skipped)
    write_parquet(train, SFT_DEMONSTRATIONS, out / SFT_TRAIN_FILE)
    write_parquet(held_out, SFT_DEMONSTRATIONS, out / SFT_EVAL_FILE)
    write_parquet([eval_row(r) for r in records], EVAL_PROMPTS, out / EVAL_PROMPTS_FILE)
    write_json({"config": asdict(demo), "seed": seed, "counts": asdict(demo_counts)}, out / "demo_data_counts.json")
    return Result(**tables, eval_prompts=EVAL_PROMPTS_FILE, sft_train=SFT_TRAIN_FILE, sft_eval=SFT_EVAL_FILE,
                  metrics=counts.as_metrics() | demo_counts.as_metrics())


def length_tokenizer(cfg: Config) -> PreTrainedTokenizerBase | None:
    """The tokenizer the lengths count (``cfg.tokenizer`` with ``cfg.tokens``, loaded as every stage loads the
    policy's), or None for characters. DataError in one line when it cannot be loaded."""
    if cfg.tokenizer is None:
        return None
    # imported only when asked for: loading models pulls in torch
    from tasks.models import TOKENIZER_FILES, tokenizer_of
    from tasks.runtime import local_model

    where = f"the tokenizer of {cfg.tokenizer!r} (sft.base_model, or `rlhf prep --tokenizer`)"
    try:
        folder = Path(local_model(cfg.tokenizer))
        tokenizer = tokenizer_of(folder, cfg.tokens, "sft.tokens")
        if tokenizer is None:
            raise OSError(f"{folder} holds none of {', '.join(TOKENIZER_FILES)}")
        return tokenizer
    except (OSError, ValueError) as err:
        why = " ".join(str(err).split()) or type(err).__name__
        raise DataError(f"{where} cannot be loaded to count data-prep lengths in tokens ({why}); give a model folder "
                        "saved with its tokenizer, a models:/ URI or a cached model id") from err


def summary(result: Result, folder: Path) -> str:
    """The counts table (with the demo task's own tables' counts) and where each table is (``rlhf prep`` prints
    it)."""
    counts = DataPrepCounts(**{k: v for k, v in _read_counts(folder / result.counts).items()
                               if k != "quarantine_fraction"})
    paths = {name: folder / value for name, value in asdict(result).items()
             if isinstance(value, str) and value.endswith((".parquet", ".json"))}
    demo = {name.removeprefix("demo/"): int(value) for name, value in result.metrics.items()
            if name.startswith("demo/")}
    rows = [("sft demos", "sft_rows_in"), ("  duplicates", "sft_duplicates"), ("sft train", "sft_train"),
            ("sft eval", "sft_eval"), ("eval prompts", "eval_prompts")] if demo else []
    lines = [format_counts(counts), *(f"{label:<19}  {demo[name]}" for label, name in rows)]
    return "\n".join(lines + [f"{name:<14} {path}" for name, path in paths.items()])


def _read_counts(path: Path) -> dict[str, object]:
    return json.loads(path.read_text(encoding="utf-8"))


def publish(cfg: Config, result: Result, pub: Publication) -> None:
    pub.log_params({"length_unit": cfg.length_unit})
    pub.log_metrics(result.metrics)
    pub.log_files([result.counts, result.quarantine], "data")
    tables = {"train_pairs": (result.train_pairs, "training"), "heldout_pairs": (result.heldout_pairs, "evaluation"),
              "ppo_prompts": (result.ppo_prompts, "training"), "eval_prompts": (result.eval_prompts, "evaluation")}
    if result.sft_train is not None:
        tables["sft_train"] = (result.sft_train, "training")
    pub.log_tables(tables)


STAGE = Stage(NAME, compute, publish, Result)
data_prep_task = stage_task(STAGE, retries=2)
