"""Peak memory of a PPO step: four full models vs LoRA-shared models (see run.py)."""
