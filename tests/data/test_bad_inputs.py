"""Every bad input: one line on stderr naming problem and fix, non-zero exit, no traceback, no output."""

import bz2
import gzip

import pytest

from genolong.data.synthetic import write_fasta

from .conftest import assert_one_line_error, run_cli, write_text_fasta

GOOD = [("chr1", "ACGTACGTAC" * 30), ("chr2", "GGCCAATT" * 20), ("chr22", "acgtnNNNAC" * 20)]


def _missing(tmp_path):
    return tmp_path / "nope.fa", ["does not exist"]


def _empty(tmp_path):
    p = tmp_path / "empty.fa"
    p.write_bytes(b"")
    return p, ["is empty"]


def _blank(tmp_path):
    p = tmp_path / "blank.fa.gz"
    p.write_bytes(gzip.compress(b"\n\n  \n"))
    return p, ["is empty"]


def _binary(tmp_path):
    p = tmp_path / "genome.fa"
    p.write_bytes(bytes(range(256)) * 40)
    return p, ["binary"]


def _fastq(tmp_path):
    p = tmp_path / "reads.fa"
    p.write_text("@read1\nACGT\n+\nIIII\n")
    return p, ["FASTQ"]


def _html(tmp_path):
    p = tmp_path / "hg38.fa.gz"
    p.write_text("<!DOCTYPE html>\n<html><body>404 Not Found</body></html>\n")
    return p, ["HTML"]


def _byte_order_mark(tmp_path):
    p = tmp_path / "notepad.fa"
    p.write_bytes(b"\xef\xbb\xbf>chr1\nACGT\n>chr2\nACGT\n>chr22\nACGT\n")
    return p, ["byte-order mark", "before its first '>'"]


def _truncated_gzip(tmp_path):
    full = write_fasta(
        tmp_path / "full.fa.gz", [("chr1", 200_000), ("chr2", 1000), ("chr22", 1000)], compression="gzip"
    )
    p = tmp_path / "cut.fa.gz"
    p.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    full.unlink()
    return p, ["truncated gzip", "download it again"]


def _bzip2(tmp_path):
    p = tmp_path / "g.fa.bz2"
    p.write_bytes(bz2.compress(b">chr1\nACGT\n"))
    return p, ["bzip2", "bgzip"]


def _duplicate(tmp_path):
    return write_text_fasta(tmp_path / "g.fa", GOOD + [("chr2", "ACGT")]), ["'chr2' appears more than once"]


def _non_bases(tmp_path):
    bad = [("chr1", "ACGTACGT" * 10 + "AC-GT*"), *GOOD[1:]]
    return write_text_fasta(tmp_path / "g.fa", bad), ["'chr1'", "not bases", "'-'", "'*'", "base 83"]


def _mid_line_header(tmp_path):
    p = tmp_path / "g.fa"
    p.write_text(">chr1\nACGT>chr9\nACGT\n>chr2\nAC\n>chr22\nGT\n")
    return p, ["'>'", "not bases"]


def _no_name(tmp_path):
    p = tmp_path / "g.fa"
    p.write_text(">chr1\nACGT\n>\nACGT\n>chr2\nAC\n>chr22\nGT\n")
    return p, ["no record name"]


CASES = [_missing, _empty, _blank, _binary, _fastq, _html, _byte_order_mark, _truncated_gzip, _bzip2, _duplicate, _non_bases,
         _mid_line_header, _no_name]  # fmt: skip


def _assert_no_output(tmp_path):
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out.")]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.strip("_") for c in CASES])
def test_bad_fasta(tmp_path, case):
    fasta, fragments = case(tmp_path)
    result = run_cli("prepare", "--fasta", str(fasta), "--out", str(tmp_path / "out"))
    assert_one_line_error(result, *fragments)
    _assert_no_output(tmp_path)


def test_missing_record_lists_what_exists(tmp_path):
    fasta = write_text_fasta(tmp_path / "g.fa", GOOD)
    result = run_cli("prepare", "--fasta", str(fasta), "--out", str(tmp_path / "out"), "--holdout", "chr21")
    assert_one_line_error(result, "chr21", "chr1, chr2, chr22")
    _assert_no_output(tmp_path)


def test_a_genome_of_one_record_is_told_it_cannot_be_split(tmp_path):
    fasta = write_text_fasta(tmp_path / "g.fa", [("chrX", "ACGT" * 10)])
    result = run_cli("prepare", "--fasta", str(fasta), "--out", str(tmp_path / "out"))
    assert_one_line_error(result, "one record (chrX)", "at least two")
    _assert_no_output(tmp_path)


@pytest.mark.parametrize("where", ["middle", "last"])
def test_an_index_that_skips_a_duplicated_record_is_refused(tmp_path, where):
    # samtools faidx keeps the first of two records with one name: the .fai then lists fewer
    # records than the file has, and reading through it would drop one silently.
    body = {"middle": ">chr1\nACGT\n>chr1\nGGGG\n>chr2\nACGT\n>chr22\nACGT\n",
            "last": ">chr1\nACGT\n>chr2\nACGT\n>chr22\nACGT\n>chr22\nGGGG\n"}[where]
    fasta = tmp_path / "g.fa"
    fasta.write_text(body)
    listed = []
    for name in ("chr1", "chr2", "chr22"):
        offset = body.index(f">{name}\n") + len(name) + 2
        listed.append(f"{name}\t4\t{offset}\t4\t5\n")
    (tmp_path / "g.fa.fai").write_text("".join(listed))
    result = run_cli("prepare", "--fasta", str(fasta), "--out", str(tmp_path / "out"))
    assert_one_line_error(result, "does not list", "delete the .fai")
    _assert_no_output(tmp_path)
    (tmp_path / "g.fa.fai").unlink()
    result = run_cli("prepare", "--fasta", str(fasta), "--out", str(tmp_path / "out"))
    assert_one_line_error(result, "appears more than once")


def test_missing_record_fails_before_reading_when_indexed(tmp_path):
    import pyfaidx

    fasta = write_text_fasta(tmp_path / "g.fa", GOOD)
    pyfaidx.Faidx(str(fasta)).close()
    result = run_cli("prepare", "--fasta", str(fasta), "--out", str(tmp_path / "out"), "--train", "chr1,chrX")
    assert_one_line_error(result, "chrX", "chr1, chr2, chr22")
    _assert_no_output(tmp_path)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--train", "chr1,chr2", "--holdout", "chr2"], "in both --train and --holdout"),
        (["--train", "chr1", "--holdout", "chr22", "--validation", "22"], "in both --holdout and --validation"),
        (["--train", "chr1,chr1"], "twice in --train"),
        (["--train", " , "], "names no records"),
    ],
)
def test_bad_splits(tmp_path, args, fragment):
    fasta = write_text_fasta(tmp_path / "g.fa", GOOD)
    result = run_cli("prepare", "--fasta", str(fasta), "--out", str(tmp_path / "out"), *args)
    assert_one_line_error(result, fragment)
    _assert_no_output(tmp_path)


def test_existing_output_is_refused_and_kept(tmp_path):
    fasta = write_text_fasta(tmp_path / "g.fa", GOOD)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_cli("prepare", "--fasta", str(fasta), "--out", str(out))
    assert_one_line_error(result, "already exists", "--overwrite")
    assert (out / "keep.txt").read_text() == "mine"


def test_good_input_succeeds_through_the_cli(tmp_path):
    fasta = write_text_fasta(tmp_path / "g.fa", GOOD, newline="\r\n")
    result = run_cli("prepare", "--fasta", str(fasta), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_sigterm_mid_run_leaves_no_output(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    fasta = write_fasta(
        tmp_path / "g.fa", [("chr1", 150 << 20), ("chr2", 100), ("chr22", 100)], lowercase=False, iupac_rate=0
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "genolong", "prepare", "--fasta", str(fasta), "--out", str(tmp_path / "out")],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".out.tmp-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr  # 130: stopped by the signal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.fa"]
