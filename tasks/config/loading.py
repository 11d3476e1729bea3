"""Loading a ``PipelineConfig``: a preset, then the user's YAML file, then dotted overrides, converted strictly."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tasks.config.pipeline import PipelineConfig
from tasks.typed_yaml import ConfigError, build, flatten_for_params, merge_layer, one_line, parse_override, read_yaml

PRESETS_DIR = Path(__file__).resolve().parents[2] / "infra" / "presets"


def available_presets() -> list[str]:
    """Names of the preset files in ``infra/presets``."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_config(path: str | Path | None = None, preset: str | None = None,
                overrides: Sequence[str] = ()) -> PipelineConfig:
    """Preset YAML, then the user's YAML, then ``key.sub=value`` overrides, converted strictly.

    Without a preset the dataclass defaults are the base. Raises ConfigError naming the bad key and its source.
    """
    return build(PipelineConfig, *_layers(path, preset, overrides))


def load_config_with_origins(path: str | Path | None = None, preset: str | None = None,
                              overrides: Sequence[str] = ()) -> tuple[PipelineConfig, dict[str, str]]:
    """:func:`load_config`, and where each setting came from (dotted key -> its layer), for the checks that run
    after the config is built (``tasks.preflight.resolve_config``) to name a bad value's source."""
    merged, key, origins = _layers(path, preset, overrides)
    return build(PipelineConfig, merged, key, origins), origins


def _layers(path: str | Path | None, preset: str | None,
            overrides: Sequence[str]) -> tuple[dict[str, Any], str, dict[str, str]]:
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    if preset is not None:
        if preset not in available_presets():
            raise ConfigError(f"unknown preset {preset!r}; choose one of {available_presets()}")
        preset_path = PRESETS_DIR / f"{preset}.yaml"
        merge_layer(merged, read_yaml(preset_path), f"preset '{preset}' ({preset_path})", origins)
    if path is not None:
        merge_layer(merged, read_yaml(Path(path)), str(path), origins)
    for item in overrides:
        merge_layer(merged, parse_override(item), f"override '{one_line(item)}'", origins)
    return merged, "", origins


#: Settings that say where a run lives, not what it does (and may hold credentials): never shown as changes.
_NOT_CHANGES = ("state_dir", "tracking.tracking_uri")


def changed_settings(config: PipelineConfig, preset: str | None) -> dict[str, str]:
    """The settings of ``config`` that differ from ``preset`` (from the code defaults when None), as
    ``{'ppo.kl.coef': '0.2'}``: what tells one run of a preset from another."""
    base = flatten_for_params(load_config(None, preset) if preset in available_presets() else PipelineConfig())
    mine = flatten_for_params(config)
    return {k: v for k, v in mine.items() if base.get(k) != v and k not in _NOT_CHANGES}


def config_from_dict(data: Mapping[str, Any], source: str = "serialised config") -> PipelineConfig:
    """The config ``config_to_dict`` turned into ``data`` (e.g. in a job file), converted as strictly as
    ``load_config``; a bad key is reported as coming from ``source``."""
    return build(PipelineConfig, dict(data), "", {str(key): source for key in data})
