"""The pipeline config: presets, layering, strict errors that name the key and its source, round trips."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml

from rlhf_core.data import InputFormat
from rlhf_core.models.lm import PRESETS as MODEL_SIZES
from tasks.config import ConfigError, PipelineConfig, SFTSection, available_presets, load_config
from tasks.typed_yaml import config_to_dict, dump_config, flatten_for_params


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def error_of(**kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    return str(info.value)


@pytest.mark.parametrize("preset", ["tiny", "demo", "gpu-7b"])
def test_presets_load(preset: str) -> None:
    assert preset in available_presets()
    assert isinstance(load_config(None, preset, []), PipelineConfig)


def test_preset_values_reach_the_dataclasses() -> None:
    tiny = load_config(None, "tiny", [])
    assert (tiny.data.demo.n_pairs, tiny.data.demo.n_sft, tiny.sft.model_size) == (200, 200, "tiny")
    assert (tiny.ppo.iterations, tiny.ppo.updates_per_iteration, tiny.ppo.ppo.rollout_batch_size) == (2, 2, 8)
    gpu = load_config(None, "gpu-7b", [])
    assert gpu.dtype == "bfloat16" and gpu.ppo.ppo.value_model == "critic"
    assert gpu.ppo.ppo.learning_rate == 1e-5 and gpu.sft.base_model and gpu.data.files
    assert gpu.ppo.ppo.gradient_checkpointing and gpu.ppo.ppo.autocast == "bf16" and gpu.ppo.ppo.lora.enabled
    assert gpu.distributed.deepspeed_config is None  # one GPU; docs/scaling.md for ZeRO on several


def test_no_preset_no_file_is_the_defaults() -> None:
    assert load_config(None, None, []) == PipelineConfig()


def test_model_size_choices_match_rlhf_core_presets() -> None:
    assert set(typing.get_args(typing.get_type_hints(SFTSection)["model_size"])) == set(MODEL_SIZES)


def test_preset_then_file_then_overrides(tmp_path: Path) -> None:
    user = write_yaml(tmp_path / "user.yaml",
                      {"data": {"demo": {"n_pairs": 300}}, "ppo": {"ppo": {"kl": {"coef": 0.2}}}})
    cfg = load_config(user, "tiny", ["data.demo.n_pairs=500", "ppo.ppo.kl.estimator=k3"])
    assert cfg.data.demo.n_pairs == 500  # override beats file beats preset
    assert cfg.ppo.ppo.kl.coef == 0.2  # file beats preset (tiny leaves the default 0.05)
    assert cfg.ppo.ppo.kl.estimator == "k3"
    assert cfg.data.demo.n_sft == 200  # preset value kept beside the file's sibling key
    assert cfg.ppo.ppo.kl.target == 6.0  # dataclass default


def test_override_values_are_yaml(tmp_path: Path) -> None:
    cfg = load_config(None, "tiny", ["ppo.ppo.learning_rate=1e-6", "ppo.ppo.clip_range_value=null",
                                     "ppo.ppo.reward.clip=5", "refresh.enabled=false",
                                     "data.prep.input_format=chat", "name=my run"])
    assert cfg.ppo.ppo.learning_rate == 1e-6  # PyYAML reads '1e-6' as a string; float fields accept it
    assert cfg.ppo.ppo.clip_range_value is None
    assert cfg.ppo.ppo.reward.clip == 5.0 and isinstance(cfg.ppo.ppo.reward.clip, float)
    assert cfg.refresh.enabled is False and cfg.name == "my run"
    assert cfg.data.prep.input_format is InputFormat.CHAT


def test_files_source(tmp_path: Path) -> None:
    cfg = load_config(None, "tiny", ["data.source=files", "data.files=[a.parquet, b.jsonl]", "refresh.enabled=false"])
    assert cfg.data.files == ("a.parquet", "b.jsonl")


def test_unknown_key_names_dotted_key_file_and_closest(tmp_path: Path) -> None:
    user = write_yaml(tmp_path / "user.yaml", {"ppo": {"ppo": {"kl": {"coeff": 0.1}}}})
    message = error_of(path=user, preset="tiny")
    assert "'ppo.ppo.kl.coeff'" in message
    assert str(user) in message
    assert "did you mean 'ppo.ppo.kl.coef'" in message
    assert "estimator" in message and "horizon" in message  # the valid keys are listed


def test_unknown_key_from_override_names_the_override() -> None:
    message = error_of(path=None, preset="tiny", overrides=["data.demo.n_pair=5"])
    assert "'data.demo.n_pair'" in message and "override 'data.demo.n_pair=5'" in message
    assert "did you mean 'data.demo.n_pairs'" in message


def test_unknown_top_level_section_from_preset_layer_is_blamed_on_the_right_layer(tmp_path: Path) -> None:
    user = write_yaml(tmp_path / "u.yaml", {"trainer": {"lr": 1}})
    message = error_of(path=user, preset="tiny", overrides=["seed=3"])
    assert "'trainer'" in message and str(user) in message and "override" not in message


@pytest.mark.parametrize(("override", "fragments"), [
    ("data.demo.n_pairs=many", ["'data.demo.n_pairs'", "'many'", "integer"]),
    ("data.demo.n_pairs=true", ["'data.demo.n_pairs'", "True", "integer"]),
    ("data.demo.n_pairs=2.5", ["'data.demo.n_pairs'", "2.5", "integer"]),
    ("sft.enabled=1", ["'sft.enabled'", "true or false"]),
    ("name=12", ["'name'", "string"]),
    ("ppo.ppo.kl.estimator=k9", ["'ppo.ppo.kl.estimator'", "'k9'", "'k1', 'k2', 'k3', 'abs'"]),
    ("data.prep.input_format=xml", ["'data.prep.input_format'", "'xml'", "'auto'"]),
    ("ppo.ppo.clip_range_value=wide", ["'ppo.ppo.clip_range_value'", "'wide'", "number", "null"]),
    ("data.demo=5", ["'data.demo'", "mapping"]),
    ("data.files=a.parquet", ["'data.files'", "list"]),
])
def test_bad_values_name_key_and_value(override: str, fragments: list[str]) -> None:
    message = error_of(path=None, preset="tiny", overrides=[override])
    assert f"override '{override}'" in message
    for fragment in fragments:
        assert fragment in message


def test_dataclass_validation_errors_name_section_and_values() -> None:
    message = error_of(path=None, preset="tiny", overrides=["ppo.ppo.mini_batch_size=3"])
    assert "'ppo.ppo'" in message and "must divide" in message
    assert "ppo.ppo.mini_batch_size=3 from override 'ppo.ppo.mini_batch_size=3'" in message


def test_cross_section_checks() -> None:
    assert "refresh.enabled" in error_of(path=None, preset="tiny",
                                         overrides=["data.source=files", "data.files=[a.csv]"])
    assert "positions" in error_of(path=None, preset="tiny", overrides=["sft.sft.max_length=129"])
    assert "data.files is empty" in error_of(path=None, preset="tiny", overrides=["data.source=files"])


def test_bad_inputs_are_config_errors(tmp_path: Path) -> None:
    assert "tiny" in error_of(path=None, preset="nope")
    assert "does not exist" in error_of(path=tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    assert "mapping" in error_of(path=tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("a: [1\n")
    assert "not valid YAML" in error_of(path=tmp_path / "broken.yaml")
    assert "section.key=value" in error_of(path=None, overrides=["ppo.ppo.kl.coef"])


@pytest.mark.parametrize("preset", ["tiny", "demo", "gpu-7b"])
def test_dump_then_load_round_trips(preset: str, tmp_path: Path) -> None:
    cfg = load_config(None, preset, ["ppo.ppo.kl.coef=0.125", "data.prep.max_length=77"])
    path = tmp_path / "config.yaml"
    dump_config(cfg, path)
    assert load_config(path, None, []) == cfg
    assert yaml.safe_load(path.read_text())["data"]["prep"]["input_format"] == cfg.data.prep.input_format.value


def test_flatten_for_params() -> None:
    cfg = load_config(None, "tiny", [])
    flat = flatten_for_params(cfg)
    assert flat["ppo.ppo.kl.coef"] == "0.05"
    assert flat["ppo.ppo.generation.max_new_tokens"] == "16"
    assert flat["data.prep.input_format"] == "auto"
    assert flat["data.files"] == "[]"
    assert flat["sft.base_model"] == "None"
    assert flat["refresh.enabled"] == "True"
    assert all(isinstance(v, str) for v in flat.values())
    assert len(flat) == len(set(flat)) > 100
    assert not any(k.startswith(".") or k.endswith(".") for k in flat)
    assert config_to_dict(cfg)["ppo"]["ppo"]["kl"]["coef"] == 0.05
