"""One run identity, one writer, a portable state folder: each fault the run store once had as a test (tiny preset).

Every path to the same work must give the same result and lineage: a Prefect retry continues the same rlhf run, an
upstream rerun gives PPO a fresh start with the new reward model's lineage, runs share artifacts without sharing
folders, a moved state folder resumes, a live run refuses a second writer.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.settings import PREFECT_API_URL, get_current_settings
from transformers import GPT2Config

import tasks.stage
from flows.cli import main
from flows.pipeline import rlhf_pipeline
from tasks.run_store import RunStore
from tests.tiny_models import word_tokenizer

pytestmark = pytest.mark.slow  # long tests: in the slow run (`pytest -q -m slow`; CI runs both)

REPO = Path(__file__).resolve().parents[2]
#: A small tiny run: 2 PPO iterations of 2 updates, a refresh after the first.
TINY = ["ppo.iterations=2", "ppo.updates_per_iteration=2", "ppo.checkpoint_every=1", "data.demo.n_pairs=160",
        "data.demo.n_sft=160"]


def run_cli(*args: str) -> int:
    return main(list(args))


def versions(name: str) -> list:
    return sorted(MlflowClient().search_model_versions(f"name='{name}'"), key=lambda v: int(v.version))


def unique(prefix: str, tmp_path: Path) -> list[str]:
    tag = tmp_path.name.replace("_", "-")[-20:]
    return [f"tracking.experiment={prefix}-{tag}", f"tracking.policy_model={prefix}-policy-{tag}",
            f"tracking.reward_model={prefix}-rm-{tag}", f"tracking.heldout_reward_model={prefix}-heldout-{tag}"]


REAL_RUN_STAGE = tasks.stage.run_stage


def fail_once(monkeypatch: pytest.MonkeyPatch, label: str) -> None:
    """Make stage ``label`` fail in this process (a bad node, a full disk), as a real run would fail."""
    real = tasks.stage.run_stage

    def failing(stage, this_label, *args, **kwargs):
        if this_label == label:
            raise RuntimeError(f"{label}: injected failure")
        return real(stage, this_label, *args, **kwargs)

    monkeypatch.setattr(tasks.stage, "run_stage", failing)


def test_a_prefect_retry_of_a_failed_flow_run_continues_the_same_rlhf_run(tmp_path, mlflow_store, monkeypatch):
    state = tmp_path / "state"
    names = unique("retry", tmp_path)
    fail_once(monkeypatch, "heldout-eval-2")
    with pytest.raises(RuntimeError, match="injected failure"):
        rlhf_pipeline(state_dir=str(state), preset="tiny", overrides=[*TINY, *names])  # as a deployment starts it
    monkeypatch.setattr(tasks.stage, "run_stage", REAL_RUN_STAGE)
    store = RunStore(state)
    (failed,) = store.list_runs()
    assert failed.status == "failed" and "injected failure" in failed.error
    assert "heldout-eval-2" not in failed.stages and failed.stages["ppo-iteration-2"].status == "completed"
    flow_run_id = failed.prefect_flow_run_id

    # `prefect flow-run retry <id>`: same flow run, new attempt in another process.
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO),
           "MLFLOW_TRACKING_URI": mlflow_store}
    retried = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "retry", flow_run_id, "--entrypoint",
                              "flows/pipeline.py:rlhf_pipeline"], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=900)
    assert retried.returncode == 0, retried.stdout[-3000:] + retried.stderr[-3000:]

    (record,) = store.list_runs()  # the same run, not a second one
    assert record.run_id == failed.run_id and record.status == "completed" and record.prefect_flow_run_id == flow_run_id
    assert all(entry.status == "completed" and entry.cached_from is None for entry in record.stages.values())
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    assert flow_run.name == record.run_id and flow_run.state.is_completed()
    task_names = {t.name for t in task_runs}
    assert {"data-prep", "sft", "ppo-iteration-1", "rm-refresh-1", "ppo-iteration-2", "heldout-eval-2"} <= task_names
    parents = MlflowClient().search_runs([MlflowClient().get_experiment_by_name(names[0].split("=")[1]).experiment_id],
                                         f"tags.`rlhf.run_id` = '{record.run_id}' and tags.`rlhf.kind` = 'pipeline'")
    assert [p.info.run_id for p in parents] == [record.mlflow_run_id]
    policy = versions(names[1].split("=")[1])
    assert len(policy) == 3  # SFT + 2 iterations: nothing registered twice
    assert {v.tags["rlhf.run_id"] for v in policy} == {record.run_id}


def test_an_upstream_rerun_gives_ppo_a_fresh_start_with_the_new_lineage(tmp_path, mlflow_store, caplog):
    state = str(tmp_path / "state")
    names = unique("rerun", tmp_path)
    assert run_cli("run", "--preset", "tiny", "--state-dir", state, *TINY, *names) == 0
    store = RunStore(state)
    (before,) = store.list_runs()
    caplog.clear()
    assert run_cli("stage", "reward-model", "--run", before.run_id, "--state-dir", state) == 0
    after = store.load_run(before.run_id)
    assert after.reruns == {"reward-model": 1}
    for label in ("reward-model", "best-of-n", "ppo-iteration-1", "heldout-eval-1", "ppo-iteration-2"):
        assert after.stages[label].key != before.stages[label].key, label
    for label in ("data-prep", "sft"):
        assert after.stages[label].key == before.stages[label].key, label
    assert "resumed PPO" not in caplog.text  # no checkpoint of the old reward model was continued
    rm_key = after.stages["reward-model"].key
    first = store.artifact("ppo-iteration", after.stages["ppo-iteration-1"].key)
    assert first.record.inputs["reward"] == f"reward-model/{rm_key}/proxy"
    assert first.result["steps_done"] == 2  # trained from the SFT policy, not resumed at step 2
    policy_versions = {int(v.version): v for v in versions(names[1].split("=")[1])}
    latest = policy_versions[int(after.stages["ppo-iteration-1"].models["policy"].rsplit("/", 1)[1])]
    assert latest.tags["rlhf.artifact_key"] == f"ppo-iteration/{after.stages['ppo-iteration-1'].key}"
    summary = json.loads(store.summary_file(before.run_id).read_text())
    assert summary["models"]["reward-model"]["proxy"] == after.stages["reward-model"].models["proxy"]


def test_runs_share_artifacts_not_folders(tmp_path, mlflow_store):
    state = tmp_path / "state"
    args = ["run", "--preset", "tiny", *TINY, "refresh.enabled=false", *unique("share", tmp_path)]
    assert run_cli(*args, "--state-dir", str(state)) == 0
    assert run_cli(*args, "--state-dir", str(state)) == 0
    first, second = sorted(RunStore(state).list_runs(), key=lambda r: r.created)
    assert all(entry.cached_from == first.run_id for entry in second.stages.values())
    shutil.rmtree(state / "runs" / first.run_id)  # deleting the run that computed everything breaks nothing
    assert run_cli(*args, "--state-dir", str(state)) == 0
    assert run_cli("resume", second.run_id, "--state-dir", str(state)) == 0
    third = max(RunStore(state).list_runs(), key=lambda r: r.created)
    assert third.status == "completed" and third.stages["ppo-iteration-2"].cached_from == first.run_id


def test_a_moved_state_folder_resumes_with_its_own_mlflow_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # the state folder's own SQLite store, which holds absolute paths
    state, moved = tmp_path / "state", tmp_path / "moved"
    args = ["run", "--preset", "tiny", *TINY, "refresh.enabled=false", *unique("move", tmp_path)]
    fail_once(monkeypatch, "ppo-iteration-2")
    assert run_cli(*args, "--state-dir", str(state)) == 1  # "injected failure", in one line
    monkeypatch.setattr(tasks.stage, "run_stage", REAL_RUN_STAGE)
    (failed,) = RunStore(state).list_runs()
    shutil.move(str(state), moved)
    assert run_cli("resume", failed.run_id, "--state-dir", str(moved)) == 0
    store = RunStore(moved)
    done = store.load_run(failed.run_id)
    assert done.status == "completed" and done.stages["ppo-iteration-1"].status == "completed"
    assert store.artifact("ppo-iteration", done.stages["ppo-iteration-2"].key).record.produced_by == failed.run_id
    # MLflow's records were rebased onto the new place: artifacts logged before the move download from there.
    client = MlflowClient(f"sqlite:///{moved}/mlflow.db")
    sft_run = done.stages["sft"].mlflow_run_id
    assert client.get_run(sft_run).info.artifact_uri.startswith(moved.as_uri())
    local = client.download_artifacts(sft_run, "sft", str(tmp_path / "download"))
    assert (Path(local) / "sft_metrics.json").is_file()
    assert not (tmp_path / "state").exists(), sorted(str(p) for p in (tmp_path / "state").rglob("*"))[:20]


def test_a_second_writer_is_refused_in_one_line(tmp_path, capsys):
    store = RunStore(tmp_path / "state").ensure()
    record = store.create_run("tiny", "name: tiny\n")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom tasks.run_store import RunStore\n"
        f"with RunStore({str(store.root)!r}).hold({record.run_id!r}, 'rlhf resume'):\n"
        "    print('held', flush=True); time.sleep(600)\n")], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert run_cli("resume", record.run_id, "--state-dir", str(store.root)) == 2
        assert run_cli("stage", "sft", "--run", record.run_id, "--state-dir", str(store.root)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 2 and all(f"pid {holder.pid}" in line and "rlhf resume" in line for line in err)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert run_cli("runs", "--state-dir", str(store.root)) == 0
    assert "crashed" in capsys.readouterr().out


def test_nothing_in_the_state_folder_is_a_pickle(tmp_path, mlflow_store):
    state = tmp_path / "state"
    assert run_cli("run", "--preset", "tiny", *TINY, "ppo.iterations=1", *unique("pickle", tmp_path),
                   "--state-dir", str(state)) == 0
    pickles = [p for p in state.rglob("*") if p.is_file() and p.suffix not in (".db", ".safetensors", ".parquet", ".png")
               and p.read_bytes()[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")]
    assert pickles == []
    assert list(state.glob("runs/*/run.json")) and not list(state.glob("prefect/results/*"))
    # A failed flow run's exception is a result Prefect always writes, whatever the persistence setting: JSON.
    broken = tmp_path / "not-a-model"  # passes the checks before the run (a GPT-2 config), fails when sft loads it
    broken.mkdir()
    GPT2Config(n_embd=32, n_layer=1, n_head=2).to_json_file(broken / "config.json")
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    word_tokenizer().save_pretrained(broken)  # data-prep counts lengths with the policy's tokenizer: it loads
    assert run_cli("run", "--preset", "tiny", *TINY, f"sft.base_model={broken}", *unique("pickle", tmp_path),
                   "--state-dir", str(state)) == 1
    storage = Path(get_current_settings().results.local_storage_path)
    written = [p for p in storage.iterdir() if p.is_file()] if storage.is_dir() else []
    assert written and not [p for p in written if '"type": "pickle"' in p.read_text(errors="replace")]


@pytest.mark.slow
def test_two_runs_starting_together_on_a_fresh_state_folder(tmp_path):
    """Both create the MLflow and Prefect databases of an empty folder at once: the init lock serialises it."""
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env["PYTHONPATH"] = str(REPO)
    command = [sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--state-dir", str(state), *TINY,
               "ppo.iterations=1", "refresh.enabled=false"]
    runs = [subprocess.Popen([*command, f"seed={seed}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for seed in (0, 1)]
    outputs = [run.communicate(timeout=900)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], "\n".join(out[-2000:] for out in outputs)
    records = RunStore(state).list_runs()
    assert len(records) == 2 and {r.status for r in records} == {"completed"}
    assert (state / "mlflow.db").is_file() and (state / "prefect" / "prefect.db").is_file()


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['PLANTED_MARKER']}",))


def test_a_planted_pickle_never_runs_and_the_cli_says_which_file(tmp_path, mlflow_store, monkeypatch, capsys):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("PLANTED_MARKER", str(marker))
    state = tmp_path / "state"
    assert run_cli("run", "--preset", "tiny", *TINY, "ppo.iterations=1", "refresh.enabled=false",
                   *unique("plant", tmp_path), "--state-dir", str(state)) == 0
    store = RunStore(state)
    (record,) = store.list_runs()
    capsys.readouterr()
    # Where a stage's record was (the SFT artifact every later stage reads): refused by name, nothing unpickled.
    sft_record = state / "artifacts" / "sft" / record.stages["sft"].key / "record.json"
    sft_record.write_bytes(pickle.dumps(_Exploit()))
    assert run_cli("resume", record.run_id, "--state-dir", str(state)) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert str(sft_record) in err and "not a valid artifact record" in err and "rlhf resume" in err
    # Where the run's own record was: refused before anything starts.
    store.layout.run_file(record.run_id).write_bytes(pickle.dumps(_Exploit()))
    assert run_cli("resume", record.run_id, "--state-dir", str(state)) == 2
    assert "not a valid run record" in capsys.readouterr().err
    assert not marker.exists()
