"""The sft stage: the policy every later stage starts from (and PPO's reference).

Three cases, by config and data:
- no ``sft.base_model``: train a byte-level BPE tokenizer on the task's text and a small GPT from scratch
  (``sft.model_size``), then fine-tune it on the demonstrations;
- a base model and ``sft.enabled``: fine-tune it on the demonstrations;
- a base model and ``sft.enabled=false``, or user data (no demonstrations): use it as it is. The artifact then
  records where the model is instead of copying it - unless ``sft.tokens`` changes its tokenizer's special tokens:
  then the model is saved into the artifact with the changed tokenizer, so every later stage reads the same tokens.
A base model must be a causal LM (refused in one line otherwise); its tokenizer's eos / pad come from ``sft.tokens``,
its own, or the fallbacks (``rlhf_core.models.tokenizer.resolve_special_tokens``).
On the demo task the policy's greedy and sampled replies to the first evaluation prompts are judged by the gold
scorer next to the demonstrations: evaluation only, after training, reported in the artifact's metrics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import GenerationConfig
from rlhf_core.data import PREFERENCE_PAIRS
from rlhf_core.demo.tables import EVAL_PROMPTS, REPLY, SFT_DEMONSTRATIONS
from rlhf_core.evaluation.demo_eval import PolicyGoldReport, gold_report, record_from_row
from rlhf_core.models.lm import ModelSize, build_causal_lm, config_for_tokenizer, count_parameters, model_size
from rlhf_core.models.roles import check_causal_lm, fuse_activations
from rlhf_core.models.tokenizer import SpecialTokens, train_bpe_tokenizer
from rlhf_core.training.sft import SFTResult, eval_loss, train_sft
from tasks.config import PipelineConfig, SFTSection
from tasks.io import read_parquet, write_json
from tasks.models import load_tokenizer
from tasks.plots import loss_curve, save_figure
from tasks.run_store import Artifact
from tasks.runtime import ModelInput, Runtime, local_model
from tasks.stage import Publication, Stage, StageContext, stage_task
from tasks.typed_yaml import one_line

log = logging.getLogger(__name__)

NAME = "sft"
MODEL_DIR, LOSS_JSON, LOSS_PNG = "model", "sft_loss.json", "sft_loss.png"
METRICS_JSON, SAMPLES_JSON = "sft_metrics.json", "sft_eval_samples.json"
GOLD_REPORT_PROMPTS = 64
"""Evaluation prompts the policy answers for the gold report (at most ``eval.n_prompts``)."""

Demonstrations = list[tuple[str, str]]


@dataclass(frozen=True)
class Config:
    """What the sft stage is given."""

    sft: SFTSection
    """Base model, tokenizer/model size for a model built here, and the fine-tuning hyperparameters."""
    runtime: Runtime
    seed: int
    """Seeds the model built here and the gold report's samples."""
    gold_report_prompts: int = 0
    """Demo task: evaluation prompts answered for the gold report (0 = no report)."""
    generation: GenerationConfig | None = None
    """Demo task: sampling of the gold report (PPO's rollout settings; the budget is cut to fit the model)."""

    @classmethod
    def of(cls, config: PipelineConfig) -> Config:
        if config.data.source != "demo":
            return cls(config.sft, Runtime.of(config), config.seed)
        return cls(config.sft, Runtime.of(config), config.seed, min(GOLD_REPORT_PROMPTS, config.eval.n_prompts),
                   config.ppo.generation)


@dataclass(frozen=True)
class Inputs:
    data: Artifact
    """data-prep: SFT demonstrations (demo), train pairs (tokenizer text), evaluation prompts (gold report)."""


@dataclass(frozen=True)
class Result:
    """The policy and the stage's metrics."""

    model: str
    """The policy: ``model/`` in the artifact, or (``external``) the base model's folder or Hugging Face id."""
    external: bool
    """True when the base model is used as it is and the artifact only records where it is."""
    trained: bool
    metrics_file: str
    metrics: dict[str, float] = field(default_factory=dict)
    loss_curve: str | None = None
    loss_plot: str | None = None
    samples: str | None = None


def model_input(artifact: Artifact) -> ModelInput:
    """The SFT policy of an sft artifact, as a model input of later stages."""
    result = STAGE.result(artifact)
    return ModelInput(artifact, external=result.model) if result.external else ModelInput(artifact, result.model)


def compute(cfg: Config, inputs: Inputs, ctx: StageContext) -> Result:
    data = inputs.data.result
    section = cfg.sft
    if data["sft_train"] is None:
        if section.base_model is None:
            raise ValueError("user data has no SFT demonstrations: set sft.base_model to the policy to start from "
                             "(a local folder, a models:/ URI or a Hugging Face id)")
        log.info("sft: user data has no demonstrations; using %s as the SFT policy", section.base_model)
        write_json({"base_model": section.base_model}, ctx.out / METRICS_JSON)
        if section.tokens != SpecialTokens():  # the changed tokenizer must travel with the model
            _save_policy(*load_base(local_model(section.base_model), section.tokens), ctx.out / MODEL_DIR)
            return Result(MODEL_DIR, external=False, trained=False, metrics_file=METRICS_JSON)
        return Result(outside_model(section.base_model), external=True, trained=False, metrics_file=METRICS_JSON)
    train = read_demonstrations(inputs.data.path(data["sft_train"]))
    held_out = read_demonstrations(inputs.data.path(data["sft_eval"]))
    if section.base_model is not None:
        model, tokenizer = load_base(local_model(section.base_model), section.tokens)
    else:
        model, tokenizer = build_policy(train, inputs.data.path(data["train_pairs"]), cfg)
    model = model.to(cfg.runtime.torch_device)
    sft_config = _fit_to_model(section, model)
    trained = section.base_model is None or section.enabled
    outputs: dict[str, str | None] = {}
    if trained:
        history = train_sft(model, tokenizer, train, held_out, sft_config,
                            on_log=lambda step, metrics: ctx.tracker.log(metrics, step))
        metrics = loss_metrics(history)
        _write_loss_curve(history, ctx.out / LOSS_JSON)
        _plot_loss(history, ctx.out / LOSS_PNG)
        outputs.update(loss_curve=LOSS_JSON, loss_plot=LOSS_PNG)
        _save_policy(model, tokenizer, ctx.out / MODEL_DIR)
    else:
        metrics = {"sft/final_eval_loss": eval_loss(model, tokenizer, held_out, sft_config.max_length,
                                                    sft_config.eval_batch_size)}
    if cfg.gold_report_prompts:
        report = _gold_report(model, tokenizer, inputs.data.path(data["eval_prompts"]), held_out, cfg)
        metrics.update(report.as_metrics("sft_eval"))
        rows = [{"prompt": p, "greedy": g, "sampled": s} for p, g, s in report.samples]
        write_json(rows, ctx.out / SAMPLES_JSON)
        outputs["samples"] = SAMPLES_JSON
    log.info("sft stage metrics: %s", {k: round(v, 4) for k, v in metrics.items()})
    write_json({"metrics": metrics, "trained": trained, "base_model": section.base_model}, ctx.out / METRICS_JSON)
    saved = trained or section.tokens != SpecialTokens()
    if not trained and saved:  # used as it is, with the tokenizer sft.tokens changed: both travel in the artifact
        _save_policy(model, tokenizer, ctx.out / MODEL_DIR)
    model_ref = MODEL_DIR if saved else outside_model(section.base_model)
    return Result(model_ref, not saved, trained, METRICS_JSON, metrics, **outputs)


def _save_policy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def outside_model(base_model: str) -> str:
    """How the artifact records a base model it does not copy: a local folder by its absolute path (so a later
    process in another working directory finds it), a ``models:/`` URI or Hugging Face id as given."""
    return str(Path(base_model).absolute()) if Path(base_model).exists() else base_model


def read_demonstrations(path: str | Path) -> Demonstrations:
    """(prompt, reply) rows of an SFT_DEMONSTRATIONS Parquet table."""
    return [(str(row["prompt"]), str(row[REPLY])) for row in read_parquet(path, SFT_DEMONSTRATIONS)]


def build_policy(train: Demonstrations, pairs_path: Path, cfg: Config) -> tuple[PreTrainedModel,
                                                                                 PreTrainedTokenizerBase]:
    """A BPE tokenizer trained on the demonstrations and pairs, and a fresh GPT of ``sft.model_size``."""
    texts = [prompt + reply for prompt, reply in train]
    for row in read_parquet(pairs_path, PREFERENCE_PAIRS):
        texts += [str(row["prompt"]) + str(row["chosen"]), str(row["prompt"]) + str(row["rejected"])]
    size = cfg.sft.model_size
    shape = size if isinstance(size, ModelSize) else model_size(size)  # a preset name or the shape itself
    tokenizer = train_bpe_tokenizer(texts, cfg.sft.vocab_size, model_max_length=shape.n_positions)
    model = build_causal_lm(config_for_tokenizer(tokenizer, shape), seed=cfg.seed)
    log.info("sft: built a GPT %s (%d parameters) and a %d-token BPE tokenizer from %d texts",
             shape, count_parameters(model), len(tokenizer), len(texts))
    return model, tokenizer


def load_base(folder: str, tokens: SpecialTokens = SpecialTokens()) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model (a causal LM: ``roles.check_causal_lm``) and tokenizer (special tokens resolved with ``sft.tokens``)
    from a Hugging Face folder or cached model id."""
    try:
        model = AutoModelForCausalLM.from_pretrained(folder)
        tokenizer = load_tokenizer(folder, tokens, "sft.tokens")
    except OSError as err:
        raise ValueError(f"sft.base_model {folder!r} cannot be loaded ({one_line(str(err))}); give a local Hugging Face "
                         "folder (save_pretrained layout) or a model id present in the local cache") from err
    except ValueError as err:
        raise ValueError(f"sft.base_model {folder!r}: {one_line(str(err))}") from None
    return fuse_activations(check_causal_lm(model, f"sft.base_model {folder!r}")), tokenizer


def _fit_to_model(section: SFTSection, model: PreTrainedModel) -> SFTSection:
    """The section with ``max_length`` cut to the model's position embeddings."""
    positions = getattr(model.config, "max_position_embeddings", None)
    return section if positions is None or section.max_length <= positions else replace(section, max_length=positions)


def loss_metrics(history: SFTResult) -> dict[str, float]:
    """Initial / final held-out loss, last train loss, steps and seconds as ``sft/...`` metrics."""
    return {"sft/initial_eval_loss": history.initial_eval_loss, "sft/final_eval_loss": history.final_eval_loss,
            "sft/final_train_loss": history.train_losses[-1], "sft/steps": float(len(history.train_losses)),
            "sft/seconds": history.seconds}


def _write_loss_curve(history: SFTResult, path: Path) -> str:
    curve = {"train_steps": list(range(1, len(history.train_losses) + 1)), "train_losses": list(history.train_losses),
             "eval_steps": list(history.eval_steps), "eval_losses": list(history.eval_losses),
             "seconds": history.seconds}
    return write_json(curve, path)


def _plot_loss(history: SFTResult, path: Path) -> Path:
    figure = loss_curve(range(1, len(history.train_losses) + 1), history.train_losses, history.eval_steps,
                        history.eval_losses, title="SFT loss")
    return save_figure(figure, path)


def _gold_report(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, eval_prompts: Path,
                 held_out: Demonstrations, cfg: Config) -> PolicyGoldReport:
    """The gold report on the first ``cfg.gold_report_prompts`` evaluation prompts (evaluation only)."""
    records = [record_from_row(row) for row in read_parquet(eval_prompts, EVAL_PROMPTS)[: cfg.gold_report_prompts]]
    started = time.perf_counter()
    report = gold_report(model, tokenizer, records, held_out, cfg.generation, cfg.seed)
    log.info("sft: gold report on %d prompts in %.1fs", len(records), time.perf_counter() - started)
    return report


def publish(cfg: Config, result: Result, pub: Publication) -> None:
    pub.log_metrics(result.metrics)
    pub.log_files([f for f in (result.loss_curve, result.loss_plot, result.samples, result.metrics_file) if f], "sft")
    folder = model_input(pub.artifact).path
    if Path(folder).is_dir():  # a Hugging Face id stays outside the registry
        usage = {"generation": asdict(cfg.generation)} if cfg.generation is not None else None
        pub.register("policy", pub.names.policy_model, folder, usage=usage)


STAGE = Stage(NAME, compute, publish, Result)
sft_task = stage_task(STAGE, retries=1)
