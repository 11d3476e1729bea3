"""PPO math: small pure functions on ``(B, T)`` tensors with one mask, ``response_mask``.

- ``masking``: masked mean / variance / whitening, log-probs and entropy from logits, the stop-token mask.
- ``kl``: per-token KL estimators (k1, k2, k3, abs) and the fixed / adaptive KL coefficient controllers.
- ``rewards``: per-token rewards (KL penalty on every token, score on the last), score shaping, running moments.
- ``advantages``: GAE, sequence-level advantages, advantage whitening.
- ``losses``: policy, value, Bradley-Terry and the combined PPO objective.
- ``pairwise``: pairwise accuracy of two scores (one tie rule for every accuracy and win rate).
- ``stats``: typed PPO statistics and their metric names.

Import from the modules themselves (``from rlhf_core.ppo.losses import policy_loss``).
"""
