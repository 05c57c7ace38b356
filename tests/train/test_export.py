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
