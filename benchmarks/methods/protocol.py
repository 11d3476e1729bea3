"""The methods benchmark's protocol as data: each method's settings, the tuning rounds' grids in the order they ran
(each with what it tested and what it chose), and the evaluation sizes, seeds and KL budget the phases of
``benchmarks/methods/run.py`` use. A round is declared here (and in docs/results.md) before it runs."""

from __future__ import annotations

from typing import Any

from rlhf_core.evaluation.metrics import best_of_n_kl

#: Every method's settings on top of the demo preset. PPO's (tuned) and DPO's are the preset's own; RLOO's, GRPO's and
#: REINFORCE++'s are their tuning rounds' choices.
METHODS: dict[str, list[str]] = {
    "ppo": [],
    "grpo": ["ppo.advantage=grpo", "ppo.samples_per_prompt=4", "ppo.learning_rate=2.5e-5", "ppo.iterations=3",
             "ppo.reward.missing_stop_penalty=-3"],
    "rloo": ["ppo.advantage=rloo", "ppo.samples_per_prompt=4", "ppo.learning_rate=5e-5", "ppo.iterations=3"],
    "reinforce_pp": ["ppo.advantage=reinforce_pp", "ppo.learning_rate=5e-5", "ppo.iterations=3"],
    "dpo": ["method=dpo"],
}


def method_setting(method: str) -> tuple[str, str]:
    """The one setting that tells a method's runs apart from the other methods' (``method=dpo`` for DPO, the
    advantage estimator for the rest, ``gae`` for PPO): the report's grid key, and what names a sweep's method."""
    if method == "dpo":
        return "method", "dpo"
    return "ppo.advantage", next((o.split("=", 1)[1] for o in METHODS[method] if o.startswith("ppo.advantage=")),
                                 "gae")


def method_of(settings: list[str]) -> str:
    """The method (a name of ``METHODS``) that ``KEY=VALUE`` settings train: the inverse of ``method_setting``, with
    the configuration's defaults (``method=ppo``, ``ppo.advantage=gae``) where a key is not set. Raises
    ``ValueError`` (one line) for an estimator no method of ``METHODS`` uses."""
    given = {"method": "ppo", "ppo.advantage": "gae", **dict(s.split("=", 1) for s in settings)}
    if given["method"] == "dpo":
        return "dpo"
    setting = ("ppo.advantage", given["ppo.advantage"])
    if (method := next((m for m in METHODS if method_setting(m) == setting), None)) is None:
        raise ValueError(f"no method of the benchmark uses ppo.advantage={setting[1]}")
    return method


#: Per method: its fixed settings, then the grids tuned round after round (each on top of the earlier winners).
TUNING: dict[str, dict[str, Any]] = {
    "ppo": {"fixed": [], "rounds": [
        {"ppo.learning_rate": ["1e-4", "2e-4"], "ppo.critic_warmup_updates": ["0", "3"]},
        {"ppo.kl.coef": ["0.05", "0.1"], "refresh.every_k": ["0", "1"]},
        # round 3, the first chosen by the frontier rule: a larger coefficient, and the rate again (rounds 1 and 2
        # had chosen the rate by the final held-out mean), with round 2's refresh after every iteration
        {"ppo.kl.coef": ["0.1", "0.2"], "ppo.learning_rate": ["1e-4", "2e-4"]},
        # round 4, the first chosen within the KL budget: a proxy ensemble of 3 members as PPO's reward (Coste et al.
        # 2023), their mean or mean - std; the incumbent (one proxy) competes with round 3's runs of it
        # (`selection.py --incumbent`). Chosen: mean_minus_std (held-out +0.05 over the incumbent; reported: gold
        # 0.26 below best-of-16)
        {"reward_model.ensemble_size": ["3"], "ppo.reward.ensemble": ["mean", "mean_minus_std"]},
        # round 5, rule E again: four times the rollouts per update at the same optimizer steps (mini-batches four
        # times larger), against the preset (its own runs in this round). PPO reaches less proxy per nat of KL than
        # best-of-N; if gradient noise is what spends that KL, averaging over more rollouts should buy more reward
        # per nat (a value sets both keys as one mapping, written without spaces: a setting's name splits on them).
        # Chosen: 256 / 128 (held-out +0.11 on every seed; reported: gold 0.255 below best-of-16, sd halved)
        {"ppo": ['{"rollout_batch_size":64,"mini_batch_size":32}', '{"rollout_batch_size":256,"mini_batch_size":128}']},
        # round 6, rule E, declared before it ran: half the KL coefficient at round 5's batch, against the preset's
        # 0.2. Round 5's report found PPO on the held-out judge's best-of-N curve at its own KL but ending short of
        # best-of-16's KL (1.37 against 1.84 nats), where that curve is higher. Its choice is reported on seeds 8-12
        # (seeds 3-7 informed this grid). Chosen: 0.1 (held-out +0.09 on every seed at KL 2.5; reported on seeds
        # 8-12: gold 0.14 (0.09) above best-of-16 and 0.31 (0.08) above DPO; replicated on seeds 13-17: 0.07 (0.10)
        # and 0.28 (0.09))
        {"ppo.kl.coef": ["0.1", "0.2"]},
        # round 7, rule E, declared before it ran: two more iterations (a refresh after each but the last, as the
        # preset does). On the report seeds 8-12 gold rose at the last of the preset's 3 iterations on every seed and
        # the held-out judge on 4 of 5. Iterations 1-3 are the preset's own (a constant learning rate keeps their
        # keys), so the 5-iteration runs continue the 3-iteration ones. Chosen: 3 (5 raised the held-out mean by 0.13
        # on every seed, but at mean KL 3.39, over the budget); the preset is unchanged.
        {"ppo.iterations": ["3", "5"]},
        # round 8, rule E, declared before it runs: four iterations between them. It computes nothing new (a
        # 4-iteration policy is iteration 4 of round 7's 5-iteration runs), and its held-out and KL numbers were seen
        # in round 7's runs before it was declared (gold of iteration 4 was not). A choice of 4 is reported on seeds
        # 13-17. Chosen: 4 (held-out +0.115 over 3 on every seed at mean KL 3.11); the preset takes it. Reported on
        # seeds 13-17: gold 0.18 (0.06) above best-of-16 and 0.39 (0.10) above DPO, on every seed
        {"ppo.iterations": ["3", "4", "5"]},
    ]},
    "dpo": {"fixed": ["method=dpo"], "rounds": [
        {"dpo.beta": ["0.1", "0.3", "0.5"]},
    ]},
    # The critic-free estimators' round 1 each, rule E (the held-out mean within the KL budget): the learning rate on
    # top of the demo preset as PPO's round 8 left it (4 iterations, a refresh after each but the last, the 3-member
    # proxy ensemble scored mean - std), GRPO and RLOO with 4 replies per prompt (the rollouts per update unchanged:
    # a quarter of the prompts). Seeds 0-2; the choices report on REPORT_SEEDS. Declared as {1e-4, 2e-4}; amended
    # during RLOO's round, before any 2e-4 run had finished: RLOO at 1e-4 ended at mean KL 3.93, over the budget,
    # and a doubled rate spent more KL in every PPO round that tried one, so 2e-4 could not be chosen; the rate
    # below 1e-4 takes its place for all three (what moved it was KL alone, not a judge's score).
    # GRPO's and REINFORCE++'s round 1 take RLOO's two rounds as one, declared after them and before either ran: the
    # rate with 3 or 4 iterations (the 3-iteration runs are the 4-iteration runs' iteration 3: no extra cost).
    "grpo": {"fixed": ["ppo.advantage=grpo", "ppo.samples_per_prompt=4"], "rounds": [
        # round 1 named no winner: every setting ended over the KL budget (mean KL 3.63-5.39 nats)
        {"ppo.learning_rate": ["5e-5", "1e-4"], "ppo.iterations": ["3", "4"]},
        # round 2, rule E, declared after round 1: fewer iterations. GRPO spends most of its KL in iteration 1 (2.5
        # nats at 5e-5, 3.9 at 1e-4), as RLOO does. It computes nothing new (a 1- or 2-iteration policy is an
        # iteration of round 1's runs; a constant rate keeps the keys); its held-out and KL numbers were seen in
        # round 1's runs before it was declared, and so was one gold mean of round 1 (5e-5 with 3 iterations), read
        # by mistake; no gold of 1 or 2 iterations was. Chosen: 5e-5 with 2 iterations. Reported on seeds 18-22:
        # gold 1.384 (se 0.305), paired with 0.9 x PPO -0.812 (0.294): below on every seed
        {"ppo.learning_rate": ["5e-5", "1e-4"], "ppo.iterations": ["1", "2", "3", "4"]},
        # round 3, rule E, declared after the report on seeds 18-22 (docs/results.md): on two of its seeds GRPO ended
        # with 10% and 25% of replies cut off at the token limit, which the proxy scores above finished ones. A reply
        # without a stop token scores -3 instead (about the lowest proxy score of a single SFT reply), or not.
        # Chosen: -3 (held-out 1.096 against 1.024, paired +0.130, +0.088, -0.001; KL 2.68 against 2.77). Reported on
        # seeds 23-27 beside PPO: gold 1.904 (se 0.073), paired with 0.9 x PPO -0.286 (0.092): below on every seed
        {"ppo.reward.missing_stop_penalty": ["null", "-3"]},
        # round 4, rule E, declared after the report on seeds 23-27 (docs/results.md): there GRPO after two
        # iterations was above PPO after two, and the KL budget had stopped it at two. A halved rate, and the chosen
        # one, with 2, 3 or 4 iterations, on top of round 3's penalty (the 2- and 3-iteration policies are
        # iterations of the 4-iteration runs: a constant rate keeps the keys); 5e-5 with 2 iterations is round 3's
        # choice, recomputed (to the digit). Chosen: 2.5e-5 with 3 iterations (held-out 1.101 at KL 2.17 against
        # 1.096 at 2.68; paired +0.072, -0.056, -0.001: level, at half a nat less); 5e-5 with 3 or 4 ended over
        # the budget (3.94, 3.98). Reported on seeds 28-32 beside PPO: gold 1.920 (se 0.142), paired with 0.9 x PPO
        # -0.280 (0.101): below on four seeds of five
        {"ppo.learning_rate": ["2.5e-5", "5e-5"], "ppo.iterations": ["2", "3", "4"]},
        # round 5, rule E, declared after the report on seeds 28-32 (docs/results.md): there each GRPO iteration
        # after the first added about 0.6 nats, where PPO's KL held at 2.3-2.8 nats over four; in round 4 the rate
        # 5e-5 gained held-out score in its third iteration but ended over the budget. A tighter leash at that rate:
        # ppo.kl.coef 0.2 or 0.4 (0.1 today) with 2, 3 or 4 iterations, on top of round 4's entry (the penalty
        # stays). Its winner replaces the entry only if its held-out mean is above round 4's choice's 1.101
        {"ppo.learning_rate": ["5e-5"], "ppo.kl.coef": ["0.2", "0.4"], "ppo.iterations": ["2", "3", "4"]},
    ]},
    "rloo": {"fixed": ["ppo.advantage=rloo", "ppo.samples_per_prompt=4"], "rounds": [
        # round 1 named no winner: both rates ended over the KL budget (mean KL 3.42 at 5e-5, 3.93 at 1e-4)
        {"ppo.learning_rate": ["5e-5", "1e-4"]},
        # round 2, rule E, declared after round 1 (as PPO's round 8 was after round 7): the iterations with the rate.
        # It computes nothing new (a 3-iteration policy is iteration 3 of round 1's runs; a constant rate keeps its
        # keys), and its held-out and KL numbers were seen in round 1's runs before it was declared; gold was not.
        # Chosen: 5e-5 with 3 iterations, the one setting within the budget (held-out 0.787 at mean KL 2.89).
        # Reported on seeds 18-22: gold 2.207 (se 0.061), paired with 0.9 x PPO +0.011 (0.060)
        {"ppo.learning_rate": ["5e-5", "1e-4"], "ppo.iterations": ["3", "4"]},
    ]},
    "reinforce_pp": {"fixed": ["ppo.advantage=reinforce_pp"], "rounds": [
        # amended before it ran, after GRPO's round 1: 1 and 2 iterations too (they are the runs' iterations 1 and
        # 2, no extra cost), as RLOO and GRPO both spent most of their KL in iteration 1. Chosen: 5e-5 with 3
        # iterations (held-out 1.372 at mean KL 2.62; 4 iterations and every 1e-4 setting ended over the budget).
        # Reported on seeds 18-22: gold 2.305 (se 0.024), paired with 0.9 x PPO +0.108 (0.053)
        {"ppo.learning_rate": ["5e-5", "1e-4"], "ppo.iterations": ["1", "2", "3", "4"]},
    ]},
}
#: Evaluation prompts of every tuning run: more than the demo's 128 (less noise in the choice) ...
TUNE_EVAL_PROMPTS = 256
#: ... and of every report run: more again, so that a gap of a few tenths of gold is beyond two standard errors.
REPORT_EVAL_PROMPTS = 512
BEST_OF = 16
#: The critic-free estimators' target: final gold at least this fraction of PPO's, read per seed as the paired
#: difference gold - fraction x PPO's gold (met when its mean over the report seeds is >= 0).
PPO_FRACTION = 0.9
#: The seeds the next report runs on: no run of this work has used them (3-7 reported the choices of rounds 1-5, 8-12
#: round 6's, 13-17 round 6's again and round 8's, 18-22 all five methods at their entries above, 23-27 GRPO's round 3
#: beside PPO, 28-32 GRPO's round 4 beside PPO; docs/results.md declares which choice each set reports).
REPORT_SEEDS = "33,34,35,36,37"
#: The tuning rounds' KL budget from round 4 on: best-of-64's KL (nats per reply), the furthest best-of-N point
#: measured (benchmarks/methods/frontier.py), past which best-of-N's held-out and gold curves are flat.
KL_BUDGET = best_of_n_kl(64)
