"""Models and text: building, loading and running the PPO roles, and turning text into token ids.

- ``roles``: policy, frozen reference, reward model, value model (``ValueHead`` / ``Critic``) and their forwards.
- ``families``: what kind of checkpoint a model is (causal or not, where its score is read, its head), from the model.
- ``lm``: small GPT-2 models built from a config (no downloads).
- ``lm_head``: the output layer applied at chosen positions only.
- ``lora``: LoRA adapters sharing one copy of the frozen base weights (the only module that imports peft).
- ``sequences``: the rollout layout (``Rollout``: left-padded prompts, right-padded replies) and its positions.
- ``packing``: padding-free forwards over the rollout layout.
- ``memory``: bf16 autocast and gradient checkpointing.
- ``offload``: frozen networks held in host memory while trained ones train (``ppo.offload_frozen``).
- ``tokenizer``: a small byte-level BPE tokenizer trained on the task's text.
- ``text``: (prompt, response) text -> token ids, the same way for the policy, the reward model and SFT.
- ``scoring``: reward sources (reward model, rule functions, weighted sums).
"""
