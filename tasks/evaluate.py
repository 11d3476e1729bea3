"""The heldout-eval stage: judge one PPO iteration's policy against the reference, flag reward hacking, promote.

For a fixed set of evaluation prompts the policy and the reference each answer (same seed, so the reference's
replies are identical in every iteration); the replies are scored by the proxy reward model (the one PPO
optimised), by the held-out reward model (trained on different pairs) and, on the demo task, by the hidden
gold scorer. The stage logs everything to a nested MLflow run, writes a sample table, gives a reward-hacking
verdict over the iterations so far, and moves the ``champion`` alias to the policy only when the verdict is
``ok`` and the policy beats the reference often enough (gold win rate on the demo task, else held-out).

Gold is read here and only here on the pipeline side (evaluation only; ``tests/unit/test_gold_isolation.py``).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
from mlflow import MlflowClient
from prefect import task
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.data import Column, DType, TableSchema
from rlhf_core.demo import gold_score
from rlhf_core.evaluation.metrics import HackingRules, HackingVerdict, IterationEval, detect_reward_hacking
from rlhf_core.evaluation.policy_eval import (ReplySet, comparison_metrics, evaluation_generation, fit_max_new_tokens,
                                              sample_and_judge, with_scores)
from rlhf_core.models.roles import freeze, load_policy, load_reward_model
from rlhf_core.models.scoring import RewardModelScorer
from rlhf_core.models.text import encode_prompt, same_vocabulary
from tasks.config import PipelineConfig
from tasks.retries import retry_on_transient_io
from tasks.io import atomic_write, write_json, write_parquet
from tasks.plots import PolicyPoint, length_distribution, overoptimisation_curve, save_figure, score_histograms
from tasks.runtime import device_of, dtype_of, local_model
from tasks.tracking import get_alias_version, log_file, log_metrics, set_alias, stage_run

log = logging.getLogger(__name__)

STAGE = "heldout-eval"
CHAMPION = "champion"
SAMPLES_FILE = "eval_samples.parquet"
METRICS_FILE = "eval_metrics.json"
REASONS_FILE = "eval_reasons.txt"
STATUS_TAG = "eval.status"
#: ``eval/hacking`` metric value of each verdict.
HACKING_CODES = {"ok": 0, "warn": 1, "hacking": 2}
_VERSION_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[^/]+))$")

_S, _F, _I = DType.STRING, DType.FLOAT64, DType.INT64
EVAL_SAMPLES = TableSchema(
    "eval_samples",
    (Column("prompt", _S, doc="Evaluation prompt."),
     Column("reference_reply", _S, doc="The reference policy's reply (the same in every iteration)."),
     Column("policy_reply", _S, doc="The evaluated policy's reply."),
     Column("proxy_policy", _F, doc="Proxy reward-model score of the policy's reply."),
     Column("proxy_reference", _F, doc="Proxy reward-model score of the reference's reply."),
     Column("heldout_policy", _F, doc="Held-out reward-model score of the policy's reply."),
     Column("heldout_reference", _F, doc="Held-out reward-model score of the reference's reply."),
     Column("gold_policy", _F, nullable=True, doc="Gold score of the policy's reply (demo task only, else null)."),
     Column("gold_reference", _F, nullable=True, doc="Gold score of the reference's reply (demo task only)."),
     Column("kl", _F, doc="Per-sequence k1 KL(policy || reference), nats summed over response tokens."),
     Column("kl_k3", _F, doc="Per-sequence k3 KL (non-negative estimator)."),
     Column("length", _I, doc="Policy reply length in tokens (stop token included)."),
     Column("reference_length", _I, doc="Reference reply length in tokens."),
     Column("stopped", _I, doc="1 when the policy's reply ended with eos, 0 when cut at max_new_tokens.")),
)


@dataclass(frozen=True)
class EvalResult:
    """What the heldout-eval stage found (no tensors, no models)."""

    iteration: int
    """PPO iteration the policy comes from (the MLflow step of every metric)."""
    metrics: dict[str, float]
    """``eval/...`` metrics: pass this dict in ``history`` of the next iteration's eval."""
    status: str
    """Reward-hacking verdict: 'ok', 'warn' or 'hacking'."""
    reasons: tuple[str, ...]
    """One sentence per finding of the verdict, plus why the policy was not promoted (if it was not)."""
    promoted: bool
    """Whether the ``champion`` alias now points at this policy's registered version."""
    samples_path: str
    """The sample table (``EVAL_SAMPLES``) as Parquet."""
    mlflow_run_id: str
    """The nested ``heldout-eval`` run."""


def run_heldout_eval(
    config: PipelineConfig,
    policy_uri: str,
    reference_uri: str,
    proxy_rm_uri: str,
    heldout_rm_uri: str,
    eval_prompts: str,
    out_dir: str,
    parent_run_id: str,
    iteration: int,
    history: list[dict[str, float]] | None = None,
    policy_version: int | None = None,
    best_of_n: list[dict] | None = None,
    rm_generation: int = 0,
) -> EvalResult:
    """Evaluate ``policy_uri`` against ``reference_uri`` on ``eval_prompts`` and gate its promotion.

    ``history`` holds the ``EvalResult.metrics`` of the earlier iterations of this run, oldest first (without
    a baseline: the stage prepends one computed from the reference's own replies, KL 0). ``rm_generation``
    counts the promoted reward-model refreshes before this iteration (recorded as ``eval/rm_generation``):
    the hacking detector compares only iterations scored by the same proxy RM, because proxy scores of
    different reward models are on different scales, while the over-optimisation plot shows every iteration. URIs are local
    folders or ``models:/name/version`` / ``models:/name@alias``. ``policy_version`` names the registered
    version to promote; without it the version is read from ``policy_uri``. ``best_of_n`` (the
    ``BestOfNResult.points`` of the best-of-n stage: dicts with ``kl``, ``proxy``, ``heldout``, ``gold``) is drawn
    on the over-optimisation plot as the baseline.
    """
    best_of_n_plot = best_of_n_series(best_of_n)
    prompts = read_eval_prompts(eval_prompts, config.eval.n_prompts)
    out = Path(out_dir)
    params = {"iteration": iteration, "policy_uri": policy_uri, "reference_uri": reference_uri,
              "proxy_rm_uri": proxy_rm_uri, "heldout_rm_uri": heldout_rm_uri, "n_prompts": len(prompts),
              "temperature": config.eval.temperature}
    with stage_run(STAGE, parent_run_id, params=params) as run:
        policy, reference = judge_replies(config, prompts, policy_uri, reference_uri, proxy_rm_uri, heldout_rm_uri)
        metrics = {"eval/iteration": float(iteration), "eval/rm_generation": float(rm_generation),
                   **comparison_metrics(policy, reference)}
        same_rm = [h for h in history or [] if int(h.get("eval/rm_generation", 0)) == rm_generation]
        verdict = hacking_verdict(config, metrics, same_rm)
        version, refusal = promotion_decision(config, verdict, metrics, policy_uri, policy_version)
        reasons = (*verdict.reasons, *([refusal] if refusal else []))
        metrics["eval/hacking"] = float(HACKING_CODES[verdict.status])
        metrics["eval/promoted"] = float(refusal is None)
        samples = write_samples(prompts, policy, reference, out / SAMPLES_FILE)
        _log_run(run.info.run_id, metrics, verdict.status, reasons, iteration, out, samples)
        _log_plots(run.info.run_id, policy, reference, metrics, history or [], iteration, out, best_of_n_plot)
        if refusal is None:
            set_alias(config.tracking.policy_model, CHAMPION, version)
            log.info("promoted %s version %d to @%s", config.tracking.policy_model, version, CHAMPION)
    return EvalResult(iteration, metrics, verdict.status, reasons, refusal is None, samples, run.info.run_id)


heldout_eval_task = task(name="heldout-eval", retries=1, retry_delay_seconds=10,
                         retry_condition_fn=retry_on_transient_io)(run_heldout_eval)
"""Prefect task around :func:`run_heldout_eval`; retries once, only on transient I/O errors (never on a bad
input: ValueError, FileNotFoundError)."""


# --- inputs and models ----------------------------------------------------------------------------------


def read_eval_prompts(path: str, n_prompts: int) -> list[str]:
    """The first ``n_prompts`` prompts of a Parquet table with a ``prompt`` column (fewer if it is shorter)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"evaluation prompts {path} do not exist; run data-prep (eval_prompts.parquet) "
                                "or pass a Parquet file with a 'prompt' column")
    columns = pq.read_schema(path).names
    if "prompt" not in columns:
        raise ValueError(f"{path} has columns {columns} but no 'prompt' column; evaluation needs one prompt per row")
    prompts = [str(p) for p in pq.read_table(path, columns=["prompt"]).column("prompt").to_pylist()[:n_prompts]]
    if not prompts:
        raise ValueError(f"{path} holds no prompts; evaluation needs at least one")
    if len(prompts) < n_prompts:
        log.warning("%s holds %d prompts, fewer than eval.n_prompts=%d; evaluating all of them",
                    path, len(prompts), n_prompts)
    return prompts


def _tokenizer_of(model_dir: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved next to a model, or None when the folder holds none."""
    folder = Path(model_dir)
    if folder.is_dir() and not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(model_dir)


def load_frozen_lm(config: PipelineConfig, uri: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """A frozen causal LM (eval mode, no dropout, no gradients) and its folder's tokenizer, on the config's device."""
    folder = local_model(uri)
    return freeze(load_policy(folder, dtype_of(config)).to(device_of(config))), _tokenizer_of(folder)


def reward_scorer(config: PipelineConfig, uri: str, tokenizer: PreTrainedTokenizerBase, max_length: int) -> RewardModelScorer:
    """A frozen reward model as a scorer of policy rollouts (re-tokenizing when its tokenizer differs)."""
    folder = local_model(uri)
    model = load_reward_model(folder, dtype_of(config)).to(device_of(config))
    return RewardModelScorer(freeze(model), tokenizer, _tokenizer_of(folder), max_length, config.eval.batch_size)


def judge_replies(config: PipelineConfig, prompts: Sequence[str], policy_uri: str, reference_uri: str,
                  proxy_rm_uri: str, heldout_rm_uri: str) -> tuple[ReplySet, ReplySet]:
    """Replies of policy and reference, scored by the proxy and held-out RMs (and gold on the demo task)."""
    policy, tokenizer = load_frozen_lm(config, policy_uri)
    reference, ref_tokenizer = load_frozen_lm(config, reference_uri)
    if tokenizer is None:
        raise FileNotFoundError(f"policy {policy_uri} has no tokenizer files; save it with tokenizer.save_pretrained")
    if ref_tokenizer is not None and not same_vocabulary(tokenizer, ref_tokenizer):
        raise ValueError(f"policy {policy_uri} and reference {reference_uri} have different vocabularies; KL "
                         "needs both on the same tokens: use the policy's SFT checkpoint as the reference")
    scorers = {"proxy": reward_scorer(config, proxy_rm_uri, tokenizer, config.reward_model.training.max_length),
               "heldout": reward_scorer(config, heldout_rm_uri, tokenizer, config.reward_model.heldout.max_length)}
    prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
    budget = fit_max_new_tokens(policy, prompt_ids, config.ppo.generation.max_new_tokens)
    generation = evaluation_generation(config.ppo.generation, config.eval.temperature, config.eval.batch_size,
                                       budget)
    replies = sample_and_judge(policy, reference, tokenizer, prompt_ids, generation, scorers, config.seed)
    if config.data.source == "demo":
        replies = tuple(with_scores(r, "gold", [gold_score(p, t) for p, t in zip(prompts, r.replies, strict=True)])
                        for r in replies)
    return replies


# --- verdict and promotion --------------------------------------------------------------------------------


def iteration_eval(metrics: Mapping[str, float], prefix: str = "eval", kl: float | None = None) -> IterationEval:
    """An ``IterationEval`` from eval metrics (``prefix='eval/reference'`` and ``kl=0`` give the baseline)."""
    def get(key: str) -> float:
        if f"{prefix}/{key}" not in metrics:
            raise ValueError(f"eval history entry lacks {prefix}/{key} (has {sorted(metrics)}); history must hold "
                             "the EvalResult.metrics of earlier iterations")
        return float(metrics[f"{prefix}/{key}"])
    gold = metrics.get(f"{prefix}/gold/mean")
    return IterationEval(proxy_mean=get("proxy/mean"), heldout_mean=get("heldout/mean"),
                         gold_mean=None if gold is None else float(gold),
                         kl_mean=get("kl/mean") if kl is None else kl, length_mean=get("length/mean"),
                         repetition_rate=get("repetition_rate"))


def hacking_rules(config: PipelineConfig) -> HackingRules:
    """``HackingRules`` from ``config.eval``; ``hacking_margin`` 0 (unset) keeps the rules' default drop."""
    margin = config.eval.hacking_margin
    return HackingRules(kl_budget=config.eval.kl_budget, min_drop=margin if margin > 0 else HackingRules.min_drop)


def hacking_verdict(config: PipelineConfig, metrics: Mapping[str, float],
                    history: Sequence[Mapping[str, float]]) -> HackingVerdict:
    """Verdict over [reference baseline, *history, this iteration] (oldest first)."""
    evals = [iteration_eval(metrics, "eval/reference", kl=0.0), *map(iteration_eval, history),
             iteration_eval(metrics)]
    return detect_reward_hacking(evals, hacking_rules(config))


def _registered_version(config: PipelineConfig, policy_uri: str, policy_version: int | None) -> int | str:
    """The version to promote, or a sentence saying why there is none."""
    name = config.tracking.policy_model
    match = _VERSION_URI.match(policy_uri)
    if match is not None and match["name"] != name:
        return f"policy {policy_uri} is not a version of tracking.policy_model {name!r}"
    if policy_version is not None:
        return policy_version
    if match is None:
        return f"policy {policy_uri} is not a registered version; pass policy_version to promote it"
    if match["version"] is not None:
        return int(match["version"])
    version = get_alias_version(name, match["alias"])
    return version if version is not None else f"{policy_uri}: alias {match['alias']!r} does not exist"


def promotion_decision(config: PipelineConfig, verdict: HackingVerdict, metrics: Mapping[str, float],
                       policy_uri: str, policy_version: int | None) -> tuple[int, str | None]:
    """(version, None) when the policy may become champion, else (-1, the reason it may not)."""
    judge = "gold" if "eval/win_rate/gold" in metrics else "heldout"
    wins = metrics[f"eval/win_rate/{judge}"]
    if verdict.status != "ok":
        return -1, f"not promoted: the reward-hacking verdict is {verdict.status!r}, not 'ok'"
    if wins < config.eval.min_win_rate:
        return -1, (f"not promoted: {judge} win rate against the reference is {wins:.3f}, below "
                    f"eval.min_win_rate={config.eval.min_win_rate:.3f}")
    version = _registered_version(config, policy_uri, policy_version)
    if isinstance(version, str):
        return -1, f"not promoted: {version}"
    return version, None


# --- outputs ---------------------------------------------------------------------------------------------


def write_samples(prompts: Sequence[str], policy: ReplySet, reference: ReplySet, path: Path) -> str:
    """The ``EVAL_SAMPLES`` table, one row per prompt, written atomically as Parquet."""
    def scores(replies: ReplySet, judge: str) -> Sequence[float | None]:
        return replies.scores.get(judge, (None,) * len(prompts))

    columns = {
        "prompt": prompts, "reference_reply": reference.replies, "policy_reply": policy.replies,
        **{f"{judge}_{who}": scores(replies, judge) for judge in ("proxy", "heldout", "gold")
           for who, replies in (("policy", policy), ("reference", reference))},
        "kl": policy.kl, "kl_k3": policy.kl_k3, "length": policy.lengths, "reference_length": reference.lengths,
        "stopped": [int(s) for s in policy.stopped],
    }
    rows = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
    return write_parquet(rows, EVAL_SAMPLES, path)


def _log_run(run_id: str, metrics: dict[str, float], status: str, reasons: Sequence[str], iteration: int,
             out: Path, samples: str) -> None:
    """Metrics at step=iteration, the status tag, and the metrics / reasons / samples files as artifacts."""
    log_metrics(metrics, step=iteration, run_id=run_id)
    MlflowClient().set_tag(run_id, STATUS_TAG, status)  # tasks.tracking has no tag helper; stage tags are set at start
    json_safe = {k: (None if math.isnan(v) else v) for k, v in metrics.items()}
    metrics_json = write_json({"iteration": iteration, "status": status, "reasons": list(reasons),
                               "metrics": json_safe}, out / METRICS_FILE)
    text = "\n".join(reasons) + "\n" if reasons else "no findings\n"
    reasons_txt = atomic_write(out / REASONS_FILE, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    for path in (samples, metrics_json, reasons_txt):
        log_file(path, "eval", run_id=run_id)


def best_of_n_series(best_of_n: Sequence[Mapping[str, float | None]] | None) -> dict[str, object]:
    """``overoptimisation_curve`` keywords for the best-of-n baseline: its gold (held-out without gold) and proxy
    scores against KL. Empty without a baseline; ValueError when a point lacks a key."""
    if not best_of_n:
        return {}
    for point in best_of_n:
        missing = {"kl", "proxy", "heldout"} - point.keys()
        if missing:
            raise ValueError(f"best_of_n point {dict(point)} lacks {sorted(missing)}; pass the points of the "
                             "best-of-n stage (tasks.baseline_eval.BestOfNResult.points)")
    has_gold = all(p.get("gold") is not None for p in best_of_n)
    judge, label = ("gold", "gold") if has_gold else ("heldout", "held-out RM")
    return {"best_of_n": [(float(p["kl"]), float(p[judge])) for p in best_of_n], "best_of_n_judge": label,
            "best_of_n_proxy": [(float(p["kl"]), float(p["proxy"])) for p in best_of_n]}


def _log_plots(run_id: str, policy: ReplySet, reference: ReplySet, metrics: Mapping[str, float],
               history: Sequence[Mapping[str, float]], iteration: int, out: Path,
               best_of_n_plot: Mapping[str, object] | None = None) -> None:
    """Score histograms (gold if present, else held-out), reply lengths, the over-optimisation curve (with the
    best-of-n keywords of :func:`best_of_n_series`)."""
    judge = "gold" if "gold" in policy.scores else "heldout"
    baseline = PolicyPoint(kl=0.0, proxy=metrics["eval/reference/proxy/mean"],
                           heldout=metrics["eval/reference/heldout/mean"],
                           gold=metrics.get("eval/reference/gold/mean"), label="ref",
                           rm_generation=int(metrics.get("eval/rm_generation", 0)))
    points = [baseline] + [
        PolicyPoint(kl=h["eval/kl/mean"], proxy=h["eval/proxy/mean"], heldout=h["eval/heldout/mean"],
                    gold=h.get("eval/gold/mean"), label=f"it {int(h.get('eval/iteration', i + 1))}",
                    rm_generation=int(h.get("eval/rm_generation", 0)))
        for i, h in enumerate([*history, metrics])]
    figures = {
        "eval_scores.png": score_histograms({"policy": policy.scores[judge], "reference": reference.scores[judge]},
                                            title=f"{judge} scores, iteration {iteration}", xlabel=f"{judge} score"),
        "eval_lengths.png": length_distribution({"policy": policy.lengths, "reference": reference.lengths},
                                                title=f"Reply length, iteration {iteration}"),
        "eval_overoptimisation.png": overoptimisation_curve(points, **(best_of_n_plot or {})),
    }
    for name, fig in figures.items():
        log_file(save_figure(fig, out / "plots" / name), "plots", run_id=run_id)
