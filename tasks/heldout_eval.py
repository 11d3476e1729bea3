"""The heldout-eval stage: judge one PPO iteration's policy (or the dpo stage's, as iteration 1) against the
reference, and flag reward hacking.

For a fixed set of evaluation prompts the policy and the reference each answer (same seed, so the reference's
replies are identical in every iteration); the replies are scored by the proxy reward model (the one PPO
optimised), by the held-out reward model (trained on pairs the proxy never saw) and, on the demo task, by the
hidden gold scorer. The verdict (``rlhf_core.evaluation.metrics.detect_reward_hacking``) looks at this iteration and
the earlier ones scored by the same proxy RM; the policy is to be promoted when the verdict is ``ok`` and it beats
the reference often enough (gold win rate on the demo task, else held-out). Publishing moves ``champion`` to the
version this run registered for that policy. Gold is read here on purpose: evaluation only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_core.data import Column, DType, TableSchema
from rlhf_core.demo import gold_score
from rlhf_core.evaluation.metrics import HackingRules, HackingVerdict, IterationEval, Judge, detect_reward_hacking
from rlhf_core.evaluation.policy_eval import ReplySet, comparison_metrics, sample_and_judge, with_scores
from rlhf_core.models.scoring import EnsembleDisagreement, EnsembleScorer
from rlhf_core.models.text import encode_prompt, same_vocabulary
from tasks.config import PipelineConfig
from tasks.io import write_json, write_parquet
from tasks.judging import Judging, read_eval_prompts
from tasks.models import load_frozen_lm
from tasks.plots import PolicyPoint, length_distribution, overoptimisation_curve, save_figure, score_histograms
from tasks.run_store import Artifact
from tasks.runtime import ModelInput
from tasks.stage import Publication, Stage, StageContext, stage_task

log = logging.getLogger(__name__)

NAME = "heldout-eval"
CHAMPION = "champion"
SAMPLES_FILE, METRICS_FILE, REASONS_FILE = "eval_samples.parquet", "eval_metrics.json", "eval_reasons.txt"
PLOTS = ("plots/eval_scores.png", "plots/eval_lengths.png", "plots/eval_overoptimisation.png")
STATUS_TAG = "eval.status"
HELDOUT_STATUS_TAG = "eval.heldout_status"
#: What the pipeline's parent run carries per iteration (step = iteration), so compared runs line up on them.
HEADLINE = ("eval/proxy/mean", "eval/heldout/mean", "eval/gold/mean", "eval/kl/mean", "eval/win_rate/gold",
            "eval/win_rate/heldout", "eval/length/mean", "eval/reference/proxy/mean", "eval/reference/heldout/mean",
            "eval/reference/gold/mean", "eval/proxy_disagreement/mean")
DISAGREEMENT = "proxy_disagreement"
"""With a proxy ensemble: ``eval/proxy_disagreement/mean`` is the mean over replies of its members' score std."""
#: ``eval/hacking`` metric value of each verdict.
HACKING_CODES = {"ok": 0, "warn": 1, "hacking": 2}

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
class Config:
    judging: Judging
    iteration: int
    """The PPO iteration judged, 1 for the dpo policy (the MLflow step of every metric)."""
    rm_generation: int
    """Promoted reward-model refreshes before this iteration: the detector compares only iterations scored by the
    same proxy RM (proxy scores of two RMs are on different scales)."""
    kl_budget: float
    hacking_margin: float
    min_win_rate: float

    @classmethod
    def of(cls, config: PipelineConfig, iteration: int, rm_generation: int) -> Config:
        ev = config.eval
        return cls(Judging.of(config), iteration, rm_generation, ev.kl_budget, ev.hacking_margin, ev.min_win_rate)

    @property
    def rules(self) -> HackingRules:
        """``hacking_margin`` 0 (unset) keeps the rules' default drop."""
        margin = self.hacking_margin
        return HackingRules(kl_budget=self.kl_budget, min_drop=margin if margin > 0 else HackingRules.min_drop)


@dataclass(frozen=True)
class Inputs:
    data: Artifact
    """data-prep: the evaluation prompts."""
    policy: ModelInput
    reference: ModelInput
    proxy: ModelInput
    heldout: ModelInput
    best_of_n: Artifact | None = None
    """The best-of-n baseline, drawn on the over-optimisation plot."""
    earlier: tuple[Artifact, ...] = ()
    """The heldout-eval artifacts of the earlier iterations, oldest first."""


@dataclass(frozen=True)
class Result:
    iteration: int
    metrics: dict[str, float]
    """``eval/...`` metrics (NaN where undefined)."""
    status: str
    """Reward-hacking verdict: 'ok', 'warn' or 'hacking'."""
    reasons: list[str]
    """One sentence per finding, plus why the policy is not to be promoted (if it is not)."""
    promote: bool
    heldout_status: str = "ok"
    """The same verdict with the held-out reward model as the only judge (gold never counts): what triggers an
    rm-refresh and what ``rlhf sweep`` selects by, since gold may only evaluate."""
    samples: str = SAMPLES_FILE
    metrics_file: str = METRICS_FILE
    reasons_file: str = REASONS_FILE
    plots: list[str] = field(default_factory=lambda: list(PLOTS))


def compute(cfg: Config, inputs: Inputs, ctx: StageContext) -> Result:
    # The baseline is checked before any model is loaded: a bad best-of-n input fails at once, not after sampling.
    baseline = best_of_n_series(inputs.best_of_n.result["points"] if inputs.best_of_n is not None else [])
    prompts = read_eval_prompts(inputs.data.path(inputs.data.result["eval_prompts"]), cfg.judging.n_prompts)
    policy, reference = judge_replies(cfg.judging, prompts, inputs)
    metrics = {"eval/iteration": float(cfg.iteration), "eval/rm_generation": float(cfg.rm_generation),
               **comparison_metrics(policy, reference)}
    metrics.pop(f"eval/win_rate/{DISAGREEMENT}", None)  # a spread, not a judge
    history = [earlier.result["metrics"] for earlier in inputs.earlier]
    same_rm = [h for h in history if int(h.get("eval/rm_generation", 0)) == cfg.rm_generation]
    verdict = hacking_verdict(cfg.rules, metrics, same_rm)
    heldout_verdict = hacking_verdict(cfg.rules, metrics, same_rm, judge="heldout")
    refusal = promotion_refusal(verdict, metrics, cfg.min_win_rate)
    reasons = [*verdict.reasons, *([refusal] if refusal else [])]
    metrics["eval/hacking"] = float(HACKING_CODES[verdict.status])
    metrics["eval/hacking_heldout"] = float(HACKING_CODES[heldout_verdict.status])
    metrics["eval/promoted"] = float(refusal is None)
    write_samples(prompts, policy, reference, ctx.out / SAMPLES_FILE)
    json_safe = {k: (None if math.isnan(v) else v) for k, v in metrics.items()}
    write_json({"iteration": cfg.iteration, "status": verdict.status, "heldout_status": heldout_verdict.status,
                "reasons": reasons, "metrics": json_safe}, ctx.out / METRICS_FILE)
    (ctx.out / REASONS_FILE).write_text("\n".join(reasons) + "\n" if reasons else "no findings\n", encoding="utf-8")
    _plots(policy, reference, metrics, history, cfg.iteration, ctx.out, baseline)
    log.info("heldout-eval %d: %s%s", cfg.iteration, verdict.status, f" ({'; '.join(reasons)})" if reasons else "")
    return Result(cfg.iteration, metrics, verdict.status, reasons, refusal is None, heldout_status=heldout_verdict.status)


def judge_replies(judging: Judging, prompts: Sequence[str], inputs: Inputs) -> tuple[ReplySet, ReplySet]:
    """Replies of policy and reference, scored by the proxy and held-out RMs (and gold on the demo task)."""
    policy, tokenizer = load_frozen_lm(judging.runtime, inputs.policy.path)
    reference, ref_tokenizer = load_frozen_lm(judging.runtime, inputs.reference.path)
    if tokenizer is None:
        raise FileNotFoundError(f"policy {inputs.policy.path} has no tokenizer files; save it with "
                                "tokenizer.save_pretrained")
    if ref_tokenizer is not None and not same_vocabulary(tokenizer, ref_tokenizer):
        raise ValueError(f"policy {inputs.policy.path} and reference {inputs.reference.path} have different "
                         "vocabularies; KL needs both on the same tokens: use the policy's SFT model as the reference")
    scorers = judging.scorers(inputs.proxy, inputs.heldout, tokenizer)
    if isinstance(scorers["proxy"], EnsembleScorer):  # how far the proxy's members disagree on these replies
        scorers[DISAGREEMENT] = EnsembleDisagreement(scorers["proxy"])
    prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
    replies = sample_and_judge(policy, reference, tokenizer, prompt_ids, judging.sampling(policy, prompt_ids),
                               scorers, judging.seed, judging.max_tokens_per_forward)
    if judging.gold:
        replies = tuple(with_scores(r, "gold", [gold_score(p, t) for p, t in zip(prompts, r.replies, strict=True)])
                        for r in replies)
    return replies


# --- verdict and promotion --------------------------------------------------------------------------------


def iteration_eval(metrics: Mapping[str, float], prefix: str = "eval", kl: float | None = None) -> IterationEval:
    """An ``IterationEval`` from eval metrics (``prefix='eval/reference'`` and ``kl=0`` give the baseline)."""
    def get(key: str) -> float:
        if f"{prefix}/{key}" not in metrics:
            raise ValueError(f"eval history entry lacks {prefix}/{key} (has {sorted(metrics)}); history must hold "
                             "the metrics of earlier heldout-eval results")
        return float(metrics[f"{prefix}/{key}"])
    gold = metrics.get(f"{prefix}/gold/mean")
    return IterationEval(proxy_mean=get("proxy/mean"), heldout_mean=get("heldout/mean"),
                         gold_mean=None if gold is None else float(gold),
                         kl_mean=get("kl/mean") if kl is None else kl, length_mean=get("length/mean"),
                         repetition_rate=get("repetition_rate"))


def hacking_verdict(rules: HackingRules, metrics: Mapping[str, float],
                    history: Sequence[Mapping[str, float]], judge: Judge = "gold") -> HackingVerdict:
    """Verdict over [reference baseline, *history, this iteration] (oldest first); ``judge='heldout'``: the held-out
    reward model's fall, never gold's."""
    evals = [iteration_eval(metrics, "eval/reference", kl=0.0), *map(iteration_eval, history),
             iteration_eval(metrics)]
    return detect_reward_hacking(evals, rules, judge)


def promotion_refusal(verdict: HackingVerdict, metrics: Mapping[str, float], min_win_rate: float) -> str | None:
    """None when the policy may become champion, else the reason it may not."""
    judge = "gold" if "eval/win_rate/gold" in metrics else "heldout"
    wins = metrics[f"eval/win_rate/{judge}"]
    if verdict.status != "ok":
        return f"not promoted: the reward-hacking verdict is {verdict.status!r}, not 'ok'"
    if wins < min_win_rate:
        return (f"not promoted: {judge} win rate against the reference is {wins:.3f}, below "
                f"eval.min_win_rate={min_win_rate:.3f}")
    return None


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


def best_of_n_series(best_of_n: Sequence[Mapping[str, float | None]]) -> dict[str, object]:
    """``overoptimisation_curve`` keywords for the best-of-n baseline: its gold (held-out without gold) and proxy
    scores against KL. Empty without a baseline; ValueError when a point lacks a key."""
    if not best_of_n:
        return {}
    for point in best_of_n:
        missing = {"kl", "proxy", "heldout"} - point.keys()
        if missing:
            raise ValueError(f"best_of_n point {dict(point)} lacks {sorted(missing)}; pass the points of the "
                             "best-of-n stage")
    has_gold = all(p.get("gold") is not None for p in best_of_n)
    judge, label = ("gold", "gold") if has_gold else ("heldout", "held-out RM")
    return {"best_of_n": [(float(p["kl"]), float(p[judge])) for p in best_of_n], "best_of_n_judge": label,
            "best_of_n_proxy": [(float(p["kl"]), float(p["proxy"])) for p in best_of_n]}


def _plots(policy: ReplySet, reference: ReplySet, metrics: Mapping[str, float],
           history: Sequence[Mapping[str, float]], iteration: int, out: Path,
           best_of_n_plot: Mapping[str, object]) -> None:
    """Score histograms (gold if present, else held-out), reply lengths, the over-optimisation curve."""
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
        PLOTS[0]: score_histograms({"policy": policy.scores[judge], "reference": reference.scores[judge]},
                                   title=f"{judge} scores, iteration {iteration}", xlabel=f"{judge} score"),
        PLOTS[1]: length_distribution({"policy": policy.lengths, "reference": reference.lengths},
                                      title=f"Reply length, iteration {iteration}"),
        PLOTS[2]: overoptimisation_curve(points, **best_of_n_plot),
    }
    for name, fig in figures.items():
        save_figure(fig, out / name)


def publish(cfg: Config, result: Result, pub: Publication) -> None:
    pub.log_metrics(result.metrics, step=cfg.iteration)
    pub.set_tags({STATUS_TAG: result.status, HELDOUT_STATUS_TAG: result.heldout_status})
    pub.log_headline({k: result.metrics[k] for k in HEADLINE if k in result.metrics}, step=cfg.iteration,
                     tags={STATUS_TAG: result.status, HELDOUT_STATUS_TAG: result.heldout_status,
                           "eval.iteration": cfg.iteration})
    pub.log_files([result.samples, result.metrics_file, result.reasons_file], "eval")
    pub.log_files(result.plots, "plots")
    policy = pub.registered_input("policy", "policy")
    if policy is not None:
        shown = {k.removeprefix("eval/").replace("/mean", ""): f"{result.metrics[k]:.4g}" for k in HEADLINE
                 if k in result.metrics and "reference" not in k}
        pub.tag_model(policy, {STATUS_TAG: result.status, **{f"eval.{k}": v for k, v in shown.items()},
                               "eval.reasons": "; ".join(result.reasons) or "-"})
    if result.promote:
        if policy is None:
            log.warning("heldout-eval %d: the policy has no registered version in this run; champion stays where it "
                        "is", cfg.iteration)
            pub.set_tags({"eval.promotion": "not promoted: the policy has no registered version in this run"})
            return
        ref = pub.alias(policy, CHAMPION)
        log.info("promoted %s version %d to @%s", ref.name, ref.version, CHAMPION)


STAGE = Stage(NAME, compute, publish, Result)
heldout_eval_task = stage_task(STAGE, retries=1, retry_delay_seconds=10)
