"""prepare: output equals an independent parse of the FASTA, for every input flavour."""

import hashlib
import json
import os
import shutil

import datasets
import numpy as np
import pyfaidx
import pytest

from genolong.data import open_prepared, prepare, store
from genolong.data.synthetic import hg38_like, write_fasta
from genolong.errors import GenolongError

from .conftest import reference_parse, write_text_fasta

SCALE = 2e-4  # chr1 ~50 kb: every record of hg38, small enough for the per-base reference parser


def _records():
    return hg38_like(SCALE)


def _check_against_reference(out, fasta, expected_splits):
    ref = reference_parse(fasta)
    pg = open_prepared(out)
    assert pg.splits == list(expected_splits)
    for split, names in expected_splits.items():
        assert [name for name, _ in pg.records(split)] == names
        for name, length in pg.records(split):
            assert length == len(ref[name]["tokens"])
            tokens, mask = pg.read(split, name, 0, length)
            np.testing.assert_array_equal(tokens, ref[name]["tokens"])
            np.testing.assert_array_equal(mask, ref[name]["mask"])
    by_name = {r["name"]: r for r in pg.manifest["records"]}
    assert list(by_name) == list(ref)
    for name, r in ref.items():
        entry = by_name[name]
        assert entry["length"] == len(r["tokens"])
        if entry["split"] is not None:
            assert entry["description"] == r["description"]
        if entry["split"] is not None:
            assert entry["n_count"] == int((r["tokens"] == 4).sum())
            assert entry["repeat_count"] == int(r["mask"].sum())
            assert entry["iupac_to_n_by_code"] == dict(r["iupac"])
            assert entry["iupac_to_n"] == sum(r["iupac"].values())
    return pg


@pytest.mark.parametrize(
    "compression,line_width,crlf,index",
    [
        ("plain", 60, False, False),
        ("plain", 61, True, False),
        ("plain", 50, False, True),
        ("gzip", 70, False, False),
        ("bgzip", 79, True, False),
        ("bgzip", 60, False, True),
    ],
)
def test_output_matches_independent_parse(tmp_path, small_blocks, compression, line_width, crlf, index):
    suffix = ".fa" if compression == "plain" else ".fa.gz"
    fasta = write_fasta(
        tmp_path / f"g{suffix}",
        _records(),
        seed=3,
        line_width=line_width,
        crlf=crlf,
        compression=compression,
        iupac_rate=1e-3,
    )
    if index:
        pyfaidx.Faidx(str(fasta)).close()  # samtools-style .fai (+ .gzi), built by an independent reader
    out = prepare(fasta, tmp_path / "out", validation="chr21", progress=False, log=lambda m: None)
    pg = _check_against_reference(
        out, fasta, {"train": ["chr1", "chr2"], "holdout": ["chr22"], "validation": ["chr21"]}
    )
    assert pg.manifest["source"]["read_with_index"] is index
    assert pg.manifest["source"]["compression"] == compression


def test_manifest_fields(tmp_path):
    fasta = write_fasta(tmp_path / "g.fa", _records(), seed=1)
    out = prepare(fasta, tmp_path / "out", progress=False, log=lambda m: None)
    m = json.loads((out / "manifest.json").read_text())
    assert m["source"]["sha256"] == hashlib.sha256(fasta.read_bytes()).hexdigest()
    assert m["source"]["size_bytes"] == fasta.stat().st_size
    assert m["splits"] == {"train": ["chr1", "chr2"], "holdout": ["chr22"]}
    assert m["vocabulary"] == {"A": 0, "C": 1, "G": 2, "T": 3, "N": 4}
    assert m["left_out"] == [name for name, _ in _records() if name not in ("chr1", "chr2", "chr22")]
    assert [r["length"] for r in m["records"]] == [n for _, n in _records()]
    assert m["format_version"] == 1 and m["genolong_version"]
    train = [r for r in m["records"] if r["split"] == "train"]
    assert m["totals"]["train"]["bases"] == sum(r["length"] for r in train)
    for r in train:
        assert r["n_fraction"] == pytest.approx(r["n_count"] / r["length"])
        assert 0 < r["repeat_fraction"] < 1


def test_datasets_load_from_disk_round_trip(tmp_path):
    fasta = write_fasta(tmp_path / "g.fa", _records(), seed=2)
    out = prepare(fasta, tmp_path / "out", progress=False, log=lambda m: None)
    ref = reference_parse(fasta)
    dd = datasets.load_from_disk(str(out))
    assert isinstance(dd, datasets.DatasetDict)
    assert set(dd) == {"train", "holdout"}
    assert dd["train"]["name"] == ["chr1", "chr2"]
    row = dd["holdout"][0]
    assert row["name"] == "chr22" and row["length"] == len(ref["chr22"]["tokens"])
    assert np.frombuffer(row["tokens"], dtype=np.uint8).tolist() == ref["chr22"]["tokens"].tolist()
    assert np.frombuffer(row["repeat_mask"], dtype=bool).tolist() == ref["chr22"]["mask"].tolist()
    assert row["n_count"] == int((ref["chr22"]["tokens"] == 4).sum())
    # Memory-mapped, not loaded: datasets keeps its table on the files it opened.
    assert dd["train"].cache_files and all(f["filename"].startswith(str(out)) for f in dd["train"].cache_files)


def test_names_are_aliased_both_ways(tmp_path):
    ensembl = write_fasta(tmp_path / "e.fa", hg38_like(SCALE, ensembl_names=True)[:22], seed=4)
    said = []
    out = prepare(
        ensembl, tmp_path / "out", train="chr1", holdout="chr22", validation="21", progress=False, log=said.append
    )
    assert open_prepared(out).manifest["splits"] == {"train": ["1"], "holdout": ["22"], "validation": ["21"]}
    assert any("'chr1'" in m and "'1'" in m for m in said)
    ucsc = write_fasta(tmp_path / "u.fa", _records(), seed=4)
    out2 = prepare(ucsc, tmp_path / "out2", train="1,2", holdout="MT", progress=False, log=said.append)
    assert open_prepared(out2).manifest["aliases"] == [
        {"requested": "1", "used": "chr1"},
        {"requested": "2", "used": "chr2"},
        {"requested": "MT", "used": "chrM"},
    ]


def test_exact_name_wins_over_alias(tmp_path):
    fasta = write_text_fasta(tmp_path / "g.fa", [("1", "AAAA"), ("chr1", "CCCCCC"), ("chr2", "GG")])
    out = prepare(fasta, tmp_path / "out", train="chr1", holdout="chr2", progress=False, log=lambda m: None)
    pg = open_prepared(out)
    assert pg.records("train") == [("chr1", 6)]
    assert pg.read("train", "chr1", 0, 6)[0].tolist() == [1] * 6


def test_existing_output_needs_overwrite(tmp_path):
    fasta = write_text_fasta(tmp_path / "g.fa", [("chr1", "ACGT" * 10), ("chr2", "GGCC"), ("chr22", "TTAA")])
    out = prepare(fasta, tmp_path / "out", progress=False, log=lambda m: None)
    with pytest.raises(GenolongError, match="--overwrite"):
        prepare(fasta, out, progress=False, log=lambda m: None)
    write_text_fasta(fasta, [("chr1", "TTTT"), ("chr2", "GGCC"), ("chr22", "TTAA")])
    prepare(fasta, out, overwrite=True, progress=False, log=lambda m: None)
    assert open_prepared(out).records("train")[0] == ("chr1", 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.fa", "out"]


def test_reuse_keeps_the_same_preparation_and_refuses_another(tmp_path):
    fasta = write_text_fasta(tmp_path / "g.fa", [("chr1", "ACGT" * 10), ("chr2", "GGCC"), ("chr22", "TTAA")])
    out = prepare(fasta, tmp_path / "out", train="chr1,chr2", holdout="22", progress=False, log=lambda m: None)
    stamp = (out / "manifest.json").stat().st_mtime_ns
    said = []
    # The same FASTA and splits (chr22 asked for as "22" again, or by its own name): kept untouched.
    assert prepare(fasta, out, train="chr2,chr1", holdout="chr22", reuse=True, progress=False, log=said.append) == out
    assert (out / "manifest.json").stat().st_mtime_ns == stamp and "reused" in said[-1]
    with pytest.raises(GenolongError, match="was prepared from other splits.*--overwrite"):
        prepare(fasta, out, train="chr1", holdout="chr22", reuse=True, progress=False, log=lambda m: None)
    other = write_text_fasta(tmp_path / "h.fa", [("chr1", "TTTT" * 10), ("chr2", "GGCC"), ("chr22", "TTAA")])  # same size
    with pytest.raises(GenolongError, match="another FASTA of the same size"):
        prepare(other, out, train="chr1,chr2", holdout="chr22", reuse=True, progress=False, log=lambda m: None)
    bigger = write_text_fasta(tmp_path / "i.fa", [("chr1", "ACGT" * 20), ("chr2", "GGCC"), ("chr22", "TTAA")])
    with pytest.raises(GenolongError, match="another FASTA .*'g.fa'"):
        prepare(bigger, out, train="chr1,chr2", holdout="chr22", reuse=True, progress=False, log=lambda m: None)
    assert (out / "manifest.json").stat().st_mtime_ns == stamp
    prepare(bigger, out, train="chr1,chr2", holdout="chr22", reuse=True, overwrite=True, progress=False, log=lambda m: None)
    assert open_prepared(out).records("train")[0] == ("chr1", 80)
    # Nothing at --out yet: --reuse prepares it.
    prepare(fasta, tmp_path / "new", reuse=True, progress=False, log=lambda m: None)
    assert open_prepared(tmp_path / "new").records("train")[0] == ("chr1", 40)


def test_overwrite_refuses_a_directory_it_did_not_write(tmp_path):
    fasta = write_text_fasta(tmp_path / "g.fa", [("chr1", "ACGT"), ("chr2", "GGCC"), ("chr22", "TTAA")])
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(GenolongError, match="not a genolong prepare output"):
        prepare(fasta, precious, overwrite=True, progress=False, log=lambda m: None)
    assert (precious / "thesis.tex").read_text() == "years of work"


@pytest.mark.parametrize("marker", ["manifest.json", "dataset_dict.json"])
def test_overwrite_refuses_another_programs_manifest_or_dataset(tmp_path, marker):
    # A file named like ours (another tool's manifest.json, a Hugging Face save_to_disk directory's
    # dataset_dict.json) does not make a directory a genolong output.
    fasta = write_text_fasta(tmp_path / "g.fa", [("chr1", "ACGT"), ("chr2", "GGCC"), ("chr22", "TTAA")])
    other = tmp_path / "other"
    other.mkdir()
    (other / marker).write_text('{"app": 1, "splits": ["train"]}')
    (other / "important.txt").write_text("keep me")
    with pytest.raises(GenolongError, match="not a genolong prepare output"):
        prepare(fasta, other, overwrite=True, progress=False, log=lambda m: None)
    assert (other / "important.txt").read_text() == "keep me"


def test_overwrite_through_a_symlink_replaces_the_output_it_points_to(tmp_path):
    fasta = write_text_fasta(tmp_path / "g.fa", [("chr1", "ACGT" * 10), ("chr2", "GGCC"), ("chr22", "TTAA")])
    real = prepare(fasta, tmp_path / "real", progress=False, log=lambda m: None)
    link = tmp_path / "link"
    link.symlink_to("real")
    write_text_fasta(fasta, [("chr1", "TTTT"), ("chr2", "GGCC"), ("chr22", "TTAA")])
    prepare(fasta, link, overwrite=True, progress=False, log=lambda m: None)
    assert link.is_symlink() and open_prepared(link).records("train")[0] == ("chr1", 4)
    assert open_prepared(real).records("train")[0] == ("chr1", 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.fa", "link", "real"]


@pytest.mark.parametrize(
    "failure,raised",
    [(OSError(28, "No space left on device"), GenolongError), (KeyboardInterrupt(), KeyboardInterrupt)],
)
def test_failed_or_interrupted_run_leaves_nothing(tmp_path, monkeypatch, failure, raised):
    fasta = write_fasta(tmp_path / "g.fa", _records(), seed=5)

    def boom(*args, **kwargs):
        raise failure

    monkeypatch.setattr(store, "write_split", boom)
    with pytest.raises(raised) as err:
        prepare(fasta, tmp_path / "out", progress=False, log=lambda m: None)
    if raised is GenolongError:
        assert "No space left on device" in str(err.value) and "--out" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.fa"]


def test_failed_overwrite_keeps_the_previous_output(tmp_path, monkeypatch):
    fasta = write_text_fasta(tmp_path / "g.fa", [("chr1", "ACGT"), ("chr2", "GGCC"), ("chr22", "TTAA")])
    out = prepare(fasta, tmp_path / "out", progress=False, log=lambda m: None)
    write_text_fasta(fasta, [("chr1", "AC-GT"), ("chr2", "GGCC"), ("chr22", "TTAA")])
    with pytest.raises(GenolongError, match="not bases"):
        prepare(fasta, out, overwrite=True, progress=False, log=lambda m: None)
    assert open_prepared(out).records("train")[0] == ("chr1", 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.fa", "out"]


def test_read_is_a_view_of_the_mapped_file(tmp_path):
    import pyarrow as pa

    fasta = write_fasta(tmp_path / "g.fa", hg38_like(1e-3)[:3], seed=6)
    out = prepare(fasta, tmp_path / "out", train="chr1", holdout="chr3", progress=False, log=lambda m: None)
    pg = open_prepared(out)
    before = pa.total_allocated_bytes()
    a, ma = pg.read("train", "chr1", 1000, 50_000)
    b, _ = pg.read("train", "chr1", 26_000, 50_000)
    # Views: nothing allocated, read-only, and two overlapping reads share memory.
    assert pa.total_allocated_bytes() == before
    assert not a.flags.owndata and not a.flags.writeable and not ma.flags.writeable
    assert np.shares_memory(a, b)
    assert a.dtype == np.uint8 and ma.dtype == np.bool_ and a.shape == ma.shape == (50_000,)
    with pytest.raises(IndexError):
        pg.read("train", "chr1", pg.records("train")[0][1] - 10, 11)


def test_open_prepared_rejects_damaged_output(tmp_path):
    fasta = write_text_fasta(tmp_path / "g.fa", [("chr1", "ACGT" * 5), ("chr2", "GGCC"), ("chr22", "TTAA")])
    out = prepare(fasta, tmp_path / "out", progress=False, log=lambda m: None)
    for damage, fragment in [
        (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
        (lambda d: (d / "manifest.json").write_text("{"), "not valid JSON"),
        (lambda d: (d / "train" / "data-00000-of-00002.arrow").unlink(), "damaged"),
        (lambda d: (d / "train" / "data-00001-of-00002.arrow").write_bytes(b"junk"), "damaged"),
    ]:
        copy = tmp_path / "copy"
        shutil.copytree(out, copy)
        damage(copy)
        with pytest.raises(GenolongError, match=fragment) as err:
            open_prepared(copy)
        assert "\n" not in str(err.value) and "genolong prepare" in str(err.value)
        shutil.rmtree(copy)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["records"][0]["length"] += 1
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GenolongError, match="does not match manifest.json"):
        open_prepared(out)
    with pytest.raises(GenolongError, match="does not exist"):
        open_prepared(tmp_path / "nowhere")


def test_stale_index_is_not_trusted(tmp_path):
    fasta = write_text_fasta(tmp_path / "g.fa", [("chr1", "ACGT" * 100), ("chr2", "GGCC" * 50), ("chr22", "TTAA" * 10)])
    pyfaidx.Faidx(str(fasta)).close()
    # Older index than FASTA: ignored, the file is streamed and the output is still right.
    write_text_fasta(fasta, [("chr1", "CCCC" * 10), ("chr2", "GGCC" * 50), ("chr22", "TTAA" * 10)])
    fai = tmp_path / "g.fa.fai"
    os.utime(fai, (fasta.stat().st_mtime - 60, fasta.stat().st_mtime - 60))
    out = prepare(fasta, tmp_path / "out", progress=False, log=lambda m: None)
    assert open_prepared(out).manifest["source"]["read_with_index"] is False
    assert open_prepared(out).records("train")[0] == ("chr1", 40)
    # An index that looks fresh but describes other bytes: a one-line error that names it.
    os.utime(fai, (fasta.stat().st_mtime + 60, fasta.stat().st_mtime + 60))
    with pytest.raises(GenolongError, match="g.fa.fai") as err:
        prepare(fasta, tmp_path / "out2", progress=False, log=lambda m: None)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out2").exists()


def test_memory_grows_by_a_few_bytes_per_base_of_the_largest_record(tmp_path):
    """Guards the < 4 GiB promise for hg38: ~3.3 bytes per base of chr1 (codes, tokens, mask).

    Per-base Python objects, or holding the whole text, would cost far more than 4.5 bytes per base.
    """
    import os
    import subprocess
    import sys

    bases = 48 << 20
    fasta = write_fasta(tmp_path / "m.fa", [("chr1", bases), ("chr2", 1000), ("chr22", 1000)], seed=0)

    def peak_mib(code: str) -> float:
        proc = subprocess.Popen([sys.executable, "-c", code])
        _, status, usage = os.wait4(proc.pid, 0)
        assert status == 0
        return usage.ru_maxrss / 1024

    baseline = peak_mib("import genolong.data")
    peak = peak_mib(
        "from genolong.data import prepare; "
        f"prepare({str(fasta)!r}, {str(tmp_path / 'out')!r}, progress=False, log=print)"
    )
    assert (peak - baseline) / (bases >> 20) < 4.5


@pytest.mark.parametrize("split", ["train", "holdout"])
def test_an_all_n_split_is_refused_in_one_line_and_leaves_nothing(tmp_path, split):
    records = [("chr1", "ACGT" * 50), ("chr2", "N" * 300)]
    fasta = write_text_fasta(tmp_path / "g.fa", records, width=60)
    splits = {"train": "chr1", "holdout": "chr1"} | {split: "chr2"}
    with pytest.raises(GenolongError, match=rf"the {split} split \(chr2\) is all N: .*choose records with sequence") as err:
        prepare(fasta, tmp_path / "out", **splits, progress=False, log=lambda _m: None)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["g.fa"]
