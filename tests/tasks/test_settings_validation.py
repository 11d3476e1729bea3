"""Settings are refused before any stage runs, in one line naming the dotted key, the value, its source and
what would be valid: ranges and finiteness while the config is built, files / devices / precision / lengths
against this machine (``resolve_config``), duplicate YAML keys while the file is read.

The first table is the fault-injection list that used to be accepted without a word.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from flows.cli import main
from rlhf_core.ranges import Range, range_of
from tasks.config import ConfigError, PipelineConfig, load_config
from tasks.preflight import resolve_config

# (override, the range or reason the message must give)
USED_TO_BE_ACCEPTED = [
    ("ppo.learning_rate=.nan", "finite"),
    ("ppo.learning_rate=.inf", "finite"),
    ("ppo.learning_rate=-1e-5", "must be > 0"),
    ("ppo.value_learning_rate=-1", "must be > 0"),
    ("sft.learning_rate=nan", "finite"),
    ("reward_model.training.learning_rate=-0.1", "must be >= 0"),
    ("ppo.kl.coef=-1", "must be >= 0"),
    ("ppo.kl.coef=.nan", "finite"),
    ("ppo.kl.target=-1", "must be > 0"),
    ("ppo.clip_range=-0.2", "must be > 0"),
    ("ppo.gamma=1.5", "must be in [0, 1]"),
    ("ppo.lam=2", "must be in [0, 1]"),
    ("ppo.max_grad_norm=-1", "must be > 0"),
    ("ppo.weight_decay=nan", "finite"),
    ("ppo.mini_batch_size=0", "must be >= 1"),
    ("ppo.rollout_batch_size=-8", "must be >= 1"),
    ("ppo.vf_coef=-0.1", "must be >= 0"),
    ("ppo.generation.top_p=0", "must be in (0, 1] (1 = off)"),
    ("eval.kl_budget=-1", "must be > 0"),
    ("refresh.learning_rate=0", "must be > 0 (or null)"),
    ("distributed.master_port=70000", "must be in [1, 65535]"),
]


@pytest.mark.parametrize(("override", "valid"), USED_TO_BE_ACCEPTED)
def test_a_bad_number_is_refused_naming_key_value_source_and_range(override: str, valid: str) -> None:
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError) as info:
        load_config(None, "tiny", [override])
    message = str(info.value)
    assert "\n" not in message
    assert f"for '{key}' (from override '{override}')" in message
    assert valid in message
    assert value.lstrip(".").lower() in message.lower()


def test_a_config_file_is_named_as_the_source(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("ppo:\n  kl:\n    coef: -0.5\n")
    with pytest.raises(ConfigError, match=rf"bad value -0.5 for 'ppo.kl.coef' \(from {config}\): must be >= 0"):
        load_config(config, "tiny")


def test_a_key_given_twice_in_a_yaml_file_is_refused_with_both_lines(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("ppo:\n  kl:\n    coef: 0.1\n  learning_rate: 1.0e-5\n  kl:\n    coef: 0.2\n")
    with pytest.raises(ConfigError) as info:
        load_config(config, "tiny")
    assert str(info.value) == f"{config}: key 'kl' appears twice in one mapping (lines 2 and 5); keep one"


def test_yaml_merge_keys_still_override(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("reward_model:\n  training: &rm {epochs: 2, batch_size: 4}\n"
                      "  heldout:\n    <<: *rm\n    epochs: 3\n")
    loaded = load_config(config, "tiny")
    assert (loaded.reward_model.heldout.epochs, loaded.reward_model.heldout.batch_size) == (3, 4)


def test_a_config_file_that_is_not_utf8_is_refused_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_bytes("ppo:\n  kl:\n    coef: 0.1\n".encode("utf-16"))
    with pytest.raises(ConfigError, match=rf"^{config} is not UTF-8 text"):
        load_config(config, "tiny")


# ----------------------------------------------------------------------------- against this machine


def _refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_config(None, "tiny", overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_files_that_must_exist(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    assert _refusal([f"distributed.deepspeed_config={missing}"]) == (
        f"bad value '{missing}' for 'distributed.deepspeed_config' (from override "
        f"'distributed.deepspeed_config={missing}'): no such file or folder (looked in {missing})")
    assert "'refresh.labels_file'" in _refusal(["refresh.annotator=file", f"refresh.labels_file={tmp_path}/l.csv"])
    assert "'data.files'" in _refusal(["data.source=files", f"data.files=[{tmp_path}/pairs.jsonl]",
                                       "refresh.enabled=false"])
    assert "'sft.base_model'" in _refusal([f"sft.base_model={tmp_path}/policy"])
    assert "'distributed.hostfile'" in _refusal(["distributed.launcher=deepspeed",
                                                  "distributed.deepspeed_config=infra/deepspeed/zero2.json",
                                                  f"distributed.hostfile={tmp_path}/hosts"])
    # a file per iteration is written later: only its folder must exist
    resolve_config(None, "tiny", ["refresh.annotator=file", f"refresh.labels_file={tmp_path}/labels_{{iteration}}.csv"])
    assert "its folder" in _refusal(["refresh.annotator=file", f"refresh.labels_file={tmp_path}/no/l_{{iteration}}.csv"])
    # a Hugging Face id is looked up in the local cache: not there and offline (as in every test), refused at once
    assert "`hf download gpt2`" in _refusal(["sft.base_model=gpt2"])


def test_a_deepspeed_config_the_loops_cannot_honour_is_refused_up_front(tmp_path: Path) -> None:
    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"stage": 1}}')
    assert "stage must be 2 or 3" in _refusal([f"distributed.deepspeed_config={bad}"])
    bad.write_text("{not json")
    assert "is not valid JSON" in _refusal([f"distributed.deepspeed_config={bad}"])


def test_zero3_with_lora_is_refused_before_any_stage() -> None:
    message = _refusal(["distributed.deepspeed_config=infra/deepspeed/zero3_offload.json", "ppo.lora.enabled=true"])
    assert message.startswith("ppo.lora.enabled=true with ZeRO-3") and "zero2.json" in message
    # LoRA in a stage that does not run on DeepSpeed is fine
    resolve_config(None, "tiny", ["distributed.deepspeed_config=infra/deepspeed/zero3_offload.json",
                                  "distributed.stages=[ppo-iteration]", "reward_model.training.lora.enabled=true"])


@pytest.mark.parametrize(("device", "reason"), [
    ("cuda:7", "CUDA device"), ("banana", "not a torch device"), ("tpu", "not a torch device"),
])
def test_a_device_this_machine_lacks_is_refused(device: str, reason: str) -> None:
    import torch

    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    message = _refusal([f"device={device}"])
    assert f"bad value '{device}' for 'device' (from override 'device={device}')" in message and reason in message


def test_bf16_autocast_over_float16_weights_is_refused() -> None:
    assert _refusal(["ppo.autocast=bf16", "dtype=float16"]).startswith("ppo.autocast='bf16' with dtype='float16'")


@pytest.mark.parametrize("overrides", [
    ["dtype=bfloat16", "ppo.value_model=head", "ppo.autocast=none"],
    ["dtype=bfloat16", "ppo.value_model=critic", "ppo.lora.enabled=true", "ppo.autocast=none"],
    ["dtype=bfloat16", "ppo.autocast=bf16", "reward_model.training.autocast=none"],
])
def test_bf16_weights_with_float32_heads_are_accepted(overrides: list[str]) -> None:
    """Heads and adapters train in float32 on bf16 weights, with or without autocast
    (tests/behaviour/test_precision.py runs these): nothing to refuse."""
    assert resolve_config(None, "tiny", overrides).dtype == "bfloat16"


def test_a_reply_longer_than_the_model_is_refused() -> None:
    message = _refusal(["ppo.generation.max_new_tokens=100000"])
    assert "'ppo.generation.max_new_tokens'" in message and "128 positions of model_size 'tiny'" in message


def test_rlhf_run_refuses_before_any_run_exists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    assert main(["run", "--preset", "tiny", "--state-dir", str(state), "ppo.kl.coef=-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'ppo.kl.coef'" in err and "must be >= 0" in err
    assert not (state / "runs").exists() or not any((state / "runs").iterdir())


# ----------------------------------------------------------------------------- property: the loader


def _ranged_settings(cls: type = PipelineConfig, prefix: str = "") -> dict[str, tuple[type, Range]]:
    """Dotted key -> (int or float, range) of every numeric setting with a declared range."""
    found: dict[str, tuple[type, Range]] = {}
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint, key = hints[f.name], f"{prefix}{f.name}"
        inner = next((a for a in typing.get_args(hint) if isinstance(a, type) and dataclasses.is_dataclass(a)), hint)
        if isinstance(inner, type) and dataclasses.is_dataclass(inner):
            found.update(_ranged_settings(inner, f"{key}."))
        elif (bounds := range_of(hint)) is not None:
            annotated = next(h for h in (hint, *typing.get_args(hint)) if typing.get_origin(h) is typing.Annotated)
            found[key] = (typing.get_args(annotated)[0], bounds)
    return found


RANGED = _ranged_settings()


def test_the_ranged_settings_cover_the_fault_list() -> None:
    for override, _ in USED_TO_BE_ACCEPTED:
        assert override.partition("=")[0] in RANGED
    assert len(RANGED) >= 60


NUMBERS = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from(["nan", ".inf", "-.inf", "1e-6", "-0", "1e309", "abc", "[1]", "null"]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(RANGED)), raw=NUMBERS)
def test_any_value_of_a_ranged_setting_is_in_range_or_refused_in_one_line(key: str, raw: object) -> None:
    """The loader never raises anything but ConfigError, never lets a value outside its range through, and its
    refusal is one line naming the key."""
    text = repr(raw) if isinstance(raw, float) else str(raw)
    text = {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}.get(text, text)
    override = f"{key}={text}"
    try:
        config = load_config(None, "tiny", [override])
    except ConfigError as err:
        assert "\n" not in str(err) and key in str(err)
        return
    value: object = config
    for part in key.split("."):
        value = getattr(value, part)
    if value is None:
        return  # an optional setting set to null
    kind, bounds = RANGED[key]
    assert type(value) is kind
    assert bounds.problem(value) is None, f"{override} gave {value!r} outside {bounds}"


@settings(max_examples=60, deadline=None)
@given(key=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.\n\t ", min_size=1, max_size=30),
       raw=st.text(max_size=20))
def test_any_override_loads_or_is_refused_as_a_config_error(key: str, raw: str) -> None:
    try:
        load_config(None, "tiny", [f"{key}={raw}"])
    except ConfigError as err:
        assert "\n" not in str(err), str(err)


# ----------------------------------------------------------------------------- credentials


def test_a_password_in_the_tracking_uri_is_never_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.tracking.setup import keep_credentials_out
    from tasks.typed_yaml import dump_config_text, flatten_for_params

    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    config = keep_credentials_out(load_config(None, "tiny", ["tracking.tracking_uri=https://ann:s%40cret@mlflow:5000"]))
    assert config.tracking.tracking_uri == "https://mlflow:5000"
    assert "cret" not in dump_config_text(config) and "cret" not in str(flatten_for_params(config))
    import os

    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == ("ann", "s@cret")
    plain = load_config(None, "tiny", ["tracking.tracking_uri=http://mlflow:5000"])
    assert keep_credentials_out(plain) is plain


def test_a_database_uri_with_a_password_is_refused_not_recorded() -> None:
    from tasks.tracking.setup import keep_credentials_out

    config = load_config(None, "tiny", ["tracking.tracking_uri=postgresql://ann:secret@db/mlflow"])
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_URI instead"):
        keep_credentials_out(config)


def test_a_schedule_refuses_a_password_it_would_store_in_prefect() -> None:
    import argparse

    from flows.serving import schedule_parameters

    args = argparse.Namespace(config=None, preset="tiny", state_dir=None, pool=None,
                              overrides=["tracking.tracking_uri=http://ann:secret@mlflow:5000"])
    with pytest.raises(ConfigError, match="Prefect's database"):
        schedule_parameters(args)
