"""max_tokens_per_forward is a memory knob: reward-model training, pair scores, rollout scores and experience
collection give what the row-only path gives, while the budget really splits batches into unequal chunks."""

from __future__ import annotations

import copy
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from rlhf_core.config import GenerationConfig, PPOConfig, RewardTrainingConfig
from rlhf_core.evaluation.annotators import ReplyPair, RewardModelJudge
from rlhf_core.evaluation.policy_eval import rollout_kl
from rlhf_core.models.budget import (
    packs_scores,
    pair_chunks,
    row_chunks,
    same_count,
    token_chunks,
)
from rlhf_core.models.packing import supports_packing
from rlhf_core.models.roles import (
    Critic,
    ValueHead,
    disable_dropout,
    freeze,
    load_reward_model,
    make_reference,
)
from rlhf_core.models.scoring import RewardModelScorer
from rlhf_core.models.sequences import left_pad
from rlhf_core.models.text import keep_tail, pad_id
from rlhf_core.ppo.rewards import RunningMoments
from rlhf_core.ppo.stats import UpdateStats
from rlhf_core.training import ppo_step as ppo_step_module
from rlhf_core.training.experience import PPOModels, collect_experience
from rlhf_core.training.ppo_step import ppo_update, training_micro_batches
from rlhf_core.training.reward_training import (_micro_batches, encode_pairs, evaluate_reward_model, score_pairs,
                                                train_reward_model)
from rlhf_core.data.records import PreferencePair
from rlhf_core.training.rollout import generate
from rlhf_core.training.strategy import LocalStrategy, TrainableGroup
from tests.behaviour.test_model_families import (
    SPREAD,
    TEXTS,
    handmade_rollout,
    own_tokenizer,
)
from tests.behaviour.test_ppo_step import PROMPTS as STEP_PROMPTS
from tests.behaviour.test_ppo_step import VOCAB as STEP_VOCAB
from tests.behaviour.test_ppo_step import models as step_models
from tests.model_families import save_policy, save_reward_model
from tests.tiny_models import gpt2_config

pytestmark = pytest.mark.usefixtures("single_thread")

WORDS = ["cat", "dog", "sat", "ran", "on", "mat", "red", "blue", "big", "small"]
#: 16 pairs whose sides run from 3 to 10 tokens, so a token budget takes 1 to 4 pairs per forward.
PAIRS = [PreferencePair("q " + WORDS[i % 10], " good " + " ".join(WORDS[: 1 + (i * 3) % 7]), " bad " + WORDS[i % 5],
                        margin=float(i % 3)) for i in range(16)]


def _sgd(groups: list[TrainableGroup], weight_decay: float, max_grad_norm: float,
        lr_lambda: object = None) -> LocalStrategy:
    params = [p for g in groups for p in g.params]
    return LocalStrategy(torch.optim.SGD(params, lr=0.1), None, max_grad_norm, tuple(g.module for g in groups))


def _rm_config(micro: int | None, budget: int | None) -> RewardTrainingConfig:
    return RewardTrainingConfig(epochs=1, batch_size=8, micro_batch_size=micro, max_tokens_per_forward=budget,
                                learning_rate=0.1, max_grad_norm=1e9, use_margin=True, center_rewards_coef=0.05,
                                max_length=12)


def test_reward_model_token_budget_never_changes_the_update(tiny_reward_dir, tokenizer) -> None:
    """Two SGD steps with budgets of 24 and 40 tokens (micro-batches of 1 to 4 pairs, unequal within one step), with
    the margin and the centring term in the loss, give the weights of whole 8-pair batches."""
    model = load_reward_model(str(tiny_reward_dir))
    data = encode_pairs(tokenizer, PAIRS, 12)
    for budget in (24, 40):
        one_process = SimpleNamespace(rank=0, world_size=1)
        sizes = [len(part) for part, _ in _micro_batches(data, list(range(8)), one_process, _rm_config(None, budget),
                                                           packs_scores(model))]
        assert sum(sizes) == 8 and len(set(sizes)) > 1, sizes  # the budget really splits, unequally
    results, start = {}, None
    for micro, budget in ((None, None), (None, 24), (None, 40), (3, 40)):
        model = load_reward_model(str(tiny_reward_dir))
        start = start or {k: v.clone() for k, v in model.state_dict().items()}
        history = train_reward_model(model, tokenizer, PAIRS, PAIRS[:5], _rm_config(micro, budget), make_strategy=_sgd)
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        results[micro, budget] = (weights, history.train_loss, history.final_eval)
    whole, losses, evaluation = results[None, None]
    assert max(float((whole[k] - v).abs().max()) for k, v in start.items()) > 1e-3  # the weights moved
    for key in ((None, 24), (None, 40), (3, 40)):
        weights, budget_losses, budget_eval = results[key]
        assert max(float((weights[k] - whole[k]).abs().max()) for k in whole) < 1e-6, key
        assert budget_losses == pytest.approx(losses, abs=1e-6)
        assert budget_eval.loss == pytest.approx(evaluation.loss, abs=1e-6)
        assert budget_eval.margin_mean == pytest.approx(evaluation.margin_mean, abs=1e-6)


def test_pair_scores_and_the_judge_are_the_same_under_a_budget(tiny_reward_dir, tokenizer) -> None:
    model = load_reward_model(str(tiny_reward_dir)).eval()
    data = encode_pairs(tokenizer, PAIRS, 12)
    assert len(pair_chunks(model, data.chosen, data.rejected, 16, 24)) > 2
    chosen, rejected = score_pairs(model, data.chosen, data.rejected, pad_id(tokenizer), 16)
    budget_chosen, budget_rejected = score_pairs(model, data.chosen, data.rejected, pad_id(tokenizer), 16, 24)
    torch.testing.assert_close(budget_chosen, chosen, atol=1e-6, rtol=0)
    torch.testing.assert_close(budget_rejected, rejected, atol=1e-6, rtol=0)
    assert evaluate_reward_model(model, tokenizer, data, 16, 24).loss == pytest.approx(
        evaluate_reward_model(model, tokenizer, data).loss, abs=1e-6)
    replies = [ReplyPair(p.prompt, p.chosen, p.rejected) for p in PAIRS]
    a, b = RewardModelJudge(model, tokenizer, 12, batch_size=16).scores(replies)
    budget_a, budget_b = RewardModelJudge(model, tokenizer, 12, batch_size=16, max_tokens=24).scores(replies)
    torch.testing.assert_close(budget_a, a, atol=1e-6, rtol=0)
    torch.testing.assert_close(budget_b, b, atol=1e-6, rtol=0)


def test_an_encoder_scorer_counts_padded_tokens_and_scores_the_same(tmp_path: Path) -> None:
    """A BERT reward model (a padded forward, behind [CLS]) of a GPT-2 policy's text, re-tokenized."""
    policy_tokenizer = own_tokenizer(save_policy("gpt2", tmp_path / "policy"))
    folder = save_reward_model("bert", tmp_path / "rm", seed=2, initializer_range=SPREAD)
    rm, rm_tokenizer = freeze(load_reward_model(folder)), own_tokenizer(folder)
    rollout = handmade_rollout(policy_tokenizer, [(prompt, reply, row % 2 == 0) for row, (prompt, reply)
                                                  in enumerate(TEXTS)])
    whole = RewardModelScorer(rm, policy_tokenizer, rm_tokenizer, batch_size=6)
    budget = RewardModelScorer(rm, policy_tokenizer, rm_tokenizer, batch_size=6, max_tokens=40)
    assert not budget.packed
    lengths = [len(keep_tail(row, budget.max_length, budget.prefix)[0]) for row in budget._retokenized(rollout)]
    assert len(token_chunks(lengths, 6, 40)) > 2  # rows x longest <= 40: the six rows go in several forwards
    torch.testing.assert_close(budget(rollout), whole(rollout), atol=1e-6, rtol=0)


def _ppo_models(tokenizer) -> PPOModels:
    torch.manual_seed(0)
    policy = disable_dropout(GPT2LMHeadModel(gpt2_config(len(tokenizer))))
    torch.manual_seed(1)
    rm = freeze(GPT2ForSequenceClassification(gpt2_config(len(tokenizer), num_labels=1)))
    scorer = RewardModelScorer(rm, tokenizer, batch_size=8)
    return PPOModels(policy, make_reference(policy), scorer, (tokenizer.eos_token_id,), pad_id(tokenizer),
                     value_head=ValueHead(32))


def test_experience_is_the_same_under_a_token_budget(tokenizer) -> None:
    """Old and reference log-probs, values and reward-model scores of 16 rollouts, 8 per forward or at most 24
    tokens per forward (1 to 3 rollouts)."""
    prompts = [tokenizer("q " + " ".join(WORDS[: 1 + i % 6]), add_special_tokens=False)["input_ids"]
               for i in range(16)]
    generation = GenerationConfig(max_new_tokens=8, temperature=0.7, batch_size=16)
    results = {}
    for budget in (None, 24):
        models = _ppo_models(tokenizer)
        models.scorer.max_tokens = budget
        config = PPOConfig(rollout_batch_size=16, mini_batch_size=8, micro_batch_size=8, generation=generation,
                           max_tokens_per_forward=budget)
        experience, *_ = collect_experience(models, prompts, config, 0.1, torch.Generator().manual_seed(0),
                                            RunningMoments())
        results[budget] = experience
    whole, budget = results[None], results[24]
    assert supports_packing(_ppo_models(tokenizer).policy)
    sizes = [len(c) for c in row_chunks(budget.rollout.attention_mask, 8, 24, packed=True)]
    assert len(set(sizes)) > 1, sizes  # the budget really splits, unequally
    assert torch.equal(budget.rollout.response_ids, whole.rollout.response_ids)
    mask = whole.rollout.response_mask  # what a padded slot holds depends on whether its chunk was packed: unread
    for name in ("old_logprobs", "ref_logprobs", "old_values", "advantages", "returns"):
        torch.testing.assert_close(getattr(budget, name)[mask], getattr(whole, name)[mask], atol=1e-6, rtol=0,
                                   msg=name)
    torch.testing.assert_close(budget.scores, whole.scores, atol=1e-6, rtol=0)


def test_evaluation_kl_is_the_same_under_a_token_budget(tokenizer) -> None:
    """heldout-eval's per-reply KL (k1, k3) to the reference: the whole batch in one forward, or at most 24 tokens."""
    models = _ppo_models(tokenizer)
    torch.manual_seed(2)
    with torch.no_grad():  # a policy that differs from its reference, so the KL is not zero
        for param in models.policy.parameters():
            param.add_(0.05 * torch.randn_like(param))
    prompts = [tokenizer("q " + " ".join(WORDS[: 1 + i % 6]), add_special_tokens=False)["input_ids"]
               for i in range(12)]
    ids, mask = left_pad(prompts, models.pad_token_id)
    rollout = generate(models.policy, ids, mask, GenerationConfig(max_new_tokens=8, batch_size=12),
                       models.stop_token_ids, models.pad_token_id, torch.Generator().manual_seed(0))
    whole = rollout_kl(models.policy, models.reference, rollout)
    budget = rollout_kl(models.policy, models.reference, rollout, max_tokens=24)
    assert len(row_chunks(rollout.attention_mask, 12, 24, packed=True)) > 2
    assert whole[0].abs().min() > 1e-3
    for exact, chunked in zip(whole, budget, strict=True):
        torch.testing.assert_close(chunked, exact, atol=1e-6, rtol=0)


def _ppo_update_models(value: str) -> PPOModels:
    """test_ppo_step's tiny GPT-2 policy, nudged off its reference, with a value head or a GPT-2 critic."""
    m = step_models()
    with torch.no_grad():
        for param in m.policy.parameters():
            param.add_(0.05 * torch.randn_like(param))
    if value == "critic":
        torch.manual_seed(3)
        m = replace(m, value_head=None,
                    critic=Critic(GPT2ForSequenceClassification(gpt2_config(STEP_VOCAB, num_labels=1))))
    return m


def _update_config(mode: str, budget: int | None) -> PPOConfig:
    return PPOConfig(rollout_batch_size=16, mini_batch_size=8, micro_batch_size=8, ppo_epochs=2, max_grad_norm=1e9,
                     vf_coef=0.5, entropy_coef=0.01, loss_aggregation=mode, advantage="gae",
                     max_tokens_per_forward=budget,
                     generation=GenerationConfig(max_new_tokens=8, temperature=0.7, batch_size=16))


def _sgd_ppo_update(m: PPOModels, experience, config: PPOConfig) -> tuple[dict[str, torch.Tensor], UpdateStats]:
    params = [p for p in m.policy.parameters() if p.requires_grad] + m.value_parameters()
    strategy = LocalStrategy(torch.optim.SGD(params, lr=0.1), None, config.max_grad_norm)
    stats = ppo_update(m, strategy, experience, config, 0.1, torch.Generator().manual_seed(3))
    weights = {f"policy.{k}": v.detach().clone() for k, v in m.policy.state_dict().items()}
    weights.update({f"value.{k}": v.detach().clone() for k, v in m.value_model.state_dict().items()})
    return weights, stats


@pytest.mark.parametrize("value", ["head", "critic"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_ppo_training_micro_batches_under_a_token_budget_give_the_rows_only_update(mode: str, value: str) -> None:
    """Two epochs of two 8-rollout mini-batches (GAE, value head or critic): at most 8 rollouts per forward, or at
    most 32 tokens (1 to 3 rollouts, unequal within a mini-batch), give the same weights and the same UpdateStats."""
    m = _ppo_update_models(value)
    experience, *_ = collect_experience(m, STEP_PROMPTS, _update_config(mode, None), 0.1,
                                        torch.Generator().manual_seed(0), RunningMoments())
    one_process = SimpleNamespace(rank=0, world_size=1)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(3))
    for half in (order[:8], order[8:]):
        plan = training_micro_batches(half, experience.rollout.attention_mask, one_process,
                                      _update_config(mode, 32), packed=supports_packing(m.policy))
        sizes = [len(rows) for rows, counted in plan]
        assert sum(sizes) == 8 and len(set(sizes)) > 1, sizes  # the budget really splits, unequally
        assert torch.equal(torch.cat([rows for rows, _ in plan]), half)  # every row once, in order
    start = {f"policy.{k}": v.clone() for k, v in m.policy.state_dict().items()}
    rows_only, rows_stats = _sgd_ppo_update(copy.deepcopy(m), experience, _update_config(mode, None))
    budget, budget_stats = _sgd_ppo_update(copy.deepcopy(m), experience, _update_config(mode, 32))
    assert max(float((rows_only[k] - v).abs().max()) for k, v in start.items()) > 1e-3  # the weights moved
    worst = max(float((budget[k] - rows_only[k]).abs().max()) for k in rows_only)
    assert worst < 1e-6, f"{mode}, {value}: {worst}"
    for name, expected in asdict(rows_stats).items():
        assert getattr(budget_stats, name) == pytest.approx(expected, abs=1e-6), name


def test_every_rank_runs_as_many_training_micro_batches() -> None:
    """Two ranks, an 8-rollout mini-batch: rank 0's four short rows fit one 24-token forward, rank 1's four rows of
    13 need four. Rank 0 splits its chunk into halves, then quarters (one row each): four forwards, all counted.
    Equal shares always split far enough; a weight-0 repeat is for a share with fewer rows than another's chunks."""
    lengths = [3, 3, 3, 3, 13, 13, 13, 13]
    mask = torch.tensor([[i < n for i in range(13)] for n in lengths])
    config = _update_config("token-mean", 24)
    whole = torch.arange(8)
    plans = [training_micro_batches(whole, mask, SimpleNamespace(rank=r, world_size=2), config, packed=True)
             for r in range(2)]
    assert [[(rows.tolist(), counted) for rows, counted in plan] for plan in plans] == [
        [([0], True), ([1], True), ([2], True), ([3], True)],
        [([4], True), ([5], True), ([6], True), ([7], True)],
    ]
    rows_only = [training_micro_batches(whole, mask, SimpleNamespace(rank=r, world_size=2),
                                        replace(config, max_tokens_per_forward=None, micro_batch_size=2), packed=True)
                 for r in range(2)]  # no budget: micro_batch_size rows at a time, as before the budget
    assert [[(rows.tolist(), counted) for rows, counted in plan] for plan in rows_only] == [
        [([0, 1], True), ([2, 3], True)], [([4, 5], True), ([6, 7], True)]]
    assert same_count([[range(4)], [range(2), range(2, 3), range(3, 4)]], 0) == [
        (range(1), True), (range(1, 2), True), (range(2, 4), True)]  # halves, then the first half again
    # A one-row share cannot split: it repeats its row at weight 0 until it matches the rank with most forwards.
    assert same_count([[range(1)], [range(1), range(1, 2), range(2, 3)]], 0) == [
        (range(1), True), (range(1), False), (range(1), False)]
    assert same_count([[range(1)], [range(1), range(1, 2), range(2, 3)]], 1) == [
        (range(1), True), (range(1, 2), True), (range(2, 3), True)]


def test_a_weight_0_repeat_changes_neither_the_update_nor_the_metrics(monkeypatch) -> None:
    """Training micro-batches padded with a weight-0 repeat (what a rank does to match another's forward count)
    give the weights and UpdateStats of the plain rows-only plan: its backward adds nothing, its metrics count
    nothing."""
    m = _ppo_update_models("head")
    config = _update_config("token-mean", None)
    experience, *_ = collect_experience(m, STEP_PROMPTS, config, 0.1, torch.Generator().manual_seed(0),
                                        RunningMoments())
    plain, plain_stats = _sgd_ppo_update(copy.deepcopy(m), experience, config)
    planned = ppo_step_module.training_micro_batches

    def with_repeats(*args, **kwargs):
        parts = planned(*args, **kwargs)
        return parts + [(parts[0][0][:1], False)] * 2

    monkeypatch.setattr(ppo_step_module, "training_micro_batches", with_repeats)
    repeated, repeated_stats = _sgd_ppo_update(copy.deepcopy(m), experience, config)
    assert max(float((repeated[k] - plain[k]).abs().max()) for k in plain) == 0.0
    assert asdict(repeated_stats) == asdict(plain_stats)
