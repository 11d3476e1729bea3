"""One benchmark run of one side (``ours`` or ``trl``) in a fresh process; writes per-update records as JSON.

    python -m benchmarks.ppo_vs_trl.worker --side ours --seed 0 --settings settings.json --out run.json

Both sides load the same tokenizer and weights from the fixture, see the same prompt batches in the same order,
and time every update from its first to its last instruction, split into generation / scoring / training /
other. Model loading is not timed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import peak_rss_mib, rss_mib
from benchmarks.fixtures import Fixture, FixtureSpec, build_fixture
from benchmarks.ppo_vs_trl.settings import Settings, ours_config, trl_config_kwargs
from rlhf_core.models.sequences import Rollout
from rlhf_core.ppo.masking import response_mask_from_stop


def prompt_batches(fixture: Fixture, s: Settings) -> list[list[list[int]]]:
    """``s.updates`` batches of ``s.rollout_batch_size`` prompts, in order (the same on both sides)."""
    prompts = fixture.prompts()
    needed = s.updates * s.rollout_batch_size
    if len(prompts) < needed:
        raise ValueError(f"fixture has {len(prompts)} prompts; {s.updates} updates x {s.rollout_batch_size} "
                         f"need {needed}: raise FixtureSpec.n_prompts")
    return [prompts[i : i + s.rollout_batch_size] for i in range(0, needed, s.rollout_batch_size)]


class RecordingScorer:
    """Wraps a scorer and keeps the mean of its last batch of scores (the raw reward-model score)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.last_mean = float("nan")

    def __call__(self, rollout: Rollout) -> torch.Tensor:
        scores = self.inner(rollout)
        self.last_mean = float(scores.float().mean())
        return scores


class MissingStop:
    """``-1`` for a response that ran out of tokens without a stop token, else 0 (weighted by the penalty)."""

    def __call__(self, rollout: Rollout) -> torch.Tensor:
        return -(~rollout.stopped).float()


def run_ours(s: Settings, fixture: Fixture, seed: int) -> dict[str, Any]:
    """This project's PPO step (``rlhf_core.training.ppo_step.ppo_step``) with a separate critic initialised from
    the RM."""
    from rlhf_core.models.roles import Critic, load_policy, load_reward_model, make_reference
    from rlhf_core.models.scoring import RewardModelScorer, WeightedSum
    from rlhf_core.training.experience import PPOModels
    from rlhf_core.training.ppo_step import PPOState, make_kl_controller, ppo_step, prepare_training

    torch.manual_seed(seed)
    tokenizer = fixture.tokenizer()
    policy = load_policy(str(fixture.policy_dir))
    reward = load_reward_model(str(fixture.reward_dir))
    critic = Critic(reward)
    rm_scores = RecordingScorer(RewardModelScorer(reward, tokenizer, batch_size=s.micro_batch_size))
    scorer = WeightedSum([(rm_scores, 1.0), (MissingStop(), s.missing_eos_penalty)])
    models = PPOModels(policy, make_reference(policy), scorer, (tokenizer.eos_token_id,), tokenizer.pad_token_id,
                       critic=critic)
    config = ours_config(s, seed)
    models, strategy = prepare_training(models, config)
    state = PPOState(make_kl_controller(config), torch.Generator().manual_seed(seed))
    loaded_rss = rss_mib()
    records = []
    for prompts in prompt_batches(fixture, s):
        started = time.perf_counter()
        stats = ppo_step(models, strategy, state, prompts, config)
        total = time.perf_counter() - started
        t = stats.time
        records.append({
            "total_s": total,
            "generation_s": t.generation,
            "scoring_s": t.scoring,
            "training_s": t.training,
            "other_s": total - t.generation - t.scoring - t.training,
            "response_tokens": round(stats.rollout.response_length_mean * s.rollout_batch_size),
            "rm_score_mean": rm_scores.last_mean,
            "score_mean": stats.rollout.score_mean,
            "kl_mean": stats.rollout.kl_mean,
            "stop_rate": stats.rollout.stop_rate,
            "ratio_mean": stats.update.ratio_mean,
        })
    return {"rss_after_load_mib": loaded_rss, "updates": records}


class TRLTimer:
    """Timestamps inside TRL's ``train()`` without changing what it does.

    Wraps three functions that ``trl.experimental.ppo.ppo_trainer`` calls by module-global name
    (``batch_generation``, ``forward``, ``get_reward``) and a trainer callback. An update spans from the
    previous update's ``on_step_end`` (or ``on_train_begin``) to its own; generation is ``batch_generation``;
    scoring runs from the end of generation to the first training forward pass; training from there to
    ``on_step_end``; other is the part before generation (TRL's previous-update ``gc.collect()``, dataloader).
    """

    def __init__(self, impl: Any, stop_token_id: int, pad_token_id: int) -> None:
        self.impl = impl
        self.stop, self.pad = stop_token_id, pad_token_id
        self.trainer: Any = None
        self.reward_model: Any = None
        self.begin = 0.0
        self.updates: list[dict[str, Any]] = []
        self.logs: list[dict[str, float]] = []
        self._patch()

    def _patch(self) -> None:
        generation, forward, get_reward = self.impl.batch_generation, self.impl.forward, self.impl.get_reward

        def timed_generation(model, queries, *args, **kwargs):
            started = time.perf_counter()
            query_responses, logits = generation(model, queries, *args, **kwargs)
            responses = query_responses[:, queries.shape[1]:]
            _, mask = response_mask_from_stop(responses, [self.stop], self.pad)
            stopped = (responses == self.stop).any(dim=1)
            self.updates.append({"gen_start": started, "gen_end": time.perf_counter(), "rm_scores": [],
                                 "response_tokens": int(mask.sum()), "stop_rate": float(stopped.float().mean())})
            return query_responses, logits

        def timed_forward(model, query_responses, pad_token_id):
            current = self.updates[-1]
            if model is self.trainer.model and "train_start" not in current:
                current["train_start"] = time.perf_counter()
            return forward(model, query_responses, pad_token_id)

        def recorded_reward(model, query_responses, pad_token_id, context_length):
            out = get_reward(model, query_responses, pad_token_id, context_length)
            if model is self.reward_model:
                self.updates[-1]["rm_scores"].extend(out[1].float().tolist())
            return out

        self.impl.batch_generation = timed_generation
        self.impl.forward = timed_forward
        self.impl.get_reward = recorded_reward

    def callback(self) -> Any:
        """A ``TrainerCallback`` that marks the start of training, each update's end and its logged metrics."""
        from transformers import TrainerCallback

        timer = self

        class Marks(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                timer.begin = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                timer.updates[-1]["step_end"] = time.perf_counter()

            def on_log(self, args, state, control, logs=None, **kwargs):
                timer.logs.append(dict(logs or {}))

        return Marks()

    def records(self, batch: int) -> list[dict[str, Any]]:
        """Per-update records in the same format as ours."""
        out, previous_end = [], self.begin
        for u, log in zip(self.updates, self.logs, strict=True):
            total = u["step_end"] - previous_end
            generation = u["gen_end"] - u["gen_start"]
            scoring = u["train_start"] - u["gen_end"]
            training = u["step_end"] - u["train_start"]
            out.append({
                "total_s": total,
                "generation_s": generation,
                "scoring_s": scoring,
                "training_s": training,
                "other_s": total - generation - scoring - training,
                "response_tokens": u["response_tokens"],
                "rm_score_mean": sum(u["rm_scores"]) / len(u["rm_scores"]),
                "score_mean": log["objective/scores"],
                "kl_mean": log["objective/kl"],
                "stop_rate": u["stop_rate"],
                "ratio_mean": log["val/ratio"],
            })
            previous_end = u["step_end"]
        return out


def run_trl(s: Settings, fixture: Fixture, seed: int) -> dict[str, Any]:
    """TRL 1.12's ``trl.experimental.ppo.PPOTrainer`` on the same models, prompts and hyperparameters."""
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, DataCollatorWithPadding
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as impl

    torch.manual_seed(seed)
    tokenizer = fixture.tokenizer()
    policy = AutoModelForCausalLM.from_pretrained(fixture.policy_dir)
    reference = AutoModelForCausalLM.from_pretrained(fixture.policy_dir)
    reward = AutoModelForSequenceClassification.from_pretrained(fixture.reward_dir)
    value = AutoModelForSequenceClassification.from_pretrained(fixture.reward_dir)
    rows = [{"input_ids": p} for batch in prompt_batches(fixture, s) for p in batch]
    timer = TRLTimer(impl, tokenizer.eos_token_id, tokenizer.pad_token_id)
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as output_dir:
        args = PPOConfig(**trl_config_kwargs(s, seed, output_dir))
        trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=reference,
                             reward_model=reward, train_dataset=Dataset.from_list(rows), value_model=value,
                             callbacks=[timer.callback()])
        # TRL shuffles its dataloader; an unshuffled one gives it exactly our prompt batches, in our order.
        trainer.dataloader = DataLoader(rows, batch_size=s.rollout_batch_size, shuffle=False, drop_last=True,
                                        collate_fn=DataCollatorWithPadding(tokenizer))
        timer.trainer, timer.reward_model = trainer, trainer.reward_model
        loaded_rss = rss_mib()
        trainer.train()
    return {"rss_after_load_mib": loaded_rss, "updates": timer.records(s.rollout_batch_size)}


def settings_from_json(text: str) -> Settings:
    """Inverse of ``dataclasses.asdict`` for :class:`Settings`."""
    data = json.loads(text)
    data.pop("mini_batch_size", None)
    data["fixture"] = FixtureSpec(**data["fixture"])
    return Settings(**data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=("ours", "trl"), required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--settings", type=Path, required=True, help="JSON of benchmarks.ppo_vs_trl.settings.Settings")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    settings = settings_from_json(args.settings.read_text())
    if settings.threads:
        torch.set_num_threads(settings.threads)
    fixture = build_fixture(settings.fixture)
    run = run_ours if args.side == "ours" else run_trl
    result = run(settings, fixture, args.seed)
    result.update(side=args.side, seed=args.seed, peak_rss_mib=peak_rss_mib(), torch_threads=torch.get_num_threads())
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
