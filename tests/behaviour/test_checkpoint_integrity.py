"""A damaged checkpoint is never resumed from: it is skipped with one warning naming the file, and the run goes
on from the newest earlier checkpoint that verifies against its manifest."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from rlhf_core.training.checkpoint import read_run_state, resume_checkpoint
from rlhf_core.training.checkpoint_integrity import (
    MANIFEST,
    CheckpointError,
    read_tensors,
    verify_checkpoint,
    write_manifest,
)
from rlhf_core.training.ppo_loop import PPORunResult, train_ppo
from tests.behaviour.test_checkpoint_resume import PROMPTS, build, config

STEP2, STEP4 = "step_000002", "step_000004"


@pytest.fixture(scope="module")
def straight() -> tuple[PPORunResult, dict[str, torch.Tensor]]:
    """Six uninterrupted steps: what every resume below must reproduce (history and final policy weights)."""
    models = build("head")
    result = train_ppo(models, PROMPTS, config(), 6)
    return result, {k: v.clone() for k, v in models.policy.state_dict().items()}


def four_steps(root: Path) -> Path:
    """Checkpoints step_000002 and step_000004 under ``root`` (``latest`` names step 4)."""
    train_ppo(build("head"), PROMPTS, config(), 4, checkpoint_dir=root, checkpoint_every=2)
    assert sorted(p.name for p in root.glob("step_*")) == [STEP2, STEP4]
    return root


def resume_to_six(root: Path) -> tuple[PPORunResult, dict[str, torch.Tensor]]:
    models = build("head")
    result = train_ppo(models, PROMPTS, config(), 6, checkpoint_dir=root, checkpoint_every=2)
    return result, models.policy.state_dict()


def assert_same_run(resumed: tuple[PPORunResult, dict[str, torch.Tensor]], straight) -> None:
    (result, weights), (expected, expected_weights) = resumed, straight
    assert [h["ppo/policy/loss"] for h in result.history] == [h["ppo/policy/loss"] for h in expected.history]
    assert [h["ppo/scores/mean"] for h in result.history] == [h["ppo/scores/mean"] for h in expected.history]
    for name, tensor in expected_weights.items():
        assert torch.equal(weights[name], tensor), name


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_manifest_lists_every_file_with_its_size_and_sha256(tmp_path: Path):
    folder = four_steps(tmp_path) / STEP4
    manifest = json.loads((folder / MANIFEST).read_text())
    files = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    assert manifest["format"] == 1 and manifest["step"] == 4
    assert sorted(manifest["files"]) == files
    for name in files:
        data = (folder / name).read_bytes()
        assert manifest["files"][name] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_checkpoint(folder) == 4
    write_manifest(folder, 4)  # sealing the same files again gives the same manifest
    assert json.loads((folder / MANIFEST).read_text()) == manifest


def test_overwritten_weights_fall_back_to_the_previous_checkpoint(tmp_path: Path, straight, caplog):
    root = four_steps(tmp_path)
    weights = root / STEP4 / "policy.safetensors"
    data = bytearray(weights.read_bytes())
    assert len(data) > 8000
    data[4000:8000] = bytes(4000)  # same size: only the sha256 can tell
    weights.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING):
        resumed = resume_to_six(root)

    assert resumed[0].resumed_from_step == 2  # not 4 (damaged), not 0 (a restart would also match `straight`)
    assert_same_run(resumed, straight)
    (line,) = warnings_of(caplog)
    assert str(weights) in line and "sha256" in line and "\n" not in line
    # Step 4 was written again (the damaged one is gone) and the newest two checkpoints verify.
    assert sorted(p.name for p in root.glob("step_*")) == [STEP4, "step_000006"]
    assert verify_checkpoint(root / STEP4) == 4 and verify_checkpoint(root / "step_000006") == 6


def test_an_edited_step_is_refused(tmp_path: Path, caplog):
    root = four_steps(tmp_path)
    state_file = root / STEP4 / "state.json"
    text = state_file.read_text()
    assert text.count('\n "step": 4\n') == 1
    state_file.write_text(text.replace('\n "step": 4\n', '\n "step": 3\n'))  # a hand edit: same size
    with pytest.raises(CheckpointError, match="state.json does not match its sha256"):
        verify_checkpoint(root / STEP4)
    write_manifest(root / STEP4, 4)  # even re-sealed, the steps disagree
    with pytest.raises(CheckpointError, match=r"state.json disagrees on the step \(manifest 4, state.json 3"):
        verify_checkpoint(root / STEP4)
    write_manifest(root / STEP4, 3)
    with pytest.raises(CheckpointError, match="manifest 3, state.json 3, folder name 4"):
        verify_checkpoint(root / STEP4)

    with caplog.at_level(logging.WARNING):
        assert resume_checkpoint(root) == root / STEP2
    (line,) = warnings_of(caplog)
    assert STEP4 in line and "disagrees on the step" in line


def test_a_truncated_optimizer_file_falls_back(tmp_path: Path, straight, caplog):
    root = four_steps(tmp_path)
    optimizer = root / STEP4 / "optimizer.safetensors"
    data = optimizer.read_bytes()
    optimizer.write_bytes(data[: len(data) // 2])

    with caplog.at_level(logging.WARNING):
        resumed = resume_to_six(root)

    assert resumed[0].resumed_from_step == 2
    assert_same_run(resumed, straight)
    (line,) = warnings_of(caplog)
    assert str(optimizer) in line and f"has {len(data) // 2} bytes" in line


def test_a_truncated_file_that_matches_its_manifest_is_a_decode_error_naming_it(tmp_path: Path):
    folder = four_steps(tmp_path) / STEP4
    optimizer = folder / "optimizer.safetensors"
    optimizer.write_bytes(optimizer.read_bytes()[:1000])
    write_manifest(folder, 4)
    with pytest.raises(CheckpointError, match="optimizer.safetensors is unreadable .SafetensorError"):
        verify_checkpoint(folder)
    with pytest.raises(CheckpointError, match=f"checkpoint file {optimizer} is unreadable"):
        read_tensors(optimizer)


def test_garbage_state_json_with_no_checkpoint_to_fall_back_to(tmp_path: Path, caplog):
    root = tmp_path / "previous"
    train_ppo(build("head"), PROMPTS, config(), 2, checkpoint_dir=root, checkpoint_every=2)
    folder = root / STEP2
    (folder / "state.json").write_bytes(b"\x00garbage{")

    # A previous iteration's checkpoint (init_from) has no fallback: one line naming the file.
    with pytest.raises(CheckpointError) as refused:
        train_ppo(build("head"), PROMPTS, config(), 4, checkpoint_dir=tmp_path / "next", init_from=folder)
    message = str(refused.value)
    assert f"{folder / 'state.json'} has 9 bytes, its manifest.json says" in message and "\n" not in message
    assert not (tmp_path / "next").exists()

    # Re-sealed, the decode error itself names the file, in verification and in loading.
    write_manifest(folder, 2)
    with pytest.raises(CheckpointError, match=r"state.json is unreadable \((UnicodeDecodeError|JSONDecodeError)"):
        verify_checkpoint(folder)
    with pytest.raises(CheckpointError, match=f"checkpoint file {folder / 'state.json'} is unreadable"):
        read_run_state(folder, torch.Generator())

    # Its own checkpoint folder: the run starts from the beginning, and says so.
    with caplog.at_level(logging.WARNING):
        result = train_ppo(build("head"), PROMPTS, config(), 2, checkpoint_dir=root, checkpoint_every=2)
    assert result.resumed_from_step == 0 and len(result.history) == 2
    skipped, start_over = warnings_of(caplog)
    assert str(folder / "state.json") in skipped and "no usable checkpoint" in start_over
    assert verify_checkpoint(folder) == 2  # written again, sound


def test_a_missing_manifest_or_file_is_refused(tmp_path: Path):
    folder = four_steps(tmp_path) / STEP4
    (folder / "rng.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rng.safetensors is missing"):
        verify_checkpoint(folder)
    (folder / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=f"{STEP4} has no manifest.json"):
        verify_checkpoint(folder)
    assert resume_checkpoint(tmp_path) == tmp_path / STEP2


def test_orphan_temporary_folders_are_removed_on_resume_and_on_write(tmp_path: Path):
    root = four_steps(tmp_path)
    orphans = [root / ".tmp-step_000006-k1ll3d", root / ".tmp-step_000006"]  # one-process and DeepSpeed names
    for orphan in orphans:
        (orphan / "deepspeed").mkdir(parents=True)
        (orphan / "policy.safetensors").write_bytes(b"half")
    (root / ".unrelated").mkdir()

    assert resume_checkpoint(root, clean=False) == root / STEP4
    assert all(o.is_dir() for o in orphans)  # a data-parallel rank other than 0 leaves them alone
    assert resume_checkpoint(root) == root / STEP4
    assert not any(o.exists() for o in orphans) and (root / ".unrelated").is_dir()

    def kill_a_write_mid_run(stats) -> None:  # after the resume has cleaned up, before step 6 is written
        if stats.step == 5:
            shutil.copytree(root / STEP4, orphans[0])

    train_ppo(build("head"), PROMPTS, config(), 6, checkpoint_dir=root, checkpoint_every=2,
              on_step=kill_a_write_mid_run)
    assert not orphans[0].exists()
    assert sorted(p.name for p in root.iterdir()) == [".unrelated", "latest", STEP4, "step_000006"]


def test_checkpoints_past_the_one_resumed_from_go_when_the_run_writes_again(tmp_path: Path):
    root = four_steps(tmp_path)
    (root / STEP4 / "value.safetensors").write_bytes(b"")
    result = train_ppo(build("head"), PROMPTS, config(), 3, checkpoint_dir=root, checkpoint_every=1)
    assert result.resumed_from_step == 2
    # The skipped step 4 would otherwise outrank the good step 2 when pruning to the newest two.
    assert sorted(p.name for p in root.glob("step_*")) == [STEP2, "step_000003"]
