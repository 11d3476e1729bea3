"""Cache keys are derived from what a stage is given, never listed: change any config leaf and exactly the stages
that read it get a new key.

"Reads" is recorded, not declared: each stage's ``Config.of`` runs on a proxy of the pipeline config that notes every
setting it touches (a section handed over whole counts as every leaf under it). The key side is the real thing:
``stage_key`` of the real slice, with the stage's inputs held fixed (an input's own key covers everything upstream).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import json
import tempfile
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tasks import best_of_n, data_prep, dpo, heldout_eval, ppo_iteration, reward_model, rm_refresh, sft
from rlhf_core.ranges import is_retention
from tasks.config import ConfigError, PipelineConfig, load_config
from tasks.run_store import stage_key
from tasks.typed_yaml import DERIVED, config_to_dict, dump_config_text

REPO = Path(__file__).resolve().parents[2]
STAGE_MODULES = (data_prep, sft, reward_model, best_of_n, ppo_iteration, heldout_eval, rm_refresh, dpo)

#: Settings no stage reads: where a run lives and how it is named and tracked, never what it computes.
RUN_LEVEL = {"name", "state_dir", "tracking.experiment", "tracking.policy_model", "tracking.reward_model",
             "tracking.heldout_reward_model", "tracking.tracking_uri", "tracking.model_storage", "orchestration.stage_timeout_minutes"}
#: Settings that cannot change alone (validation ties them to another): the other variant changes them.
ONLY_WITH_ANOTHER = {
    "data.source": "files needs data.files", "data.files": "only with data.source=files",
    "data.prompts_file": "only with data.source=files", "data.prep.train_fraction": "the fractions sum to 1",
    "data.prep.heldout_fraction": "the fractions sum to 1", "data.prep.ppo_fraction": "the fractions sum to 1",
    "sft.enabled": "false needs sft.base_model", "refresh.labels_file": "only with refresh.annotator=file",
    "refresh.judge_model": "only with refresh.annotator=rm_judge", "distributed.hostfile": "only with the deepspeed launcher",
    "distributed.num_processes": "more than 1 needs distributed.deepspeed_config",
    "distributed.num_nodes": "more than 1 needs distributed.deepspeed_config",
    "refresh.annotator": "simulated needs demo data; file/rm_judge change other settings' meaning",
    "ppo.kl.placement": "loss refuses the default k1 estimator",
    "reward_model.heldout_onpolicy_pairs": "only with data.source=demo (its simulated annotator labels them)",
}
#: Settings that decide which stages run (the flow reads them), not what one stage computes.
FLOW_LEVEL = {"refresh.enabled", "refresh.every_k", "refresh.on_hacking", "ppo.iterations", "method"}


def slices(config: PipelineConfig) -> dict[str, Any]:
    """Every stage's config slice, as the flow builds them (iteration 2 where a stage repeats)."""
    return {"data-prep": data_prep.Config.of(config), "sft": sft.Config.of(config),
            "reward-model": reward_model.Config.of(config), "best-of-n": best_of_n.Config.of(config),
            "ppo-iteration": ppo_iteration.Config.of(config, 2), "heldout-eval": heldout_eval.Config.of(config, 2, 1),
            "rm-refresh": rm_refresh.Config.of(config, 2), "dpo": dpo.Config.of(config)}


def keys(config: PipelineConfig) -> dict[str, str]:
    return {stage: stage_key(stage, cfg, {"inputs": "fixed"}) for stage, cfg in slices(config).items()}


# --------------------------------------------------------------------------------------------- recording reads


def recording(value: Any, path: str, reads: set[str]) -> Any:
    """A copy of config section ``value`` whose field reads are noted in ``reads`` (dotted paths). It is an instance
    of a subclass of the real class, so ``dataclasses.replace``, properties and methods all read through it."""
    copy = object.__new__(_recording_class(type(value)))
    for f in dataclasses.fields(value):
        object.__setattr__(copy, f.name, getattr(value, f.name))
    object.__setattr__(copy, "_recording", (path, reads))
    return copy


@functools.cache
def _recording_class(cls: type) -> type:
    names = {f.name for f in dataclasses.fields(cls)}

    def __getattribute__(self: Any, name: str) -> Any:
        value = object.__getattribute__(self, name)
        note = object.__getattribute__(self, "__dict__").get("_recording")
        if note is None or name not in names:
            return value
        path = f"{note[0]}.{name}" if note[0] else name
        if dataclasses.is_dataclass(value):
            return recording(value, path, note[1])
        note[1].add(path)
        return value

    return type(f"Recording{cls.__name__}", (cls,), {"__getattribute__": __getattribute__})


def read_leaves(build: Callable[[Any], Any], config: PipelineConfig) -> set[str]:
    """Dotted leaves of ``config`` that ``build`` (a ``Config.of``) reads; a section it hands over whole (puts into
    the slice as it is) counts as every leaf under it."""
    reads: set[str] = set()
    built = build(recording(config, "", reads))

    def handed_over(value: Any) -> Iterator[str]:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            note = value.__dict__.get("_recording")
            if note is not None:
                yield note[0]
                return
            for f in dataclasses.fields(value):
                yield from handed_over(object.__getattribute__(value, f.name))
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from handed_over(item)

    sections = set(handed_over(built))
    settable = leaves(config)
    for path, formula in derived_fields(config).items():  # a derived value reads what it is derived from
        if path in reads or any(path.startswith(s + ".") for s in sections):
            reads |= {leaf for leaf in settable if leaf in formula.split()}
    return {leaf for leaf in settable if leaf in reads or any(leaf.startswith(s + ".") for s in sections)}


def derived_fields(config: Any, prefix: str = "") -> dict[str, str]:
    """Dotted path -> formula of every derived (``init=False``) field, e.g. ppo.total_updates."""
    out = {}
    for f in dataclasses.fields(config):
        value, path = getattr(config, f.name), f"{prefix}{f.name}"
        if not f.init and DERIVED in f.metadata:
            out[path] = f.metadata[DERIVED]
        elif dataclasses.is_dataclass(value):
            out |= derived_fields(value, path + ".")
    return out


def leaves(config: Any, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(config):
        value, path = getattr(config, f.name), f"{prefix}{f.name}"
        if not f.init:
            continue  # derived (e.g. ppo.total_updates): follows the settings it is derived from
        out += leaves(value, path + ".") if dataclasses.is_dataclass(value) else [path]
    return out


def reads_by_stage(config: PipelineConfig) -> dict[str, set[str]]:
    builders = {"data-prep": data_prep.Config.of, "sft": sft.Config.of, "reward-model": reward_model.Config.of,
                "best-of-n": best_of_n.Config.of, "ppo-iteration": lambda c: ppo_iteration.Config.of(c, 2),
                "heldout-eval": lambda c: heldout_eval.Config.of(c, 2, 1),
                "rm-refresh": lambda c: rm_refresh.Config.of(c, 2), "dpo": dpo.Config.of}
    return {stage: read_leaves(build, config) for stage, build in builders.items()}


# --------------------------------------------------------------------------------------------- perturbing


def candidates(value: Any, hint: Any) -> list[Any]:
    """Other valid-looking values for a leaf of type ``hint`` currently ``value``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return [a for a in args if a != value]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return [m.value for m in hint if m != value]
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None and inner == [bool]:  # None means "the rule decides": either answer is a change
            return [True, False]
        return ([None] if value is not None and type(None) in args else []) + \
            [c for a in inner for c in candidates(value if value is not None else _default(a), a)]
    if isinstance(value, bool) or hint is bool:
        return [not value]
    if isinstance(value, int) or hint is int:
        v = value or 0
        return [v + 1, v - 1, v * 2, 1, 2, 1 << 20]  # the last: above floors such as a token budget's
    if isinstance(value, float) or hint is float:
        v = value or 0.0
        return [v * 0.5 if v else 0.25, v + 0.1, v * 2, 0.5, 3.0]  # the last: above floors such as dual_clip's 1
    if origin in (tuple, list):
        return [tuple(value) + ("extra",), ()] if value else [("a",)]
    if isinstance(value, str) or hint is str:
        return [(value or "x") + "-changed"]
    return []


def _default(hint: Any) -> Any:
    return {int: 1, float: 0.5, str: "x", bool: False}.get(hint, None)


def leaf_hint(config: Any, dotted: str) -> Any:
    node = config
    *parents, last = dotted.split(".")
    for part in parents:
        node = getattr(node, part)
    return typing.get_type_hints(type(node))[last], getattr(node, last)


def _retention(config: Any, dotted: str) -> bool:
    *parents, last = dotted.split(".")
    node = functools.reduce(getattr, parents, config)
    return is_retention(typing.get_type_hints(type(node), include_extras=True)[last])


def perturbed(config: PipelineConfig, dotted: str) -> Iterator[PipelineConfig]:
    """Valid configs that differ from ``config`` in ``dotted`` alone."""
    hint, value = leaf_hint(config, dotted)
    base = dump_config_text(config)
    for candidate in candidates(value, hint):
        override = f"{dotted}={_yaml(candidate)}"
        try:
            changed = _load_text(base, override)
        except ConfigError:
            continue
        if config_to_dict(changed) != config_to_dict(config):
            yield changed


def _yaml(value: Any) -> str:
    return "null" if value is None else json.dumps(list(value) if isinstance(value, tuple) else value)


def _load_text(text: str, override: str) -> PipelineConfig:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        handle.write(text)
    try:
        return load_config(handle.name, None, [override])
    finally:
        Path(handle.name).unlink()


# --------------------------------------------------------------------------------------------- the tests

CONFIGS = {
    "tiny": ["state_dir=/tmp/unused"],
    "files+rm_judge+distributed": ["data.source=files", "data.files=[pairs.jsonl]", "refresh.annotator=rm_judge",
                                   "distributed.deepspeed_config=infra/deepspeed/zero2.json",
                                   "distributed.num_processes=2", "sft.base_model=some/model", "sft.enabled=false",
                                   "ppo.lr_schedule=linear"],
}


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_exactly_the_stages_that_read_a_setting_get_a_new_key(variant: str) -> None:
    config = load_config(None, "tiny", CONFIGS[variant])
    reads = reads_by_stage(config)
    base = keys(config)
    mismatches, unchangeable = [], []
    for leaf in leaves(config):
        # A retention setting (how many checkpoints are kept) is read, yet changes no result: no key may move.
        readers = set() if _retention(config, leaf) else {
            stage for stage, leafs in reads.items() if leaf in leafs}
        moved_any, seen_changes = False, set()
        for other in perturbed(config, leaf):
            changed = {stage for stage, key in keys(other).items() if key != base[stage]}
            seen_changes |= changed
            moved_any = True
            if not changed <= readers:
                mismatches.append(f"{leaf}: changes the key of {sorted(changed - readers)}, which do not read it")
        if not moved_any:
            unchangeable.append(leaf)
        elif seen_changes != readers:
            mismatches.append(f"{leaf}: read by {sorted(readers)} but no change moved {sorted(readers - seen_changes)}")
    assert not mismatches, "\n".join(mismatches)
    # Every setting is read by some stage, or is a run/flow-level one; and only a few cannot change alone.
    unread = {leaf for leaf in leaves(config) if not any(leaf in leafs for leafs in reads.values())}
    assert {"ppo.keep_checkpoints", "ppo.keep_resume_states"} <= set(leaves(config)) - unread  # read, yet keyless
    assert RUN_LEVEL <= unread, "where a run lives and how it is tracked must never enter a stage's key"
    assert unread - RUN_LEVEL - FLOW_LEVEL <= _conditional(variant), unread
    assert set(unchangeable) <= set(ONLY_WITH_ANOTHER), unchangeable


def _conditional(variant: str) -> set[str]:
    """Settings the variant's choices switch off (e.g. the demo sizes with user files, lora with LoRA off)."""
    config = load_config(None, "tiny", CONFIGS[variant])
    return {leaf for leaf in leaves(config) if leaf.startswith(
        ("data.demo.", "data.files", "data.prompts_file", "distributed.", "refresh.judge_model", "refresh.labels_file",
         "refresh.export_format", "refresh.annotator_temperature", "sft.vocab_size", "sft.model_size",
         "seed" if variant != "tiny" else "\0"))} | ({"seed"} if variant != "tiny" else set())


def test_the_old_sft_leak_is_closed() -> None:
    """sft reads eval.n_prompts (its gold report's size) and PPO's sampling: both are in its key now."""
    config = load_config(None, "tiny", [])
    for override in ("eval.n_prompts=15", "ppo.generation.temperature=0.7"):
        assert keys(load_config(None, "tiny", [override]))["sft"] != keys(config)["sft"], override


def test_stage_code_sees_its_slice_only() -> None:
    """A stage module touches the pipeline config only in ``Config.of``: compute and publish get the slice."""
    for module in STAGE_MODULES:
        tree = ast.parse(Path(module.__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name not in ("of",):
                for arg in node.args.args:
                    annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                    assert "PipelineConfig" not in annotation, f"{module.__name__}.{node.name} takes the whole config"
