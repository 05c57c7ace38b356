"""`genolong export` of a one-process run: the copy loads, reads like any new directory, and bad
--run / --out values get one line naming the flag, with nothing left behind."""

import os
import stat

import pytest
import torch
from typer.testing import CliRunner

from genolong.cli import app
from genolong.errors import GenolongError
from genolong.model import from_pretrained
from genolong.train.export import export

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--preset", "tiny", "--seq", "64", "--device", "cpu", "--no-progress", "--warmup", "1"]


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "run"
    result = CliRunner().invoke(app, ["finetune", "--data", str(data), "--out", str(out), "--steps", "2", *TINY])
    assert result.exit_code == 0, result.output
    return out


def _modes(root):
    return {p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def test_export_copies_a_loadable_model_with_ordinary_permissions(run, tmp_path):
    umask = os.umask(0o022)
    try:
        out = export(run, tmp_path / "hf")
    finally:
        os.umask(umask)
    model = from_pretrained(out, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) > 0
    modes = _modes(out)
    # Readable by others as any new directory under umask 022 (mkdtemp would make 0700, safetensors 0600).
    assert modes["."] == 0o755 and all(m == 0o644 for name, m in modes.items() if name != "."), modes
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no staging directory left beside it


def test_export_refuses_bad_destinations_and_leaves_nothing(run, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("hi")
    with pytest.raises(GenolongError, match="--out .* is a file"):
        export(run, afile)
    inside = sorted((run / "checkpoints").iterdir())[-1] / "model" / "sub"
    with pytest.raises(GenolongError, match="inside the checkpoint"):
        export(run, inside)
    assert not inside.exists()
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("keep")
    with pytest.raises(GenolongError, match="not empty"):
        export(run, full)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "full"] and (full / "x").read_text() == "keep"


def test_export_errors_name_its_own_flag(tmp_path):
    with pytest.raises(GenolongError, match=r"^--run .*no such directory"):
        export(tmp_path / "nope", tmp_path / "out")
    not_run = tmp_path / "notrun"
    not_run.mkdir()
    with pytest.raises(GenolongError, match=r"^--run .*not a genolong run"):
        export(not_run, tmp_path / "out")



def _unreadable(monkeypatch, *locked):
    """Make `locked` unreadable to export as they would be without read permission (this may run as root)."""
    import genolong.train.export as export_module

    real_access = os.access
    locked = {str(p) for p in locked}
    monkeypatch.setattr(export_module.os, "access", lambda path, mode: str(path) not in locked and real_access(path, mode))


def test_export_names_an_unreadable_checkpoint_file_as_a_read_error(run, tmp_path, monkeypatch):
    import shutil

    weights = sorted((sorted((run / "checkpoints").iterdir())[-1] / "model").glob("*.safetensors"))[0]
    _unreadable(monkeypatch, weights)
    real_copy2 = shutil.copy2

    def copy2(src, dst, **kw):
        if str(src) == str(weights):
            raise PermissionError(13, "Permission denied", str(src))
        return real_copy2(src, dst, **kw)

    real_copytree = shutil.copytree  # its copy_function default was bound when shutil was imported
    monkeypatch.setattr(shutil, "copytree", lambda src, dst, **kw: real_copytree(src, dst, copy_function=copy2, **kw))
    with pytest.raises(GenolongError, match=r"^--run: could not read .*safetensors"):
        export(run, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []  # neither the output nor its staging directory is left


def test_unreadable_source_tells_reading_from_writing(tmp_path, monkeypatch):
    import shutil

    from genolong.train.export import _unreadable_source

    src = tmp_path / "src"
    src.mkdir()
    locked, readable = src / "w.safetensors", src / "config.json"
    locked.write_text("x")
    readable.write_text("{}")
    _unreadable(monkeypatch, locked)
    many = shutil.Error([(str(readable), str(tmp_path / "o" / "config.json"), "disk full"), (str(locked), str(tmp_path / "o" / "w"), "denied")])
    assert _unreadable_source(src, many) == repr(str(locked))
    assert _unreadable_source(src, shutil.Error([(str(readable), "d", "No space left on device")])) is None
    assert _unreadable_source(src, PermissionError(13, "denied", str(locked))) == repr(str(locked))
    assert _unreadable_source(src, OSError(28, "No space left on device", str(tmp_path / "out" / "x"))) is None
    # A path outside the checkpoint is never the checkpoint's fault.
    outside = tmp_path / "elsewhere"
    outside.write_text("y")
    _unreadable(monkeypatch, outside)
    assert _unreadable_source(src, PermissionError(13, "denied", str(outside))) is None
