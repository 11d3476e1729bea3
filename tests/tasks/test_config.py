"""The pipeline config: presets, layering, strict errors that name the key and its source, round trips."""

from __future__ import annotations

import json
import typing
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from flows.cli import main
from rlhf_core.config import PPOConfig
from rlhf_core.data import DataPrepConfig, InputFormat
from rlhf_core.demo.config import DemoDataConfig
from rlhf_core.models.lm import PRESETS as MODEL_SIZES, ModelSize
from rlhf_core.training.ppo_step import make_kl_controller
from rlhf_core.config import SFTConfig
from tasks.config import (ConfigError, PipelineConfig, SFTSection, available_presets, changed_settings, config_from_dict,
                          load_config)
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
    assert (tiny.ppo.iterations, tiny.ppo.updates_per_iteration, tiny.ppo.rollout_batch_size) == (2, 2, 8)
    gpu = load_config(None, "gpu-7b", [])
    assert gpu.dtype == "bfloat16" and gpu.ppo.value_model == "critic"
    assert gpu.ppo.learning_rate == 1e-5 and gpu.sft.base_model and gpu.data.files
    assert gpu.ppo.gradient_checkpointing and gpu.ppo.autocast == "bf16" and gpu.ppo.lora.enabled
    assert gpu.distributed.deepspeed_config is None  # one GPU; docs/scaling.md for ZeRO on several


def test_no_preset_no_file_is_the_defaults() -> None:
    assert load_config(None, None, []) == PipelineConfig()


def test_model_size_choices_match_rlhf_core_presets() -> None:
    names, shape = typing.get_args(typing.get_type_hints(SFTSection)["model_size"])
    assert set(typing.get_args(names)) == set(MODEL_SIZES) and shape is ModelSize


def test_preset_then_file_then_overrides(tmp_path: Path) -> None:
    user = write_yaml(tmp_path / "user.yaml",
                      {"data": {"demo": {"n_pairs": 300}}, "ppo": {"kl": {"coef": 0.2}}})
    cfg = load_config(user, "tiny", ["data.demo.n_pairs=500", "ppo.kl.estimator=k3"])
    assert cfg.data.demo.n_pairs == 500  # override beats file beats preset
    assert cfg.ppo.kl.coef == 0.2  # file beats preset (tiny leaves the default 0.05)
    assert cfg.ppo.kl.estimator == "k3"
    assert cfg.data.demo.n_sft == 200  # preset value kept beside the file's sibling key
    assert cfg.ppo.kl.target == 6.0  # dataclass default


def test_override_values_are_yaml(tmp_path: Path) -> None:
    cfg = load_config(None, "tiny", ["ppo.learning_rate=1e-6", "ppo.clip_range_value=null",
                                     "ppo.reward.clip=5", "refresh.enabled=false",
                                     "data.prep.input_format=chat", "name=my run"])
    assert cfg.ppo.learning_rate == 1e-6  # PyYAML reads '1e-6' as a string; float fields accept it
    assert cfg.ppo.clip_range_value is None
    assert cfg.ppo.reward.clip == 5.0 and isinstance(cfg.ppo.reward.clip, float)
    assert cfg.refresh.enabled is False and cfg.name == "my run"
    assert cfg.data.prep.input_format is InputFormat.CHAT


def test_files_source(tmp_path: Path) -> None:
    cfg = load_config(None, "tiny", ["data.source=files", "data.files=[a.parquet, b.jsonl]", "refresh.enabled=false"])
    assert cfg.data.files == ("a.parquet", "b.jsonl")


def test_unknown_key_names_dotted_key_file_and_closest(tmp_path: Path) -> None:
    user = write_yaml(tmp_path / "user.yaml", {"ppo": {"kl": {"coeff": 0.1}}})
    message = error_of(path=user, preset="tiny")
    assert "'ppo.kl.coeff'" in message
    assert str(user) in message
    assert "did you mean 'ppo.kl.coef'" in message
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
    ("ppo.kl.estimator=k9", ["'ppo.kl.estimator'", "'k9'", "'k1', 'k2', 'k3', 'abs'"]),
    ("data.prep.input_format=xml", ["'data.prep.input_format'", "'xml'", "'auto'"]),
    ("ppo.clip_range_value=wide", ["'ppo.clip_range_value'", "'wide'", "number", "null"]),
    ("data.demo=5", ["'data.demo'", "mapping"]),
    ("data.files=a.parquet", ["'data.files'", "list"]),
])
def test_bad_values_name_key_and_value(override: str, fragments: list[str]) -> None:
    message = error_of(path=None, preset="tiny", overrides=[override])
    assert f"override '{override}'" in message
    for fragment in fragments:
        assert fragment in message


def test_dataclass_validation_errors_name_section_and_values() -> None:
    message = error_of(path=None, preset="tiny", overrides=["ppo.mini_batch_size=3"])
    assert "'ppo'" in message and "must divide" in message
    assert "ppo.mini_batch_size=3 from override 'ppo.mini_batch_size=3'" in message


def test_cross_section_checks() -> None:
    assert "refresh.enabled" in error_of(path=None, preset="tiny",
                                         overrides=["data.source=files", "data.files=[a.csv]"])
    assert "positions" in error_of(path=None, preset="tiny", overrides=["sft.max_length=129"])
    assert "data.files is empty" in error_of(path=None, preset="tiny", overrides=["data.source=files"])


def test_bad_inputs_are_config_errors(tmp_path: Path) -> None:
    assert "tiny" in error_of(path=None, preset="nope")
    assert "does not exist" in error_of(path=tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    assert "mapping" in error_of(path=tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("a: [1\n")
    assert "not valid YAML" in error_of(path=tmp_path / "broken.yaml")
    assert "section.key=value" in error_of(path=None, overrides=["ppo.kl.coef"])


@pytest.mark.parametrize("preset", ["tiny", "demo", "gpu-7b"])
def test_dump_then_load_round_trips(preset: str, tmp_path: Path) -> None:
    cfg = load_config(None, preset, ["ppo.kl.coef=0.125", "data.prep.max_length=7777"])  # > gpu-7b's prompt cap
    path = tmp_path / "config.yaml"
    dump_config(cfg, path)
    assert load_config(path, None, []) == cfg
    assert yaml.safe_load(path.read_text())["data"]["prep"]["input_format"] == cfg.data.prep.input_format.value


def test_flatten_for_params() -> None:
    cfg = load_config(None, "tiny", [])
    flat = flatten_for_params(cfg)
    assert flat["ppo.kl.coef"] == "0.05"
    assert flat["ppo.generation.max_new_tokens"] == "16"
    assert flat["data.prep.input_format"] == "auto"
    assert flat["data.files"] == "[]"
    assert flat["sft.base_model"] == "None"
    assert flat["refresh.enabled"] == "True"
    assert all(isinstance(v, str) for v in flat.values())
    assert len(flat) == len(set(flat)) > 100
    assert not any(k.startswith(".") or k.endswith(".") for k in flat)
    assert config_to_dict(cfg)["ppo"]["kl"]["coef"] == 0.05


# --------------------------------------------------------------------------------------------- one name per quantity


def test_kl_coef_override_reaches_the_ppo_config_passed_to_training() -> None:
    cfg = load_config(None, "tiny", ["ppo.kl.coef=0.1"])
    assert cfg.ppo.kl.coef == 0.1
    assert isinstance(cfg.ppo, PPOConfig)  # the section IS the core config: train_ppo gets it as it is
    assert make_kl_controller(cfg.ppo).coef == 0.1
    assert flatten_for_params(cfg)["ppo.kl.coef"] == "0.1"


@pytest.mark.parametrize("preset", [None, "tiny", "demo", "gpu-7b"])
def test_total_updates_is_iterations_times_updates(preset: str | None) -> None:
    cfg = load_config(None, preset, [])
    assert cfg.ppo.total_updates == cfg.ppo.iterations * cfg.ppo.updates_per_iteration
    changed = load_config(None, preset, ["ppo.iterations=7", "ppo.updates_per_iteration=3"])
    assert changed.ppo.total_updates == 21 and replace(changed.ppo, iterations=2).total_updates == 6
    assert "total_updates" not in config_to_dict(cfg)["ppo"] and "ppo.total_updates" not in flatten_for_params(cfg)


def test_setting_total_updates_fails_naming_the_key(tmp_path: Path) -> None:
    message = error_of(path=None, preset="tiny", overrides=["ppo.total_updates=4"])
    assert "'ppo.total_updates'" in message and "override 'ppo.total_updates=4'" in message
    assert "derived" in message and "ppo.iterations x ppo.updates_per_iteration" in message
    user = write_yaml(tmp_path / "user.yaml", {"ppo": {"total_updates": 30}})
    assert str(user) in error_of(path=user) and "derived" in error_of(path=user)


@pytest.mark.parametrize(("override", "unknown", "meant"), [
    ("ppo.ppo.kl.coef=0.1", "'ppo.ppo'", "'ppo.kl.coef'"),
    ("sft.sft.lr=0.002", "'sft.sft'", "'sft.learning_rate'"),
    ("sft.lr=0.002", "'sft.lr'", "'sft.learning_rate'"),
    ("ppo.ppo.generation.max_new_tokens=8", "'ppo.ppo'", "'ppo.generation.max_new_tokens'"),
])
def test_old_stuttering_keys_are_unknown_and_point_at_the_new_ones(override: str, unknown: str, meant: str) -> None:
    message = error_of(path=None, preset="tiny", overrides=[override])
    assert f"unknown setting {unknown} (from override '{override}')" in message
    assert f"did you mean {meant}?" in message


@pytest.mark.parametrize("preset", [None, *available_presets()])
def test_every_preset_round_trips_through_yaml_and_json(preset: str | None, tmp_path: Path) -> None:
    cfg = load_config(None, preset, [])
    path = tmp_path / "config.yaml"
    dump_config(cfg, path)
    assert load_config(path, None, []) == cfg
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg


def test_sft_section_is_the_core_sft_config_with_a_custom_shape(tmp_path: Path) -> None:
    cfg = load_config(None, "tiny", ["sft.learning_rate=0.002",
                                     "sft.model_size={n_layer: 1, n_embd: 8, n_head: 2, n_positions: 128}"])
    assert isinstance(cfg.sft, SFTConfig) and cfg.sft.learning_rate == 0.002
    assert cfg.sft.model_size == ModelSize(n_layer=1, n_embd=8, n_head=2, n_positions=128)
    dump_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
    assert "positions" in error_of(path=None, preset="tiny", overrides=[
        "sft.model_size={n_layer: 1, n_embd: 8, n_head: 2, n_positions: 64}"])


def test_demo_section_defaults_are_the_pipelines() -> None:
    assert load_config().data.demo == DemoDataConfig(n_pairs=4000, n_sft=4000, sft_eval_fraction=0.1,
                                                     n_eval_prompts=256, annotator_temperature=1.5)


# --------------------------------------------------------------------------------------------- rlhf prep


def prep_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["prep", *argv]) == 2
    return capsys.readouterr().err.strip()


def one_line(message: str) -> str:
    return "rlhf prep: error: " + " ".join(message.split())


@pytest.mark.parametrize(("flags", "overrides"), [
    (["--demo", "--pairs", "0"], ["data.source=demo", "data.demo.n_pairs=0"]),
    (["--demo", "--sft-demos", "many"], ["data.source=demo", "data.demo.n_sft=many"]),
    (["--demo", "--seed", "1.5"], ["data.source=demo", "seed=1.5"]),
    (["--demo", "--set", "data.demo.sft_eval_fraction=1"], ["data.source=demo", "data.demo.sft_eval_fraction=1"]),
    (["--demo", "--set", "data.demo.n_pair=5"], ["data.source=demo", "data.demo.n_pair=5"]),
    (["in.jsonl", "--max-quarantine-fraction", "3"],
     ["data.source=files", 'data.files=["in.jsonl"]', "refresh.enabled=false", "data.prep.max_quarantine_fraction=3"]),
    (["in.jsonl", "--format", "xml"],
     ["data.source=files", 'data.files=["in.jsonl"]', "refresh.enabled=false", "data.prep.input_format=xml"]),
    (["in.jsonl", "--max-length", "0"],
     ["data.source=files", 'data.files=["in.jsonl"]', "refresh.enabled=false", "data.prep.max_length=0"]),
])
def test_prep_flags_give_the_same_error_as_the_equivalent_override(
    flags: list[str], overrides: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = error_of(path=None, preset=None, overrides=overrides)
    assert prep_error(capsys, *flags, "--out", str(tmp_path)) == one_line(expected)


def _capture_prepare(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Replace the data-prep stage's work with a recorder of what `rlhf prep` gave it."""
    from tasks import data_prep

    calls: list[tuple] = []
    monkeypatch.setattr(data_prep, "prepare", lambda cfg, out, tokenizer=None: calls.append((cfg, out, tokenizer)))
    monkeypatch.setattr(data_prep, "summary", lambda result, folder: "ok")
    return calls


def test_prep_demo_runs_the_data_stage_with_the_loaded_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from tasks import data_prep

    calls = _capture_prepare(monkeypatch)
    argv = ["--demo", "--seed", "3", "--pairs", "150", "--eval-prompts", "9", "--max-length", "300",
            "--set", "data.demo.annotator_temperature=0.5", "--out", str(tmp_path)]
    assert main(["prep", *argv]) == 0
    cfg = load_config(None, None, ["data.source=demo", "seed=3", "data.demo.n_pairs=150", "data.demo.n_eval_prompts=9",
                                   "data.prep.max_length=300", "data.demo.annotator_temperature=0.5"])
    assert calls == [(data_prep.Config.of(cfg), tmp_path, None)]


def test_prep_files_runs_the_data_stage_with_the_loaded_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    calls = _capture_prepare(monkeypatch)
    assert main(["prep", "a b.jsonl", "c.csv", "--prompts", "p: q.csv", "--format", "trl", "--out", str(tmp_path),
                 "--set", "data.prep.heldout_fraction=0.2", "--set", "data.prep.ppo_fraction=0"]) == 0
    ((cfg, out, tokenizer),) = calls
    assert (cfg.source, cfg.files, cfg.prompts_file, out, tokenizer) == (
        "files", ("a b.jsonl", "c.csv"), "p: q.csv", tmp_path, None)
    assert cfg.prep == DataPrepConfig(input_format=InputFormat.TRL, heldout_fraction=0.2, ppo_fraction=0.0)
    assert cfg.demo is None and cfg.seed is None  # user files: no demo sizes, no seed in data-prep's key




def test_registered_model_names_follow_the_experiment_unless_set() -> None:
    """A smoke run on the tiny preset registers under its own names: it can never move the demo's @champion."""
    tiny, demo = load_config(None, "tiny").tracking, load_config(None, "demo").tracking
    assert (tiny.policy_model, tiny.reward_model, tiny.heldout_reward_model) == (
        "rlhf-tiny-policy", "rlhf-tiny-reward-model", "rlhf-tiny-heldout-reward-model")
    assert demo.policy_model == "rlhf-demo-policy" != tiny.policy_model
    assert load_config(None, "tiny", ["tracking.policy_model=shared"]).tracking.policy_model == "shared"
    # resolved once: the recorded config names them, and reloading it keeps them under another experiment
    assert load_config(None, "tiny", ["tracking.experiment=x"]).tracking.reward_model == "x-reward-model"


def test_stage_timeout_is_positive_or_none() -> None:
    assert load_config(None, "tiny").orchestration.stage_timeout_minutes is None
    assert load_config(None, "tiny", ["orchestration.stage_timeout_minutes=90"]).orchestration.stage_timeout_minutes == 90
    message = error_of(path=None, preset="tiny", overrides=["orchestration.stage_timeout_minutes=0"])
    assert "bad value 0 for 'orchestration.stage_timeout_minutes'" in message and "must be > 0 (or null)" in message


def test_changed_settings_are_what_differs_from_the_preset(tmp_path: Path) -> None:
    config = load_config(None, "tiny", ["ppo.kl.coef=0.2", "state_dir=/elsewhere", "seed=0",
                                        "tracking.tracking_uri=http://user:secret@host"])
    # the same value as the preset is no change; where the run lives (or a URI with a password) is never shown
    assert changed_settings(config, "tiny") == {"ppo.kl.coef": "0.2"}
    mine = tmp_path / "mine.yaml"
    mine.write_text("ppo:\n  iterations: 7\n")
    assert changed_settings(load_config(mine, "demo"), "demo") == {"ppo.iterations": "7"}
    assert "name" in changed_settings(load_config(None, "tiny"), None)  # against the code defaults
