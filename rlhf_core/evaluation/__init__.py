"""Evaluation of policies and reward models, apart from training.

- ``metrics``: diversity, repetition, agreement, per-sequence KL and the reward-hacking verdict.
- ``policy_eval``: a policy against its reference on held-out prompts (replies, KL, comparison metrics).
- ``best_of_n``: best-of-N sampling, the baseline PPO's reward-vs-KL curve is compared against.
- ``demo_eval``: the demo task's gold-scored reports (evaluation only).
- ``annotators``: who says which of two replies is better (simulated, reward-model judge, people).

Import from the modules themselves (``from rlhf_core.evaluation.metrics import distinct_n``).
"""
