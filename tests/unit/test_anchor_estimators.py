"""Where the anchors (verl 0.8, OpenRLHF 0.11, TRL) define an estimator, ours means the same: numbers worked by hand
from their formulas. KL clamps, verl's loss-aggregation names, dual-clip PPO, the critic-free estimators'
whitening rule, the critic's own GAE lambda (VC-PPO) and the order of reward normalisation and clipping."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.config import GenerationConfig, KLConfig, PPOConfig, RewardShapingConfig
from rlhf_core.models.sequences import Rollout
from rlhf_core.ppo.aggregation import Normaliser, agg_loss
from rlhf_core.ppo.kl import kl_estimate
from rlhf_core.ppo.losses import policy_loss
from rlhf_core.ppo.rewards import RunningMoments
from rlhf_core.training.experience import build_experience

# ---------------------------------------------------------------------------------------------- KL clamps

# log-ratios logp - logp_ref: -3, -5, +10.5 (and 0)
LOGP = torch.tensor([[-3.0, -5.0, 10.5, 0.0]])
REF = torch.zeros(1, 4)


def test_k3_unclamped_values_by_hand() -> None:
    # k3 = e^u - 1 - u with u = ref - logp = 3, 5, -10.5, 0
    expected = [math.exp(3) - 4, math.exp(5) - 6, math.exp(-10.5) + 9.5, 0.0]
    assert expected[:3] == pytest.approx([16.085537, 142.413159, 9.500028], abs=1e-5)
    assert kl_estimate(LOGP, REF, "k3").tolist()[0] == pytest.approx(expected, rel=1e-6)


def test_k3_value_clamped_at_ten_as_verl_and_openrlhf() -> None:
    # 16.09 and 142.41 -> 10; 9.50 stays (the log-ratio itself is never cut at 10, as the old clamp did)
    assert kl_estimate(LOGP, REF, "k3", clamp=10.0).tolist()[0] == pytest.approx([10.0, 10.0, 9.500028, 0.0],
                                                                                 abs=1e-5)


def test_openrlhf_clamps_k1_and_k2_values_too() -> None:
    # k1: -3, -5, 10.5 -> -3, -5, 10; k2 = x^2 / 2: 4.5, 12.5, 55.125 -> 4.5, 10, 10
    assert kl_estimate(LOGP, REF, "k1", clamp=10.0).tolist()[0] == [-3.0, -5.0, 10.0, 0.0]
    assert kl_estimate(LOGP, REF, "k2", clamp=10.0).tolist()[0] == [4.5, 10.0, 10.0, 0.0]
    assert kl_estimate(LOGP, REF, "k2").tolist()[0] == [4.5, 12.5, 55.125, 0.0]


def test_a_clamped_token_gets_no_gradient_and_the_rest_keep_theirs() -> None:
    logp = LOGP.clone().requires_grad_(True)
    kl_estimate(logp, REF, "k3", clamp=10.0).sum().backward()
    # d k3 / d logp = 1 - e^(ref - logp): at +10.5 that is 1 - e^-10.5; at 0 it is 0
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.0, 1 - math.exp(-10.5), 0.0], abs=1e-6)


def test_k3_bounds_the_log_ratio_at_twenty_before_exp() -> None:
    # u = 50: bounded to 20 -> e^20 - 21; u = 1000 would overflow exp (and its gradient) without the bound
    logp = torch.tensor([[-50.0, -1000.0]], requires_grad=True)
    k3 = kl_estimate(logp, torch.zeros(1, 2), "k3")
    assert k3.tolist()[0] == pytest.approx([math.exp(20) - 21] * 2, rel=1e-6)
    kl_estimate(logp, torch.zeros(1, 2), "k3", clamp=10.0).sum().backward()
    assert torch.isfinite(logp.grad).all() and logp.grad.abs().sum() == 0


def test_the_kl_section_defaults_to_openrlhfs_clamp() -> None:
    assert KLConfig().clamp == 10.0
    assert KLConfig(clamp=None).clamp is None


# ----------------------------------------------------------------------------------- loss aggregation (verl)

X = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[True, True, True, False], [True, False, False, False]])


@pytest.mark.parametrize(("mode", "expected"), [
    ("token-mean", 10 / 4),                              # sum / tokens
    ("seq-mean-token-mean", (6 / 3 + 4 / 1) / 2),        # mean over sequences of each one's token mean
    ("seq-mean-token-sum", (6 + 4) / 2),                 # verl: each sequence's sum, averaged over sequences
    ("seq-mean-token-sum-norm", (6 + 4) / (2 * 8)),      # verl 0.8 / TRL dr_grpo: sum / (S x L), L = 8 here
])
def test_aggregation_modes_mean_what_verl_means(mode: str, expected: float) -> None:
    assert float(agg_loss(X, MASK, Normaliser.of(MASK, mode, max_length=8))) == pytest.approx(expected)


def test_seq_mean_token_sum_is_l_times_its_norm_variant() -> None:
    plain = agg_loss(X, MASK, Normaliser.of(MASK, "seq-mean-token-sum", max_length=8))
    norm = agg_loss(X, MASK, Normaliser.of(MASK, "seq-mean-token-sum-norm", max_length=8))
    assert float(plain) == pytest.approx(8 * float(norm))


# ---------------------------------------------------------------------------------------------- dual clip

def _dual(advantages: list[float], ratios: list[float], dual_clip: float | None):
    old = torch.zeros(1, len(ratios))
    logp = torch.log(torch.tensor([ratios])).requires_grad_(True)
    mask = torch.ones(1, len(ratios), dtype=torch.bool)
    out = policy_loss(logp, old, torch.tensor([advantages]), mask, 0.2, Normaliser.of(mask, "seq-mean-token-sum"),
                      dual_clip)
    out.loss.backward()
    return out, logp.grad


def test_dual_clip_by_hand_as_verls_clip_ratio_c() -> None:
    # token 1: A = -0.5, r = 4.5: max(2.25, 0.6) = 2.25, dual bound -A*3 = 1.5 -> 1.5 (no gradient)
    # token 2: A = -0.5, r = 2.0: max(1.0, 0.6) = 1.0 < 1.5 -> 1.0 (gradient -A*r = 1.0)
    # token 3: A = +1.0, r = 4.5: max(-4.5, -1.2) = -1.2 (positive advantages are never dual-clipped)
    out, grad = _dual([-0.5, -0.5, 1.0], [4.5, 2.0, 4.5], 3.0)
    assert float(out.loss.detach()) == pytest.approx(1.5 + 1.0 - 1.2, abs=1e-5)   # seq-mean-token-sum: one sequence's sum
    assert grad.tolist()[0] == pytest.approx([0.0, 1.0, 0.0], abs=1e-5)
    assert float(out.dual_clipfrac) == pytest.approx(1 / 3)
    plain, _ = _dual([-0.5, -0.5, 1.0], [4.5, 2.0, 4.5], None)
    assert float(plain.loss.detach()) == pytest.approx(2.25 + 1.0 - 1.2, abs=1e-5) and float(plain.dual_clipfrac) == 0.0


def test_dual_clip_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="ppo.dual_clip must be > 1"):
        PPOConfig(dual_clip=1.0)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        _dual([-1.0], [2.0], 0.5)


# ------------------------------------------------------------------------------ critic-free whitening rule

def _rollout(mask: torch.Tensor) -> Rollout:
    b, t = mask.shape
    return Rollout(torch.ones(b, 1, dtype=torch.long), torch.ones(b, 1, dtype=torch.bool),
                   torch.full((b, t), 5), mask, torch.zeros(b, t), torch.ones(b, dtype=torch.bool))


def _config(**overrides) -> PPOConfig:
    settings = dict(rollout_batch_size=8, mini_batch_size=8, micro_batch_size=8,
                    generation=GenerationConfig(max_new_tokens=3, batch_size=8), kl=KLConfig(coef=0.0))
    return PPOConfig(**{**settings, **overrides})


@pytest.mark.parametrize(("advantage", "spp", "whitens"), [
    ("gae", 1, True), ("sequence", 1, True), ("reinforce_pp", 1, True), ("grpo", 4, False), ("rloo", 4, False)])
def test_each_estimator_whitens_as_its_anchors_do(advantage: str, spp: int, whitens: bool) -> None:
    assert _config(advantage=advantage, samples_per_prompt=spp).whitens is whitens


def test_grpo_is_normalised_once_by_default() -> None:
    """Two groups of four with binary scores (1, 1, 0, 0): GRPO gives +-0.866 (Bessel std) on the last token of every
    reply. Whitening again over tokens (winners of 1 token, losers of 3) would shift and rescale them to 1.68 / -0.56;
    by default it is not done, and asked for, it is."""
    mask = torch.tensor([[True, False, False], [True, False, False], [True, True, True], [True, True, True]] * 2)
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0] * 2)
    zeros = torch.zeros(8, 3)

    def last_token_advantages(config: PPOConfig) -> list[float]:
        experience, _ = build_experience(_rollout(mask), zeros, zeros, zeros, scores, config, 0.0, RunningMoments())
        return [experience.advantages[i, int(mask[i].sum()) - 1].item() for i in range(4)]

    s = 0.5 / math.sqrt(1 / 3)
    assert s == pytest.approx(0.866025, abs=1e-6)
    assert last_token_advantages(_config(advantage="grpo", samples_per_prompt=4)) == pytest.approx([s, s, -s, -s],
                                                                                                   abs=1e-5)
    again = last_token_advantages(_config(advantage="grpo", samples_per_prompt=4, whiten_advantages=True))
    # token-weighted: 2 tokens of +s, 6 of -s per group -> mean -s/2, Bessel var over 16 tokens
    mean = -s / 2
    var = (4 * (s - mean) ** 2 + 12 * (-s - mean) ** 2) / 15
    assert again == pytest.approx([(s - mean) / math.sqrt(var)] * 2 + [(-s - mean) / math.sqrt(var)] * 2, abs=1e-4)
    assert again == pytest.approx([1.677, 1.677, -0.559, -0.559], abs=1e-3)


def test_reinforce_pp_still_refuses_to_go_unwhitened() -> None:
    with pytest.raises(ValueError, match="reinforce_pp whitens its returns"):
        _config(advantage="reinforce_pp", whiten_advantages=False)


# ------------------------------------------------------------------------------- critic lambda (VC-PPO)

def test_critic_lambda_gives_the_value_targets_their_own_gae() -> None:
    """One reply of 3 tokens, rewards (0, 0, 1), values (0.5, 0.5, 0.5), gamma 1.
    lam 0.5 (advantages): deltas (0, 0, 0.5) -> A = (0.125, 0.25, 0.5).
    critic_lam 1: A = (0.5, 0.5, 0.5) -> returns = A + V = (1, 1, 1), the Monte-Carlo return."""
    mask = torch.ones(1, 3, dtype=torch.bool)
    values = torch.full((1, 3), 0.5)
    zeros = torch.zeros(1, 3)
    config = PPOConfig(rollout_batch_size=1, mini_batch_size=1, micro_batch_size=1, whiten_advantages=False,
                       lam=0.5, critic_lam=1.0, kl=KLConfig(coef=0.0), generation=GenerationConfig(max_new_tokens=3))
    experience, _ = build_experience(_rollout(mask), zeros, zeros, values, torch.tensor([1.0]), config, 0.0,
                                     RunningMoments())
    assert experience.advantages.tolist()[0] == pytest.approx([0.125, 0.25, 0.5])
    assert experience.returns.tolist()[0] == pytest.approx([1.0, 1.0, 1.0])
    same, _ = build_experience(_rollout(mask), zeros, zeros, values,
                               torch.tensor([1.0]), PPOConfig(**{**config.__dict__, "critic_lam": None}), 0.0,
                               RunningMoments())
    assert same.returns.tolist()[0] == pytest.approx([0.625, 0.75, 1.0])  # A + V with lam 0.5


def test_critic_lambda_and_warmup_are_refused_where_nothing_reads_them() -> None:
    with pytest.raises(ValueError, match="ppo.critic_lam is the GAE lambda"):
        _config(advantage="sequence", critic_lam=1.0)
    with pytest.raises(ValueError, match="ppo.critic_warmup_updates=2 warms up a value model"):
        _config(advantage="grpo", samples_per_prompt=4, critic_warmup_updates=2)


# ------------------------------------------------------------------- reward normalisation, then clipping

def test_scores_are_clipped_after_normalisation_as_openrlhf_and_ppo_max() -> None:
    """Scores (0, 0, 0, 40): population mean 10, std sqrt(300) = 17.32 -> normalised (-0.577 x3, 1.732); clip 1
    -> (-0.577 x3, 1.0). Clipping first at 1 would give (0, 0, 0, 1) -> (-0.577 x3, 1.732)."""
    mask = torch.ones(4, 1, dtype=torch.bool)
    zeros = torch.zeros(4, 1)
    config = PPOConfig(rollout_batch_size=4, mini_batch_size=4, micro_batch_size=4, whiten_advantages=False,
                       kl=KLConfig(coef=0.0), reward=RewardShapingConfig(normalize=True, clip=1.0),
                       generation=GenerationConfig(max_new_tokens=1))
    experience, _ = build_experience(_rollout(mask), zeros, zeros, zeros, torch.tensor([0.0, 0.0, 0.0, 40.0]),
                                     config, 0.0, RunningMoments())
    z = 10 / math.sqrt(300)
    assert experience.scores.tolist() == pytest.approx([-z, -z, -z, 1.0], abs=1e-5)


# ------------------------------------------------------------------------ reward-model ensemble aggregation

def test_ensemble_aggregations_by_hand() -> None:
    from rlhf_core.ppo.rewards import aggregate_members

    # members (rows) x replies (columns); reply 0: 1, 2, 6 -> mean 3, min 1, population std sqrt(14/3)
    scores = torch.tensor([[1.0, 0.0], [2.0, 0.0], [6.0, 0.0]])
    assert aggregate_members(scores, "mean").tolist() == pytest.approx([3.0, 0.0])
    assert aggregate_members(scores, "min").tolist() == [1.0, 0.0]
    std = math.sqrt(((1 - 3) ** 2 + (2 - 3) ** 2 + (6 - 3) ** 2) / 3)
    assert aggregate_members(scores, "mean_minus_std", 0.5).tolist() == pytest.approx([3.0 - 0.5 * std, 0.0])
    with pytest.raises(ValueError, match="unknown ensemble aggregation 'max'"):
        aggregate_members(scores, "max")  # type: ignore[arg-type]


@pytest.mark.parametrize("aggregation", ["mean", "min", "mean_minus_std"])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_an_ensemble_of_identical_members_scores_as_one(aggregation: str, k: int) -> None:
    from rlhf_core.models.scoring import EnsembleDisagreement, EnsembleScorer

    def member(rollout: Rollout) -> torch.Tensor:
        return rollout.response_ids.float().sum(dim=1) / 7.0

    mask = torch.ones(3, 2, dtype=torch.bool)
    rollout = Rollout(torch.ones(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.bool),
                      torch.tensor([[3, 4], [5, 9], [1, 1]]), mask, torch.zeros(3, 2), torch.ones(3, dtype=torch.bool))
    ensemble = EnsembleScorer([member] * k, aggregation, coef=3.0)
    assert torch.allclose(ensemble(rollout), member(rollout), rtol=0, atol=1e-6)
    assert EnsembleDisagreement(ensemble)(rollout).tolist() == [0.0, 0.0, 0.0]
