"""The reward-model stage: train the proxy reward model PPO optimises and the held-out one only evaluation sees.

The proxy learns the train pairs and is evaluated on the held-out pairs; the held-out reward model learns the
held-out pairs (which the proxy never saw) and is evaluated on a sample of the train pairs. Both start from
the same ``reward_model.init`` rule with their own seeds. Everything runs inside one nested MLflow run
(``reward-model``): params, per-step curves, final metrics, plots and both registered models (alias
``candidate``). Outputs under ``out_dir``: ``proxy/`` and ``heldout/`` (model + tokenizer, ``save_pretrained``
layout), the PNGs and ``metrics.json``. The returned :class:`RewardModelResult` holds only strings and numbers.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import MAX_METRICS_PER_BATCH
from prefect import task
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import RewardTrainingConfig
from rlhf_core.data import PREFERENCE_PAIRS
from rlhf_core.evaluation.metrics import spearman
from rlhf_core.models.lm import build_reward_model, config_for_tokenizer
from rlhf_core.models.roles import fuse_activations, load_reward_model, sequence_scores
from rlhf_core.models.text import pad_id, right_pad
from rlhf_core.training.reward_training import PreferencePair, RewardTrainingResult, encode_pairs
from tasks.config import PipelineConfig
from tasks.launch import fit_reward_model
from tasks.retries import retry_on_transient_io
from tasks.io import atomic_write_dir, read_parquet, write_json
from tasks.plots import loss_curve, save_figure, score_histograms
from tasks.runtime import device_of, dtype_of, local_model
from tasks.tracking import get_alias_version, log_file, log_metrics, register_model_dir, set_alias, stage_run
from tasks.typed_yaml import flatten_for_params

if TYPE_CHECKING:
    from prefect import Task
    from prefect.client.schemas.objects import TaskRun
    from prefect.states import State

log = logging.getLogger(__name__)

STAGE = "reward-model"
METRICS_FILE = "metrics.json"
SCORES_PNG = "rm_proxy_heldout_scores.png"
MAX_CROSS_EVAL_PAIRS = 1000
"""The held-out RM is evaluated on at most this many train pairs (a seeded sample): enough for a stable
accuracy, and it keeps the stage's second evaluation cheap on large datasets."""
EVALS_PER_TRAINING = 4
"""Evaluations during each training (plus the final one): the points of the eval line on the loss plot."""
FLUSH_EVERY = 10
"""Per-step metrics are sent to MLflow in one batch every this many steps (and at the end)."""
ALIASES = ("candidate",)


@dataclass(frozen=True)
class RewardModelResult:
    """Both registered reward models and the stage's metrics (plain values: Prefect caches this)."""

    proxy_uri: str
    """``models:/<tracking.reward_model>/<version>``: the RM PPO optimises against."""
    proxy_version: int
    """Registry version of the proxy RM."""
    proxy_dir: str
    """Local ``save_pretrained`` folder of the proxy RM (model + tokenizer)."""
    heldout_uri: str
    """``models:/<tracking.heldout_reward_model>/<version>``: the RM only evaluation uses."""
    heldout_version: int
    """Registry version of the held-out RM."""
    heldout_dir: str
    """Local folder of the held-out RM."""
    metrics: dict[str, float]
    """``rm/{proxy,heldout}/eval/*`` (on data the model never saw), ``rm/{proxy,heldout}/train/*``, ``rm/cross/*``."""
    mlflow_run_id: str
    """The nested ``reward-model`` MLflow run."""
    metrics_json: str = ""
    """``out_dir/metrics.json``."""


@dataclass(frozen=True)
class _Fitted:
    """One trained reward model with what the stage reports about it."""

    model: PreTrainedModel
    history: RewardTrainingResult
    metrics: dict[str, float]


def run_reward_model(config: PipelineConfig, train_pairs: str, heldout_pairs: str, sft_model: str | None,
                     out_dir: str, parent_run_id: str) -> RewardModelResult:
    """Train, evaluate, save and register the proxy and held-out reward models under ``parent_run_id``.

    ``sft_model`` (local folder or ``models:/`` URI) supplies the tokenizer and, with ``reward_model.init``
    'sft', the backbone. Raises FileNotFoundError / ValueError naming the file or setting on bad inputs.
    """
    out, section = Path(out_dir), config.reward_model
    train, heldout = read_pairs(train_pairs), read_pairs(heldout_pairs)
    init_dir, tokenizer = resolve_init(section.init, sft_model)
    cross_sample = _sample(train, MAX_CROSS_EVAL_PAIRS, section.heldout.seed)
    params = {**{f"reward_model.{k}": v for k, v in flatten_for_params(section).items()},
              "inputs.train_pairs": train_pairs, "inputs.heldout_pairs": heldout_pairs,
              "inputs.sft_model": str(sft_model), "inputs.n_train_pairs": len(train),
              "inputs.n_heldout_pairs": len(heldout), "inputs.n_cross_eval_pairs": len(cross_sample)}
    with stage_run(STAGE, parent_run_id, params=params) as run:
        run_id = run.info.run_id
        proxy = _fit("proxy", _init_model(config, init_dir, tokenizer, section.training.seed), tokenizer,
                     train, heldout, section.training, run_id, config, out / "distributed" / "proxy")
        held = _fit("heldout", _init_model(config, init_dir, tokenizer, section.heldout.seed), tokenizer,
                    heldout, cross_sample, section.heldout, run_id, config, out / "distributed" / "heldout")
        cross, proxy_scores = _cross_metrics(proxy.model, held.model, tokenizer, heldout, section.training.max_length)
        metrics = {**proxy.metrics, **held.metrics, **cross}
        log_metrics(cross, run_id=run_id)  # each model's eval and train metrics went in at its own steps
        for png in _plots(out, proxy.history, held.history, proxy_scores):
            log_file(png, "plots", run_id=run_id)
        proxy_dir = _save(proxy.model, tokenizer, out / "proxy")
        held_dir = _save(held.model, tokenizer, out / "heldout")
        proxy_ref = register_model_dir(proxy_dir, config.tracking.reward_model, run_id, aliases=ALIASES)
        held_ref = register_model_dir(held_dir, config.tracking.heldout_reward_model, run_id, aliases=ALIASES)
        for ref in (proxy_ref, held_ref):  # the first reward model is the champion that refreshes must match
            if get_alias_version(ref.name, "champion") is None:
                set_alias(ref.name, "champion", ref.version)
        record = {"metrics": metrics, "proxy_uri": proxy_ref.uri, "heldout_uri": held_ref.uri,
                  "proxy_dir": str(proxy_dir), "heldout_dir": str(held_dir), "mlflow_run_id": run_id}
        metrics_json = write_json(record, out / METRICS_FILE)
        log_file(metrics_json, run_id=run_id)
    log.info("reward-model: proxy %s (held-out accuracy %.3f), held-out %s (accuracy %.3f on train pairs)",
             proxy_ref.uri, metrics["rm/proxy/eval/accuracy"], held_ref.uri, metrics["rm/heldout/eval/accuracy"])
    return RewardModelResult(proxy_ref.uri, proxy_ref.version, str(proxy_dir), held_ref.uri, held_ref.version,
                             str(held_dir), metrics, run_id, metrics_json)


# --------------------------------------------------------------------------------------------- inputs


def read_pairs(path: str) -> list[PreferencePair]:
    """The rows of a PREFERENCE_PAIRS Parquet table as PreferencePair (a null or NaN margin becomes None)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"preference table {path} does not exist; run the data-prep stage first "
                                "(it writes train_pairs.parquet and heldout_pairs.parquet)")
    rows = read_parquet(path, PREFERENCE_PAIRS)
    if not rows:
        raise ValueError(f"preference table {path} has no rows; the reward model needs (prompt, chosen, rejected) "
                         "pairs: check the data-prep counts (quarantine, split fractions) or add data")
    return [PreferencePair(str(r["prompt"]), str(r["chosen"]), str(r["rejected"]), _margin(r["margin"]))
            for r in rows]


def _margin(value: object) -> float | None:
    return None if value is None or math.isnan(float(value)) else float(value)


def _sample(pairs: Sequence[PreferencePair], limit: int, seed: int) -> list[PreferencePair]:
    """All pairs, or a seeded sample of ``limit`` of them."""
    return list(pairs) if len(pairs) <= limit else random.Random(seed).sample(list(pairs), limit)


def resolve_init(init: str, sft_model: str | None) -> tuple[str | None, PreTrainedTokenizerBase]:
    """(local folder of the initial weights or None for 'scratch', tokenizer) for ``reward_model.init``.

    'sft' and 'scratch' take the tokenizer from the SFT policy; a path or ``models:/`` URI of an existing
    reward model brings its own.
    """
    if init in ("sft", "scratch"):
        if sft_model is None:
            raise ValueError(f"reward_model.init={init!r} needs the SFT policy (sft_model is None); run the sft "
                             "stage, set sft.base_model, or set reward_model.init to a reward-model path")
        sft_dir = local_model(sft_model)
        return (sft_dir if init == "sft" else None), _load_tokenizer(sft_dir, "sft_model")
    init_dir = local_model(init)
    return init_dir, _load_tokenizer(init_dir, "reward_model.init")


def _load_tokenizer(path: str, setting: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"{setting}: no tokenizer can be loaded from {path!r} ({err}); give a folder saved with "
                         "save_pretrained (model + tokenizer)") from err


def _init_model(config: PipelineConfig, init_dir: str | None, tokenizer: PreTrainedTokenizerBase,
                seed: int) -> PreTrainedModel:
    """A 1-output sequence classifier on the configured device: SFT backbone + fresh head, fresh, or loaded."""
    torch.manual_seed(seed)  # the fresh score head (and a scratch model) differ per seed, reproducibly
    init, dtype = config.reward_model.init, dtype_of(config)
    if init == "scratch":
        model = build_reward_model(config_for_tokenizer(tokenizer, config.sft.model_size), seed).to(dtype)
    elif init == "sft":
        model = fuse_activations(AutoModelForSequenceClassification.from_pretrained(
            init_dir, num_labels=1, dtype=dtype, pad_token_id=pad_id(tokenizer)))
    else:
        model = load_reward_model(init_dir, dtype)
    # The head reads the last real token by looking for padding; the tokenizer's pad id must be the model's.
    model.config.pad_token_id = pad_id(tokenizer)
    return model.to(device_of(config))


# --------------------------------------------------------------------------------------------- training


class _StepLogger:
    """``on_log`` for train_reward_model: renames ``rm/x/y`` to ``rm/<role>/x/y``, buffers, sends in batches."""

    def __init__(self, role: str, run_id: str) -> None:
        self.role, self.run_id = role, run_id
        self.pending: list[Metric] = []

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        self.pending += [Metric(self.name(k), float(v), now, step) for k, v in metrics.items()]
        if "rm/eval/accuracy" in metrics:
            log.info("reward-model %s step %d: eval accuracy %.3f, loss %.4f, margin %.3f", self.role, step,
                     metrics["rm/eval/accuracy"], metrics["rm/eval/loss"], metrics["rm/eval/margin_mean"])
        elif step % FLUSH_EVERY == 0:
            log.info("reward-model %s step %d: train loss %.4f", self.role, step, metrics["rm/train/loss"])
        if step % FLUSH_EVERY == 0:
            self.flush()

    def name(self, key: str) -> str:
        return f"rm/{self.role}/{key.removeprefix('rm/')}"

    def flush(self) -> None:
        client = MlflowClient()
        for start in range(0, len(self.pending), MAX_METRICS_PER_BATCH):
            client.log_batch(self.run_id, metrics=self.pending[start:start + MAX_METRICS_PER_BATCH])
        self.pending = []


def _fit(role: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, train: Sequence[PreferencePair],
         evaluate_on: Sequence[PreferencePair], cfg: RewardTrainingConfig, run_id: str, config: PipelineConfig,
         workdir: Path) -> _Fitted:
    """Train one reward model, log its curve under ``rm/<role>/``, and return its final metrics.

    Training runs in this process, or on DeepSpeed workers when ``distributed.deepspeed_config`` is set
    (tasks/launch.py; ``workdir`` holds their job files).
    """
    steps = cfg.epochs * math.ceil(len(train) / cfg.batch_size)
    log.info("reward-model %s: %d train pairs, %d eval pairs, %d steps", role, len(train), len(evaluate_on), steps)
    on_log = _StepLogger(role, run_id)
    history = fit_reward_model(config, model, tokenizer, train, evaluate_on, cfg, on_log,
                               max(1, steps // EVALS_PER_TRAINING), workdir)
    on_log.flush()
    final = history.final_eval
    metrics = {f"rm/{role}/eval/{k}": float(v) for k, v in asdict(final).items()}
    summary = {f"rm/{role}/train/final_loss": history.train_loss[-1], f"rm/{role}/train/steps": float(steps),
               f"rm/{role}/train/seconds": history.seconds, f"rm/{role}/train/n_truncated": float(history.n_truncated)}
    log_metrics(summary, step=steps, run_id=run_id)  # the final eval was logged by on_log at this step
    metrics.update(summary)
    return _Fitted(model.eval(), history, metrics)


@torch.no_grad()
def pair_scores(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pairs: Sequence[PreferencePair],
                max_length: int, batch_size: int = 64) -> tuple[list[float], list[float]]:
    """Scores of every chosen and every rejected reply, in pair order: ((N,), (N,)) as lists."""
    encoded = encode_pairs(tokenizer, pairs, max_length)
    device, chosen, rejected = next(model.parameters()).device, [], []
    for start in range(0, len(pairs), batch_size):
        c, r = encoded.chosen[start:start + batch_size], encoded.rejected[start:start + batch_size]
        ids, mask = right_pad(c + r, pad_id(tokenizer))  # (2B, T)
        scores = sequence_scores(model, ids.to(device), mask.to(device)).float().cpu().tolist()
        chosen += scores[:len(c)]
        rejected += scores[len(c):]
    return chosen, rejected


def _cross_metrics(proxy: PreTrainedModel, heldout: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                   pairs: Sequence[PreferencePair], max_length: int) -> tuple[dict[str, float], dict[str, list]]:
    """How far the proxy agrees with the held-out RM on the held-out pairs (unseen by the proxy).

    ``rm/cross/agreement``: share of pairs both RMs order the same way; ``rm/cross/spearman``: rank
    correlation of their scores over all replies. Also returns the proxy's scores for the histogram.
    """
    p_chosen, p_rejected = pair_scores(proxy, tokenizer, pairs, max_length)
    h_chosen, h_rejected = pair_scores(heldout, tokenizer, pairs, max_length)
    agree = [(pc > pr) == (hc > hr) for pc, pr, hc, hr in zip(p_chosen, p_rejected, h_chosen, h_rejected)]
    metrics = {"rm/cross/agreement": sum(agree) / len(agree),
               "rm/cross/spearman": float(spearman(p_chosen + p_rejected, h_chosen + h_rejected))}
    return metrics, {"chosen": p_chosen, "rejected": p_rejected}


# --------------------------------------------------------------------------------------------- outputs


def _plots(out: Path, proxy: RewardTrainingResult, heldout: RewardTrainingResult,
           proxy_scores: Mapping[str, Sequence[float]]) -> list[Path]:
    """Loss curves of both RMs and the proxy's score histogram on the held-out pairs, as PNGs under ``out``."""
    paths = []
    for role, history, evaluated_on in (("proxy", proxy, "held-out pairs"), ("heldout", heldout, "train pairs")):
        eval_steps = [step for step, _ in history.evals]
        fig = loss_curve(range(1, len(history.train_loss) + 1), history.train_loss, eval_steps,
                         [e.loss for _, e in history.evals], title=f"{role} reward model (eval on {evaluated_on})")
        paths.append(save_figure(fig, out / f"rm_{role}_loss.png"))
    fig = score_histograms(proxy_scores, title="Proxy RM scores on held-out pairs", xlabel="proxy score")
    paths.append(save_figure(fig, out / SCORES_PNG))
    return paths


def _save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path) -> Path:
    """Model + tokenizer in ``save_pretrained`` layout, moved into place only when complete."""
    model.eval()

    def save(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return atomic_write_dir(target, save)


# --------------------------------------------------------------------------------------------- prefect

#: MLflow error codes of a busy store (a locked SQLite file, a rate-limited server); a retry may pass.
#: Not INTERNAL_ERROR: it is the default code of every MlflowException, bugs included.
_TRANSIENT_MLFLOW_CODES = frozenset({"TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED"})


def retry_on_transient_io_or_registry(task: Task, task_run: TaskRun, state: State) -> bool:
    """Retry what ``retry_on_transient_io`` retries (passing OSErrors) plus transient MLflow server errors;
    never configuration or data errors (ValueError, FileNotFoundError, KeyError, DataError), which repeat."""
    if retry_on_transient_io(task, task_run, state):
        return True
    error = state.result(raise_on_failure=False)
    return isinstance(error, MlflowException) and error.error_code in _TRANSIENT_MLFLOW_CODES


reward_model_task = task(name=STAGE, retries=1, retry_delay_seconds=2,
                         retry_condition_fn=retry_on_transient_io_or_registry)(run_reward_model)
