"""The PPO objective is a property of the mini-batch, not of how it is split; the KL in the loss pulls; the
critic-free estimators run without a value model."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf_core.config import GenerationConfig, KLConfig, PPOConfig
from rlhf_core.ppo.aggregation import AGGREGATIONS
from rlhf_core.ppo.rewards import RunningMoments
from rlhf_core.training.experience import PPOModels, collect_experience
from rlhf_core.training.ppo_loop import _modules
from rlhf_core.training.ppo_step import PPOState, make_kl_controller, ppo_step, ppo_update, prepare_training
from rlhf_core.training.strategy import LocalStrategy
from tests.behaviour.test_ppo_step import PROMPTS, CountSeven, models

pytestmark = pytest.mark.usefixtures("single_thread")


def _config(**overrides) -> PPOConfig:
    settings = dict(rollout_batch_size=16, mini_batch_size=8, micro_batch_size=8, ppo_epochs=1, max_grad_norm=1e9,
                    vf_coef=0.5, entropy_coef=0.01, generation=GenerationConfig(max_new_tokens=8, temperature=0.7,
                                                                                batch_size=16))
    return PPOConfig(**{**settings, **overrides})


def _sgd_update(m: PPOModels, experience, config: PPOConfig) -> dict[str, torch.Tensor]:
    """One ppo_update with plain SGD (lr 0.1): the parameters move by exactly lr x the gradient."""
    params = [p for p in m.policy.parameters() if p.requires_grad] + m.value_parameters()
    strategy = LocalStrategy(torch.optim.SGD(params, lr=0.1), None, config.max_grad_norm)
    ppo_update(m, strategy, experience, config, 0.1, torch.Generator().manual_seed(3))
    weights = {f"policy.{k}": v.detach().clone() for k, v in m.policy.state_dict().items()}
    weights.update({f"value.{k}": v.detach().clone() for k, v in m.value_model.state_dict().items()})
    return weights


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_micro_batch_size_never_changes_the_update(mode: str) -> None:
    """Micro-batch 1, 2 and the whole mini-batch (8) give the same parameters after one epoch of two mini-batches,
    with replies of different lengths, for every loss aggregation (policy, value and entropy terms, KL in the
    loss)."""
    base = models()
    with torch.no_grad():
        for p in base.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    config = _config(loss_aggregation=mode, kl=KLConfig(coef=0.1, placement="loss", estimator="k3"))
    experience, stats, _, _ = collect_experience(base, PROMPTS, config, 0.1, torch.Generator().manual_seed(0),
                                                 RunningMoments())
    lengths = experience.rollout.response_mask.sum(dim=1)
    assert lengths.min() < lengths.max()  # the case where the old per-micro-batch mean went wrong
    start = {k: v.clone() for k, v in base.policy.state_dict().items()}
    results = {micro: _sgd_update(copy.deepcopy(base), experience, _config(
        loss_aggregation=mode, micro_batch_size=micro, kl=config.kl)) for micro in (1, 2, 8)}
    moved = max(float((results[8][f"policy.{k}"] - v).abs().max()) for k, v in start.items())
    assert moved > 1e-4
    for micro in (1, 2):
        worst = max(float((results[micro][k] - results[8][k]).abs().max()) for k in results[8])
        assert worst < 1e-6, f"micro-batch {micro} vs 8 ({mode}): {worst}"


def _zero_score(rollout) -> torch.Tensor:
    return torch.zeros(rollout.response_ids.shape[0])


def test_kl_in_the_loss_pulls_the_policy_back_to_the_reference() -> None:
    """With no reward at all, only the KL term moves the policy: KL to the reference must shrink."""
    m = models()
    m.scorer = _zero_score
    with torch.no_grad():
        for p in m.policy.parameters():
            p.add_(0.1 * torch.randn_like(p, generator=torch.Generator().manual_seed(0)))
    config = _config(mini_batch_size=16, micro_batch_size=16, learning_rate=3e-3, vf_coef=0.0, entropy_coef=0.0,
                     kl=KLConfig(coef=1.0, placement="loss", estimator="k3"))
    m, strategy = prepare_training(m, config)
    state = PPOState(make_kl_controller(config), torch.Generator().manual_seed(0))
    kls = [ppo_step(m, strategy, state, PROMPTS, config).rollout.kl_k3_mean for _ in range(12)]
    assert kls[0] > 0.2
    assert kls[-1] < 0.5 * kls[0], kls


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp"])
def test_critic_free_estimators_train_without_a_value_model(estimator: str) -> None:
    torch.manual_seed(0)
    m = models()
    m = PPOModels(m.policy, m.reference, CountSeven(), m.stop_token_ids, m.pad_token_id)
    assert m.value_model is None
    config = _config(advantage=estimator, samples_per_prompt=4, mini_batch_size=16, micro_batch_size=4)
    m, strategy = prepare_training(m, config)
    assert len(strategy.optimizer.param_groups) == 1  # the policy only
    state = PPOState(make_kl_controller(config), torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in m.policy.state_dict().items()}
    stats = ppo_step(m, strategy, state, PROMPTS[:4], config)
    assert stats.update.value_loss == 0.0 and stats.update.value_grad_norm == 0.0
    assert stats.update.policy_grad_norm > 0
    assert any(not torch.equal(before[k], v) for k, v in m.policy.state_dict().items())
    assert set(_modules(m, config)) == {"policy"}  # nothing of a value model is checkpointed


def test_replies_to_one_prompt_sit_side_by_side() -> None:
    """samples_per_prompt repeats each prompt in place, so a group is consecutive rows (what the baselines read)."""
    m = models()
    m = PPOModels(m.policy, m.reference, CountSeven(), m.stop_token_ids, m.pad_token_id)
    config = _config(advantage="grpo", samples_per_prompt=4, mini_batch_size=16, micro_batch_size=16)
    seen = []
    original = m.scorer

    def record(rollout):
        seen.append(rollout.query_ids.clone())
        return original(rollout)

    m.scorer = record
    m, strategy = prepare_training(m, config)
    ppo_step(m, strategy, PPOState(make_kl_controller(config), torch.Generator().manual_seed(0)),
             PROMPTS[:4], config)
    queries = seen[0]
    for group in range(4):
        rows = queries[group * 4:(group + 1) * 4]
        assert all(torch.equal(rows[0], row) for row in rows)
    with pytest.raises(ValueError, match="it takes ppo.rollout_batch_size / ppo.samples_per_prompt = 4"):
        ppo_step(m, strategy, PPOState(make_kl_controller(config), torch.Generator()), PROMPTS, config)


def test_a_critic_free_run_resumes_to_the_weights_of_a_straight_run(tmp_path) -> None:
    """Checkpoints without a value model: killed after 2 updates and resumed to 4 == 4 in one go."""
    from rlhf_core.training.ppo_loop import train_ppo

    def fresh() -> PPOModels:
        m = models()
        return PPOModels(m.policy, m.reference, CountSeven(), m.stop_token_ids, m.pad_token_id)

    config = _config(advantage="rloo", samples_per_prompt=4, mini_batch_size=8, micro_batch_size=4)
    straight = fresh()
    train_ppo(straight, PROMPTS, config, 4, tmp_path / "straight", 1)
    train_ppo(fresh(), PROMPTS, config, 2, tmp_path / "resumed", 1)
    resumed = fresh()
    result = train_ppo(resumed, PROMPTS, config, 4, tmp_path / "resumed", 1)
    assert result.resumed_from_step == 2
    for (name, a), b in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_reward_model_micro_batch_size_never_changes_the_update(tiny_reward_dir, tokenizer) -> None:
    """reward_model.*.micro_batch_size is a memory knob: micro-batches of 1 and 3 pairs (the last one short) give the
    weights of whole 8-pair batches after two SGD steps, with the margin and the centring term in the loss."""
    from rlhf_core.config import RewardTrainingConfig
    from rlhf_core.models.roles import load_reward_model
    from rlhf_core.training.reward_training import train_reward_model
    from rlhf_core.data.records import PreferencePair
    from rlhf_core.training.strategy import TrainableGroup

    def sgd(groups: list[TrainableGroup], weight_decay: float, max_grad_norm: float,
            lr_lambda: object = None) -> LocalStrategy:
        params = [p for g in groups for p in g.params]
        return LocalStrategy(torch.optim.SGD(params, lr=0.1), None, max_grad_norm, tuple(g.module for g in groups))

    words = ["cat", "dog", "sat", "ran", "on", "mat", "red", "blue", "big", "small"]
    pairs = [PreferencePair("q " + words[i % 10], " good " + " ".join(words[: 1 + i % 7]), " bad " + words[i % 5],
                            margin=float(i % 3)) for i in range(16)]
    results, start = {}, None
    for micro in (None, 1, 3):
        model = load_reward_model(str(tiny_reward_dir))
        start = start or {k: v.clone() for k, v in model.state_dict().items()}
        config = RewardTrainingConfig(epochs=1, batch_size=8, micro_batch_size=micro, learning_rate=0.1,
                                      max_grad_norm=1e9, use_margin=True, center_rewards_coef=0.05, max_length=64)
        history = train_reward_model(model, tokenizer, pairs, [], config, make_strategy=sgd)
        results[micro] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, history.train_loss)
    whole, losses = results[None]
    assert max(float((whole[k] - v).abs().max()) for k, v in start.items()) > 1e-3  # the weights moved
    for micro in (1, 3):
        weights, micro_losses = results[micro]
        assert max(float((weights[k] - whole[k]).abs().max()) for k in whole) < 1e-6
        assert micro_losses == pytest.approx(losses, abs=1e-6)
