"""Loading the models stages run, the same way in every stage (and in DeepSpeed workers).

Shared by the stage modules so that no stage imports another: tokenizers, frozen language models and reward-model
scorers for the evaluation stages, reward-model ensembles on disk, and tokenized PPO prompts. The four PPO roles are
built in ``tasks.ppo_models``, apart, so that only the stages that train or judge a policy depend on PPO's code.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.models import families
from rlhf_core.models.roles import freeze, load_policy, load_reward_model
from rlhf_core.models.scoring import EnsembleScorer, RewardModelScorer, Scorer
from rlhf_core.models.text import encode_prompt
from rlhf_core.ppo.rewards import EnsembleAggregation
from rlhf_core.models.tokenizer import SpecialTokens, resolve_special_tokens
from tasks.runtime import Runtime

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(folder: str | Path, tokens: SpecialTokens = SpecialTokens(),
                   setting: str = "tokens") -> PreTrainedTokenizerBase:
    """The tokenizer saved with a model, its eos / bos / pad resolved (``tokens``, else its own, else the fallbacks
    of :func:`rlhf_core.models.tokenizer.resolve_special_tokens`): every stage loads tokenizers here, so all of
    them see the same special tokens."""
    return resolve_special_tokens(AutoTokenizer.from_pretrained(str(folder)), tokens, setting)


def tokenizer_of(model_dir: str | Path, tokens: SpecialTokens = SpecialTokens(),
                 setting: str = "tokens") -> PreTrainedTokenizerBase | None:
    """The tokenizer saved next to a model (:func:`load_tokenizer`), or None when the folder holds none."""
    folder = Path(model_dir)
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    return load_tokenizer(model_dir, tokens, setting)


def load_frozen_lm(runtime: Runtime, folder: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """A frozen causal LM (eval mode, no dropout, no gradients) and its folder's tokenizer."""
    model = load_policy(str(folder), runtime.torch_dtype).to(runtime.torch_device)
    return freeze(model), tokenizer_of(folder)


ENSEMBLE_FILE = "ensemble.json"
"""In a reward-model folder that holds an ensemble: the member folders, in order (``{"members": ["member-0", ...]}``)."""


def save_ensemble(folder: Path, members: Sequence[tuple[PreTrainedModel, PreTrainedTokenizerBase]]) -> None:
    """One reward model saved as it is (``save_pretrained``: model + tokenizer), or several as an ensemble: each in
    ``member-<k>/`` and ``ensemble.json`` naming them. Either way ``folder`` is one model to register and load."""
    if len(members) == 1:
        model, tokenizer = members[0]
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return
    names = [f"member-{k}" for k in range(len(members))]
    for name, (model, tokenizer) in zip(names, members, strict=True):
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    (folder / ENSEMBLE_FILE).write_text(json.dumps({"members": names}) + "\n", encoding="utf-8")


def reward_members(folder: str | Path) -> list[Path]:
    """The model folders of a reward-model folder: the folder itself, or each member of an ensemble."""
    folder = Path(folder)
    listing = folder / ENSEMBLE_FILE
    if not listing.is_file():
        return [folder]
    names = json.loads(listing.read_text(encoding="utf-8"))["members"]
    return [folder / name for name in names]


def reward_scorer(runtime: Runtime, folder: str | Path, tokenizer: PreTrainedTokenizerBase, max_length: int,
                  batch_size: int, max_tokens: int | None = None, ensemble: EnsembleAggregation = "mean",
                  ensemble_coef: float = 1.0) -> Scorer:
    """A frozen reward model as a scorer of policy rollouts (re-tokenizing when its tokenizer differs), ``batch_size``
    rows and at most ``max_tokens`` tokens per forward; an ensemble as one scorer of its members' scores aggregated
    by ``ensemble`` (``ppo.reward.ensemble``, ``ensemble_coef``)."""
    scorers = []
    for member in reward_members(folder):
        model = load_reward_model(str(member), runtime.torch_dtype).to(runtime.torch_device)
        scorers.append(RewardModelScorer(freeze(model), tokenizer, tokenizer_of(member), max_length, batch_size,
                                         max_tokens))
    return ensemble_of(scorers, ensemble, ensemble_coef)


def ensemble_of(scorers: Sequence[RewardModelScorer], ensemble: EnsembleAggregation = "mean",
                ensemble_coef: float = 1.0) -> Scorer:
    """The scorer itself when there is one, else their :class:`EnsembleScorer` (``ppo.reward.ensemble``)."""
    if len(scorers) == 1:
        return scorers[0]
    return EnsembleScorer(scorers, ensemble, ensemble_coef)


def max_positions(model: PreTrainedModel) -> int:
    """Positions the model takes (``n_positions`` for GPT-2, ``max_position_embeddings`` otherwise)."""
    positions = families.max_positions(model)
    if positions is None:
        raise ValueError(f"{type(model).__name__}'s config names no maximum length (n_positions / "
                         "max_position_embeddings)")
    return positions


def config_max_positions(folder: str | Path) -> int:
    """:func:`max_positions` of the model saved in ``folder``, read from its config alone (no weights loaded)."""
    positions = families.config_positions(AutoConfig.from_pretrained(str(folder)))
    if positions is None:
        raise ValueError(f"the config of {folder} names no maximum length (n_positions / max_position_embeddings)")
    return positions


def tokenize_prompts(prompts: Sequence[str], source: str, tokenizer: PreTrainedTokenizerBase,
                     max_prompt_tokens: int) -> list[list[int]]:
    """Tokenized PPO prompts; prompts longer than the model can take next to its reply fail clearly."""
    if not prompts:
        raise ValueError(f"PPO prompt table {source} is empty; data-prep put no prompts in the PPO split")
    ids = [encode_prompt(tokenizer, text) for text in prompts]
    too_long = [i for i, prompt in enumerate(ids) if len(prompt) > max_prompt_tokens]
    if too_long:
        raise ValueError(
            f"{len(too_long)} prompts in {source} (first: row {too_long[0]}) are longer than {max_prompt_tokens} "
            "tokens, which leaves no room for ppo.generation.max_new_tokens within the model's positions; "
            "lower data.prep.max_length or ppo.generation.max_new_tokens"
        )
    return ids
