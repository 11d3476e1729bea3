"""The reward-model stage: the proxy reward model PPO optimises, and the held-out one only evaluation sees.

The proxy learns the train pairs and is evaluated on the held-out pairs; the held-out reward model learns the
held-out pairs (which the proxy never saw) and is evaluated on a sample of the train pairs. The proxy starts from
``reward_model.init`` and the held-out one from ``reward_model.heldout_init`` (default: the same): 'sft' (the SFT
policy's backbone with a fresh scalar head), 'scratch', or any sequence-classification or base checkpoint, decoder or
encoder, with its own tokenizer (a fresh scalar head unless it already is a 1-output classifier), each with its own
seed. The artifact holds ``proxy/`` and ``heldout/`` (model + tokenizer), the loss and score plots
and ``metrics.json``; publishing registers both (alias ``candidate``; ``champion`` when the name has none yet).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import GenerationConfig, RewardTrainingConfig
from rlhf_core.data import PREFERENCE_PAIRS
from rlhf_core.data.split import pair_id
from rlhf_core.demo.annotator import SimulatedAnnotator
from rlhf_core.evaluation.annotators import sample_reply_pairs
from rlhf_core.evaluation.metrics import pairwise_agreement, spearman
from rlhf_core.models.lm import ModelSize, build_reward_model, config_for_tokenizer
from rlhf_core.models.families import config_positions, describe, score_prefix
from rlhf_core.models.roles import init_reward_model
from rlhf_core.models.text import pad_id
from rlhf_core.models.tokenizer import SpecialTokens
from rlhf_core.training.refresh import refresh_seed
from rlhf_core.training.reward_training import RewardTrainingResult, encode_pairs, score_pairs
from rlhf_core.data.records import PreferencePair
from tasks.config import DistributedSection, PipelineConfig, RewardModelSection
from tasks.io import read_pairs, write_json, write_parquet
from tasks.models import load_frozen_lm, load_tokenizer, save_ensemble
from tasks.plots import loss_curve, save_figure, score_histograms
from tasks.reward_job import RewardModelJob, fit_reward_model
from tasks.run_store import Artifact
from tasks.runtime import ModelInput, Runtime, local_model
from tasks.stage import Publication, Stage, StageContext, stage_task
from tasks.typed_yaml import one_line

log = logging.getLogger(__name__)

NAME = "reward-model"
ROLES = ("proxy", "heldout")
METRICS_FILE = "metrics.json"
ONPOLICY_FILE = "heldout_onpolicy_pairs.parquet"
ONPOLICY_BATCH_ROWS = 256
"""Replies the SFT policy samples at once for the held-out RM's on-policy pairs (a demo-sized model; thousands of
replies): fewer, wider decoding loops than PPO's rollout batches."""
SCORES_PNG = "rm_proxy_heldout_scores.png"
MAX_CROSS_EVAL_PAIRS = 1000
"""The held-out RM is evaluated on at most this many train pairs (a seeded sample): enough for a stable
accuracy, and it keeps the stage's second evaluation cheap on large datasets."""
EVALS_PER_TRAINING = 4
"""Evaluations during each training (plus the final one): the points of the eval line on the loss plot."""
FLUSH_EVERY = 10
"""Per-step metrics go to MLflow in one batch every this many steps."""


@dataclass(frozen=True)
class OnPolicyLabels:
    """How the held-out reward model's on-policy pairs are sampled and labelled (``reward_model.heldout_onpolicy_pairs``)."""

    n_pairs: int
    generation: GenerationConfig
    """``ppo.generation`` with ``ONPOLICY_BATCH_ROWS`` rows at once: the SFT policy samples as PPO will."""
    annotator_temperature: float
    """``data.demo.annotator_temperature``: the preference data's label noise."""
    seed: int


@dataclass(frozen=True)
class Config:
    """What the reward-model stage is given."""

    reward_model: RewardModelSection
    """inits, their tokenizers' special tokens, and the proxy's and held-out model's training settings."""
    runtime: Runtime
    model_size: str | ModelSize | None = None
    """Shape of a reward model built from scratch (``sft.model_size``; only when an init is 'scratch')."""
    distributed: DistributedSection | None = None
    """DeepSpeed workers for the training (None: in this process)."""
    heldout_onpolicy: OnPolicyLabels | None = None
    """Labelled pairs of the SFT policy's replies for the held-out RM (None: none)."""

    @classmethod
    def of(cls, config: PipelineConfig) -> Config:
        section = config.reward_model
        onpolicy = (OnPolicyLabels(section.heldout_onpolicy_pairs,
                                   replace(config.ppo.generation, batch_size=ONPOLICY_BATCH_ROWS),
                                   config.data.demo.annotator_temperature, config.seed)
                    if section.heldout_onpolicy_pairs else None)
        return cls(section, Runtime.of(config), config.sft.model_size if "scratch" in section.inits else None,
                   config.distributed if config.distributed.runs(NAME) else None, onpolicy)


@dataclass(frozen=True)
class Inputs:
    data: Artifact
    """data-prep: train and held-out pairs."""
    sft: ModelInput | None
    """The SFT policy: backbone ('sft'), tokenizer and shape ('scratch'), the replies of the held-out RM's on-policy
    pairs; None when nothing uses it."""

    @classmethod
    def of(cls, cfg: Config, data: Artifact, sft: ModelInput) -> Inputs:
        needed = {"sft", "scratch"} & set(cfg.reward_model.inits) or cfg.heldout_onpolicy is not None
        return cls(data, sft if needed else None)


@dataclass(frozen=True)
class Result:
    proxy: str
    heldout: str
    metrics: dict[str, float]
    """``rm/{proxy,heldout}/eval/*`` (on data the model never saw), ``rm/{proxy,heldout}/train/*``, ``rm/cross/*``."""
    plots: list[str] = field(default_factory=list)
    metrics_file: str = METRICS_FILE
    counts: dict[str, int] = field(default_factory=dict)
    """Pairs trained and evaluated on."""


def model_input(artifact: Artifact, role: str) -> ModelInput:
    """The proxy (``role='proxy'``) or held-out reward model of a reward-model artifact."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return ModelInput(artifact, getattr(STAGE.result(artifact), role))


@dataclass(frozen=True)
class _Fitted:
    role: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    training: RewardTrainingConfig
    """Its training settings (``max_length`` cut to the model's positions): scoring reads them as training did."""
    history: RewardTrainingResult
    metrics: dict[str, float]

    def pair_scores(self, pairs: Sequence[PreferencePair]) -> tuple[list[float], list[float]]:
        """:func:`pair_scores` of this model, as many pairs and tokens per forward as its training used."""
        return pair_scores(self.model, self.tokenizer, pairs, self.training.max_length,
                           self.training.micro_batch_size or 64, self.training.max_tokens_per_forward)


def compute(cfg: Config, inputs: Inputs, ctx: StageContext) -> Result:
    section, data = cfg.reward_model, inputs.data
    train, heldout = read_pairs(data.path(data.result["train_pairs"])), read_pairs(data.path(data.result["heldout_pairs"]))
    cross_sample = _sample(train, MAX_CROSS_EVAL_PAIRS, section.heldout.seed)
    ctx.tracker.flush_every = FLUSH_EVERY
    members = [_fit(member_role(k), inputs.sft, train, heldout, cfg, ctx) for k in range(section.ensemble_size)]
    onpolicy = _onpolicy_pairs(cfg, inputs, [*train, *heldout], ctx.out / ONPOLICY_FILE)
    held = _fit("heldout", inputs.sft, [*heldout, *onpolicy], cross_sample, cfg, ctx)
    *proxy_scores, ensemble = proxy_pair_scores(members, heldout)
    cross, proxy_scores = _cross_metrics(tuple(proxy_scores), held, heldout)
    metrics = {k: v for member in members for k, v in member.metrics.items()}
    metrics |= {**ensemble, **held.metrics, **cross}
    plots = _plots(ctx.out, members[0].history, held.history, proxy_scores)
    save_ensemble(ctx.out / "proxy", [(m.model, m.tokenizer) for m in members])
    save_ensemble(ctx.out / "heldout", [(held.model, held.tokenizer)])
    write_json({"metrics": metrics}, ctx.out / METRICS_FILE)
    log.info("reward-model: proxy held-out accuracy %.3f%s, held-out RM accuracy %.3f on train pairs",
             metrics["rm/proxy/eval/accuracy"],
             f" ({len(members)} members; each {', '.join(format(m.metrics[f'rm/{m.role}/eval/accuracy'], '.3f') for m in members)})"
             if len(members) > 1 else "", metrics["rm/heldout/eval/accuracy"])
    counts = {"n_train_pairs": len(train), "n_heldout_pairs": len(heldout), "n_cross_eval_pairs": len(cross_sample),
              **({"n_heldout_onpolicy_pairs": len(onpolicy)} if cfg.heldout_onpolicy else {})}
    return Result("proxy", "heldout", metrics, plots, METRICS_FILE, counts)


def _onpolicy_pairs(cfg: Config, inputs: Inputs, pairs: Sequence[PreferencePair], path: Path) -> list[PreferencePair]:
    """The held-out RM's on-policy pairs (none unless ``reward_model.heldout_onpolicy_pairs``): two replies of the SFT
    policy to each of that many prompts drawn from ``pairs``' prompts, labelled by the simulated annotator with the
    preference data's noise (a pair of identical or empty replies is dropped: there is nothing to prefer), written to
    ``path`` for people to read."""
    spec = cfg.heldout_onpolicy
    if spec is None:
        return []
    prompts = list(dict.fromkeys(pair.prompt for pair in pairs))
    seed = refresh_seed(spec.seed, 0)  # iteration 0: the SFT policy; refreshes draw from iterations 1, 2, ...
    rng = random.Random(f"heldout-onpolicy:{seed}")
    drawn = [rng.choice(prompts) for _ in range(spec.n_pairs)]
    policy, tokenizer = load_frozen_lm(cfg.runtime, inputs.sft.path)
    started = time.monotonic()
    sampled = [p for p in sample_reply_pairs(policy, tokenizer, drawn, spec.generation, seed)
               if p.reply_a != p.reply_b and p.reply_a.strip() and p.reply_b.strip()]
    annotator = SimulatedAnnotator(spec.annotator_temperature, seed=seed)
    labelled = [PreferencePair(p.prompt, *annotator.label(p.prompt, p.reply_a, p.reply_b)) for p in sampled]
    write_parquet([{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected, "margin": None,
                    "source_file": "heldout-onpolicy", "source_row": i, "pair_id": pair_id(p.prompt, p.chosen, p.rejected)}
                   for i, p in enumerate(labelled)], PREFERENCE_PAIRS, path)
    log.info("reward-model heldout: %d on-policy pairs of the SFT policy labelled (%d identical or empty dropped) in "
             "%.0fs", len(labelled), spec.n_pairs - len(labelled), time.monotonic() - started)
    return labelled


def member_role(k: int) -> str:
    """The metric role of proxy member ``k``: 'proxy' for the first (the proxy, without an ensemble), 'proxy_<k>'."""
    return "proxy" if k == 0 else f"proxy_{k}"


def _sample(pairs: Sequence[PreferencePair], limit: int, seed: int) -> list[PreferencePair]:
    """All pairs, or a seeded sample of ``limit`` of them."""
    return list(pairs) if len(pairs) <= limit else random.Random(seed).sample(list(pairs), limit)


def resolve_init(init: str, sft: ModelInput | None, tokens: SpecialTokens = SpecialTokens(),
                 setting: str = "reward_model.init") -> tuple[str | None, PreTrainedTokenizerBase]:
    """(local folder of the initial weights or None for 'scratch', tokenizer) for a reward-model init.

    'sft' and 'scratch' take the tokenizer from the SFT policy; a path, ``models:/`` URI or hub id brings its own, its
    special tokens resolved with ``tokens`` (``reward_model.tokens``).
    """
    if init in ("sft", "scratch"):
        if sft is None:
            raise ValueError(f"{setting}={init!r} needs the SFT policy")
        return (sft.path if init == "sft" else None), _load_tokenizer(sft.path, "the SFT policy")
    init_dir = local_model(init)
    return init_dir, _load_tokenizer(init_dir, setting, tokens)


def _load_tokenizer(path: str, setting: str, tokens: SpecialTokens = SpecialTokens()) -> PreTrainedTokenizerBase:
    try:
        return load_tokenizer(path, tokens, "reward_model.tokens")
    except (OSError, TypeError) as err:
        raise ValueError(f"{setting}: no tokenizer can be loaded from {path!r} ({one_line(str(err))}); give a folder saved "
                         "with save_pretrained (model + tokenizer)") from err


def _settings(cfg: Config, role: str,
              sft: ModelInput | None) -> tuple[str | None, PreTrainedTokenizerBase, RewardTrainingConfig]:
    """The ``role`` reward model's initial weights folder (None: 'scratch'), its tokenizer, and its training settings
    with ``max_length`` cut to the model's positions (read from its config: no weights are loaded here). Proxy member
    k (``role`` 'proxy_<k>') trains as the proxy with seed ``training.seed + k``."""
    section = cfg.reward_model
    kind = "heldout" if role == "heldout" else "proxy"
    init, setting = section.init_of(kind), "reward_model.init" if kind == "proxy" else "reward_model.heldout_init"
    init_dir, tokenizer = resolve_init(init, sft, section.tokens, setting)
    training = section.heldout if kind == "heldout" else section.training
    if role.startswith("proxy_"):
        training = replace(training, seed=training.seed + int(role.removeprefix("proxy_")))
    shape = AutoConfig.from_pretrained(init_dir) if init_dir is not None else config_for_tokenizer(tokenizer,
                                                                                                    cfg.model_size)
    positions = config_positions(shape)
    if positions is not None and training.max_length > positions:  # as sft does: no longer than the model reads
        log.info("reward-model %s: max_length %d cut to the %d positions of %s", role, training.max_length, positions,
                 init)
        training = replace(training, max_length=positions)
    return init_dir, tokenizer, training


def _start(cfg: Config, role: str, init_dir: str | None, tokenizer: PreTrainedTokenizerBase,
           training: RewardTrainingConfig) -> PreTrainedModel:
    """The ``role`` reward model's starting weights, a 1-output sequence classifier on the configured device: the SFT
    backbone + fresh head, fresh ('scratch', ``init_dir`` None), or any checkpoint (continued, or under a fresh
    head), the fresh parts drawn with ``training.seed``."""
    init = cfg.reward_model.init_of("heldout" if role == "heldout" else "proxy")
    seed, dtype = training.seed, cfg.runtime.torch_dtype
    torch.manual_seed(seed)  # the fresh score head (and a scratch model) differ per seed, reproducibly
    if init_dir is None:
        model = build_reward_model(config_for_tokenizer(tokenizer, cfg.model_size), seed).to(dtype)
    else:
        model, fresh = init_reward_model(init_dir, seed, dtype, pad_id(tokenizer))
        if init != "sft":
            log.info("reward-model %s: %s from %s (%s)", role, describe(model), init,
                     "a fresh scalar head on its weights" if fresh else "continuing its 1-output head")
    # The tokenizer's pad id is the model's (a decoder head reading the last non-pad token would otherwise misread).
    model.config.pad_token_id = pad_id(tokenizer)
    score_prefix(model, tokenizer)  # an encoder without a [CLS] / bos fails here, naming the setting
    return model.to(cfg.runtime.torch_device)


def _fit(role: str, sft: ModelInput | None, train: Sequence[PreferencePair], evaluate_on: Sequence[PreferencePair],
         cfg: Config, ctx: StageContext) -> _Fitted:
    """Train one reward model, log its curve under ``rm/<role>/``, and return its final metrics. The model is built
    inside ``fit_reward_model`` (launched: saved for the workers and dropped before they start)."""
    init_dir, tokenizer, training = _settings(cfg, role, sft)
    steps = training.epochs * math.ceil(len(train) / training.batch_size)
    log.info("reward-model %s: %d train pairs, %d eval pairs, %d steps", role, len(train), len(evaluate_on), steps)

    def on_log(step: int, metrics: Mapping[str, float]) -> None:
        ctx.tracker.log({f"rm/{role}/{k.removeprefix('rm/')}": v for k, v in metrics.items()}, step)
        if "rm/eval/accuracy" in metrics:
            log.info("reward-model %s step %d: eval accuracy %.3f, loss %.4f, margin %.3f", role, step,
                     metrics["rm/eval/accuracy"], metrics["rm/eval/loss"], metrics["rm/eval/margin_mean"])
        elif step % FLUSH_EVERY == 0:
            log.info("reward-model %s step %d: train loss %.4f", role, step, metrics["rm/train/loss"])

    job = RewardModelJob(training, cfg.runtime, tuple(train), tuple(evaluate_on), max(1, steps // EVALS_PER_TRAINING))
    model, history = fit_reward_model(job, lambda: _start(cfg, role, init_dir, tokenizer, training), tokenizer,
                                      cfg.distributed, on_log, ctx.work / "distributed" / role)
    ctx.tracker.flush()
    metrics = {f"rm/{role}/eval/{k}": float(v) for k, v in asdict(history.final_eval).items()}
    metrics |= {f"rm/{role}/train/final_loss": history.train_loss[-1], f"rm/{role}/train/steps": float(steps),
                f"rm/{role}/train/seconds": history.seconds, f"rm/{role}/train/n_truncated": float(history.n_truncated)}
    return _Fitted(role, model.eval(), tokenizer, training, history, metrics)


@torch.no_grad()
def pair_scores(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pairs: Sequence[PreferencePair],
                max_length: int, batch_size: int = 64,
                max_tokens: int | None = None) -> tuple[list[float], list[float]]:
    """Scores of every chosen and every rejected reply, in pair order: ((N,), (N,)) as lists; ``batch_size`` pairs
    (at most ``max_tokens`` tokens, ``reward_model.*.max_tokens_per_forward``) per forward."""
    encoded = encode_pairs(tokenizer, pairs, max_length, score_prefix(model, tokenizer))
    chosen, rejected = score_pairs(model, encoded.chosen, encoded.rejected, pad_id(tokenizer), batch_size, max_tokens)
    return chosen.cpu().tolist(), rejected.cpu().tolist()


def proxy_pair_scores(members: Sequence[_Fitted],
                      pairs: Sequence[PreferencePair]) -> tuple[list[float], list[float], dict[str, float]]:
    """The proxy's scores of each chosen and rejected reply of ``pairs`` (the held-out pairs), and for an ensemble its
    metrics there: the members' mean score (the stage does not know ``ppo.reward.ensemble``, which PPO, best-of-n
    and evaluation read), its accuracy, and how far the members disagree (mean over replies of their scores' std)."""
    if len(members) == 1:
        return (*members[0].pair_scores(pairs), {})
    scores = [member.pair_scores(pairs) for member in members]
    chosen = torch.tensor([c for c, _ in scores], dtype=torch.float64)  # (K, N)
    rejected = torch.tensor([r for _, r in scores], dtype=torch.float64)
    margins = chosen.mean(dim=0) - rejected.mean(dim=0)
    metrics = {"rm/proxy/ensemble/eval/accuracy": float(((margins > 0).double() + 0.5 * (margins == 0).double()).mean()),
               "rm/proxy/ensemble/eval/disagreement": float(torch.cat([chosen, rejected], dim=1)
                                                            .std(dim=0, unbiased=False).mean()),
               "rm/proxy/ensemble/size": float(len(members))}
    return chosen.mean(dim=0).tolist(), rejected.mean(dim=0).tolist(), metrics


def _cross_metrics(proxy_scores: tuple[list[float], list[float]], heldout: _Fitted,
                   pairs: Sequence[PreferencePair]) -> tuple[dict[str, float], dict[str, list]]:
    """How far the proxy (its scores of ``pairs``) agrees with the held-out RM on the held-out pairs (unseen by the
    proxy).

    ``rm/cross/agreement``: share of pairs both RMs order the same way, a pair either ties counting half (the
    accuracy tie rule); ``rm/cross/spearman``: rank correlation of their scores over all replies. Also returns the
    proxy's scores for the histogram.
    """
    p_chosen, p_rejected = proxy_scores
    h_chosen, h_rejected = heldout.pair_scores(pairs)
    p_margin = torch.tensor(p_chosen, dtype=torch.float64) - torch.tensor(p_rejected, dtype=torch.float64)
    h_margin = torch.tensor(h_chosen, dtype=torch.float64) - torch.tensor(h_rejected, dtype=torch.float64)
    metrics = {"rm/cross/agreement": pairwise_agreement(p_margin, h_margin),
               "rm/cross/spearman": float(spearman(p_chosen + p_rejected, h_chosen + h_rejected))}
    return metrics, {"chosen": p_chosen, "rejected": p_rejected}


def _plots(out: Path, proxy: RewardTrainingResult, heldout: RewardTrainingResult,
           proxy_scores: Mapping[str, Sequence[float]]) -> list[str]:
    """Loss curves of both RMs and the proxy's score histogram on the held-out pairs, as PNGs under ``out``."""
    names = []
    for role, history, evaluated_on in (("proxy", proxy, "held-out pairs"), ("heldout", heldout, "train pairs")):
        eval_steps = [step for step, _ in history.evals]
        fig = loss_curve(range(1, len(history.train_loss) + 1), history.train_loss, eval_steps,
                         [e.loss for _, e in history.evals], title=f"{role} reward model (eval on {evaluated_on})")
        save_figure(fig, out / f"rm_{role}_loss.png")
        names.append(f"rm_{role}_loss.png")
    save_figure(score_histograms(proxy_scores, title="Proxy RM scores on held-out pairs", xlabel="proxy score"),
                out / SCORES_PNG)
    return [*names, SCORES_PNG]


def publish(cfg: Config, result: Result, pub: Publication) -> None:
    pub.log_params({**{f"inputs.{k}": v for k, v in result.counts.items()}})
    pub.log_metrics(result.metrics)
    pub.log_files(result.plots, "plots")
    pub.log_files([result.metrics_file])
    members = int(result.metrics.get("rm/proxy/ensemble/size", 1))
    for role, name in (("proxy", pub.names.reward_model), ("heldout", pub.names.heldout_reward_model)):
        ref = pub.register(role, name, getattr(result, role))
        prefix = f"rm/{role}/ensemble/eval/" if role == "proxy" and members > 1 else f"rm/{role}/eval/"
        tags = {f"eval.{k.removeprefix(prefix)}": f"{v:.4g}" for k, v in result.metrics.items() if k.startswith(prefix)}
        pub.tag_model(ref.uri, {**tags, **({"rlhf.ensemble_size": members} if role == "proxy" and members > 1 else {})})
        if pub.alias_version(name, "champion") is None:  # the first RM is the champion that refreshes must match
            pub.set_alias(name, "champion", ref.version)


STAGE = Stage(NAME, compute, publish, Result)
reward_model_task = stage_task(STAGE, retries=1, retry_delay_seconds=2)
