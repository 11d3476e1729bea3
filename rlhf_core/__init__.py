"""Pure RLHF algorithms: torch + transformers only (no prefect, mlflow, pandas or pyarrow here).

The parts, in import order (each imports only those above it; ``tests/unit/test_import_boundaries.py`` checks it):

- ``rlhf_core.ranges``, ``rlhf_core.compat``: value ranges of config fields; what the installed libraries support.
- ``rlhf_core.ppo``: PPO math as pure functions (masking, KL, rewards, advantages, losses, pairwise accuracy, stats).
- ``rlhf_core.config``: the frozen config dataclasses of the core algorithms (PPO, reward model, SFT, DPO).
- ``rlhf_core.data``: preference-data validation, dedupe and split.
- ``rlhf_core.demo``: the embedded customer-support task.
- ``rlhf_core.models``: the rollout layout, the PPO roles and their forwards, small GPTs, LoRA, tokenizer, scorers.
- ``rlhf_core.training``: rollouts, experience, the PPO step and loop, checkpoints, reward-model training, SFT, DPO.
- ``rlhf_core.distributed``: DeepSpeed ZeRO training (the only deepspeed import) and its JSON config checks.
- ``rlhf_core.evaluation``: held-out metrics, policy evaluation, best-of-N, gold reports, annotators.
"""
