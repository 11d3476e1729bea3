"""The reward-model stage on a planted rule (the chosen reply says "good", the rejected one "bad"): both RMs
learn it, are saved in the artifact, registered with lineage and the 'candidate' alias, and logged to a nested
MLflow run with plots; a later run reuses the artifact and registers it again without a second upload."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE
from prefect.states import Failed
from transformers import AutoTokenizer, GPT2LMHeadModel

from rlhf_core.data import PREFERENCE_PAIRS, DataError
from rlhf_core.models.roles import load_reward_model
from tasks import reward_model
from tasks.config import PipelineConfig, load_config
from tasks.io import read_pairs, write_parquet
from tasks.retries import is_transient, retry_on_transient_io
from tasks.reward_model import SCORES_PNG, pair_scores, reward_model_task
from tasks.run_store import Artifact
from tests import model_families
from tests.stage_harness import StageHarness
from tests.tiny_models import WORDS, gpt2_config, word_tokenizer

FILLER = [w for w in WORDS if w not in ("good", "bad", "q")]
LABEL = "reward-model"


def planted_pairs(n: int, seed: int) -> list[dict[str, object]]:
    """Pairs whose chosen reply holds "good" and rejected "bad" at a random place among filler words."""
    rng = random.Random(seed)

    def reply(marker: str) -> str:
        words = rng.sample(FILLER, rng.randint(2, 5))
        words.insert(rng.randint(0, len(words)), marker)
        return " " + " ".join(words)

    rows = []
    for i in range(n):
        prompt = "q " + " ".join(rng.sample(FILLER, 3))
        chosen, rejected = reply("good"), reply("bad")
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected,
                     "margin": [None, float("nan"), 1.0][i % 3], "source_file": "planted", "source_row": i,
                     "pair_id": f"{seed}-{i}"})
    return rows


def tiny_config(*extra: str) -> PipelineConfig:
    return load_config(preset="tiny", overrides=[
        "device=cpu", "reward_model.training.epochs=4", "reward_model.heldout.epochs=4",
        "reward_model.training.learning_rate=0.003", "reward_model.heldout.learning_rate=0.003", *extra])


def latest_version(name: str) -> int:
    """The newest registered version of ``name``."""
    return max(int(v.version) for v in MlflowClient().search_model_versions(f"name='{name}'"))


def pairs_artifact(harness: StageHarness, train: Path, heldout: Path) -> Artifact:
    """A hand-made data-prep artifact holding the two pair tables the stage reads."""
    return harness.artifact("data-prep", {"train_pairs.parquet": train, "heldout_pairs.parquet": heldout},
                            {"train_pairs": "train_pairs.parquet", "heldout_pairs": "heldout_pairs.parquet"})


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("rm-inputs")
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    GPT2LMHeadModel(gpt2_config(len(tokenizer))).save_pretrained(root / "sft")
    tokenizer.save_pretrained(root / "sft")
    return SimpleNamespace(
        root=root, sft=root / "sft",
        train=Path(write_parquet(planted_pairs(160, seed=1), PREFERENCE_PAIRS, root / "train_pairs.parquet")),
        heldout=Path(write_parquet(planted_pairs(64, seed=2), PREFERENCE_PAIRS, root / "heldout_pairs.parquet")),
        empty=Path(write_parquet([], PREFERENCE_PAIRS, root / "empty.parquet")),
    )


@pytest.fixture(scope="module")
def harness(files: SimpleNamespace) -> Iterator[StageHarness]:
    harness = StageHarness(files.root / "state")
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def inputs(harness: StageHarness, files: SimpleNamespace) -> reward_model.Inputs:
    return reward_model.Inputs(pairs_artifact(harness, files.train, files.heldout), harness.model("sft", files.sft))


@pytest.fixture(scope="module")
def stage(harness: StageHarness, inputs: reward_model.Inputs) -> Artifact:
    return harness.run(reward_model, LABEL, reward_model.Config.of(tiny_config()), inputs)


def test_both_models_learn_the_planted_rule_on_pairs_they_never_saw(stage: Artifact, files: SimpleNamespace) -> None:
    m = reward_model.STAGE.result(stage).metrics
    assert m["rm/proxy/eval/accuracy"] >= 0.85 and m["rm/proxy/eval/n_pairs"] == 64
    assert m["rm/heldout/eval/accuracy"] >= 0.85 and m["rm/heldout/eval/n_pairs"] == 160
    assert m["rm/proxy/eval/margin_mean"] > 0 and m["rm/proxy/eval/score_std"] > 0
    assert m["rm/cross/agreement"] >= 0.8 and m["rm/cross/spearman"] > 0.3
    # The saved proxy, reloaded from the artifact, orders the held-out pairs as the stage reported.
    proxy_dir = reward_model.model_input(stage, "proxy").path
    model, tokenizer = load_reward_model(proxy_dir).eval(), AutoTokenizer.from_pretrained(proxy_dir)
    chosen, rejected = pair_scores(model, tokenizer, read_pairs(files.heldout), max_length=64)
    accuracy = sum(c > r for c, r in zip(chosen, rejected)) / len(chosen)
    assert accuracy == pytest.approx(m["rm/proxy/eval/accuracy"], abs=1e-9)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id == 0
    assert model.config.n_embd == 32  # the SFT policy's backbone (tests.tiny_models), not the 'tiny' preset's 48
    assert stage.result["counts"] == {"n_train_pairs": 160, "n_heldout_pairs": 64, "n_cross_eval_pairs": 160}


def test_both_models_are_registered_with_lineage_and_the_candidate_alias(stage: Artifact,
                                                                         harness: StageHarness) -> None:
    client, names = MlflowClient(), harness.names
    entry = harness.active.stage(LABEL)
    assert entry.status == "completed" and entry.key == stage.key and entry.cached_from is None
    assert entry.models == {"proxy": f"models:/{names.reward_model}/1",
                            "heldout": f"models:/{names.heldout_reward_model}/1"}
    for role, name in (("proxy", names.reward_model), ("heldout", names.heldout_reward_model)):
        version = client.get_model_version_by_alias(name, "candidate")
        assert int(version.version) == 1 and version.run_id == entry.mlflow_run_id
        assert int(client.get_model_version_by_alias(name, "champion").version) == 1  # the first RM of the name
        lineage = {k: v for k, v in version.tags.items() if k.startswith("rlhf.")}
        assert lineage == {"rlhf.run_id": harness.run_id, "rlhf.stage": LABEL, "rlhf.role": role,
                           "rlhf.artifact_key": stage.identity(), "rlhf.produced_by": harness.run_id}
        # its evaluation on the held-out pairs, in the registry
        accuracy = stage.result["metrics"][f"rm/{role}/eval/accuracy"]
        assert float(version.tags["eval.accuracy"]) == pytest.approx(accuracy, abs=1e-3)
    assert (stage.path("proxy") / "config.json").is_file() and (stage.path("heldout") / "tokenizer.json").is_file()


def test_the_nested_run_holds_params_curves_plots_and_metrics(stage: Artifact, harness: StageHarness) -> None:
    client, metrics = MlflowClient(), stage.result["metrics"]
    run = harness.mlflow_run(LABEL)
    run_id = run.info.run_id
    assert run.data.tags["mlflow.parentRunId"] == harness.parent_run_id and run.data.tags["rlhf.stage"] == LABEL
    assert run.data.tags["rlhf.run_id"] == harness.run_id and run.data.tags["rlhf.artifact_key"] == stage.identity()
    assert run.data.params["reward_model.init"] == "sft"
    assert run.data.params["reward_model.training.epochs"] == "4"
    assert run.data.params["inputs.n_train_pairs"] == "160"
    assert run.data.metrics["rm/proxy/eval/accuracy"] == pytest.approx(metrics["rm/proxy/eval/accuracy"])
    steps = int(metrics["rm/proxy/train/steps"])  # 4 epochs x ceil(160 / 16)
    assert steps == 40
    assert len(client.get_metric_history(run_id, "rm/proxy/train/loss")) == steps
    evals = client.get_metric_history(run_id, "rm/heldout/eval/accuracy")
    # Evaluations during training, the last at the held-out RM's own final step (4 epochs x 64 / 16 pairs).
    assert len(evals) >= 4 and max(e.step for e in evals) == metrics["rm/heldout/train/steps"] == 16
    assert max(evals, key=lambda e: e.step).value == metrics["rm/heldout/eval/accuracy"]
    plots = {Path(a.path).name for a in client.list_artifacts(run_id, "plots")}
    assert plots == {"rm_proxy_loss.png", "rm_heldout_loss.png", SCORES_PNG} == set(stage.result["plots"])
    assert all(stage.path(name).read_bytes().startswith(b"\x89PNG") for name in plots)
    assert "metrics.json" in {a.path for a in client.list_artifacts(run_id)}
    record = json.loads(stage.path(stage.result["metrics_file"]).read_text())
    assert record["metrics"] == pytest.approx(metrics)
    assert {"rm/proxy/eval/accuracy", "rm/proxy/eval/margin_mean", "rm/proxy/eval/score_mean",
            "rm/proxy/eval/score_std", "rm/heldout/eval/accuracy", "rm/cross/agreement"} <= set(record["metrics"])


def test_the_stage_starts_from_a_registered_reward_model(stage: Artifact, harness: StageHarness,
                                                         inputs: reward_model.Inputs) -> None:
    proxy_uri = harness.active.stage(LABEL).models["proxy"]
    # init = the proxy's models:/ URI: no SFT policy needed, the tokenizer comes with the model.
    cfg = reward_model.Config.of(tiny_config(f"reward_model.init={proxy_uri}", "reward_model.training.epochs=1",
                                             "reward_model.heldout.epochs=1"))
    rm_inputs = reward_model.Inputs.of(cfg, inputs.data, inputs.sft)
    assert rm_inputs.sft is None
    name = harness.names.reward_model
    expected = f"models:/{name}/{latest_version(name) + 1}"
    art = harness.run(reward_model, "reward-model-from-registry", cfg, rm_inputs)
    assert art.key != stage.key and art.record.config["reward_model"]["init"] == proxy_uri
    assert harness.active.stage("reward-model-from-registry").models["proxy"] == expected
    # Started from a model that already knows the rule: the held-out RM is good before much training.
    metrics = art.result["metrics"]
    assert metrics["rm/proxy/eval/accuracy"] >= 0.85 and metrics["rm/heldout/eval/accuracy"] >= 0.85
    assert metrics["rm/proxy/train/steps"] == 10  # 1 epoch x ceil(160 / 16)


def test_scratch_init_builds_the_configured_size(harness: StageHarness, inputs: reward_model.Inputs) -> None:
    cfg = reward_model.Config.of(tiny_config("reward_model.init=scratch", "reward_model.training.epochs=2",
                                             "reward_model.heldout.epochs=1"))
    assert cfg.model_size == "tiny"  # sft.model_size, read only for a model built from scratch
    art = harness.run(reward_model, "reward-model-scratch", cfg, inputs)
    proxy, held = (load_reward_model(reward_model.model_input(art, role).path) for role in ("proxy", "heldout"))
    assert proxy.config.n_embd == held.config.n_embd == 48 and proxy.config.n_layer == 2
    assert art.result["metrics"]["rm/proxy/eval/accuracy"] >= 0.85


def test_an_encoder_and_a_base_decoder_start_the_two_reward_models(harness: StageHarness, inputs: reward_model.Inputs,
                                                                     tmp_path: Path) -> None:
    """Through configuration alone: the proxy starts from a 2-label BERT classifier (WordPiece tokenizer, no eos), the
    held-out RM from a bare GPT-2 backbone (byte-level BPE, no pad). Each gets a fresh scalar head and keeps its own
    tokenizer, with eos / pad filled in; both learn the planted rule and score what they are given."""
    bert = model_families.save_reward_model("bert", tmp_path / "bert", num_labels=2)
    gpt2 = model_families.save_base_model("gpt2", tmp_path / "gpt2")
    cfg = reward_model.Config.of(tiny_config(f"reward_model.init={bert}", f"reward_model.heldout_init={gpt2}",
                                             "reward_model.training.max_length=128",
                                             "reward_model.heldout.max_length=128"))
    rm_inputs = reward_model.Inputs.of(cfg, inputs.data, inputs.sft)
    assert rm_inputs.sft is None  # neither init reads the SFT policy
    art = harness.run(reward_model, "reward-model-byo", cfg, rm_inputs)
    proxy_dir, held_dir = (reward_model.model_input(art, role).path for role in ("proxy", "heldout"))
    proxy, held = load_reward_model(proxy_dir), load_reward_model(held_dir)
    assert type(proxy).__name__ == "BertForSequenceClassification" and proxy.config.num_labels == 1
    assert type(held).__name__ == "GPT2ForSequenceClassification" and held.config.num_labels == 1
    proxy_tok, held_tok = AutoTokenizer.from_pretrained(proxy_dir), AutoTokenizer.from_pretrained(held_dir)
    assert (proxy_tok.eos_token, proxy_tok.bos_token, proxy_tok.pad_token) == ("[SEP]", "[CLS]", "[PAD]")
    assert held_tok.pad_token == held_tok.eos_token == "<|endoftext|>"
    metrics = art.result["metrics"]
    assert metrics["rm/proxy/eval/accuracy"] >= 0.8 and metrics["rm/heldout/eval/accuracy"] >= 0.8
    # The saved encoder scores a pair the same way the stage measured it (the [CLS] layout travels with it).
    pairs = read_pairs(inputs.data.path("heldout_pairs.parquet"))[:16]
    chosen, rejected = pair_scores(proxy, proxy_tok, pairs, 128)
    assert sum(c > r for c, r in zip(chosen, rejected)) >= 12


def test_missing_or_empty_tables_fail_naming_the_file(harness: StageHarness, files: SimpleNamespace,
                                                      inputs: reward_model.Inputs) -> None:
    cfg = reward_model.Config.of(tiny_config())
    missing = harness.artifact("data-prep", {"heldout_pairs.parquet": files.heldout},
                               {"train_pairs": "nope/train_pairs.parquet", "heldout_pairs": "heldout_pairs.parquet"})
    empty = pairs_artifact(harness, files.train, files.empty)
    cases = [("rm-missing", reward_model.Inputs(missing, inputs.sft), FileNotFoundError,
              r"nope/train_pairs\.parquet does not exist; run the data-prep"),
             ("rm-empty", reward_model.Inputs(empty, inputs.sft), ValueError, r"heldout_pairs\.parquet has no rows"),
             ("rm-no-sft", reward_model.Inputs(inputs.data, None), ValueError,
              r"reward_model.init='sft' needs the SFT policy")]
    for label, rm_inputs, error, message in cases:
        with pytest.raises(error, match=message):
            harness.run(reward_model, label, cfg, rm_inputs)
        entry = harness.active.stage(label)
        assert entry.status == "failed" and entry.error.startswith(error.__name__) and entry.models == {}
        assert harness.store.artifact(reward_model.NAME, entry.key) is None  # nothing published


def test_a_later_run_reuses_the_artifact_and_registers_it_without_a_second_upload(
        stage: Artifact, harness: StageHarness, inputs: reward_model.Inputs, files: SimpleNamespace) -> None:
    client, names, first_run = MlflowClient(), harness.names, harness.run_id
    cfg = reward_model.Config.of(tiny_config())
    roles = {"proxy": names.reward_model, "heldout": names.heldout_reward_model}
    new = {role: latest_version(name) + 1 for role, name in roles.items()}
    later = StageHarness(files.root / "state", names=names)
    try:
        reused = later.run(reward_model, LABEL, cfg, inputs)
        assert (reused.key, reused.record.produced_by) == (stage.key, first_run) and later.run_id != first_run
        entry = later.active.stage(LABEL)
        assert entry.cached_from == first_run and entry.status == "completed"
        assert entry.models == {role: f"models:/{name}/{new[role]}" for role, name in roles.items()}
        for role, name in roles.items():
            version = client.get_model_version(name, str(new[role]))
            assert version.tags["rlhf.cached_from"] == first_run and version.tags["rlhf.run_id"] == later.run_id
            assert version.tags["rlhf.produced_by"] == first_run and version.tags["rlhf.role"] == role
            assert version.source == client.get_model_version(name, "1").source  # the first run's upload
            assert version.run_id == entry.mlflow_run_id
            assert int(client.get_model_version_by_alias(name, "candidate").version) == new[role]
            assert int(client.get_model_version_by_alias(name, "champion").version) == 1  # kept
        run = later.mlflow_run(LABEL)
        assert run.data.tags["rlhf.cached_from"] == first_run
        assert run.data.metrics["rm/cross/agreement"] == stage.result["metrics"]["rm/cross/agreement"]
        # The curves of the run that computed it, replayed into this run's stage run.
        assert len(client.get_metric_history(run.info.run_id, "rm/proxy/train/loss")) == 40

        # Again in the same run: the stage is done there, nothing new is registered.
        assert later.run(reward_model, LABEL, cfg, inputs) == reused
        # A publication that died half-way (entry not completed) publishes again into the same MLflow run: the
        # versions it registered are found, not registered twice.
        later.active.stage_update(LABEL, status="failed")
        assert later.run(reward_model, LABEL, cfg, inputs) == reused
        assert later.active.stage(LABEL).models == entry.models
        assert later.active.stage(LABEL).mlflow_run_id == entry.mlflow_run_id
        assert {role: latest_version(name) for role, name in roles.items()} == new
    finally:
        later.close()


@pytest.mark.parametrize("error, retried", [
    (ValueError("bad setting"), False), (FileNotFoundError("gone"), False), (KeyError("column"), False),
    (DataError("bad table"), False), (RuntimeError("bug"), False), (ConnectionError("reset"), True),
    (TimeoutError("slow"), True), (None, False),
    (MlflowException("database is locked", error_code=TEMPORARILY_UNAVAILABLE), True),
    (MlflowException("no such model", error_code=RESOURCE_DOES_NOT_EXIST), False),
    (MlflowException("a bug, default code"), False),
])
def test_retries_only_transient_io_and_registry_errors(error: BaseException | None, retried: bool) -> None:
    assert is_transient(error) is retried
    if error is not None:
        assert retry_on_transient_io(reward_model_task, None, Failed(data=error)) is retried
    assert reward_model_task.retries == 1 and reward_model_task.retry_condition_fn is retry_on_transient_io


def test_an_ensemble_trains_members_that_register_and_score_as_one_model(stage: Artifact, harness: StageHarness,
                                                                          inputs: reward_model.Inputs) -> None:
    """reward_model.ensemble_size=3: member 0 is the proxy a single-model stage trains (same seed, same weights),
    members 1-2 train with seeds 1-2; the folder is one registered version; as a scorer the members' scores are
    aggregated as ppo.reward.ensemble says; the stage reports the ensemble's accuracy and disagreement."""
    from rlhf_core.models.scoring import EnsembleScorer
    from rlhf_core.models.sequences import Rollout
    from tasks.models import reward_members, reward_scorer
    from tasks.runtime import Runtime

    cfg = tiny_config("reward_model.ensemble_size=3")
    art = harness.run(reward_model, "reward-model-ensemble", reward_model.Config.of(cfg), inputs)
    folder = reward_model.model_input(art, "proxy").path
    members = reward_members(folder)
    assert [m.name for m in members] == ["member-0", "member-1", "member-2"]
    single = load_reward_model(reward_model.model_input(stage, "proxy").path).state_dict()
    first = load_reward_model(str(members[0])).state_dict()
    assert all(torch.equal(single[k], first[k]) for k in single)
    other = load_reward_model(str(members[1])).state_dict()
    assert not torch.equal(first["score.weight"], other["score.weight"])
    m = art.result["metrics"]
    assert m["rm/proxy/ensemble/size"] == 3 and m["rm/proxy/ensemble/eval/accuracy"] >= 0.85
    assert m["rm/proxy/ensemble/eval/disagreement"] > 0
    assert {"rm/proxy_1/eval/accuracy", "rm/proxy_2/eval/accuracy"} <= m.keys()
    version = MlflowClient().get_model_version_by_alias(harness.names.reward_model, "candidate")
    assert harness.active.stage("reward-model-ensemble").models["proxy"] == \
        f"models:/{harness.names.reward_model}/{version.version}"
    assert version.tags["rlhf.ensemble_size"] == "3"
    assert float(version.tags["eval.accuracy"]) == pytest.approx(m["rm/proxy/ensemble/eval/accuracy"], abs=1e-3)

    tokenizer = AutoTokenizer.from_pretrained(members[0])
    ids = torch.tensor([tokenizer(" q good a", add_special_tokens=False)["input_ids"]] * 2)
    rollout = Rollout(ids[:, :1], torch.ones(2, 1, dtype=torch.bool), ids[:, 1:], torch.ones_like(ids[:, 1:]).bool(),
                      torch.zeros(ids[:, 1:].shape), torch.tensor([False, False]))
    runtime = Runtime("cpu", "float32")
    means = reward_scorer(runtime, folder, tokenizer, 64, 8)
    assert isinstance(means, EnsembleScorer) and len(means.members) == 3
    each = means.member_scores(rollout)
    assert torch.allclose(means(rollout), each.mean(dim=0))
    worst = reward_scorer(runtime, folder, tokenizer, 64, 8, ensemble="min")
    assert torch.equal(worst(rollout), each.min(dim=0).values)
    cautious = reward_scorer(runtime, folder, tokenizer, 64, 8, ensemble="mean_minus_std", ensemble_coef=2.0)
    assert torch.allclose(cautious(rollout), each.mean(dim=0) - 2 * each.std(dim=0, unbiased=False))


def test_the_heldout_model_also_learns_labelled_replies_of_the_sft_policy(harness: StageHarness,
                                                                          inputs: reward_model.Inputs) -> None:
    """reward_model.heldout_onpolicy_pairs=12: two replies of the SFT policy to each of 12 drawn prompts, labelled by
    the simulated annotator, join the held-out RM's training pairs (and the artifact, for people to read); the proxy
    never sees them. Without the setting the stage needs no SFT policy for them."""
    cfg = reward_model.Config.of(tiny_config("reward_model.heldout_onpolicy_pairs=12"))
    assert cfg.heldout_onpolicy is not None and cfg.heldout_onpolicy.n_pairs == 12
    art = harness.run(reward_model, "reward-model-onpolicy", cfg, reward_model.Inputs.of(cfg, inputs.data, inputs.sft))
    labelled = read_pairs(art.path(reward_model.ONPOLICY_FILE))
    n = art.result["counts"]["n_heldout_onpolicy_pairs"]
    assert 0 < n == len(labelled) <= 12 and all(p.chosen != p.rejected for p in labelled)
    prompts = {p.prompt for p in read_pairs(inputs.data.path("train_pairs.parquet"))} | \
        {p.prompt for p in read_pairs(inputs.data.path("heldout_pairs.parquet"))}
    assert {p.prompt for p in labelled} <= prompts
    m = art.result["metrics"]
    assert m["rm/heldout/train/steps"] == 4 * math.ceil((64 + n) / 16)  # held-out pairs + on-policy pairs
    assert m["rm/proxy/train/steps"] == 40  # the proxy's training is untouched
    with pytest.raises(ValueError, match="reward_model.heldout_onpolicy_pairs needs data.source='demo'"):
        tiny_config("reward_model.heldout_onpolicy_pairs=12", "data.source=files", "data.files=[x.jsonl]",
                    "refresh.enabled=false")
