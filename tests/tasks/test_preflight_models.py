"""Every model path and hub id is checked when the config is loaded: a local folder holds a config.json, a
Hugging Face id is in the local cache or the hub is reachable (offline: only the cache), a policy is a causal LM, a
reward model or judge has a sequence-classification class, and a critic can read the policy's token ids.

Models are tiny configs saved with ``save_pretrained`` (no weights are needed: the checks build on the meta device);
the hub cache is a folder of this test, laid out as huggingface_hub writes it; the hub is a local port.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (BertConfig, DistilBertConfig, GPT2Config, LlamaConfig, PretrainedConfig,
                          PreTrainedTokenizerFast, ViTConfig)

from tasks.config import ConfigError, PipelineConfig
from tasks.preflight import hub_cache, resolve_config
from tests.tiny_models import word_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


@pytest.fixture(autouse=True)
def own_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache per test, offline unless a test says otherwise, and no proxy between us and a local hub."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "hf" / "hub"


def bert(**overrides: object) -> BertConfig:
    return BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                      vocab_size=100, bos_token_id=1, eos_token_id=2, **overrides)


def gpt2(**overrides: object) -> GPT2Config:
    return GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100, bos_token_id=1, eos_token_id=2, **overrides)


def other_tokenizer() -> PreTrainedTokenizerFast:
    """A word tokenizer with another vocabulary than ``word_tokenizer``'s."""
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<bos>", "<eos>", "yes", "no", "maybe"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def save(folder: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerFast | None = None) -> str:
    config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return str(folder)


def cache(repo_id: str, config: PretrainedConfig) -> None:
    """``repo_id`` in the hub cache as huggingface_hub lays it out: refs/main names a snapshot holding the files
    (the config and a tokenizer)."""
    repo = hub_cache() / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    save(repo / "snapshots" / COMMIT, config, word_tokenizer())


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_config(None, "tiny", list(overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


def accepted(*overrides: str) -> PipelineConfig:
    return resolve_config(None, "tiny", list(overrides))


@pytest.fixture
def closed_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A local port that accepts connections (the kernel's backlog answers; nothing is served)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        yield server.getsockname()[1]


# ----------------------------------------------------------------------------- local folders


def test_a_missing_local_folder_is_refused(tmp_path: Path) -> None:
    message = refusal(f"sft.base_model={tmp_path}/policy")
    assert message.startswith(f"bad value '{tmp_path}/policy' for 'sft.base_model' (from override ")
    assert f"no such file or folder (looked in {tmp_path}/policy)" in message


def test_a_folder_without_config_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "model.safetensors").write_bytes(b"")
    message = refusal(f"reward_model.init={tmp_path}/rm")
    assert "'reward_model.init'" in message and f"'{tmp_path}/rm'" in message
    assert "not a Hugging Face model folder (no config.json); save it with save_pretrained" in message


def test_a_config_transformers_cannot_read_is_refused(tmp_path: Path) -> None:
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "config.json").write_text('{"model_type": "no-such-architecture"}')
    message = refusal(f"sft.base_model={tmp_path}/policy")
    assert "'sft.base_model'" in message and f"{tmp_path}/policy/config.json is not a model config" in message


# ----------------------------------------------------------------------------- hub ids


def test_a_malformed_hub_id_is_refused() -> None:
    message = refusal("reward_model.init=org/too/deep")
    assert "'reward_model.init'" in message and "'org/too/deep'" in message
    assert f"neither a local folder (no such path: {Path('org/too/deep').resolve()}) nor a Hugging Face model id" \
        in message


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_an_uncached_id_is_refused_offline(own_hub_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                           variable: str) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv(variable, "yes")
    message = refusal("sft.base_model=org/tiny-gpt2")
    assert "'sft.base_model'" in message and "'org/tiny-gpt2'" in message
    assert f"local cache {own_hub_cache}" in message and "offline" in message
    assert "`hf download org/tiny-gpt2`" in message and "save_pretrained" in message


def test_an_uncached_id_is_refused_when_the_hub_is_unreachable(monkeypatch: pytest.MonkeyPatch,
                                                               closed_port: int) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port}")
    message = refusal("reward_model.init=org/tiny-rm")
    assert "'reward_model.init'" in message and "'org/tiny-rm'" in message
    assert f"the hub http://127.0.0.1:{closed_port} cannot be reached" in message
    assert "`hf download org/tiny-rm`" in message


def test_an_uncached_id_is_left_to_download_when_the_hub_is_reachable(monkeypatch: pytest.MonkeyPatch,
                                                                      listening_port: int) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listening_port}")
    assert accepted("sft.base_model=org/tiny-gpt2").sft.base_model == "org/tiny-gpt2"


def test_a_cached_id_passes_offline_and_its_kind_is_checked() -> None:
    cache("org/tiny-bert", bert())
    cache("org/tiny-gpt2", gpt2(n_positions=16))
    assert accepted("reward_model.init=org/tiny-bert").reward_model.init == "org/tiny-bert"
    assert "BertLMHeadModel, whose attention sees later tokens" in refusal("sft.base_model=org/tiny-bert")
    # its positions are read from the cached config too: a 16-token reply leaves no room for a prompt
    message = refusal("sft.base_model=org/tiny-gpt2")
    assert "'ppo.generation.max_new_tokens'" in message and "16 positions of sft.base_model 'org/tiny-gpt2'" in message
    assert accepted("sft.base_model=org/tiny-gpt2", "ppo.generation.max_new_tokens=8").sft.base_model


# ----------------------------------------------------------------------------- model kinds


def test_an_encoder_policy_is_refused(tmp_path: Path) -> None:
    folder = save(tmp_path / "bert", bert())
    message = refusal(f"sft.base_model={folder}")
    assert message.startswith(f"bad value '{folder}' for 'sft.base_model' (from override ")
    assert "a policy must be a causal LM, but this loads as BertLMHeadModel, whose attention sees later tokens" \
        in message


def test_a_decoder_bert_is_a_causal_policy(tmp_path: Path) -> None:
    """BertLMHeadModel with is_decoder=True masks later tokens: its attention is causal, so it may be a policy."""
    folder = save(tmp_path / "bert", bert(is_decoder=True), word_tokenizer())
    assert accepted(f"sft.base_model={folder}").sft.base_model == folder


def test_a_model_without_a_causal_lm_class_is_refused_as_policy(tmp_path: Path) -> None:
    folder = save(tmp_path / "distilbert", DistilBertConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64,
                                                            vocab_size=100))
    message = refusal(f"sft.base_model={folder}")
    assert "'sft.base_model'" in message
    assert "a policy must be a causal LM (GPT-2, Llama, Qwen, ...); distilbert has no causal-LM class" in message


def test_decoder_policies_are_accepted(tmp_path: Path) -> None:
    llama = LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        vocab_size=100, max_position_embeddings=64)
    for name, config in (("gpt2", gpt2()), ("llama", llama)):
        folder = save(tmp_path / name, config, word_tokenizer())
        assert accepted(f"sft.base_model={folder}").sft.base_model == folder


def test_a_policy_saved_without_its_tokenizer_is_refused(tmp_path: Path) -> None:
    """data-prep counts lengths in the policy's tokens: a folder of weights alone fails at load, not in a stage."""
    folder = save(tmp_path / "weights-only", gpt2())
    message = refusal(f"sft.base_model={folder}")
    assert "'sft.base_model'" in message and "holds no tokenizer" in message and "tokenizer.save_pretrained" in message


@pytest.mark.parametrize("key", ["reward_model.init", "reward_model.heldout_init"])
def test_an_encoder_reward_model_is_accepted(tmp_path: Path, key: str) -> None:
    folder = save(tmp_path / "bert", bert())
    assert folder in accepted(f"{key}={folder}").reward_model.inits


def test_a_model_without_a_sequence_classifier_is_refused_as_reward_model_or_judge(tmp_path: Path) -> None:
    folder = save(tmp_path / "vit", ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                              intermediate_size=64))
    for overrides in ([f"reward_model.heldout_init={folder}"],
                      ["refresh.annotator=rm_judge", f"refresh.judge_model={folder}"]):
        message = refusal(*overrides)
        key = overrides[-1].partition("=")[0]
        assert f"'{key}'" in message and "a reward model needs a sequence-classification class; vit has none" \
            in message


# ----------------------------------------------------------------------------- the critic


def test_a_critic_with_another_vocabulary_than_the_policy_is_refused(tmp_path: Path) -> None:
    policy = save(tmp_path / "policy", gpt2(), word_tokenizer())
    rm = save(tmp_path / "rm", gpt2(), other_tokenizer())
    message = refusal("ppo.value_model=critic", f"sft.base_model={policy}", f"reward_model.init={rm}")
    assert message.startswith("bad value 'critic' for 'ppo.value_model' (from override 'ppo.value_model=critic')")
    assert f"reward_model.init '{rm}'" in message and f"sft.base_model '{policy}' has another vocabulary" in message
    assert "use ppo.value_model=head or reward_model.init=sft" in message
    # the same tokenizer: the critic reads the policy's ids as its own
    same = save(tmp_path / "rm-same", gpt2(), word_tokenizer())
    assert accepted("ppo.value_model=critic", f"sft.base_model={policy}", f"reward_model.init={same}")
    # without a critic the reward model reads its own ids (the stage retokenizes)
    assert accepted("ppo.value_model=head", f"sft.base_model={policy}", f"reward_model.init={rm}")
    # no tokenizer saved with the reward model: nothing to compare here (the stage that loads it says so)
    bare = save(tmp_path / "rm-bare", gpt2())
    assert accepted("ppo.value_model=critic", f"sft.base_model={policy}", f"reward_model.init={bare}")


def test_a_critic_from_a_model_when_the_run_trains_the_policy_tokenizer_is_refused(tmp_path: Path) -> None:
    rm = save(tmp_path / "rm", gpt2(), word_tokenizer())
    message = refusal("ppo.value_model=critic", f"reward_model.init={rm}")
    assert "'ppo.value_model'" in message and "sft.base_model is null" in message
    assert "use ppo.value_model=head or reward_model.init=sft" in message
    assert accepted("ppo.value_model=critic", "reward_model.init=sft").ppo.value_model == "critic"


def test_a_critic_from_an_encoder_reward_model_is_refused(tmp_path: Path) -> None:
    policy = save(tmp_path / "policy", gpt2(), word_tokenizer())
    rm = save(tmp_path / "bert", bert(), word_tokenizer())
    message = refusal("ppo.value_model=critic", f"sft.base_model={policy}", f"reward_model.init={rm}")
    assert "'ppo.value_model'" in message and "BertForSequenceClassification (bidirectional encoder)" in message
    assert "per-token linear score head; use ppo.value_model=head" in message
    assert accepted("ppo.value_model=head", f"sft.base_model={policy}", f"reward_model.init={rm}")
