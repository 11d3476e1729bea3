"""Registered models as MLflow pyfunc models: ``mlflow.pyfunc.load_model("models:/rlhf-demo-policy@champion")``.

Every version the pipeline registers carries a ``python_function`` flavor whose loader is this module. A policy's
``predict`` takes prompts (a DataFrame with a ``prompt`` column, a list of strings, or one string) and returns a
DataFrame with a ``response`` column, sampled with the generation settings the version was trained with (the
``params`` of ``predict`` override ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p`` and ``seed``). A
reward model's ``predict`` takes ``prompt`` and ``response`` columns and returns a ``score`` column (an ensemble:
the mean of its members' scores). Versions registered by reference (``tracking.model_storage=reference``)
load from the state folder that produced them. The environment is the one the pipeline runs in:
``mlflow models serve --env-manager local``.

Without MLflow's loaders, ``tasks.tracking.resolve_model_uri`` gives the version's Hugging Face folder, which
transformers' ``from_pretrained`` loads.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from rlhf_core.config import GenerationConfig
from rlhf_core.evaluation.policy_eval import sample_replies
from rlhf_core.models.roles import freeze, load_policy
from rlhf_core.models.sequences import Rollout, left_pad
from rlhf_core.models.text import encode_pair, encode_prompt, pad_id, right_pad
from tasks.models import load_tokenizer, reward_members, reward_scorer
from tasks.runtime import Runtime
from tasks.tracking.registry import SETTINGS_FILE, referenced_folder

POLICY_ROLES = ("policy",)


def _load_pyfunc(data_path: str) -> PolicyModel | RewardModel:
    """MLflow's entry point: the version's files (downloaded) -> its model."""
    files = Path(data_path)
    settings = json.loads((files / SETTINGS_FILE).read_text(encoding="utf-8"))
    folder = referenced_folder(files)
    if settings["role"] in POLICY_ROLES:
        return PolicyModel(folder, GenerationConfig(**settings.get("generation", {})))
    return RewardModel(folder)


def _texts(model_input: Any, column: str) -> list[str]:
    if isinstance(model_input, str):
        return [model_input]
    if isinstance(model_input, pd.DataFrame):
        if column not in model_input.columns:
            raise ValueError(f"input needs a {column!r} column; got {list(model_input.columns)}")
        return [str(v) for v in model_input[column]]
    if isinstance(model_input, dict):
        values = model_input[column]
        return [values] if isinstance(values, str) else [str(v) for v in values]
    return [str(v) for v in model_input]


class PolicyModel:
    """A registered policy: prompts in, sampled replies out."""

    def __init__(self, folder: Path, generation: GenerationConfig, runtime: Runtime = Runtime()) -> None:
        self.tokenizer = load_tokenizer(folder)
        self.model = freeze(load_policy(str(folder), runtime.torch_dtype).to(runtime.torch_device))
        self.generation = generation

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> pd.DataFrame:
        # MLflow has checked and typed the params against the version's signature (GENERATION_PARAMS and seed)
        params = dict(params or {})
        seed = int(params.pop("seed", 0))
        generation = replace(self.generation, **params)
        replies = sample_replies(self.model, self.tokenizer, _texts(model_input, "prompt"), generation, seed)
        return pd.DataFrame({"response": list(replies.replies)})


class RewardModel:
    """A registered reward model (or ensemble): (prompt, response) pairs in, scores out."""

    def __init__(self, folder: Path, runtime: Runtime = Runtime(), batch_size: int = 32) -> None:
        self.tokenizer = load_tokenizer(reward_members(folder)[0])
        self.scorer = reward_scorer(runtime, folder, self.tokenizer, max_length=1 << 20, batch_size=batch_size)
        self.device = runtime.torch_device

    @torch.no_grad()
    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> pd.DataFrame:
        prompts, responses = _texts(model_input, "prompt"), _texts(model_input, "response")
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        tok, pad = self.tokenizer, pad_id(self.tokenizer)
        query_ids, query_mask = left_pad([encode_prompt(tok, p) for p in prompts], pad)
        # a reply's ids and eos: prompt and reply are tokenized apart (rlhf_core.models.text), so this is the
        # tail of encode_pair(prompt, reply)
        response_ids, response_mask = right_pad([encode_pair(tok, "", r) for r in responses], pad)
        rollout = Rollout(query_ids.to(self.device), query_mask.to(self.device), response_ids.to(self.device),
                          response_mask.bool().to(self.device), torch.zeros(response_ids.shape, device=self.device),
                          torch.ones(len(responses), dtype=torch.bool, device=self.device))
        return pd.DataFrame({"score": self.scorer(rollout).float().cpu().tolist()})
