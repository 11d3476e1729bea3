"""Training: rollouts, experience, the PPO step and loop, reward-model training, SFT, and how updates apply.

- ``rollout``: batched sampling with a KV cache -> ``Rollout``.
- ``experience``: generate -> old / reference log-probs, values -> scores -> rewards -> GAE (``PPOModels``).
- ``ppo_step``: one PPO update (epochs x mini-batches, KL controller, optional reference refresh).
- ``ppo_loop``: ``train_ppo`` over a prompt table with checkpoints and exact resume.
- ``sampler``: the deterministic, resumable prompt order.
- ``checkpoint``: atomic, pickle-free checkpoints.
- ``checkpoint_integrity``: the manifest that seals a checkpoint, verified before a resume trusts it.
- ``reward_training``: Bradley-Terry reward-model training and evaluation.
- ``sft``: supervised fine-tuning on demonstrations.
- ``dpo``, ``dpo_losses``: DPO / IPO on preference pairs, offline (the loop, and its math as pure functions).
- ``strategy``: how losses become weight updates (one process, or data-parallel).
"""
