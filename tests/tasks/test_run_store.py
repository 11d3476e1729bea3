"""The run store: content-addressed artifacts, JSON run records, one writer per run and per key, liveness."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tasks.run_store import (ArtifactError, LocalPath, RunLockedError, RunStore, StateError, new_run_id,
                             stage_key)
from tasks.run_store.layout import LayoutError
from tasks.run_store.locks import FileLock, LockBusy, holder_if_alive

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    return RunStore(tmp_path / "state").ensure()


@dataclass(frozen=True)
class Slice:
    lr: float
    data_file: LocalPath | None = None


def publish(store: RunStore, stage: str, key: str, run_id: str = "run-a", text: str = "hello"):
    with store.claim(stage, key, run_id) as claim:
        (claim.staging / "table.txt").write_text(text)
        (claim.staging / "model").mkdir()
        (claim.staging / "model" / "weights.bin").write_bytes(b"\x00\x01")
        return claim.publish({"table": "table.txt", "model": "model", "metrics": {"loss": 0.5}}, Slice(0.1), {})


# --------------------------------------------------------------------------------------------- keys


def test_key_changes_with_every_part_and_only_with_them(tmp_path: Path) -> None:
    data = tmp_path / "pairs.jsonl"
    data.write_text("a\n")
    base = stage_key("sft", Slice(0.1, str(data)), {"x": 1})
    assert base == stage_key("sft", Slice(0.1, str(data)), {"x": 1})
    assert base != stage_key("sft", Slice(0.2, str(data)), {"x": 1})
    assert base != stage_key("reward-model", Slice(0.1, str(data)), {"x": 1})
    assert base != stage_key("sft", Slice(0.1, str(data)), {"x": 2})
    assert base != stage_key("sft", Slice(0.1, str(data)), {"x": 1}, rerun=1)
    data.write_text("b\n")  # a LocalPath field enters by content
    assert base != stage_key("sft", Slice(0.1, str(data)), {"x": 1})
    moved = tmp_path / "elsewhere.jsonl"
    data.rename(moved)
    assert stage_key("sft", Slice(0.1, str(moved)), {}) != stage_key("sft", Slice(0.1, "missing.jsonl"), {})


def test_artifact_inputs_enter_keys_by_identity(store: RunStore) -> None:
    first = publish(store, "data-prep", "k1")
    assert first.identity() == "data-prep/k1"
    assert first.part("model").identity() == "data-prep/k1/model"
    assert stage_key("sft", Slice(0.1), {"data": first}) != stage_key("sft", Slice(0.1), {"data": first.part("model")})


# --------------------------------------------------------------------------------------------- artifacts


def test_publish_is_atomic_json_with_a_manifest_and_clears_the_work_folder(store: RunStore) -> None:
    assert store.artifact("sft", "abc") is None
    art = publish(store, "sft", "abc")
    assert art.folder == store.root / "artifacts" / "sft" / "abc"
    record = json.loads((art.folder / "record.json").read_text())
    assert record["stage"] == "sft" and record["key"] == "abc" and record["produced_by"] == "run-a"
    assert record["result"]["metrics"] == {"loss": 0.5}
    assert set(record["files"]) == {"table.txt", "model/weights.bin"}
    assert record["files"]["table.txt"]["size"] == 5
    again = store.artifact("sft", "abc")
    assert again is not None and again.path("table.txt").read_text() == "hello"
    work = store.root / "work" / "sft" / "abc"
    assert [p.name for p in work.iterdir()] == ["claim.lock"]
    with pytest.raises(ArtifactError, match="outside"):
        again.path("../../runs")


def test_a_killed_attempt_leaves_nothing_published(store: RunStore) -> None:
    with pytest.raises(RuntimeError, match="boom"), store.claim("sft", "k", "run-a") as claim:
        (claim.staging / "half.txt").write_text("partial")
        (claim.work / "checkpoints").mkdir()
        raise RuntimeError("boom")
    assert store.artifact("sft", "k") is None
    with store.claim("sft", "k", "run-b") as claim:
        assert list(claim.staging.iterdir()) == []  # the half-written artifact is gone ...
        assert (claim.work / "checkpoints").is_dir()  # ... the key's checkpoints are kept for a resume


def test_a_second_claimant_waits_then_finds_the_artifact(store: RunStore) -> None:
    seen: list[object] = []
    started = threading.Event()

    def second() -> None:
        started.wait()
        with store.claim("sft", "k", "run-b"):
            seen.append(store.artifact("sft", "k"))

    thread = threading.Thread(target=second)
    with store.claim("sft", "k", "run-a") as claim:
        thread.start()
        started.set()
        time.sleep(0.3)
        assert seen == []  # still waiting
        (claim.staging / "x").write_text("1")
        claim.publish({}, Slice(0.1), {})
    thread.join(10)
    assert len(seen) == 1 and seen[0] is not None and seen[0].record.produced_by == "run-a"


def test_damaged_records_are_refused_by_name(store: RunStore) -> None:
    art = publish(store, "sft", "abc")
    (art.folder / "model" / "weights.bin").unlink()
    with pytest.raises(ArtifactError, match="lacks 1 of its files.*delete"):
        store.artifact("sft", "abc")
    art = publish(store, "sft", "def")
    (art.folder / "record.json").write_text("{not json")
    with pytest.raises(ArtifactError, match=r"record\.json is not a valid artifact record"):
        store.artifact("sft", "def")


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {Path(os.environ['PLANTED_MARKER'])}",))


def test_a_planted_pickle_never_runs(store: RunStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "pwned"
    monkeypatch.setenv("PLANTED_MARKER", str(marker))
    art = publish(store, "sft", "abc")
    (art.folder / "record.json").write_bytes(pickle.dumps(_Exploit()))
    record = store.create_run("demo", "name: demo\n")
    store.layout.run_file(record.run_id).write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(ArtifactError):
        store.artifact("sft", "abc")
    with pytest.raises(StateError, match="not a valid run record"):
        store.load_run(record.run_id)
    assert not marker.exists()
    assert not any(p.suffix in (".pkl", ".pickle") for p in store.root.rglob("*"))


# --------------------------------------------------------------------------------------------- runs


def test_runs_round_trip_and_list_newest_first(store: RunStore) -> None:
    first = store.create_run("demo", "name: demo\n", run_id="20260101-000000-aaaaaa")
    second = store.create_run("tiny", "name: tiny\n")
    assert store.config_file(second.run_id).read_text() == "name: tiny\n"
    with store.hold(second.run_id, "test") as run:
        run.stage_started("sft", "sft", "k1")
        run.stage_update("sft", status="completed", models={"policy": "models:/p/1"})
        run.set_status("completed")
    loaded = store.load_run(second.run_id)
    assert loaded.status == "completed" and loaded.ended and loaded.stages["sft"].models == {"policy": "models:/p/1"}
    assert [r.run_id for r in store.list_runs()][:2] == [second.run_id, first.run_id]
    assert store.load_run("latest").run_id == second.run_id
    with pytest.raises(StateError, match="exists already"):
        store.create_run("demo", "", run_id=first.run_id)


def test_missing_and_bad_run_ids(store: RunStore) -> None:
    with pytest.raises(StateError, match="there are no runs yet"):
        store.load_run("nope")
    store.create_run("demo", "")
    with pytest.raises(StateError, match="existing runs"):
        store.load_run("nope")
    with pytest.raises(StateError, match="not a valid run id"):
        store.load_run("../outside")
    with pytest.raises(LayoutError):
        store.layout.artifact_dir("sft", "../../etc")


def test_run_ids_sort_by_time() -> None:
    ids = [new_run_id() for _ in range(3)]
    assert all(len(i) == len("20260101-000000-abcdef") for i in ids)
    assert ids == sorted(ids, key=lambda i: i[:15])


def test_one_writer_per_run(store: RunStore) -> None:
    record = store.create_run("demo", "")
    with store.hold(record.run_id, "rlhf resume"):
        with pytest.raises(RunLockedError) as info, store.hold(record.run_id, "a second rlhf resume"):
            pass
        message = str(info.value)
        assert "\n" not in message and f"pid {os.getpid()}" in message and "rlhf resume" in message
        assert store.holder(record.run_id) is not None
        assert store.list_runs()[0].status == "running"  # alive: not crashed
    assert store.holder(record.run_id) is None


HOLD_SCRIPT = """
import sys, time
from tasks.run_store import RunStore
store = RunStore(sys.argv[1])
with store.hold(sys.argv[2], "holder test"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_killed_holder_frees_the_run_and_shows_as_crashed(store: RunStore) -> None:
    record = store.create_run("demo", "")
    process = subprocess.Popen([sys.executable, "-c", HOLD_SCRIPT, str(store.root), record.run_id],
                               stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert process.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=f"pid {process.pid}"):
            with store.hold(record.run_id, "resume"):
                pass
        assert store.list_runs()[0].status == "running"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    (listed,) = store.list_runs()
    assert listed.status == "crashed" and "rlhf resume" in listed.error
    with store.hold(record.run_id, "resume") as run:  # free again
        run.set_status("running")
    assert store.end_run(record.run_id, "failed", "boom") and store.load_run(record.run_id).status == "failed"
    assert not store.end_run(record.run_id, "crashed")  # only a running record changes


def test_file_lock_names_its_holder(tmp_path: Path) -> None:
    lock = FileLock(tmp_path / "l", "writing").acquire()
    assert holder_if_alive(tmp_path / "l").purpose == "writing"
    with pytest.raises(LockBusy, match="writing"):
        FileLock(tmp_path / "l").acquire()
    lock.release()
    assert holder_if_alive(tmp_path / "l") is None


def test_a_moved_state_folder_is_noticed(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "a").ensure()
    assert store.moved_from is None
    assert RunStore(tmp_path / "a").ensure().moved_from is None
    (tmp_path / "a").rename(tmp_path / "b")
    moved = RunStore(tmp_path / "b").ensure()
    assert moved.moved_from == str(tmp_path / "a")
    assert RunStore(tmp_path / "b").ensure().moved_from == str(tmp_path / "a")  # noticed until settled
    moved.settle_move()
    assert moved.moved_from is None and RunStore(tmp_path / "b").ensure().moved_from is None
