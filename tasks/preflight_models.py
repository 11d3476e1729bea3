"""The model settings of a config checked on this machine before any stage runs (``tasks.preflight``): each can be
had and is of the right kind.

A model setting is a local folder (it must hold a ``config.json``), a Hugging Face id (in the local hub cache, or
else the hub must be reachable, and offline mode allows only the cache), a ``models:/`` URI (the registry resolves
it when the stage runs) or 'sft' / 'scratch'. Whenever its ``config.json`` is at hand the model is built on the meta
device (no weights read) to see that it is a causal LM where a policy is wanted and has a sequence-classification
class where a reward model is wanted, and that a critic can be made of the proxy reward model.
"""

from __future__ import annotations

import copy
import logging
import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass_environment

import torch
from torch import nn

from rlhf_core.models.families import attention_is_causal, describe, per_token_head
from tasks.typed_yaml import bad_value

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from tasks.config import PipelineConfig

MODEL_WORDS = ("sft", "scratch")
"""ModelSource values that name no file (reward_model.init)."""
POLICY_KEY = "sft.base_model"
"""The model setting that must be a causal LM."""
SCORER_KEYS = ("reward_model.init", "reward_model.heldout_init", "refresh.judge_model")
"""Model settings that must have a sequence-classification class (a reward model or a judge)."""
DEFAULT_ENDPOINT = "https://huggingface.co"
"""The hub when HF_ENDPOINT is not set."""
CONNECT_TIMEOUT = 3.0
"""Seconds a TCP connection to the hub (or its proxy) may take before the hub counts as unreachable."""
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model")
"""Files of which a folder holds at least one when a tokenizer was saved into it."""
_TRUE = ("1", "true", "yes", "on")


class ModelsAtHand:
    """The model settings whose ``config.json`` is on this machine (a local folder or a cached hub snapshot), by
    dotted key; each config is read once and each model built once, on the meta device (no weights read)."""

    def __init__(self, origins: Mapping[str, str]) -> None:
        self.origins = origins
        self.folders: dict[str, tuple[str, Path]] = {}
        """Dotted key -> (the value as given, the folder holding its config.json)."""
        self._configs: dict[Path, PretrainedConfig] = {}
        self._models: dict[tuple[Path, str], nn.Module] = {}

    def config(self, key: str) -> PretrainedConfig:
        """The transformers config of the model ``key`` names (a ConfigError when transformers cannot read it)."""
        from transformers import AutoConfig

        value, folder = self.folders[key]
        if folder not in self._configs:
            try:
                with _quiet_transformers():
                    self._configs[folder] = AutoConfig.from_pretrained(folder, local_files_only=True)
            except (OSError, ValueError) as err:
                why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise bad_value(key, value, self.origins, f"{folder / 'config.json'} is not a model config "
                                                          f"transformers can read ({why})") from None
        return self._configs[folder]

    def build(self, key: str, kind: Literal["causal-lm", "scorer"]) -> nn.Module:
        """The model ``key`` names as a causal LM or a 1-output sequence classifier, on the meta device; ValueError
        when its architecture has no such class."""
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        folder = self.folders[key][1]
        if (folder, kind) not in self._models:
            config = self.config(key)
            with torch.device("meta"), _quiet_transformers():
                if kind == "causal-lm":
                    model = AutoModelForCausalLM.from_config(config)
                else:
                    config = copy.deepcopy(config)
                    config.num_labels = 1
                    model = AutoModelForSequenceClassification.from_config(config)
            self._models[folder, kind] = model
        return self._models[folder, kind]

    def has_tokenizer(self, key: str) -> bool:
        """Whether a tokenizer was saved with the model ``key`` names (:data:`TOKENIZER_FILES`)."""
        folder = self.folders[key][1]
        return any((folder / name).is_file() for name in TOKENIZER_FILES)

    def vocabulary(self, key: str) -> dict[str, int] | None:
        """The token -> id map of the tokenizer saved with the model, or None when there is none to read (the stage
        that loads it says so)."""
        from transformers import AutoTokenizer

        folder = self.folders[key][1]
        if not self.has_tokenizer(key):
            return None  # AutoTokenizer would make an empty tokenizer of the model's type, with a vocabulary of 1
        try:
            with _quiet_transformers():
                return AutoTokenizer.from_pretrained(folder, local_files_only=True).get_vocab()
        except (OSError, ValueError):
            return None


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Keep transformers' warnings about a config (e.g. BERT's 'add is_decoder=True') out of a check that refuses
    in its own words."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def looks_local(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or os.path.exists(value)


def require_exists(key: str, value: str, origins: Mapping[str, str]) -> None:
    path = Path(value).expanduser()
    if "{iteration}" in value:  # a file per iteration, written later (refresh.labels_file): its folder must exist
        folder = Path(value.split("{iteration}")[0]).expanduser()
        folder = folder if value.split("{iteration}")[0].endswith(("/", os.sep)) else folder.parent
        if not folder.is_dir():
            raise bad_value(key, value, origins, f"its folder {folder.resolve()} does not exist")
        return
    if not path.exists():
        raise bad_value(key, value, origins, f"no such file or folder (looked in {path.resolve()})")


def model_folder(key: str, value: str, origins: Mapping[str, str]) -> Path | None:
    """The folder holding the config.json of a local model folder or a cached hub id; None for a hub id that
    ``from_pretrained`` will download."""
    if looks_local(value):
        require_exists(key, value, origins)
        folder = Path(value).expanduser()
        if not (folder / "config.json").is_file():
            raise bad_value(key, value, origins, "not a Hugging Face model folder (no config.json); save it with "
                                                 "save_pretrained")
        return folder
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    here = Path(value).resolve()
    try:
        validate_repo_id(value)
    except HFValidationError:
        raise bad_value(key, value, origins, f"neither a local folder (no such path: {here}) nor a Hugging Face "
                                             "model id") from None
    cache = hub_cache()
    cached = try_to_load_from_cache(value, "config.json", cache_dir=cache)
    if isinstance(cached, str):
        return Path(cached).parent
    fix = (f"download it where there is network (`hf download {value}`) and copy that cache here, or save it with "
           "save_pretrained into a folder and give its path")
    if hub_offline():
        raise bad_value(key, value, origins, f"no local folder {here}, and offline (HF_HUB_OFFLINE / "
                                             f"TRANSFORMERS_OFFLINE) this Hugging Face id must be in the local cache "
                                             f"{cache}, which lacks it; {fix}")
    endpoint = os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")
    if not hub_reachable(endpoint):
        raise bad_value(key, value, origins, f"no local folder {here}, not in the local Hugging Face cache {cache}, "
                                             f"and the hub {endpoint} cannot be reached; {fix}")
    return None  # from_pretrained downloads it when the stage runs


def hub_cache() -> Path:
    """The Hugging Face hub cache folder as the environment names it now (huggingface_hub reads it once, at
    import): HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(cache)).expanduser()


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set to a true word: only the local cache may be read."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_reachable(endpoint: str) -> bool:
    """Whether a TCP connection to ``endpoint`` (or to the proxy the environment names for it) opens within
    ``CONNECT_TIMEOUT`` seconds."""
    parts = urlsplit(endpoint)
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    proxy = None if host is None or proxy_bypass_environment(host) else getproxies().get(parts.scheme)
    if proxy:
        via = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = via.hostname, via.port or (443 if via.scheme == "https" else 80)
    if host is None:
        return False
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT):
            return True
    except OSError:
        return False


def check_model_kinds(models: ModelsAtHand) -> None:
    """A policy is a causal LM whose attention sees only earlier tokens; a reward model or judge has a
    sequence-classification class (encoder or decoder)."""
    for key, (value, _) in models.folders.items():
        model_type = getattr(models.config(key), "model_type", None) or "this config"
        if key == POLICY_KEY:
            try:
                policy = models.build(key, "causal-lm")
            except ValueError:
                raise bad_value(key, value, models.origins, f"a policy must be a causal LM (GPT-2, Llama, Qwen, ...); "
                                                            f"{model_type} has no causal-LM class") from None
            if attention_is_causal(policy) is False:
                raise bad_value(key, value, models.origins, f"a policy must be a causal LM, but this loads as "
                                                            f"{type(policy).__name__}, whose attention sees later "
                                                            "tokens; use a decoder (GPT-2, Llama, Qwen, ...)")
            if not models.has_tokenizer(key):
                raise bad_value(key, value, models.origins, f"{models.folders[key][1]} holds no tokenizer (none of "
                                                            f"{', '.join(TOKENIZER_FILES)}), which data-prep counts "
                                                            "lengths with and every stage reads text with; save it "
                                                            "next to the model (tokenizer.save_pretrained)")
        elif key in SCORER_KEYS:
            try:
                models.build(key, "scorer")
            except ValueError:
                raise bad_value(key, value, models.origins, f"a reward model needs a sequence-classification class; "
                                                            f"{model_type} has none (BERT, GPT-2, Llama, Qwen, ... "
                                                            "do)") from None


def preflight_critic(config: PipelineConfig, origins: Mapping[str, str], models: ModelsAtHand) -> None:
    """A critic is the proxy reward model reading the policy's token ids: it needs a per-token score head and
    the policy's vocabulary."""
    ppo = config.ppo
    init = config.reward_model.init
    if config.method != "ppo" or not ppo.uses_value_model or ppo.value_model != "critic" or init in MODEL_WORDS:
        return
    if "://" in init or init.startswith("models:/"):
        return  # a registered model: checked when the critic is built
    key, fix = "ppo.value_model", "use ppo.value_model=head or reward_model.init=sft"
    base = config.sft.base_model
    if base is None:
        raise bad_value(key, "critic", origins, f"the critic starts from reward_model.init {init!r} but reads the "
                                                "policy's token ids, which come from the tokenizer this run trains "
                                                f"(sft.base_model is null): another vocabulary; {fix}")
    if "reward_model.init" not in models.folders:
        return  # a hub id still to download
    scorer = models.build("reward_model.init", "scorer")
    if per_token_head(scorer) is None:
        raise bad_value(key, "critic", origins, f"the critic starts from reward_model.init {init!r}, a "
                                                f"{describe(scorer)}, but needs a decoder reward model with a "
                                                "per-token linear score head; use ppo.value_model=head")
    if POLICY_KEY not in models.folders:
        return
    policy_vocab, critic_vocab = models.vocabulary(POLICY_KEY), models.vocabulary("reward_model.init")
    if policy_vocab is not None and critic_vocab is not None and policy_vocab != critic_vocab:
        raise bad_value(key, "critic", origins, f"the critic starts from reward_model.init {init!r} but reads the "
                                                f"policy's token ids, and sft.base_model {base!r} has another "
                                                f"vocabulary ({len(policy_vocab)} vs {len(critic_vocab)} tokens "
                                                f"or other ids); {fix}")
