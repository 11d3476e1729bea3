"""Pure RLHF algorithms: torch + transformers only (no prefect, mlflow, pandas or pyarrow here)."""
