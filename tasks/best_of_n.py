"""The best-of-n stage: the best-of-N baseline from the SFT policy, to set PPO's reward-vs-KL curve against.

Once per pipeline run: sample ``max(ns)`` replies per evaluation prompt from the SFT policy, score every reply with
the proxy reward model, keep the proxy's favourite among the first n of each prompt (``rlhf_core.evaluation.
best_of_n``), and report the mean proxy, held-out and (demo task) gold score of the chosen replies against the
analytic KL ``log n - (n - 1) / n``. heldout-eval draws these points on its over-optimisation plot.

Sampling matches heldout-eval (``tasks.judging``), except that greedy evaluation (temperature 0) would make the n
samples identical, so best-of-n then samples at the rollout temperature. Gold is read here on purpose: this is an
evaluation stage; nothing it writes feeds training.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from matplotlib.figure import Figure

from rlhf_core.data import Column, DType, TableSchema
from rlhf_core.demo import gold_score
from rlhf_core.evaluation.best_of_n import (BestOfNPoint, Candidates, best_of_n_curve, best_of_n_kl, check_ns,
                                            sample_candidates, score_candidates)
from rlhf_core.models.text import encode_prompt
from tasks.config import PipelineConfig
from tasks.io import write_json, write_parquet
from tasks.judging import Judging, read_eval_prompts
from tasks.models import load_frozen_lm
from tasks.plots import PolicyPoint, overoptimisation_curve, save_figure
from tasks.run_store import Artifact
from tasks.runtime import ModelInput
from tasks.stage import Publication, Stage, StageContext, stage_task

log = logging.getLogger(__name__)

NAME = "best-of-n"
DEFAULT_NS = (1, 2, 4, 8, 16)
TABLE_FILE, POINTS_FILE, PLOT_FILE = "best_of_n.parquet", "best_of_n_points.json", "plots/best_of_n.png"
JUDGES = ("proxy", "heldout", "gold")

_S, _F, _I = DType.STRING, DType.FLOAT64, DType.INT64
BEST_OF_N_SAMPLES = TableSchema(
    "best_of_n",
    (Column("prompt", _S, doc="Evaluation prompt."),
     Column("n", _I, doc="Samples the reply was chosen among (the first n drawn for this prompt)."),
     Column("kl", _F, doc="Analytic KL(best-of-n || sampling distribution), log n - (n - 1) / n nats."),
     Column("sample", _I, doc="Which of the prompt's samples was chosen (0-based draw order, < n)."),
     Column("reply", _S, doc="The chosen reply: the highest proxy score among the first n samples."),
     Column("proxy", _F, doc="Proxy reward-model score of the chosen reply (the selection criterion)."),
     Column("heldout", _F, doc="Held-out reward-model score of the chosen reply."),
     Column("gold", _F, nullable=True, doc="Gold score of the chosen reply (demo task only, else null)."),
     Column("length", _I, doc="Chosen reply length in tokens (stop token included)."),
     Column("stopped", _I, doc="1 when the chosen reply ended with eos, 0 when cut at max_new_tokens.")),
)
"""One row per (prompt, n), prompts in file order and n ascending within a prompt."""


@dataclass(frozen=True)
class Config:
    judging: Judging
    ns: tuple[int, ...] = DEFAULT_NS
    """Candidate counts N."""

    @classmethod
    def of(cls, config: PipelineConfig) -> Config:
        return cls(Judging.of(config))

    @property
    def temperature(self) -> float:
        """``eval.temperature``, or the rollout temperature when evaluation is greedy (0): n greedy replies to a
        prompt are all the same, which would make best-of-n a flat line."""
        judging = self.judging
        return judging.temperature if judging.temperature > 0 else judging.generation.temperature


@dataclass(frozen=True)
class Inputs:
    data: Artifact
    """data-prep: the evaluation prompts."""
    sft: ModelInput
    proxy: ModelInput
    heldout: ModelInput


@dataclass(frozen=True)
class Result:
    points: list[dict[str, float | None]]
    """One dict per n, ascending: ``{"n", "kl", "proxy", "heldout", "gold" (None without gold), "length"}``."""
    table: str = TABLE_FILE
    plot: str = PLOT_FILE
    points_file: str = POINTS_FILE


def compute(cfg: Config, inputs: Inputs, ctx: StageContext) -> Result:
    ns = check_ns(cfg.ns)
    prompts = read_eval_prompts(inputs.data.path(inputs.data.result["eval_prompts"]), cfg.judging.n_prompts)
    candidates, scores = sample_and_score(cfg, prompts, inputs, max(ns))
    # Length rides along as one more "judge": RMs that reward length show up as a climbing length mean.
    judged = {**scores, "length": candidates.grid(candidates.lengths)}
    chosen, curve = best_of_n_curve(scores["proxy"], judged, ns)
    points = [_point(p) for p in curve]
    write_table(prompts, candidates, scores, chosen, ctx.out / TABLE_FILE)
    save_figure(best_of_n_figure(points), ctx.out / PLOT_FILE)
    write_json({"points": points}, ctx.out / POINTS_FILE)
    log.info("best-of-n: %s", ", ".join(f"n={p['n']} proxy={p['proxy']:.3f}" for p in points))
    return Result(points)


def sample_and_score(cfg: Config, prompts: Sequence[str], inputs: Inputs,
                     n_max: int) -> tuple[Candidates, dict[str, torch.Tensor]]:
    """``n_max`` SFT replies per prompt and their scores: judge -> (P, n_max), gold on the demo task."""
    judging = cfg.judging
    policy, tokenizer = load_frozen_lm(judging.runtime, inputs.sft.path)
    if tokenizer is None:
        raise FileNotFoundError(f"SFT policy {inputs.sft.path} has no tokenizer files; save it with "
                                "tokenizer.save_pretrained")
    scorers = judging.scorers(inputs.proxy, inputs.heldout, tokenizer)
    prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
    generation = judging.sampling(policy, prompt_ids, cfg.temperature)
    candidates = sample_candidates(policy, tokenizer, prompt_ids, n_max, generation, judging.seed)
    scores = score_candidates(candidates, scorers)
    if judging.gold:
        rows = [p for p in prompts for _ in range(n_max)]
        scores["gold"] = candidates.grid([gold_score(p, r) for p, r in zip(rows, candidates.replies, strict=True)])
    return candidates, scores


def _point(point: BestOfNPoint) -> dict[str, float | None]:
    means = point.means
    return {"n": point.n, "kl": point.kl, "proxy": means["proxy"], "heldout": means["heldout"],
            "gold": means.get("gold"), "length": means["length"]}


def write_table(prompts: Sequence[str], candidates: Candidates, scores: dict[str, torch.Tensor],
                chosen: dict[int, torch.Tensor], path) -> str:
    """The ``BEST_OF_N_SAMPLES`` table, one row per (prompt, n), written atomically as Parquet."""
    rows = []
    for p, prompt in enumerate(prompts):
        for n, index in chosen.items():
            i = int(index[p])
            flat = p * candidates.n_max + i
            rows.append({"prompt": prompt, "n": n, "kl": best_of_n_kl(n), "sample": i,
                         "reply": candidates.replies[flat],
                         **{j: float(scores[j][p, i]) if j in scores else None for j in JUDGES},
                         "length": candidates.lengths[flat], "stopped": int(candidates.stopped[flat])})
    return write_parquet(rows, BEST_OF_N_SAMPLES, path)


def best_of_n_figure(points: Sequence[dict[str, float | None]]) -> Figure:
    """Mean score against analytic KL, one line per judge (gold only when every point has it)."""
    policy_points = [PolicyPoint(kl=p["kl"], proxy=p["proxy"], heldout=p["heldout"], gold=p["gold"],
                                 label=f"n={p['n']}") for p in points]
    return overoptimisation_curve(policy_points, title="Best-of-N from the SFT policy, chosen by the proxy RM")


def publish(cfg: Config, result: Result, pub: Publication) -> None:
    pub.log_params({"temperature": cfg.temperature})
    for p in result.points:
        metrics = {"best_of_n/kl": p["kl"], "best_of_n/length/mean": p["length"],
                   **{f"best_of_n/{j}/mean": p[j] for j in JUDGES if p[j] is not None}}
        pub.log_metrics(metrics, step=int(p["n"]))
    pub.log_files([result.table, result.points_file], "best_of_n")
    pub.log_files([result.plot], "plots")


STAGE = Stage(NAME, compute, publish, Result)
best_of_n_task = stage_task(STAGE, retries=1, retry_delay_seconds=10)
