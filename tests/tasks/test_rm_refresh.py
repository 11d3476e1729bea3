"""The rm-refresh stage on tiny models with a planted rule, run as the flow runs it (tests/stage_harness.py). Its
labelling round trip is in test_refresh_labelling.py, the pure refresh rules in tests/unit/test_refresh_rules.py.

A judge reward model learns the rule ("good" in a reply is better, "bad" is worse). The proxy PPO would use is
the judge with its score head negated: exactly wrong about the rule, so it orders every judged on-policy pair
the wrong way. Refreshing it on pairs of a (random) tiny policy labelled by the judge must fix that on
on-policy pairs it never trained on; promotion then follows the held-out accuracy.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from mlflow import MlflowClient
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel, PreTrainedTokenizerFast

from rlhf_core.config import RewardTrainingConfig
from rlhf_core.data import PPO_PROMPTS, PREFERENCE_PAIRS, prompt_id
from rlhf_core.demo import SimulatedAnnotator
from rlhf_core.evaluation.annotators import PerPairAnnotator, ReplyPair, RewardModelJudge
from rlhf_core.models.roles import load_reward_model
from rlhf_core.training.reward_training import train_reward_model
from rlhf_core.data.records import PreferencePair
from tasks import rm_refresh, tracking
from tasks.config import ConfigError, PipelineConfig, load_config
from tasks.io import read_pairs, read_parquet, write_parquet
from tasks.retries import is_transient
from tasks.rm_refresh import Config, Inputs, LabelsPendingError, Result, build_annotator
from tasks.run_store import Artifact
from tasks.stage import METRICS_LOG
from tests.stage_harness import StageHarness
from tests.tiny_models import WORDS, gpt2_config, word_tokenizer

FILLER = [w for w in WORDS if w not in ("good", "bad", "q")]
CHAMPION = "champion"


# --------------------------------------------------------------------------------------------- the stage


def planted_pairs(n: int, seed: int) -> list[PreferencePair]:
    """Chosen replies hold "good" and rejected ones "bad", among random filler words."""
    rng = random.Random(seed)

    def reply(marker: str) -> str:
        words = rng.sample(FILLER, rng.randint(2, 6))
        words.insert(rng.randint(0, len(words)), marker)
        return " " + " ".join(words)

    return [PreferencePair("q " + " ".join(rng.sample(FILLER, 3)), reply("good"), reply("bad")) for _ in range(n)]


def rule_heavy_policy(tokenizer: PreTrainedTokenizerFast, boost: float = 1.75) -> GPT2LMHeadModel:
    """A random tiny GPT whose replies are full of "good" and "bad" (each about 15% of tokens): a policy that
    went for the words its proxy reacts to, so most fresh pairs differ in exactly what the proxy gets wrong."""
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(gpt2_config(len(tokenizer), tie_word_embeddings=False))
    with torch.no_grad():
        policy.transformer.ln_f.bias[0] = 5.0  # a constant feature on every position ...
        policy.lm_head.weight[:, 0] = 0.0
        for word in ("good", "bad"):  # ... that only these two words read: +boost on their logits
            policy.lm_head.weight[tokenizer.convert_tokens_to_ids(word), 0] = boost / 5.0
    return policy


def _table(pairs: list[PreferencePair], path: Path) -> str:
    rows = [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected, "margin": None, "source_file": "planted",
             "source_row": i, "pair_id": f"p{i}"} for i, p in enumerate(pairs)]
    return write_parquet(rows, PREFERENCE_PAIRS, path)


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StageHarness]:
    harness = StageHarness(tmp_path_factory.mktemp("rm-refresh") / "state")
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def inputs(harness: StageHarness, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Model folders, tables, and the artifacts the stage reads: data-prep (two variants), policy, proxy, judge."""
    root = tmp_path_factory.mktemp("refresh-inputs")
    tokenizer = word_tokenizer()
    rule_heavy_policy(tokenizer).save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")
    torch.manual_seed(1)
    judge = GPT2ForSequenceClassification(gpt2_config(len(tokenizer), num_labels=1))
    train_reward_model(judge, tokenizer, planted_pairs(160, seed=1), [],
                       RewardTrainingConfig(epochs=4, batch_size=16, learning_rate=3e-3, max_length=64))
    for name, sign in (("judge", 1.0), ("proxy", -1.0)):
        with torch.no_grad():
            judge.score.weight.mul_(sign)  # the proxy is the judge turned upside down: wrong on every pair
        judge.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    heldout = planted_pairs(48, seed=2)
    prompts = ["q " + " ".join(random.Random(i).sample(FILLER, 3)) for i in range(80)]
    train = _table(planted_pairs(64, seed=3), root / "train_pairs.parquet")
    ppo_prompts = write_parquet([{"prompt": p, "prompt_id": prompt_id(p)} for p in prompts], PPO_PROMPTS,
                                root / "ppo_prompts.parquet")

    def data(heldout_pairs: str) -> Artifact:
        files = {"train_pairs.parquet": train, "heldout_pairs.parquet": heldout_pairs,
                 "ppo_prompts.parquet": ppo_prompts}
        return harness.artifact("data-prep", files, {"train_pairs": "train_pairs.parquet",
                                                     "heldout_pairs": "heldout_pairs.parquet",
                                                     "ppo_prompts": "ppo_prompts.parquet"})

    return SimpleNamespace(
        root=root, policy_dir=str(root / "policy"), judge_dir=str(root / "judge"), train=train,
        data=data(_table(heldout, root / "heldout_pairs.parquet")),
        # held-out pairs that agree with the upside-down proxy: learning the judge's rule must lose them
        data_flipped=data(_table([PreferencePair(p.prompt, p.rejected, p.chosen) for p in heldout],
                                 root / "heldout_flipped.parquet")),
        policy=harness.model("ppo-iteration", root / "policy"), proxy=harness.model("reward-model", root / "proxy"),
        judge=harness.model("reward-model", root / "judge"))


def refresh_config(*extra: str) -> PipelineConfig:
    return load_config(preset="tiny", overrides=[
        "device=cpu", "refresh.annotator=rm_judge", "refresh.n_pairs=144", "refresh.on_policy_eval_fraction=0.35",
        "refresh.epochs=6", "refresh.learning_rate=0.003", "refresh.keep_old_pairs=false",
        "reward_model.training.max_length=64", "reward_model.heldout.max_length=64",
        "ppo.generation.max_new_tokens=12", "ppo.generation.batch_size=48", *extra])


def refresh(harness: StageHarness, label: str, cfg: Config, inputs: SimpleNamespace, data: Artifact | None = None,
            earlier: tuple[Artifact, ...] = ()) -> tuple[Artifact, Result]:
    """rm-refresh on the policy and proxy; the judge is the default rm_judge: the held-out RM input."""
    stage_inputs = Inputs.of(cfg, data or inputs.data, inputs.policy, inputs.proxy, inputs.judge, earlier)
    artifact = harness.run(rm_refresh, label, cfg, stage_inputs)
    return artifact, rm_refresh.STAGE.result(artifact)


def registered(harness: StageHarness, label: str) -> int:
    """The reward-model version stage ``label`` registered in this run."""
    return tracking.parse_model_uri(harness.active.stage(label).models["reward_model"]).version


def alias(harness: StageHarness, name: str) -> int | None:
    return tracking.get_alias_version(harness.names.reward_model, name)


@pytest.fixture(scope="module")
def promoted(harness: StageHarness, inputs: SimpleNamespace) -> tuple[Artifact, Result]:
    """Fresh pairs only (no replay), judged by the held-out RM input."""
    return refresh(harness, "rm-refresh-1", Config.of(refresh_config(), 1), inputs)


def test_refresh_fixes_the_proxy_on_on_policy_pairs_it_never_saw(promoted: tuple[Artifact, Result],
                                                                 inputs: SimpleNamespace) -> None:
    artifact, result = promoted
    m = result.metrics
    # measured: on-policy accuracy 0.000 -> 0.814 (43 eval pairs on unseen prompts), held-out 0.000 -> 1.000
    assert m["refresh/onpolicy_accuracy_before"] <= 0.05  # the upside-down proxy disagrees with every judge label
    assert m["refresh/onpolicy_accuracy_after"] >= 0.6  # 0.65-0.80 over judge seeds 0-3
    assert m["refresh/heldout_accuracy_after"] > m["refresh/heldout_accuracy_before"] + 0.5
    assert m["refresh/n_onpolicy_eval"] >= 15 and m["refresh/n_old_replayed"] == 0
    # every sampled pair is used or skipped with a reason (here: replies the policy ended at once)
    assert m["refresh/n_sampled"] == 144 == m["refresh/n_new_pairs"] + m["refresh/n_skipped"] + m["labels/quarantined"]
    assert m["refresh/skipped/empty_text"] == m["refresh/n_skipped"] > 0 and m["labels/quarantined"] == 0
    assert m["refresh/n_new_pairs"] == m["refresh/n_train_new"] + m["refresh/n_onpolicy_eval"]
    assert 0.2 < m["refresh/label_a_fraction"] < 0.8
    # data.source is 'demo' here, so the eval pairs are also judged by gold (a report, never a training label)
    gold = {f"refresh/onpolicy_gold_{k}_{w}" for k in ("accuracy", "loss", "margin") for w in ("before", "after")}
    assert gold <= set(m)
    assert 0.0 <= m["refresh/onpolicy_gold_accuracy_before"] <= 1.0
    train = read_parquet(artifact.path(result.train_pairs), PREFERENCE_PAIRS)
    held = read_parquet(artifact.path(result.eval_pairs), PREFERENCE_PAIRS)
    assert (len(train), len(held)) == (m["refresh/n_train_new"], m["refresh/n_onpolicy_eval"])
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}  # eval prompts never trained on
    # the saved model is the one measured: the judge agrees with it on its own on-policy eval pairs
    model = load_reward_model(str(artifact.path(result.reward_model))).eval()
    judge = RewardModelJudge(model, word_tokenizer(), max_length=64)
    assert sum(judge.label([ReplyPair(r["prompt"], r["chosen"], r["rejected"]) for r in held])) / len(held) == \
        pytest.approx(m["refresh/onpolicy_accuracy_after"], abs=1e-6)
    assert (result.iteration, result.promoted, m["refresh/promoted"]) == (1, True, 1.0)


def test_a_better_refresh_is_registered_and_becomes_champion(harness: StageHarness,
                                                             promoted: tuple[Artifact, Result]) -> None:
    artifact, result = promoted
    client = MlflowClient()
    version = registered(harness, "rm-refresh-1")
    assert alias(harness, "candidate") == alias(harness, CHAMPION) == version
    model_version = client.get_model_version(harness.names.reward_model, str(version))
    assert model_version.tags["rlhf.artifact_key"] == artifact.identity()
    assert (model_version.tags["rlhf.role"], model_version.tags["rlhf.run_id"]) == ("reward_model", harness.run_id)
    run = harness.mlflow_run("rm-refresh-1")
    assert run.info.run_name == "rm-refresh-1" and run.data.tags["mlflow.parentRunId"] == harness.parent_run_id
    assert run.data.tags["refresh.promotion"] == result.reason and result.reason.startswith("promoted")
    assert run.data.params["refresh.annotator"] == "rm_judge" and run.data.params["training.epochs"] == "6"
    base_seed = refresh_config().reward_model.training.seed
    assert run.data.params["iteration"] == "1" and run.data.params["training.seed"] == str(base_seed + 1)
    assert run.data.metrics["refresh/onpolicy_accuracy_after"] == result.metrics["refresh/onpolicy_accuracy_after"]
    assert "refresh/eval/accuracy" in run.data.metrics  # the on-policy curve during training ...
    assert METRICS_LOG in artifact.record.files  # ... kept in the artifact, for runs that reuse it
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "pairs")}
    assert artifacts == {"pairs/refresh_train_pairs.parquet", "pairs/onpolicy_eval_pairs.parquet",
                         "pairs/refresh_quarantine.parquet"}


def test_a_refresh_that_loses_held_out_accuracy_is_registered_but_not_promoted(
        harness: StageHarness, inputs: SimpleNamespace, promoted: tuple[Artifact, Result]) -> None:
    champion = alias(harness, CHAMPION)  # the promoted refresh above
    cfg = Config.of(refresh_config("refresh.keep_old_pairs=true", "refresh.old_pairs_ratio=0.5"), 1)
    kept, result = refresh(harness, "rm-refresh-1-kept", cfg, inputs, inputs.data_flipped)
    m = result.metrics
    # measured: held-out 1.000 -> 0.000, on-policy 0.000 -> 0.860 (46 old pairs replayed next to 92 fresh)
    assert m["refresh/heldout_accuracy_after"] < m["refresh/heldout_accuracy_before"]
    assert m["refresh/onpolicy_accuracy_after"] > m["refresh/onpolicy_accuracy_before"] + 0.5
    assert m["refresh/n_old_replayed"] == round(0.5 * m["refresh/n_train_new"]) and m["refresh/promoted"] == 0.0
    assert not result.promoted and "not promoted" in result.reason
    version = registered(harness, "rm-refresh-1-kept")
    assert version != champion and alias(harness, CHAMPION) == champion and alias(harness, "candidate") == version
    # The next refresh trains on these labels again even though this refresh was not promoted; this one
    # also holds a quarter of its fresh training prompts back to choose the epoch it keeps.
    validated = Config.of(refresh_config("refresh.keep_old_pairs=true", "refresh.old_pairs_ratio=0.5",
                                         "refresh.validation_fraction=0.25"), 2)
    assert validated.training.select_best_epoch and not cfg.training.select_best_epoch
    again, second = refresh(harness, "rm-refresh-2", validated, inputs, inputs.data_flipped, earlier=(kept,))
    n = second.metrics
    assert n["refresh/n_earlier_refresh_pairs"] == m["refresh/n_train_new"] > 0 and m["refresh/n_validation"] == 0
    wanted = round(0.5 * (n["refresh/n_train_new"] + n["refresh/n_earlier_refresh_pairs"]))
    assert n["refresh/n_old_replayed"] == min(wanted, len(read_pairs(inputs.train)))  # at most all old pairs
    fresh = n["refresh/n_train_new"] + n["refresh/n_validation"] + n["refresh/n_onpolicy_eval"]
    assert n["refresh/n_new_pairs"] == fresh
    assert n["refresh/n_validation"] >= 10 and n["refresh/best_epoch"] in range(7) and m["refresh/best_epoch"] == 6
    # validation pairs are saved with the refresh-train pairs: later refreshes train on every label
    saved = read_parquet(again.path(second.train_pairs), PREFERENCE_PAIRS)
    assert len(saved) == n["refresh/n_train_new"] + n["refresh/n_validation"]
    assert again.record.inputs["earlier"] == [kept.identity()]  # the earlier refresh is part of the key
    history = MlflowClient().get_metric_history(harness.mlflow_run("rm-refresh-2").info.run_id, "refresh/eval/loss")
    assert min(h.step for h in history) == 0 and len(history) >= 7  # validation loss before training, each epoch


def test_file_annotator_exports_then_the_same_stage_with_labels_file_trains_on_them(
        harness: StageHarness, inputs: SimpleNamespace, tmp_path: Path) -> None:
    label = "rm-refresh-2-file"
    cfg = Config.of(refresh_config("refresh.annotator=file"), 2)
    stage_inputs = Inputs.of(cfg, inputs.data, inputs.policy, inputs.proxy, inputs.judge)
    assert stage_inputs.judge is None and cfg.labels_file is None  # people label; no judge model is read
    with pytest.raises(LabelsPendingError, match="refresh.labels_file=") as caught:
        harness.run(rm_refresh, label, cfg, stage_inputs)
    exported = Path(caught.value.exported_path)
    assert exported.name == "unlabelled_pairs.csv" and str(exported) in str(caught.value)
    assert not is_transient(caught.value)  # Prefect does not retry it: only people can help
    assert harness.store.layout.work in exported.parents  # a scratch folder of the store, not the artifact's
    assert (exported.parent / rm_refresh.SKIPPED_FILE).is_file()
    pending = harness.active.stage(label)
    assert pending.status == "failed" and pending.error.startswith("LabelsPendingError: ")
    assert harness.store.artifact(rm_refresh.NAME, pending.key) is None
    frame = pd.read_csv(exported, keep_default_na=False)
    assert len(frame) >= 60 and set(frame["label"]) == {""}
    # people label with the judge's preferences; two rows are left empty
    judge = RewardModelJudge(load_reward_model(inputs.judge_dir).eval(), word_tokenizer(), max_length=64)
    pairs = [ReplyPair(*row) for row in frame[["prompt", "reply_a", "reply_b"]].itertuples(index=False)]
    frame["label"] = ["a" if a else "b" for a in judge.label(pairs)]
    frame.loc[[3, 7], "label"] = ""
    frame.to_csv(tmp_path / "labelled_2.csv", index=False)
    # resumed with refresh.labels_file set ('{iteration}' filled in): the export it reads is the same file
    resumed = Config.of(refresh_config("refresh.annotator=file", f"refresh.labels_file={tmp_path}/labelled_"
                                       "{iteration}.csv"), 2)
    assert resumed.labels_file == str(tmp_path / "labelled_2.csv")
    assert rm_refresh._export_identity(resumed, stage_inputs) == rm_refresh._export_identity(cfg, stage_inputs)
    artifact = harness.run(rm_refresh, label, resumed, stage_inputs)
    result = rm_refresh.STAGE.result(artifact)
    assert harness.active.stage(label).key != pending.key  # the labels are part of the key
    m = result.metrics  # measured: on-policy accuracy 0.000 -> 0.851 (47 eval pairs), held-out 0.000 -> 1.000
    assert m["labels/rows_in"] == len(frame) and m["labels/quarantined"] == m["labels/quarantined/missing_label"] == 2
    assert m["refresh/n_new_pairs"] == m["labels/accepted"] == len(frame) - 2
    assert m["refresh/n_sampled"] == 144 == len(frame) + m["refresh/n_skipped"]  # skipped before the export
    reasons = pd.read_parquet(artifact.path(result.quarantine))["reason"].value_counts().to_dict()
    assert reasons == {"missing_label": 2, **({"empty_text": m["refresh/n_skipped"]} if m["refresh/n_skipped"] else {})}
    assert m["refresh/onpolicy_accuracy_before"] <= 0.05 and m["refresh/onpolicy_accuracy_after"] >= 0.6
    assert result.promoted and alias(harness, CHAMPION) == registered(harness, label)


def test_the_file_annotator_without_an_export_and_the_annotator_choice(harness: StageHarness,
                                                                      inputs: SimpleNamespace,
                                                                      tmp_path: Path) -> None:
    cfg = Config.of(refresh_config("refresh.annotator=file", f"refresh.labels_file={tmp_path}/labels.csv"), 1)
    policy = harness.model("ppo-iteration", inputs.policy_dir)  # a policy nothing was exported for
    stage_inputs = Inputs.of(cfg, inputs.data, policy, inputs.proxy, inputs.judge)
    with pytest.raises(FileNotFoundError, match=r"no pairs were exported for iteration 1 .*unlabelled_pairs\.csv"):
        harness.run(rm_refresh, "rm-refresh-no-export", cfg, stage_inputs)
    simulated = build_annotator(Config.of(load_config(preset="tiny", overrides=["refresh.annotator_temperature=0.5"]),
                                          1), stage_inputs)
    assert isinstance(simulated, PerPairAnnotator) and isinstance(simulated.labeller, SimulatedAnnotator)
    assert simulated.labeller.temperature == 0.5
    with pytest.raises(ValueError, match="labels through files"):
        build_annotator(cfg, stage_inputs)
    assert rm_refresh.rm_refresh_task.name == "rm-refresh" and rm_refresh.rm_refresh_task.retries == 1


def test_config_slice_reads_the_refresh_section_and_only_the_judge_settings_it_needs() -> None:
    judged = Config.of(refresh_config("refresh.epochs=3", "reward_model.training.seed=7"), 4)
    assert (judged.iteration, judged.training.epochs, judged.training.seed) == (4, 3, 7 + 4)
    assert (judged.judge_max_length, judged.judge_batch_size) == (64, refresh_config().eval.batch_size)
    simulated = Config.of(load_config(preset="tiny"), 4)
    assert (simulated.judge_max_length, simulated.judge_batch_size, simulated.labels_file) == (None, None, None)
    assert simulated.gold  # the tiny preset is the demo task


def test_refresh_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="labels_file is read only with refresh.annotator='file'"):
        load_config(preset="tiny", overrides=["refresh.labels_file=x.csv"])
    with pytest.raises(ConfigError, match=r"'refresh.on_policy_eval_fraction' .*: must be in \(0, 1\)"):
        load_config(preset="tiny", overrides=["refresh.on_policy_eval_fraction=1.0"])
    with pytest.raises(ConfigError, match="validation_fraction"):
        load_config(preset="tiny", overrides=["refresh.validation_fraction=1.0"])
    cfg = load_config(preset="tiny", overrides=["data.source=files", "data.files=[a.csv]", "refresh.annotator=file"])
    assert cfg.refresh.enabled  # user data can be refreshed by people or a judge, not by the demo's annotator
    with pytest.raises(ConfigError, match="refresh.annotator='simulated' needs data.source='demo'"):
        load_config(preset="tiny", overrides=["data.source=files", "data.files=[a.csv]"])


def test_an_ensemble_proxy_refreshes_every_member(harness: StageHarness, inputs: SimpleNamespace,
                                                  promoted: tuple[Artifact, Result]) -> None:
    """A two-member proxy ensemble (both the upside-down proxy): each member trains on the same fresh pairs with its
    own seed, the refreshed folder is an ensemble again, member 0's numbers are the single proxy's (same seed, same
    pairs), and promotion follows the members' mean held-out accuracy."""
    from tasks.models import reward_members, save_ensemble

    proxy = load_reward_model(str(inputs.root / "proxy"))
    save_ensemble(inputs.root / "proxy-ensemble", [(proxy, word_tokenizer()), (proxy, word_tokenizer())])
    ensemble_input = harness.model("reward-model", inputs.root / "proxy-ensemble")
    cfg = Config.of(refresh_config(), 1)
    artifact = harness.run(rm_refresh, "rm-refresh-ensemble", cfg,
                           Inputs.of(cfg, inputs.data, inputs.policy, ensemble_input, inputs.judge))
    result = rm_refresh.STAGE.result(artifact)
    members = reward_members(artifact.path(result.reward_model))
    assert [m.name for m in members] == ["member-0", "member-1"]
    single, m = promoted[1].metrics, result.metrics
    assert m["refresh/heldout_accuracy_after"] == pytest.approx(single["refresh/heldout_accuracy_after"], abs=1e-6)
    assert m["refresh/onpolicy_accuracy_after"] == pytest.approx(single["refresh/onpolicy_accuracy_after"], abs=1e-6)
    assert "refresh/member_1/heldout_accuracy_after" in m and "refresh/member_1/train_steps" in m
    mean_after = (m["refresh/heldout_accuracy_after"] + m["refresh/member_1/heldout_accuracy_after"]) / 2
    assert m["refresh/ensemble/heldout_accuracy_after"] == pytest.approx(mean_after)
    first = load_reward_model(str(members[0])).state_dict()
    second = load_reward_model(str(members[1])).state_dict()
    assert not all(torch.equal(first[k], second[k]) for k in first)  # their own seeds: their own updates
    assert result.promoted and m["refresh/promoted"] == 1.0
