"""Prefect tasks, one per stage: read inputs, call rlhf_core, write Parquet atomically, return paths."""
