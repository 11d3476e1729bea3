"""Checkpoint retention and registration by reference.

- ``ppo.keep_checkpoints``: the in-stage checkpoints the PPO loop keeps.
- ``ppo.keep_resume_states``: a ppo-iteration's last checkpoint (optimizer state) is resume state beside its
  artifact, pruned once later iterations are published; the artifacts stay whole (their checksums hold), a cached
  rerun prunes nothing more, and redoing an iteration whose predecessor's state is gone refuses in one line.
- ``tracking.model_storage=reference``: a registered policy's weights are not uploaded; ``models:/`` still loads.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from transformers import GPT2LMHeadModel

from rlhf_core.config import GenerationConfig, PPOConfig
from rlhf_core.models.roles import ValueHead, disable_dropout, make_reference
from rlhf_core.training.experience import PPOModels
from rlhf_core.training.ppo_loop import train_ppo
from tasks import ppo_iteration
from tasks.config import load_config
from tasks.run_store import ResumeStateError
from tasks.run_store.artifacts import manifest
from tasks.tracking import resolve_model_uri, set_alias
from tests.stage_harness import StageHarness, unique_names
from tests.tiny_models import gpt2_config, save_ppo_inputs

PAD, BOS, EOS, VOCAB = 0, 1, 2, 24
PROMPTS = ["hello the cat", "why the dog ran", "how big is the sun", "q red box", "the moon sat on a mat",
           "a small star", "fast blue tree", "q slow dog"]
OVERRIDES = ["device=cpu", "ppo.iterations=3", "ppo.updates_per_iteration=1", "ppo.generation.max_new_tokens=4",
             "ppo.keep_resume_states=2"]


class CountSeven:
    def __call__(self, rollout):
        return ((rollout.response_ids == 7) & rollout.response_mask).float().sum(dim=1)


def test_the_loop_keeps_the_newest_keep_checkpoints(tmp_path: Path) -> None:
    torch.manual_seed(0)
    policy = disable_dropout(GPT2LMHeadModel(gpt2_config(VOCAB)))
    models = PPOModels(policy, make_reference(policy), CountSeven(), (EOS,), PAD, value_head=ValueHead(32))
    prompts = [[BOS] + [random.Random(i).randrange(3, VOCAB) for _ in range(1 + i % 3)] for i in range(16)]
    config = PPOConfig(rollout_batch_size=8, mini_batch_size=8, micro_batch_size=8, ppo_epochs=1,
                       generation=GenerationConfig(max_new_tokens=3, batch_size=8), keep_checkpoints=3)
    train_ppo(models, prompts, config, 5, checkpoint_dir=tmp_path, checkpoint_every=1)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000003", "step_000004", "step_000005"]


def test_keep_settings_refuse_zero_naming_the_key() -> None:
    for key in ("ppo.keep_checkpoints", "ppo.keep_resume_states"):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            load_config(preset="tiny", overrides=[f"{key}=0"])


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[StageHarness, list, object]]:
    """Three ppo-iterations of one run (policies registered by reference), keeping two resume states."""
    harness = StageHarness(tmp_path_factory.mktemp("retention") / "state",
                           dataclasses.replace(unique_names(), model_storage="reference"))
    saved = save_ppo_inputs(tmp_path_factory.mktemp("retention-inputs"), PROMPTS)
    config = load_config(preset="tiny", overrides=OVERRIDES)
    data = harness.artifact("data-prep", {"ppo_prompts.parquet": saved["prompts"]},
                            {"ppo_prompts": "ppo_prompts.parquet"})
    inputs = (data, harness.model("sft", saved["sft"]), harness.model("reward-model", saved["rm"]))
    arts, kept_after = [], []
    for k in (1, 2, 3):
        arts.append(harness.run(ppo_iteration, f"ppo-iteration-{k}", ppo_iteration.Config.of(config, k),
                                ppo_iteration.Inputs(*inputs, arts[-1] if arts else None)))
        kept_after.append([_has_state(harness, a) for a in arts])
    yield harness, arts, (config, inputs, kept_after)
    harness.close()


def _has_state(harness: StageHarness, artifact) -> bool:
    try:
        return ppo_iteration.resume_checkpoint(harness.store, artifact).is_dir()
    except ResumeStateError:
        return False


def test_older_resume_states_are_pruned_once_a_later_iteration_is_published(chain) -> None:
    harness, arts, (_, _, kept_after) = chain
    assert kept_after == [[True], [True, True], [False, True, True]]
    for artifact in arts:  # the artifacts themselves are untouched: every checksum still holds, policies are there
        assert manifest(artifact.folder) == artifact.record.files
        assert (artifact.path("policy") / "model.safetensors").is_file()
        assert not (artifact.folder / "checkpoint").exists()  # optimizer state is not part of the artifact


def test_redoing_an_iteration_whose_predecessors_state_was_pruned_refuses_in_one_line(chain) -> None:
    harness, arts, (config, inputs, _) = chain
    changed = load_config(preset="tiny", overrides=[*OVERRIDES, "ppo.learning_rate=2e-5"])  # a new key: not cached
    with pytest.raises(ResumeStateError) as refused:
        harness.run(ppo_iteration, "ppo-iteration-2", ppo_iteration.Config.of(changed, 2),
                    ppo_iteration.Inputs(*inputs, arts[0]))
    message = str(refused.value)
    assert "\n" not in message
    for part in (arts[0].identity(), "pruned", arts[2].identity(), "ppo.keep_resume_states=2",
                 "rlhf stage ppo-iteration-1 --run RUN_ID"):
        assert part in message, part
    assert harness.active.stage("ppo-iteration-2").status == "failed"


def test_a_cached_rerun_reuses_everything_and_prunes_nothing_more(chain, tmp_path: Path) -> None:
    harness, arts, (config, inputs, _) = chain
    again = StageHarness(harness.store.root, harness.names)  # another run on the same state folder
    try:
        previous = None
        for k, expected in zip((1, 2, 3), arts):
            previous = again.run(ppo_iteration, f"ppo-iteration-{k}", ppo_iteration.Config.of(config, k),
                                 ppo_iteration.Inputs(*inputs, previous))
            assert previous.identity() == expected.identity()
            assert again.active.stage(f"ppo-iteration-{k}").cached_from == harness.run_id
        assert [_has_state(again, a) for a in arts] == [False, True, True]
    finally:
        again.close()


def test_reference_registration_uploads_no_weights_and_models_uris_still_load(chain) -> None:
    harness, arts, _ = chain
    client = MlflowClient()
    name = harness.names.policy_model
    every = sorted(client.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version))
    versions = [v for v in every if v.tags["rlhf.run_id"] == harness.run_id]
    assert [v.tags["rlhf.artifact_key"] for v in versions] == [a.identity() for a in arts]  # once each
    for other in (v for v in every if v.tags["rlhf.run_id"] != harness.run_id):  # the cached rerun's versions
        assert other.source == versions[[a.identity() for a in arts].index(other.tags["rlhf.artifact_key"])].source
    for version, artifact in zip(versions, arts):
        assert version.tags["rlhf.model_storage"] == "reference"
        uploaded = {f.path.rsplit("/", 1)[-1] for f in client.list_artifacts(version.run_id, "models/" + name)}
        assert uploaded == {"MLmodel", "rlhf_model.json"}  # a pointer, no weights
        assert Path(resolve_model_uri(f"models:/{name}/{version.version}")) == artifact.path("policy")
    set_alias(name, "champion", int(versions[1].version))
    folder = resolve_model_uri(f"models:/{name}@champion")
    assert Path(folder) == arts[1].path("policy")
    loaded = GPT2LMHeadModel.from_pretrained(folder)
    saved = GPT2LMHeadModel.from_pretrained(arts[1].path("policy"))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), saved.state_dict().values()))
