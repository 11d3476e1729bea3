"""DPO and IPO: the losses against numbers computed by hand, the reply-only log-probs, micro-batch invariance of the
update, the loop's exact resume and its non-finite guard, and a tiny policy learning a preference."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GPT2LMHeadModel

from rlhf_core.training.dpo import (batch_plan, dpo_step, encode_preferences, measure_logprobs,
                                    pair_logprobs, train_dpo)
from rlhf_core.config import DPOConfig
from rlhf_core.training.dpo_losses import (
    implicit_rewards,
    ipo_loss,
    log_ratio_margin,
    preference_stats,
    reply_logprobs,
    sigmoid_loss,
)
from rlhf_core.training.guards import NonFiniteError
from rlhf_core.data.records import PreferencePair
from rlhf_core.training.sft import IGNORE_INDEX
from rlhf_core.training.strategy import LocalStrategy, scheduled_strategy
from tests.tiny_models import gpt2_config, word_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

# Two pairs, column 0 chosen, column 1 rejected. Pair 0: h = (-1 - -2) - (-3 - -2) = 2; pair 1: h = -1 - 2 = -3.
LOGPROBS = torch.tensor([[-1.0, -3.0], [-4.0, -1.0]])
REF = torch.tensor([[-2.0, -2.0], [-3.0, -3.0]])


# --- the losses ---------------------------------------------------------------------------------------------


def test_sigmoid_loss_by_hand() -> None:
    assert log_ratio_margin(LOGPROBS, REF).tolist() == [2.0, -3.0]
    # beta 0.5: -log sigmoid(1) = log(1 + e^-1); -log sigmoid(-1.5) = log(1 + e^1.5)
    expected = [math.log(1 + math.exp(-1.0)), math.log(1 + math.exp(1.5))]
    assert sigmoid_loss(LOGPROBS, REF, 0.5).tolist() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx([0.3132617, 1.7014133], abs=1e-6)


def test_ipo_loss_by_hand_summed_and_per_token() -> None:
    # Summed log-probs (the paper's Eq. 17), beta 0.5: target 1 / (2 * 0.5) = 1; (2 - 1)^2, (-3 - 1)^2.
    assert ipo_loss(LOGPROBS, REF, 0.5).tolist() == pytest.approx([1.0, 16.0])
    # TRL's per-token form: pair 0 with 2 chosen and 4 rejected reply tokens: h = 1/2 - (-1)/4 = 0.75;
    # pair 1 with 1 and 2: h = -1/1 - 2/2 = -2.
    lengths = torch.tensor([[2.0, 4.0], [1.0, 2.0]])
    assert ipo_loss(LOGPROBS, REF, 0.5, lengths).tolist() == pytest.approx([0.0625, 9.0])
    # beta 0.1 moves the target to 5: (2 - 5)^2 = 9.
    assert float(ipo_loss(LOGPROBS[:1], REF[:1], 0.1)) == pytest.approx(9.0)


def test_implicit_rewards_and_stats_by_hand() -> None:
    rewards = implicit_rewards(LOGPROBS, REF, 0.5)
    assert rewards.tolist() == [[0.5, -0.5], [-0.5, 1.0]]
    losses = torch.tensor([0.25, 0.75])
    stats = preference_stats(losses, LOGPROBS, REF, 0.5)
    assert stats.loss == 0.5 and stats.reward_accuracy == 0.5  # pair 0 right, pair 1 wrong
    assert stats.reward_margin == pytest.approx((1.0 - 1.5) / 2)
    assert (stats.chosen_reward, stats.rejected_reward) == (0.0, 0.25)
    assert (stats.chosen_logprob, stats.rejected_logprob) == (-2.5, -2.0)
    # At the start the policy is the reference: every implicit reward is 0, every pair a tie, accuracy 0.5.
    assert preference_stats(losses, REF, REF, 0.5).reward_accuracy == 0.5
    assert set(stats.to_metrics("dpo")) == {"dpo/loss", "dpo/rewards/accuracy", "dpo/rewards/margin",
                                            "dpo/rewards/chosen", "dpo/rewards/rejected", "dpo/logps/chosen",
                                            "dpo/logps/rejected"}


# --- reply-only log-probs ------------------------------------------------------------------------------------


def test_reply_logprobs_by_hand_and_blind_to_prompt_and_padding() -> None:
    # [p0, p1, r0, eos, pad]: logits[t] predicts token t + 1, so positions 1 and 2 predict the reply and eos.
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 1, 0, IGNORE_INDEX]])
    logits = torch.zeros(1, 5, 2)
    logits[0, 1] = torch.tensor([0.0, 0.0])  # p(r0 = 1) = 0.5
    logits[0, 2] = torch.tensor([math.log(3.0), 0.0])  # p(eos = 0) = 0.75
    expected = math.log(0.5) + math.log(0.75)
    assert float(reply_logprobs(logits, labels)) == pytest.approx(expected, abs=1e-6)
    garbage = logits.clone()
    garbage[0, 0] = torch.tensor([float("nan"), 1e4])  # predicts p1: a prompt token
    garbage[0, 3:] = torch.tensor([-1e4, float("inf")])  # predicts padding / past the end
    assert float(reply_logprobs(garbage, labels)) == pytest.approx(expected, abs=1e-6)


def test_pairs_are_encoded_as_sft_demonstrations_and_scored_on_reply_tokens_only() -> None:
    tokenizer = word_tokenizer()
    (pair,) = encode_preferences(tokenizer, [PreferencePair("hello the cat", "good dog", "bad dog sat")], 64)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    eos = tokenizer.eos_token_id
    assert pair.chosen.input_ids == ids("hello the cat") + ids("good dog") + [eos]
    assert pair.chosen.labels == [IGNORE_INDEX] * 3 + ids("good dog") + [eos]
    assert pair.rejected.labels == [IGNORE_INDEX] * 3 + ids("bad dog sat") + [eos]
    model = tiny_policy()
    logprobs, lengths = pair_logprobs(model, [pair, pair], tokenizer.pad_token_id)
    assert lengths.tolist() == [[3.0, 4.0], [3.0, 4.0]]
    with torch.no_grad():  # a loop over one unpadded sequence at a time, summing the reply positions by hand
        for column, example in enumerate((pair.chosen, pair.rejected)):
            full = torch.tensor([example.input_ids])
            logp = torch.log_softmax(model(full).logits[0].float(), -1)
            by_hand = sum(float(logp[t - 1, example.input_ids[t]]) for t in range(3, len(example.input_ids)))
            assert float(logprobs[0, column]) == pytest.approx(by_hand, abs=1e-5)


def sgd(model: torch.nn.Module) -> LocalStrategy:
    """Plain SGD with lr 1 and no clipping: a step moves the weights by minus the gradient."""
    return LocalStrategy(torch.optim.SGD(model.parameters(), lr=1.0), None, math.inf)


def learning_rates(config: DPOConfig, total_steps: int) -> list[float]:
    """The learning rate of each step of the strategy a DPO run steps through."""
    strategy, rates = scheduled_strategy(torch.nn.Linear(1, 1), config, total_steps), []
    for _ in range(total_steps):
        rates.append(strategy.learning_rate())
        strategy.step()
    return rates


# --- the update ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_micro_batch_size_never_changes_the_update(loss: str) -> None:
    """One SGD step with micro-batches of 1 and 2 gives the parameters of one full batch of 4 (within 1e-6)."""
    tokenizer = word_tokenizer()
    pairs = encode_preferences(tokenizer, toy_pairs()[:4], 64)  # replies of 1 to 4 words: unequal token counts
    pad = tokenizer.pad_token_id
    ref = measure_logprobs(tiny_policy(seed=1), pairs, pad, 64)[0]  # a reference that differs from the policy
    results = {}
    for micro in (1, 2, 4):
        model = tiny_policy()
        config = DPOConfig(beta=0.5, loss=loss, batch_size=4, micro_batch_size=micro, max_grad_norm=math.inf)
        dpo_step(model, sgd(model), pairs, ref, config, pad)
        results[micro] = torch.cat([p.detach().flatten() for p in model.parameters()])
    start = torch.cat([p.detach().flatten() for p in tiny_policy().parameters()])
    assert (results[4] - start).abs().max() > 1e-3  # the step moved the weights
    for micro in (1, 2):
        assert (results[micro] - results[4]).abs().max() < 1e-6, micro


def test_a_non_finite_loss_stops_the_step_before_it_is_applied() -> None:
    tokenizer = word_tokenizer()
    pairs = encode_preferences(tokenizer, toy_pairs()[:2], 64)
    model = tiny_policy()
    before = [p.detach().clone() for p in model.parameters()]
    bad_ref = torch.tensor([[0.0, float("nan")], [0.0, 0.0]])
    with pytest.raises(NonFiniteError, match="DPO loss is nan"):
        dpo_step(model, sgd(model), pairs, bad_ref,
                 DPOConfig(batch_size=2, micro_batch_size=2), tokenizer.pad_token_id)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_schedule_and_batch_plan() -> None:
    assert learning_rates(DPOConfig(learning_rate=1.0, warmup_steps=2, lr_schedule="linear"), 6) == \
        [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    assert learning_rates(DPOConfig(learning_rate=0.3, lr_schedule="constant"), 6) == [0.3] * 6
    plan = batch_plan(5, DPOConfig(batch_size=2, micro_batch_size=2, epochs=2, seed=3))
    assert [len(b) for b in plan] == [2, 2, 1, 2, 2, 1]
    first, second = [i for batch in plan[:3] for i in batch], [i for batch in plan[3:] for i in batch]
    assert sorted(first) == sorted(second) == list(range(5)) and first != second  # each epoch: all, reshuffled


def test_settings_are_ranged() -> None:
    with pytest.raises(ValueError, match=r"dpo.beta must be > 0, got 0"):
        DPOConfig(beta=0.0)
    with pytest.raises(ValueError, match=r"dpo.micro_batch_size=8 must be <= dpo.batch_size=4"):
        DPOConfig(batch_size=4, micro_batch_size=8)
    with pytest.raises(ValueError, match=r"dpo.learning_rate must be a finite number"):
        DPOConfig(learning_rate=float("nan"))


# --- the loop ------------------------------------------------------------------------------------------------


def test_dpo_learns_the_preference_and_moves_implicit_reward_accuracy_from_one_half() -> None:
    tokenizer = word_tokenizer()
    pairs = toy_pairs()
    config = DPOConfig(beta=0.5, learning_rate=3e-3, epochs=4, batch_size=8, micro_batch_size=8, log_every=0)
    logged: list[tuple[int, dict[str, float]]] = []
    result = train_dpo(tiny_policy(), tokenizer, pairs[:12], config, eval_pairs=pairs[12:],
                       on_log=lambda step, metrics: logged.append((step, metrics)))
    assert result.eval_steps == (0, 8) and len(result.train_metrics) == 8
    before, after = result.eval_metrics
    assert before["dpo/eval/rewards/accuracy"] == 0.5 and before["dpo/eval/loss"] == pytest.approx(math.log(2))
    assert result.train_metrics[0]["dpo/rewards/accuracy"] == pytest.approx(0.5, abs=0.2)
    assert result.final_train["dpo/train_eval/rewards/accuracy"] == 1.0
    assert result.final_train["dpo/train_eval/loss"] < 0.5 * math.log(2)
    assert after["dpo/eval/rewards/accuracy"] >= 0.75 and after["dpo/eval/rewards/margin"] > 0
    assert [step for step, m in logged if "dpo/loss" in m] == list(range(1, 9))
    assert logged[0] == (0, before) and logged[-1] == (8, after)


def test_a_killed_run_resumes_from_its_checkpoint_to_the_same_weights(tmp_path) -> None:
    tokenizer = word_tokenizer()
    pairs = toy_pairs()[:12]
    config = DPOConfig(beta=0.5, learning_rate=3e-3, epochs=2, batch_size=4, micro_batch_size=2, log_every=0)
    whole = tiny_policy()
    uninterrupted = train_dpo(whole, tokenizer, pairs, config)

    def kill_at_step_4(step: int, metrics: dict[str, float]) -> None:
        if step == 4:
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        train_dpo(tiny_policy(), tokenizer, pairs, config, on_log=kill_at_step_4, checkpoint_dir=tmp_path,
                  checkpoint_every=1)
    resumed_policy = tiny_policy()  # a new attempt loads the starting weights again, as the stage does
    resumed = train_dpo(resumed_policy, tokenizer, pairs, config, checkpoint_dir=tmp_path, checkpoint_every=1)
    assert resumed.resumed_from == 3
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed_policy.parameters()))
    assert resumed.train_metrics == uninterrupted.train_metrics and resumed.final_train == uninterrupted.final_train


# --- helpers -------------------------------------------------------------------------------------------------


def tiny_policy(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config(len(word_tokenizer())))


def toy_pairs() -> list[PreferencePair]:
    """16 pairs: the chosen reply says 'good', the rejected one 'bad', after replies of 1 to 4 shared words."""
    prompts = ["hello the cat", "why the dog", "how big tree", "hello a star", "why red box", "how the moon",
               "hello small sun", "why blue mat", "how fast dog", "hello slow cat", "why the tree", "how a box",
               "hello big moon", "why small star", "how red sun", "hello blue mat"]
    tails = ["", "the cat", "a dog sat", "the big red"]
    return [PreferencePair(p, f"{tails[i % 4]} good".strip(), f"{tails[i % 4]} bad".strip())
            for i, p in enumerate(prompts)]
