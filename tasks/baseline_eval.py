"""The best-of-n stage: the best-of-N baseline from the SFT policy, to set PPO's reward-vs-KL curve against.

Once per pipeline run (the stage is cached on its inputs): sample ``max(ns)`` replies per evaluation prompt
from the SFT policy, score every reply with the proxy reward model, keep the proxy's favourite among the first
n of each prompt (``rlhf_core.evaluation.best_of_n``), and report the mean proxy, held-out and (demo task) gold score of
the chosen replies against the analytic KL ``log n - (n - 1) / n``. ``BestOfNResult.points`` goes to every
heldout-eval call (``run_heldout_eval(..., best_of_n=...)``), which draws it on the same over-optimisation
plot as the PPO iterations.

Sampling matches heldout-eval: PPO's rollout settings (``config.ppo.generation``) at ``eval.temperature``,
except that greedy evaluation (temperature 0) would make the n samples identical, so best-of-n then samples at
the rollout temperature. The proxy RM is the one PPO starts from; an rm-refresh later in the run does not move
the baseline.

Gold is read here on purpose: this is an evaluation stage (``tests/unit/test_gold_isolation.py`` allows
``tasks/*eval*.py``). Nothing it writes feeds training.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from matplotlib.figure import Figure
from prefect import task

from rlhf_core.data import Column, DType, TableSchema
from rlhf_core.demo import gold_score
from rlhf_core.evaluation.best_of_n import (BestOfNPoint, Candidates, best_of_n_curve, best_of_n_kl, check_ns,
                                            sample_candidates, score_candidates)
from rlhf_core.evaluation.policy_eval import evaluation_generation, fit_max_new_tokens
from rlhf_core.models.text import encode_prompt
from tasks.config import PipelineConfig
from tasks.evaluate import load_frozen_lm, read_eval_prompts, reward_scorer  # the same loading as heldout-eval
from tasks.io import write_json, write_parquet
from tasks.plots import PolicyPoint, overoptimisation_curve, save_figure
from tasks.retries import retry_on_transient_io
from tasks.tracking import log_file, log_metrics, stage_run

log = logging.getLogger(__name__)

STAGE = "best-of-n"
DEFAULT_NS = (1, 2, 4, 8, 16)
TABLE_FILE = "best_of_n.parquet"
POINTS_FILE = "best_of_n_points.json"
PLOT_FILE = "best_of_n.png"
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
class BestOfNResult:
    """What the best-of-n stage found (no tensors, no models)."""

    points: tuple[dict[str, float | None], ...]
    """One dict per n, ascending: ``{"n", "kl", "proxy", "heldout", "gold" (None without gold), "length"}``,
    means over the prompts. Pass ``list(points)`` as ``best_of_n`` to ``run_heldout_eval``."""
    table_path: str
    """The chosen replies (``BEST_OF_N_SAMPLES``) as Parquet."""
    plot_path: str
    """Score against KL, one line per judge, as PNG."""
    mlflow_run_id: str
    """The nested ``best-of-n`` run."""


def run_best_of_n(
    config: PipelineConfig,
    sft_uri: str,
    proxy_rm_uri: str,
    heldout_rm_uri: str,
    eval_prompts: str,
    out_dir: str,
    parent_run_id: str,
    ns: Sequence[int] = DEFAULT_NS,
    n_prompts: int | None = None,
) -> BestOfNResult:
    """Best-of-n from ``sft_uri`` on the first ``n_prompts`` (default ``eval.n_prompts``) evaluation prompts,
    chosen by ``proxy_rm_uri``, judged by it, by ``heldout_rm_uri`` and (demo) by gold, for every n in ``ns``.

    URIs are local folders or ``models:/name/version`` / ``models:/name@alias``. Metrics go to a nested MLflow
    run at ``step=n``: ``best_of_n/kl``, ``best_of_n/<judge>/mean``, ``best_of_n/length/mean``.
    """
    ns = check_ns(ns)
    prompts = read_eval_prompts(eval_prompts, config.eval.n_prompts if n_prompts is None else n_prompts)
    out = Path(out_dir)
    params = {"sft_uri": sft_uri, "proxy_rm_uri": proxy_rm_uri, "heldout_rm_uri": heldout_rm_uri,
              "n_prompts": len(prompts), "ns": list(ns), "temperature": sampling_temperature(config)}
    with stage_run(STAGE, parent_run_id, params=params) as run:
        candidates, scores = sample_and_score(config, prompts, sft_uri, proxy_rm_uri, heldout_rm_uri, max(ns))
        # Length rides along as one more "judge": RMs that reward length show up as a climbing length mean.
        judged = {**scores, "length": candidates.grid(candidates.lengths)}
        chosen, curve = best_of_n_curve(scores["proxy"], judged, ns)
        points = tuple(map(_point, curve))
        table = write_table(prompts, candidates, scores, chosen, out / TABLE_FILE)
        plot = save_figure(best_of_n_figure(points), out / "plots" / PLOT_FILE)
        _log_run(run.info.run_id, points, table, str(plot), out)
    log.info("best-of-n: %s", ", ".join(f"n={p['n']} proxy={p['proxy']:.3f}" for p in points))
    return BestOfNResult(points, table, str(plot), run.info.run_id)


best_of_n_task = task(name="best-of-n", retries=1, retry_delay_seconds=10,
                      retry_condition_fn=retry_on_transient_io)(run_best_of_n)
"""Prefect task around :func:`run_best_of_n`; retries once, only on transient I/O errors."""


def sampling_temperature(config: PipelineConfig) -> float:
    """``eval.temperature``, or the rollout temperature when evaluation is greedy (0): n greedy replies to a
    prompt are all the same, which would make best-of-n a flat line."""
    return config.eval.temperature if config.eval.temperature > 0 else config.ppo.generation.temperature


def sample_and_score(config: PipelineConfig, prompts: Sequence[str], sft_uri: str, proxy_rm_uri: str,
                     heldout_rm_uri: str, n_max: int) -> tuple[Candidates, dict[str, torch.Tensor]]:
    """``n_max`` SFT replies per prompt and their scores: judge -> (P, n_max), gold on the demo task."""
    policy, tokenizer = load_frozen_lm(config, sft_uri)
    if tokenizer is None:
        raise FileNotFoundError(f"SFT policy {sft_uri} has no tokenizer files; save it with "
                                "tokenizer.save_pretrained")
    scorers = {"proxy": reward_scorer(config, proxy_rm_uri, tokenizer, config.reward_model.training.max_length),
               "heldout": reward_scorer(config, heldout_rm_uri, tokenizer, config.reward_model.heldout.max_length)}
    prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
    base = config.ppo.generation
    budget = fit_max_new_tokens(policy, prompt_ids, base.max_new_tokens)
    generation = evaluation_generation(base, sampling_temperature(config), config.eval.batch_size, budget)
    candidates = sample_candidates(policy, tokenizer, prompt_ids, n_max, generation, config.seed)
    scores = score_candidates(candidates, scorers)
    if config.data.source == "demo":
        rows = [p for p in prompts for _ in range(n_max)]
        scores["gold"] = candidates.grid([gold_score(p, r) for p, r in zip(rows, candidates.replies, strict=True)])
    return candidates, scores


def _point(point: BestOfNPoint) -> dict[str, float | None]:
    """The plain-dict form of one point (JSON, Prefect results and MLflow all take it as it is)."""
    means = point.means
    return {"n": point.n, "kl": point.kl, "proxy": means["proxy"], "heldout": means["heldout"],
            "gold": means.get("gold"), "length": means["length"]}


# --- outputs ---------------------------------------------------------------------------------------------


def write_table(prompts: Sequence[str], candidates: Candidates, scores: dict[str, torch.Tensor],
                chosen: dict[int, torch.Tensor], path: Path) -> str:
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


def _log_run(run_id: str, points: Sequence[dict[str, float | None]], table: str, plot: str, out: Path) -> None:
    """Metrics at step=n, the points JSON and the table under ``best_of_n/``, the plot under ``plots/``."""
    for p in points:
        metrics = {"best_of_n/kl": p["kl"], "best_of_n/length/mean": p["length"],
                   **{f"best_of_n/{j}/mean": p[j] for j in JUDGES if p[j] is not None}}
        log_metrics(metrics, step=int(p["n"]), run_id=run_id)
    points_json = write_json({"points": list(points)}, out / POINTS_FILE)
    for path in (table, points_json):
        log_file(path, "best_of_n", run_id=run_id)
    log_file(plot, "plots", run_id=run_id)
