"""The rm-refresh stage: label fresh on-policy reply pairs and continue training the proxy reward model on them.

PPO pushes the policy towards replies the proxy RM was never trained on, which is where the proxy goes wrong
(reward hacking). This stage samples two replies per prompt from the *current* policy, has the configured
annotator (``refresh.annotator``: simulated, file, rm_judge; see ``rlhf_core.evaluation.annotators``) pick the
better one, validates the labels like any preference data, and splits the fresh pairs by prompt into refresh-train and
on-policy-eval. The current proxy is measured on the on-policy-eval pairs and on the held-out pairs, trained
further on the fresh pairs (plus replayed old ones), and measured again; with ``refresh.validation_fraction``
some fresh training prompts choose the epoch to keep (lowest validation loss, "before training" included).
The refreshed RM is always saved and registered (alias ``candidate``); alias ``champion`` moves to it only
when its held-out accuracy did not drop (beyond ``refresh.promotion_tolerance``), and only then does
:attr:`RefreshResult.reward_model_uri` point to it. The fresh pairs come from ``tasks.refresh_pairs``.

With ``refresh.annotator='file'`` and no ``refresh.labels_file`` the stage exports the unlabelled pairs to
``<out_dir>/iter_<k>/unlabelled_pairs.csv`` and stops with ``tasks.refresh_pairs.LabelsPendingError``; label
them (``tasks/labelling.py`` says how) and rerun with ``refresh.labels_file=<labelled copy>``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.utils.validation import MAX_METRICS_PER_BATCH
from prefect import task
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import RewardTrainingConfig
from rlhf_core.models.roles import load_reward_model
from rlhf_core.training.reward_training import PreferencePair, encode_pairs, evaluate_reward_model, train_reward_model
from tasks.config import PipelineConfig
from tasks.io import atomic_write_dir, write_json
from tasks.refresh_pairs import STAGE, RefreshData, prepare_refresh_data
from tasks.refresh_eval import gold_judged_onpolicy
from tasks.retries import retry_on_transient_io
from tasks.runtime import device_of, dtype_of, local_model
from tasks.tracking import log_file, log_metrics, register_model_dir, set_alias, stage_run
from tasks.typed_yaml import flatten_for_params

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"
ALIASES = ("candidate",)
CHAMPION = "champion"
EVALS_PER_TRAINING = 4
"""On-policy evaluations during the continued training (plus the final one)."""


@dataclass(frozen=True)
class RefreshResult:
    """The refreshed reward model, the promotion decision and the stage's metrics (plain values only)."""

    reward_model_uri: str
    """The RM the next PPO iteration must use: the new version if promoted, else the old ``proxy_rm_uri``."""
    candidate_uri: str
    """``models:/<tracking.reward_model>/<version>`` of the refreshed RM (registered either way)."""
    new_version: int
    """Registry version of the refreshed RM."""
    promoted: bool
    """Whether alias ``champion`` moved to the refreshed RM."""
    promotion_reason: str
    """Why it was (not) promoted, with the held-out accuracies."""
    metrics: dict[str, float]
    """``refresh/{onpolicy,heldout,onpolicy_gold}_{accuracy,loss,margin}_{before,after}`` (``onpolicy_gold``: the
    on-policy eval pairs labelled by gold, demo task only), ``refresh/n_*`` counts, ``labels/*``."""
    pairs_path: str
    """Fresh refresh-train pairs (PREFERENCE_PAIRS Parquet)."""
    eval_pairs_path: str
    """Fresh on-policy-eval pairs (PREFERENCE_PAIRS Parquet), never trained on."""
    quarantine_path: str
    """Rejected labels with reasons (QUARANTINE Parquet)."""
    model_dir: str
    """Local ``save_pretrained`` folder of the refreshed RM."""
    mlflow_run_id: str
    """The nested ``rm-refresh-<iteration>`` MLflow run."""
    metrics_json: str = ""
    """``<out_dir>/iter_<k>/metrics.json``."""
    iteration: int = 0
    """The PPO iteration whose policy wrote the fresh pairs."""


def run_rm_refresh(config: PipelineConfig, iteration: int, policy_uri: str, proxy_rm_uri: str, heldout_rm_uri: str,
                   train_pairs: str, heldout_pairs: str, ppo_prompts: str, out_dir: str,
                   parent_run_id: str, earlier_pairs: Sequence[str] = ()) -> RefreshResult:
    """Label on-policy pairs of ``policy_uri``, continue training ``proxy_rm_uri`` on them, register the result
    and promote it only if its held-out accuracy holds. Outputs go to ``<out_dir>/iter_<k>/``.

    ``earlier_pairs`` are the refresh-train tables of this run's earlier refreshes (``RefreshResult.pairs_path``):
    labels are expensive, so they are trained on again, whether or not their refresh was promoted.

    Raises LabelsPendingError (file annotator, pairs exported, labels not given yet), FileNotFoundError /
    ValueError / DataError naming the file or setting on bad inputs.
    """
    here = Path(out_dir) / f"iter_{iteration:03d}"
    data = prepare_refresh_data(config, iteration, policy_uri, heldout_rm_uri, train_pairs, heldout_pairs,
                                ppo_prompts, here, earlier_pairs)
    rm_dir = local_model(proxy_rm_uri)
    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    model = load_reward_model(rm_dir, dtype_of(config)).to(device_of(config))
    cfg = training_config(config, iteration)
    params = {**{f"refresh.{k}": v for k, v in flatten_for_params(config.refresh).items()},
              **{f"refresh.training.{k}": v for k, v in flatten_for_params(cfg).items()},
              "iteration": iteration, "inputs.policy_uri": policy_uri, "inputs.proxy_rm_uri": proxy_rm_uri,
              "inputs.heldout_rm_uri": heldout_rm_uri, "inputs.train_pairs": train_pairs,
              "inputs.heldout_pairs": heldout_pairs, "inputs.ppo_prompts": ppo_prompts}
    with stage_run(f"{STAGE}-{iteration}", parent_run_id, params=params, tags={"iteration": str(iteration)}) as run:
        run_id = run.info.run_id
        judged = {"onpolicy": data.onpolicy, "heldout": data.heldout,
                  "onpolicy_gold": gold_judged_onpolicy(config, data.onpolicy)}
        metrics = {**data.counts, **accuracies(model, tokenizer, judged, cfg, "before")}
        metrics |= _continue_training(model, tokenizer, data, cfg, run_id)
        metrics |= accuracies(model, tokenizer, judged, cfg, "after")
        new_dir = atomic_write_dir(here / "reward_model", lambda tmp: _save(model, tokenizer, tmp))
        ref = register_model_dir(new_dir, config.tracking.reward_model, run_id, aliases=ALIASES)
        promoted, reason = promotion(metrics["refresh/heldout_accuracy_before"],
                                     metrics["refresh/heldout_accuracy_after"], config.refresh.promotion_tolerance,
                                     changed=metrics["refresh/best_epoch"] > 0)
        if promoted:
            set_alias(config.tracking.reward_model, CHAMPION, ref.version)
        metrics["refresh/promoted"] = float(promoted)
        uri = ref.uri if promoted else proxy_rm_uri
        record = {"metrics": metrics, "reward_model_uri": uri, "candidate_uri": ref.uri, "promoted": promoted,
                  "promotion_reason": reason, "mlflow_run_id": run_id}
        metrics_json = _log_outputs(run_id, iteration, record, data.tables, here / METRICS_FILE)
    log.info("rm-refresh %d: on-policy accuracy %.3f -> %.3f, held-out %.3f -> %.3f; %s", iteration,
             metrics["refresh/onpolicy_accuracy_before"], metrics["refresh/onpolicy_accuracy_after"],
             metrics["refresh/heldout_accuracy_before"], metrics["refresh/heldout_accuracy_after"], reason)
    return RefreshResult(uri, ref.uri, ref.version, promoted, reason, metrics, data.tables["train"],
                         data.tables["eval"], data.tables["quarantine"], str(new_dir), run_id, metrics_json, iteration)


def _log_outputs(run_id: str, iteration: int, record: Mapping[str, object], tables: Mapping[str, str],
                 metrics_path: Path) -> str:
    """Final metrics (at step ``iteration``), the promotion reason as a tag, the tables and metrics.json."""
    log_metrics(record["metrics"], step=iteration, run_id=run_id)
    MlflowClient().set_tag(run_id, "refresh.promotion", str(record["promotion_reason"]))
    for path in tables.values():
        log_file(path, "pairs", run_id=run_id)
    metrics_json = write_json(record, metrics_path)
    log_file(metrics_json, run_id=run_id)
    return metrics_json


# --------------------------------------------------------------------------------------------- training


def training_config(config: PipelineConfig, iteration: int) -> RewardTrainingConfig:
    """``reward_model.training`` with refresh's epochs / learning rate, a per-iteration shuffle seed, and
    best-epoch selection when ``refresh.validation_fraction`` holds pairs back for it."""
    base, section = config.reward_model.training, config.refresh
    return replace(base, epochs=section.epochs, learning_rate=section.learning_rate or base.learning_rate,
                   seed=base.seed + iteration, select_best_epoch=section.validation_fraction > 0)


def accuracies(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
               judged: Mapping[str, Sequence[PreferencePair]], cfg: RewardTrainingConfig, when: str) -> dict[str, float]:
    """``refresh/<name>_{accuracy,loss,margin}_<when>`` of ``model`` for each non-empty named pair set
    (``onpolicy``: annotator labels, ``heldout``, and on the demo ``onpolicy_gold``: gold labels)."""
    metrics = {}
    for name, pairs in judged.items():
        if not pairs:
            continue
        result = evaluate_reward_model(model, tokenizer, encode_pairs(tokenizer, pairs, cfg.max_length), cfg.batch_size)
        metrics |= {f"refresh/{name}_accuracy_{when}": result.accuracy, f"refresh/{name}_loss_{when}": result.loss,
                    f"refresh/{name}_margin_{when}": result.margin_mean}
    return metrics


def _continue_training(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, data: RefreshData,
                       cfg: RewardTrainingConfig, run_id: str) -> dict[str, float]:
    """Train in place on ``data.train``; returns ``refresh/train_steps`` and ``refresh/best_epoch``.

    With validation pairs the epoch with the lowest validation loss is kept (``cfg.select_best_epoch``, set by
    :func:`training_config`) and the ``refresh/eval/*`` curve is theirs; without, it is the on-policy pairs'
    (which then only watch). Per-step ``refresh/train/*`` and ``refresh/eval/*`` curves go to MLflow.
    """
    steps = cfg.epochs * math.ceil(len(data.train) / cfg.batch_size)
    curve: list[Metric] = []

    def on_log(step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        curve.extend(Metric(f"refresh/{k.removeprefix('rm/')}", float(v), now, step) for k, v in metrics.items())

    log.info("rm-refresh: %d training pairs, %d validation pairs, %d steps", len(data.train), len(data.validation),
             steps)
    result = train_reward_model(model, tokenizer, data.train, data.validation or data.onpolicy, cfg, on_log=on_log,
                                eval_every=max(1, steps // EVALS_PER_TRAINING))
    client = MlflowClient()
    for start in range(0, len(curve), MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=curve[start : start + MAX_METRICS_PER_BATCH])
    best = result.best_epoch if result.best_epoch is not None else cfg.epochs
    return {"refresh/train_steps": float(steps), "refresh/best_epoch": float(best)}


def promotion(heldout_before: float, heldout_after: float, tolerance: float, changed: bool = True) -> tuple[bool, str]:
    """(promote?, why): promote when held-out accuracy is at least the old RM's minus ``tolerance``. A refresh
    that kept the weights from before training (``changed=False``) is not promoted: the same RM under a new
    version would only restart the detector's history."""
    if not changed:
        return False, ("not promoted: no epoch lowered the validation loss, so the refreshed RM is the old one; "
                       "champion and the RM PPO uses stay as they were")
    if heldout_after >= heldout_before - tolerance:
        if tolerance == 0:
            return True, f"promoted: held-out accuracy {heldout_after:.3f} >= {heldout_before:.3f} of the old RM"
        return True, (f"promoted: held-out accuracy {heldout_after:.3f} >= {heldout_before - tolerance:.3f} (the old "
                      f"RM's {heldout_before:.3f} minus the tolerance {tolerance})")
    return False, (f"not promoted: held-out accuracy fell from {heldout_before:.3f} to {heldout_after:.3f} (tolerance "
                   f"{tolerance}); champion and the RM PPO uses stay as they were")


def _save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


rm_refresh_task = task(name=STAGE, retries=1, retry_condition_fn=retry_on_transient_io)(run_rm_refresh)
