"""Pure RLHF algorithms: torch + transformers only (no prefect, mlflow, pandas or pyarrow here).

- ``rlhf_core.ppo``: PPO math as pure functions (masking, KL, rewards, advantages, losses, stats).
- ``rlhf_core.models``: the PPO roles and their forwards, small GPTs, LoRA, tokenizer, text encoding, scorers.
- ``rlhf_core.training``: rollouts, experience, the PPO step and loop, checkpoints, reward-model training, SFT.
- ``rlhf_core.evaluation``: held-out metrics, policy evaluation, best-of-N, gold reports, annotators.
- ``rlhf_core.distributed``: DeepSpeed ZeRO training (the only deepspeed import) and its JSON config checks.
- ``rlhf_core.config``: the frozen config dataclasses of the core algorithms.
- ``rlhf_core.data``: preference-data validation, dedupe and split.
- ``rlhf_core.demo``: the embedded customer-support task.
"""
