"""Checkpoint files: atomic, verified by their manifest, pruned to the last K, RNG round trip."""

import json
import random

import numpy as np
import pytest
import torch

from genolong import checkpoint_dir
from genolong.errors import GenolongError
from genolong.train import checkpoint as ck


def _write_model(path):
    path.mkdir()
    (path / "weights.bin").write_bytes(b"w" * 100)


def _save(run, step, keep=3, write_model=_write_model):
    return ck.save(run, step, write_model, {"step": torch.tensor(step), "m": torch.ones(3)}, {"step": step}, keep)


def test_save_writes_manifest_last_and_latest_finds_it(tmp_path):
    path = _save(tmp_path, 5)
    assert path.name == "step_00000005"
    manifest = json.loads((path / checkpoint_dir.COMPLETE).read_text())
    assert manifest["step"] == 5
    assert set(manifest["files"]) == {"model/weights.bin", ck.OPTIMIZER_FILE, ck.STATE_FILE}
    assert ck.latest(tmp_path) == path
    assert checkpoint_dir.load_trainer_state(path) == {"step": 5}
    assert torch.equal(ck.load_optimizer_state(path)["m"], torch.ones(3))


def test_a_save_that_dies_midway_leaves_no_checkpoint(tmp_path):
    _save(tmp_path, 1)

    def crash(path):
        _write_model(path)
        raise KeyboardInterrupt  # e.g. the job is killed while the weights are written

    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, write_model=crash)
    assert ck.latest(tmp_path).name == "step_00000001"
    assert [p.name for p in (tmp_path / ck.CHECKPOINTS).iterdir()] == ["step_00000001"]


def test_incomplete_or_damaged_directories_are_ignored(tmp_path):
    _save(tmp_path, 1)
    good = _save(tmp_path, 2)
    # A directory with the right name but no manifest (e.g. copied by hand, half-way).
    fake = tmp_path / ck.CHECKPOINTS / "step_00000009"
    fake.mkdir()
    (fake / ck.STATE_FILE).write_text("{}")
    assert ck.latest(tmp_path) == good
    # A file truncated after the checkpoint was completed: the manifest's size no longer matches.
    (good / "model" / "weights.bin").write_bytes(b"w")
    assert ck.latest(tmp_path).name == "step_00000001"


def test_keep_last_prunes_oldest(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep=2)
    assert [p.name for p in checkpoint_dir.complete_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert sorted(p.name for p in (tmp_path / ck.CHECKPOINTS).iterdir()) == ["step_00000003", "step_00000004"]


def test_check_run_dir_explains_what_is_wrong(tmp_path):
    with pytest.raises(GenolongError, match="no such directory"):
        ck.check_run_dir(tmp_path / "nope")
    with pytest.raises(GenolongError, match="not a genolong run"):
        ck.check_run_dir(tmp_path)
    (tmp_path / ck.OPTIONS_FILE).write_text("{}")
    with pytest.raises(GenolongError, match="no complete checkpoint.*plus --overwrite"):
        ck.check_run_dir(tmp_path)
    _save(tmp_path, 3)
    assert ck.check_run_dir(tmp_path).name == "step_00000003"


def test_rng_states_round_trip_through_json():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1), np.random.randn()  # leave a cached gaussian
    state = json.loads(json.dumps(checkpoint_dir.capture_rng()))
    want = (random.random(), np.random.randn(), float(torch.rand(1)))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    checkpoint_dir.restore_rng(state)
    assert (random.random(), np.random.randn(), float(torch.rand(1))) == want


def test_jsonable_round_trip_of_sampler_like_state():
    state = {"pos": np.int64(7), "perm": np.arange(5, dtype=np.int32), "rng": {"s": [1, 2]}, "t": torch.tensor([3])}
    back = ck.from_jsonable(json.loads(json.dumps(ck.to_jsonable(state))))
    assert back["pos"] == 7 and back["rng"] == {"s": [1, 2]}
    assert back["perm"].dtype == np.int32 and back["perm"].tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(back["t"], torch.tensor([3]))


# ------------------------------------------------------------------ crashes, interrupts, the run lock


def test_a_crashed_saves_temporary_directory_is_removed_by_the_next_save(tmp_path, capsys):
    _save(tmp_path, 1)
    # What a save killed with SIGKILL leaves behind (another pid), and a pruned checkpoint half-deleted.
    crashed = tmp_path / ck.CHECKPOINTS / ".tmp-step_00000002-999999"
    (crashed / "model").mkdir(parents=True)
    (crashed / "model" / "weights.bin").write_bytes(b"x" * 1000)
    trash = tmp_path / ck.CHECKPOINTS / ".trash-step_00000000-999999"
    trash.mkdir()
    # Not genolong's names: never touched.
    keep = [tmp_path / ck.CHECKPOINTS / "notes", tmp_path / ck.CHECKPOINTS / ".tmp-mine"]
    for path in keep:
        path.mkdir()
    _save(tmp_path, 2)
    assert not crashed.exists() and not trash.exists()
    assert all(path.is_dir() for path in keep)
    err = capsys.readouterr().err
    assert ".tmp-step_00000002-999999" in err and "did not finish" in err
    assert [p.name for p in checkpoint_dir.complete_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]


@pytest.fixture
def ctrl_c_raises():
    """Python's own SIGINT handler, whatever this process inherited (a background job ignores SIGINT)."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupt_during_a_save_waits_for_the_save(tmp_path, capsys, ctrl_c_raises):
    import signal

    def interrupted_midway(path):
        _write_model(path)
        signal.raise_signal(signal.SIGINT)  # Ctrl-C while the weights are being written
        (path / "more.bin").write_bytes(b"m" * 10)

    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 4, write_model=interrupted_midway)
    # The interrupt arrived after the save: the checkpoint is complete, nothing temporary is left.
    assert ck.latest(tmp_path).name == "step_00000004"
    assert checkpoint_dir.is_complete(ck.latest(tmp_path)) and (ck.latest(tmp_path) / "model" / "more.bin").is_file()
    assert [p.name for p in (tmp_path / ck.CHECKPOINTS).iterdir()] == ["step_00000004"]
    assert "finishing checkpoint step_00000004" in capsys.readouterr().err


def test_a_second_interrupt_abandons_the_save(tmp_path, ctrl_c_raises):
    import signal

    def interrupted_twice(path):
        _write_model(path)
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        pytest.fail("the second interrupt did not stop the save")

    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 4, write_model=interrupted_twice)
    assert ck.latest(tmp_path) is None
    assert list((tmp_path / ck.CHECKPOINTS).iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_run_lock_keeps_a_second_process_out(tmp_path):
    with ck.locked(tmp_path / "run"):
        # Another open file description, as another process would have.
        with pytest.raises(GenolongError, match=f"in use by another genolong training process \\(pid {__import__('os').getpid()}\\)"):
            with ck.locked(tmp_path / "run"):
                pass
    with ck.locked(tmp_path / "run"):  # released when the holder is done
        pass


def test_refusal_messages_point_at_resume_or_overwrite(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    ck.refuse_occupied(run)  # an empty directory is fine
    (run / ck.OPTIONS_FILE).write_text(json.dumps({"steps": 8}))
    with pytest.raises(GenolongError, match="stopped before its first complete checkpoint; start it again by adding --overwrite"):
        ck.refuse_occupied(run)
    assert "plus --overwrite" in ck.recovery_hint(run)
    _save(run, 4)
    with pytest.raises(GenolongError, match=r"last complete checkpoint: step 4 of 8\); continue it with --resume .*, replace it with --overwrite"):
        ck.refuse_occupied(run)
    assert ck.recovery_hint(run) == f"last complete checkpoint: step 4 of 8: continue with `genolong finetune --resume {run}`"


def test_overwrite_removes_only_a_genolong_run(tmp_path, capsys):
    run = tmp_path / "run"
    _save(run, 1)
    (run / ck.OPTIONS_FILE).write_text(json.dumps({"steps": 8}))
    (run / "metrics.jsonl").write_text("{}\n")
    with ck.locked(run):
        ck.clear_for_overwrite(run)
    assert sorted(p.name for p in run.iterdir()) == [ck.LOCK_FILE]
    assert "removing the earlier run" in capsys.readouterr().err
    other = tmp_path / "thesis"
    other.mkdir()
    (other / "chapter1.tex").write_text("precious")
    with pytest.raises(GenolongError, match="not a genolong run .* so it is not deleted"):
        ck.clear_for_overwrite(other)
    assert (other / "chapter1.tex").read_text() == "precious"
