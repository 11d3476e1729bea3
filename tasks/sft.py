"""The sft stage: build (or load) a policy, fine-tune it on demonstrations, save it as a Hugging Face directory.

Without a base model the stage trains a byte-level BPE tokenizer on the task's own text and a small GPT
(``sft.model_size``) from scratch. With one (``sft.base_model``) it loads it and fine-tunes only when
``sft.enabled``; otherwise it only measures it. Outputs under ``out_dir``: ``model/`` (model + tokenizer,
``save_pretrained`` layout, written to a temp dir and renamed into place), the loss curve as JSON and PNG,
and the metrics as JSON. On the demo task (an ``eval_prompts`` table given) the policy's greedy and sampled
replies are judged by the gold scorer next to the demonstrations: evaluation only, after training.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from prefect import task
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import GenerationConfig
from rlhf_core.data import PREFERENCE_PAIRS
from rlhf_core.evaluation.demo_eval import PolicyGoldReport, gold_report, record_from_row
from rlhf_core.models.lm import ModelSize, build_causal_lm, config_for_tokenizer, count_parameters, model_size
from rlhf_core.models.roles import fuse_activations
from rlhf_core.models.tokenizer import train_bpe_tokenizer
from rlhf_core.training.sft import SFTResult, eval_loss, train_sft
from tasks.config import SFTSection
from tasks.retries import retry_on_transient_io
from tasks.demo_data import EVAL_PROMPTS, REPLY, SFT_DEMONSTRATIONS
from tasks.io import atomic_write, atomic_write_dir, read_parquet, write_json

logger = logging.getLogger(__name__)

MODEL_DIR = "model"
LOSS_JSON = "sft_loss.json"
LOSS_PNG = "sft_loss.png"
METRICS_JSON = "sft_metrics.json"
SAMPLES_JSON = "sft_eval_samples.json"

Demonstrations = list[tuple[str, str]]


def _shape(size: str | ModelSize) -> ModelSize:
    """The ``ModelSize`` of a preset name (or the size itself)."""
    return model_size(size) if isinstance(size, str) else size


@dataclass(frozen=True)
class SFTStageResult:
    """Where the sft stage wrote its outputs, and its metrics (no tensors, no models)."""

    model_dir: str
    """Hugging Face directory (or the base model id) of the policy to use next."""
    trained: bool
    """Whether the stage fine-tuned (False: the base model was only loaded and evaluated)."""
    metrics_json: str
    """Metrics, config and paths as JSON."""
    loss_curve_json: str | None = None
    """Train and held-out loss per step (None when not trained)."""
    loss_plot_png: str | None = None
    """The loss curve plotted (None when not trained)."""
    samples_json: str | None = None
    """Evaluation replies with their prompts (None without evaluation prompts)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``sft/...`` (losses, time) and ``sft_eval/...`` (gold report) metrics."""

    def summary(self) -> str:
        """Metrics, then the output paths."""
        width = max((len(name) for name in self.metrics), default=0)
        lines = [f"{name:<{width}}  {value:.4f}" for name, value in sorted(self.metrics.items())]
        paths = {k: v for k, v in asdict(self).items() if k not in ("metrics", "trained") and v is not None}
        return "\n".join(lines + [f"{k:<16} {v}" for k, v in paths.items()])


def run_sft(
    out_dir: str | Path,
    sft_train_path: str,
    sft_eval_path: str,
    config: SFTSection,
    *,
    seed: int,
    generation: GenerationConfig,
    n_eval_prompts: int,
    pairs_path: str | None = None,
    eval_prompts_path: str | None = None,
) -> SFTStageResult:
    """Build or load the policy, fine-tune it, save it under ``out_dir/model``, evaluate, write the metrics.

    ``config`` is the pipeline's ``sft`` section (``max_length`` is cut to the model's positions). ``seed`` (the
    pipeline's) seeds the initial weights of a model built here and the evaluation samples. ``pairs_path``
    (preference pairs) adds tokenizer text for a model built from scratch; ``eval_prompts_path`` (the demo's
    evaluation prompts) turns on the gold report on its first ``n_eval_prompts`` prompts, sampled with
    ``generation`` (the greedy pass uses the same budget; the budget is cut to fit).
    """
    if n_eval_prompts < 0:
        raise ValueError(f"n_eval_prompts must be >= 0, got {n_eval_prompts}")
    out = Path(out_dir)
    for name in (LOSS_JSON, LOSS_PNG, METRICS_JSON, SAMPLES_JSON):  # a rerun must not leave a stale mix behind
        (out / name).unlink(missing_ok=True)
    train, held_out = read_demonstrations(sft_train_path), read_demonstrations(sft_eval_path)
    base_model = config.base_model
    model, tokenizer = load_policy(base_model) if base_model else build_policy(train, pairs_path, config, seed)
    sft_config = _fit_sft_config(config, model)
    paths: dict[str, str | None] = {"model_dir": base_model}
    trained = base_model is None or config.enabled
    if trained:
        history = train_sft(model, tokenizer, train, held_out, sft_config)
        metrics = loss_metrics(history)
        paths.update(loss_curve_json=write_loss_curve(history, out / LOSS_JSON),
                     loss_plot_png=plot_loss_curve(history, out / LOSS_PNG),
                     model_dir=save_pretrained_atomic(model, tokenizer, out / MODEL_DIR))
    else:
        metrics = {"sft/final_eval_loss": eval_loss(model, tokenizer, held_out, sft_config.max_length,
                                                    sft_config.eval_batch_size)}
    if eval_prompts_path and n_eval_prompts:
        report = _gold_report(model, tokenizer, eval_prompts_path, held_out, n_eval_prompts, generation, seed)
        metrics.update(report.as_metrics("sft_eval"))
        paths["samples_json"] = write_samples(report, out / SAMPLES_JSON)
    logger.info("sft stage metrics: %s", {k: round(v, 4) for k, v in metrics.items()})
    record = {"metrics": metrics, "config": asdict(config), "seed": seed, "n_eval_prompts": n_eval_prompts,
              "generation": asdict(generation), "base_model": base_model, "trained": trained, **paths}
    return SFTStageResult(metrics_json=write_json(record, out / METRICS_JSON), trained=trained, metrics=metrics,
                          **paths)  # type: ignore[arg-type]


def read_demonstrations(path: str) -> Demonstrations:
    """(prompt, reply) rows of an SFT_DEMONSTRATIONS Parquet table."""
    return [(str(row["prompt"]), str(row[REPLY])) for row in read_parquet(path, SFT_DEMONSTRATIONS)]


def build_policy(
    train: Demonstrations, pairs_path: str | None, config: SFTSection, seed: int
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A BPE tokenizer trained on the demonstrations (and pairs) and a fresh GPT of ``config.model_size``."""
    texts = [prompt + reply for prompt, reply in train]
    if pairs_path:
        for row in read_parquet(pairs_path, PREFERENCE_PAIRS):
            texts += [str(row["prompt"]) + str(row["chosen"]), str(row["prompt"]) + str(row["rejected"])]
    shape = _shape(config.model_size)
    tokenizer = train_bpe_tokenizer(texts, config.vocab_size, model_max_length=shape.n_positions)
    model = build_causal_lm(config_for_tokenizer(tokenizer, shape), seed=seed)
    logger.info("sft: built a GPT %s (%d parameters) and a %d-token BPE tokenizer from %d texts",
                shape, count_parameters(model), len(tokenizer), len(texts))
    return model, tokenizer


def load_policy(base_model: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model and tokenizer from a Hugging Face directory or cached model id."""
    try:
        model = fuse_activations(AutoModelForCausalLM.from_pretrained(base_model))
        return model, AutoTokenizer.from_pretrained(base_model)
    except OSError as err:
        raise ValueError(
            f"base model {base_model!r} cannot be loaded ({err}); give a local Hugging Face directory "
            "(save_pretrained layout) or a model id present in the local cache"
        ) from err


def _fit_sft_config(config: SFTSection, model: PreTrainedModel) -> SFTSection:
    """``config`` with ``max_length`` cut to the model's position embeddings."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is None or config.max_length <= positions:
        return config
    return replace(config, max_length=positions)


def loss_metrics(history: SFTResult) -> dict[str, float]:
    """Initial / final held-out loss, last train loss, steps and seconds as ``sft/...`` metrics."""
    return {
        "sft/initial_eval_loss": history.initial_eval_loss,
        "sft/final_eval_loss": history.final_eval_loss,
        "sft/final_train_loss": history.train_losses[-1],
        "sft/steps": float(len(history.train_losses)),
        "sft/seconds": history.seconds,
    }


def write_loss_curve(history: SFTResult, path: Path) -> str:
    """The per-step train loss and the held-out evaluations as JSON."""
    curve = {"train_steps": list(range(1, len(history.train_losses) + 1)), "train_losses": list(history.train_losses),
             "eval_steps": list(history.eval_steps), "eval_losses": list(history.eval_losses),
             "seconds": history.seconds}
    return write_json(curve, path)


def plot_loss_curve(history: SFTResult, path: Path) -> str:
    """Train loss per step and held-out loss per evaluation, as a PNG (Agg canvas: no display, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    axes.plot(range(1, len(history.train_losses) + 1), history.train_losses, alpha=0.6, label="train")
    axes.plot(history.eval_steps, history.eval_losses, "o-", label="held-out")
    axes.set(xlabel="optimizer step", ylabel="loss (nats / reply token)", title="SFT loss")
    axes.legend()
    return atomic_write(path, lambda tmp: figure.savefig(tmp, format="png"))


def save_pretrained_atomic(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path) -> str:
    """``save_pretrained`` model and tokenizer into ``target`` atomically (an earlier directory is replaced)."""

    def save(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return str(atomic_write_dir(target, save))


def _gold_report(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, eval_prompts_path: str,
    held_out: Demonstrations, n_prompts: int, generation: GenerationConfig, seed: int,
) -> PolicyGoldReport:
    """The gold report on the first ``n_prompts`` evaluation prompts (evaluation only)."""
    records = [record_from_row(row) for row in read_parquet(eval_prompts_path, EVAL_PROMPTS)[:n_prompts]]
    started = time.perf_counter()
    report = gold_report(model, tokenizer, records, held_out, generation, seed)
    logger.info("sft: gold report on %d prompts in %.1fs", len(records), time.perf_counter() - started)
    return report


def write_samples(report: PolicyGoldReport, path: Path) -> str:
    """The evaluation replies (prompt, greedy, sampled) as JSON, for reading by eye."""
    rows = [{"prompt": p, "greedy": g, "sampled": s} for p, g, s in report.samples]
    return write_json(rows, path)


@task(name="sft", retries=1, retry_delay_seconds=[10], retry_condition_fn=retry_on_transient_io, log_prints=True)
def sft_task(
    out_dir: str,
    sft_train_path: str,
    sft_eval_path: str,
    config: SFTSection,
    *,
    seed: int,
    generation: GenerationConfig,
    n_eval_prompts: int,
    pairs_path: str | None = None,
    eval_prompts_path: str | None = None,
) -> SFTStageResult:
    """Prefect task around run_sft. Retries only transient I/O errors (OSError); a training error fails at once."""
    result = run_sft(out_dir, sft_train_path, sft_eval_path, config, seed=seed, generation=generation,
                     n_eval_prompts=n_eval_prompts, pairs_path=pairs_path, eval_prompts_path=eval_prompts_path)
    print(result.summary())
    return result
