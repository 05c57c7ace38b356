"""Commands genolong prints name genolong the way it was started, so they work as printed."""

import os
import sys

from genolong.invocation import command
from genolong.train.checkpoint import recovery_hint


def _fake_install(tmp_path):
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    exe = bin_dir / "genolong"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    return exe


def test_a_venv_command_off_path_is_named_by_its_path(tmp_path, monkeypatch):
    exe = _fake_install(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(sys, "argv", [str(exe), "finetune"])
    assert command() == os.path.join(".venv", "bin", "genolong")


def test_a_command_on_path_is_plain_genolong(tmp_path, monkeypatch):
    exe = _fake_install(tmp_path)
    monkeypatch.setenv("PATH", f"{exe.parent}:/usr/bin:/bin")
    monkeypatch.setattr(sys, "argv", [str(exe), "finetune"])
    assert command() == "genolong"


def test_a_command_outside_the_working_directory_is_named_in_full(tmp_path, monkeypatch):
    exe = _fake_install(tmp_path / "elsewhere")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(sys, "argv", [str(exe)])
    assert command() == str(exe)


def test_a_module_run_is_named_with_its_python(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main = os.path.join(os.path.dirname(sys.modules["genolong"].__file__), "__main__.py")
    monkeypatch.setattr(sys, "argv", [main, "finetune"])
    assert command() == f"{sys.executable} -m genolong"


def test_the_resume_hint_uses_the_command_as_typed(tmp_path, monkeypatch):
    exe = _fake_install(tmp_path)
    ckpt = tmp_path / "runs" / "a" / "checkpoints" / "step_00000010"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text('{"files": {}}')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(sys, "argv", [str(exe)])
    assert recovery_hint("runs/a").endswith("continue with `.venv/bin/genolong finetune --resume runs/a`")
