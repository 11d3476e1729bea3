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
from tasks.tracking.registry import resolve_model_uri, set_alias
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
        return ppo_iteration.resume_state_checkpoint(harness.store, artifact).is_dir()
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
        assert uploaded == {"MLmodel", "rlhf_model.json", "rlhf_pyfunc.json"}  # a pointer and how to use it, no weights
        assert Path(resolve_model_uri(f"models:/{name}/{version.version}")) == artifact.path("policy")
    set_alias(name, "champion", int(versions[1].version))
    folder = resolve_model_uri(f"models:/{name}@champion")
    assert Path(folder) == arts[1].path("policy")
    loaded = GPT2LMHeadModel.from_pretrained(folder)
    saved = GPT2LMHeadModel.from_pretrained(arts[1].path("policy"))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), saved.state_dict().values()))


def test_registered_versions_load_the_mlflow_way_and_serve(chain, tmp_path: Path) -> None:
    """A policy registered by reference loads with mlflow.pyfunc and writes replies with the settings it was
    trained with; a reward model (uploaded) loads as a pyfunc that scores pairs, equal to the model's own scores;
    `mlflow models serve --env-manager local` answers a request."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    import mlflow
    import pandas as pd

    from rlhf_core.models.roles import load_reward_model, sequence_scores
    from rlhf_core.models.text import encode_pair
    from tasks import tracking
    from tasks.models import load_tokenizer

    harness, arts, (config, inputs, _) = chain
    name = harness.names.policy_model
    latest = max(int(v.version) for v in MlflowClient().search_model_versions(f"name='{name}'")
                 if v.tags["rlhf.artifact_key"] == arts[-1].identity())
    set_alias(name, "champion", latest)
    policy = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    prompts = pd.DataFrame({"prompt": PROMPTS[:3]})
    replies = policy.predict(prompts)
    assert list(replies.columns) == ["response"] and len(replies) == 3
    assert policy.predict(prompts).equals(replies)  # seeded: the same replies again
    params = policy.metadata.get_params_schema()
    assert {p.name: p.default for p in params.params}["max_new_tokens"] == config.ppo.generation.max_new_tokens
    short = policy.predict(prompts, params={"max_new_tokens": 1})["response"]
    assert all(len(r.split()) <= 1 for r in short)

    rm_folder = inputs[2].path
    with tracking.pipeline_run(harness.names.experiment, harness.run_id, "pyfunc") as run_id:
        ref = tracking.register_model(rm_folder, harness.names.reward_model, run_id,
                                      {"rlhf.run_id": harness.run_id, "rlhf.artifact_key": "reward-model/pyfunc",
                                       "rlhf.role": "proxy"})
    reward = mlflow.pyfunc.load_model(ref.uri)
    pairs = {"prompt": PROMPTS[:2], "response": [" the cat", " a dog ran"]}
    scores = reward.predict(pd.DataFrame(pairs))["score"].tolist()
    tokenizer, model = load_tokenizer(rm_folder), load_reward_model(str(rm_folder)).eval()
    for prompt, response, score in zip(pairs["prompt"], pairs["response"], scores, strict=True):
        ids = torch.tensor([encode_pair(tokenizer, prompt, response)])
        assert score == pytest.approx(sequence_scores(model, ids, torch.ones_like(ids)).item(), abs=1e-5)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # the scoring server is uvicorn, which MLflow runs from PATH: the environment's bin folder (an activated venv)
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow.get_tracking_uri(),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", f"models:/{name}@champion",
                               "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        body = json.dumps({"dataframe_records": [{"prompt": p} for p in PROMPTS[:2]]}).encode()
        deadline, answer = time.monotonic() + 180, None
        while answer is None and time.monotonic() < deadline and server.poll() is None:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", body,
                                                 {"Content-Type": "application/json"})
                answer = json.loads(urllib.request.urlopen(request, timeout=30).read())
            except OSError:
                time.sleep(1)
        assert answer is not None, (tmp_path / "serve.log").read_text()[-3000:]
        assert len(answer["predictions"]) == 2 and all("response" in row for row in answer["predictions"])
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
