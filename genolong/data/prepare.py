"""`prepare`: FASTA -> tokenized, split, memory-mapped records plus manifest.json, written atomically.

Everything is written into `.DIR.tmp-XXXX` beside the output and renamed to `DIR` only when
complete (manifest.json last), so an interrupted or failed run never leaves a `DIR` that looks
finished. Memory holds at most two requested records: one being encoded, one being written.
"""

import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from genolong.data import manifest as manifest_io
from genolong.data import store
from genolong.data.encode import InvalidBases, RecordStats, count_bases, encode, split_codes
from genolong.data.fasta import FastaIndex, FastaSource, open_stream, parse_header, sniff
from genolong.data.fasta import records as fasta_records
from genolong.data.splits import candidates, check_requested, parse_names, resolve
from genolong.errors import GenolongError
from genolong.staging import staging_dir, write_error

DEFAULT_TRAIN = "chr1,chr2"
DEFAULT_HOLDOUT = "chr22"


def _stderr(message: str) -> None:
    print(f"genolong: {message}", file=sys.stderr)


class _Hasher(threading.Thread):
    """sha256 of the source file on a second core (hashlib and file reads release the GIL)."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self._path = path
        self._hash = hashlib.sha256()
        self._stop_flag = threading.Event()
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            with open(self._path, "rb") as f:
                while not self._stop_flag.is_set():
                    block = f.read(8 << 20)
                    if not block:
                        break
                    self._hash.update(block)
        except OSError as err:
            self._error = err

    def hexdigest(self) -> str:
        self.join()
        if self._error is not None:
            raise GenolongError(f"could not read {str(self._path)!r} to checksum it ({self._error}): check the file")
        return self._hash.hexdigest()

    def stop(self) -> None:
        self._stop_flag.set()


class _Recorder:
    """Encodes one requested record's chunks into contiguous buffers and writes its shard.

    A shard is written on a second thread (Arrow's writer releases the GIL) while the next
    record is parsed; at most one record waits, so memory holds two records at most.
    """

    def __init__(self, scratch: Path):
        self._scratch = scratch
        self._writer = ThreadPoolExecutor(max_workers=1)
        self._pending: Future | None = None
        self.shards: dict[str, tuple[Path, RecordStats]] = {}

    def record(
        self, name: str, description: str, chunks: Iterable[bytes], on_bases: Callable[[int], None]
    ) -> RecordStats:
        stats = RecordStats()
        codes = []
        for chunk in chunks:
            codes.append(encode(chunk, stats, name))
            on_bases(len(codes[-1]))
        tokens, mask = split_codes(codes, stats)
        path = self._scratch / f"record-{len(self.shards):05d}.arrow"
        self.flush()
        self._pending = self._writer.submit(
            store.write_record,
            path,
            name,
            description,
            tokens,
            mask,
            stats.n_count,
            stats.repeat_count,
            stats.iupac_to_n,
        )
        self.shards[name] = (path, stats)
        return stats

    def flush(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        self._writer.shutdown(wait=True, cancel_futures=True)


def _progress(enabled: bool) -> Progress:
    console = Console(stderr=True)
    # Off when stderr is not a terminal: logs and CI keep one line per message, no bar remnants.
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not (enabled and console.is_terminal),
    )


def _read_indexed(index: FastaIndex, requested, recorder: _Recorder, progress: Progress, log):
    """Names and lengths from the index up front (missing records fail before any reading)."""
    available = [r.name for r in index.records]
    _refuse_duplicates(available, index.source)
    unlisted = index.unlisted_record()
    if unlisted is not None:
        raise GenolongError(
            f"{index.source.path.name} has a record {unlisted} that {index.source.path.name}.fai does not list (a second record "
            f"of one name, which samtools indexes once?): delete the .fai (and .gzi) and re-run, and prepare reads the file itself"
        )
    splits, renamed = resolve(requested, available, repr(str(index.source.path)))
    chosen = {name for names in splits.values() for name in names}
    wanted = [r for r in index.records if r.name in chosen]
    _refuse_empty([(r.name, r.length) for r in wanted])
    log(f"reading {len(wanted)} record(s) through the index {index.source.path.name}.fai")
    task = progress.add_task("bases", total=sum(r.length for r in wanted))
    described = {}
    for rec in wanted:
        progress.update(task, description=rec.name)
        try:
            described[rec.name] = description = index.description(rec)
            stats = recorder.record(rec.name, description, index.chunks(rec), lambda n: progress.advance(task, n))
            _report(log, rec.name, stats)
        except InvalidBases as err:
            # A stale index points into the wrong bytes (headers, other records): say so too.
            raise GenolongError(f"{err}; if {index.source.path.name}.fai is stale, delete it and re-run") from None
        if stats.length != rec.length:
            raise GenolongError(
                f"record {rec.name!r} has {stats.length:,} bases but {index.source.path.name}.fai says {rec.length:,}: "
                f"the index is stale; delete {index.source.path.name}.fai (and .gzi) and re-run"
            )
    return [(r.name, described.get(r.name, ""), r.length) for r in index.records], splits, renamed


def _report(log, name: str, stats: RecordStats) -> None:
    """One line per record read: the progress of a long prepare where no bar is drawn (logs, CI)."""
    n = max(stats.length, 1)
    iupac = f" ({stats.iupac_to_n:,} from IUPAC codes)" if stats.iupac_to_n else ""
    log(f"{name}: {stats.length:,} bases, {100 * stats.n_count / n:.2f}% N{iupac}, {100 * stats.repeat_count / n:.1f}% soft-masked")


def _refuse_duplicates(names: list[str], source: FastaSource) -> None:
    seen = set()
    for name in names:
        if name in seen:
            raise _duplicate(name, source)
        seen.add(name)


def _duplicate(name: str, source: FastaSource) -> GenolongError:
    return GenolongError(
        f"record name {name!r} appears more than once in {str(source.path)!r}: give every record a unique name "
        f"(the first word of its '>' line)"
    )


def _refuse_empty(named_lengths) -> None:
    for name, length in named_lengths:
        if length == 0:
            raise GenolongError(f"record {name!r} has no bases: choose another record for that split")


def _refuse_all_n(splits: dict[str, list[str]], shards: dict) -> None:
    """A train or holdout split with no A, C, G or T would only fail later (finetune finds no window,
    eval no target)."""
    for split, names in splits.items():
        if split in ("train", "holdout") and names and all(shards[name][1].n_count == shards[name][1].length for name in names):
            raise GenolongError(
                f"the {split} split ({', '.join(names)}) is all N: it has no base to learn from or score; "
                "choose records with sequence for it"
            )


def _read_streaming(source: FastaSource, requested, recorder: _Recorder, progress: Progress, log):
    """One pass over the file: requested records (and their aliases) are encoded, others only counted."""
    wanted = candidates(requested)
    task = progress.add_task(source.path.name, total=source.size)
    lengths: list[tuple[str, str, int]] = []
    seen: set[str] = set()
    with open_stream(source) as stream:

        def tracked(chunks):
            for chunk in chunks:
                yield chunk
                progress.update(task, completed=stream.raw.bytes_read)

        for header, chunks in fasta_records(stream, source):
            name, description = parse_header(header)
            if not name:
                raise GenolongError(
                    f"{str(source.path)!r} has a '>' line with no record name: give every record a name"
                )
            if name in seen:
                raise _duplicate(name, source)
            seen.add(name)
            if name in wanted:
                stats = recorder.record(name, description, tracked(chunks), lambda n: None)
                length = stats.length
                _report(log, name, stats)
            else:
                length = sum(count_bases(chunk) for chunk in tracked(chunks))
                log(f"{name}: {length:,} bases, not requested (counted only)")
            lengths.append((name, description, length))
    progress.update(task, completed=source.size)
    splits, renamed = resolve(requested, [name for name, _, _ in lengths], repr(str(source.path)))
    chosen = {name for names in splits.values() for name in names}
    _refuse_empty([(name, length) for name, _, length in lengths if name in chosen])
    return lengths, splits, renamed


def _is_replaceable(out: Path) -> bool:
    """Only an earlier prepare output (its manifest says so, of any format version) or an empty
    directory may be deleted by --overwrite: a file merely named manifest.json, or another
    program's dataset directory, is someone else's data."""
    if not out.is_dir():
        return False
    if not any(out.iterdir()):
        return True
    try:
        manifest = json.loads((out / manifest_io.FILENAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == manifest_io.FORMAT


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise GenolongError(
                f"output {str(out)!r} already exists: add --overwrite to replace it, or choose another --out"
            )
        if not _is_replaceable(out):
            raise GenolongError(
                f"output {str(out)!r} exists and is not a genolong prepare output, so --overwrite will not delete it: "
                f"choose another --out or remove it yourself"
            )


def _install(tmp: Path, out: Path, overwrite: bool) -> None:
    if not out.exists():
        os.rename(tmp, out)
        return
    _check_out(out, overwrite)
    old = Path(tempfile.mkdtemp(prefix=f"{out.name}.old-", dir=out.parent))
    try:
        os.replace(out, old)
    except OSError:
        old.rmdir()
        raise
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _same_preparation(out: Path, source, requested: dict[str, list[str]]) -> str | None:
    """None if the prepare output `out` was made from this FASTA (size, then sha256) with these
    splits (names as requested, or as the file spells them); else what differs."""
    manifest = manifest_io.read(out)
    was = manifest.get("source", {})
    if was.get("size_bytes") != source.size:
        return f"another FASTA ({was.get('filename')!r}, {was.get('size_bytes')} bytes; --fasta has {source.size})"
    hasher = _Hasher(source.path)
    hasher.start()
    if was.get("sha256") != hasher.hexdigest():
        return f"another FASTA of the same size ({was.get('filename')!r}: its sha256 differs)"
    used = {a["requested"]: a["used"] for a in manifest.get("aliases", [])}
    asked = {split: sorted(used.get(n, n) for n in names) for split, names in requested.items()}
    have = {split: sorted(names) for split, names in manifest["splits"].items()}
    if asked != have:
        return f"other splits ({have}; asked for {asked})"
    return None


def prepare(
    fasta: str | os.PathLike,
    out: str | os.PathLike,
    train: str | list[str] = DEFAULT_TRAIN,
    holdout: str | list[str] = DEFAULT_HOLDOUT,
    validation: str | list[str] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = _stderr,
    reuse: bool = False,
) -> Path:
    """Prepares `fasta` into the directory `out`; returns `out`. See docs/data.md for the format.
    `reuse`: an existing output made from the same FASTA (by checksum) with the same splits is
    kept as it is; one made otherwise is an error (or replaced, with `overwrite`)."""
    out = Path(out)
    if out.is_symlink():
        # A link to an output directory: the output replaced is the one it points to, and the
        # link keeps pointing at it (replacing the link itself would swap a directory for it).
        out = out.resolve()
    requested = {"train": parse_names(train, "train"), "holdout": parse_names(holdout, "holdout")}
    if validation is not None:
        requested["validation"] = parse_names(validation, "validation")
    check_requested(requested)
    if reuse and (out / manifest_io.FILENAME).is_file():
        differs = _same_preparation(out, sniff(fasta), requested)
        if differs is None:
            log(f"{out}: already prepared from {Path(fasta).name} with these splits, reused")
            return out
        if not overwrite:
            raise GenolongError(
                f"output {str(out)!r} was prepared from {differs}: add --overwrite to replace it, or choose another --out"
            )
    _check_out(out, overwrite)
    source = sniff(fasta)
    index = FastaIndex.load(source)
    tmp = staging_dir(out)
    # Everything after it is inside the try, so an interrupt at any point removes `tmp`.
    hasher = None
    try:
        hasher = _Hasher(source.path)
        hasher.start()
        scratch = tmp / "_records"
        scratch.mkdir()
        with _progress(progress) as bar:
            recorder = _Recorder(scratch)
            try:
                if index is not None:
                    lengths, splits, renamed = _read_indexed(index, requested, recorder, bar, log)
                else:
                    lengths, splits, renamed = _read_streaming(source, requested, recorder, bar, log)
                recorder.flush()
            finally:
                recorder.close()
        for asked, used in renamed:
            log(f"record {asked!r} is called {used!r} in {source.path.name}: using {used!r}")
        _refuse_all_n(splits, recorder.shards)
        sha256 = hasher.hexdigest()
        split_of = {name: split for split, names in splits.items() for name in names}
        records = [
            manifest_io.record_entry(
                name, description, length, split_of.get(name), recorder.shards[name][1] if name in split_of else None
            )
            for name, description, length in lengths
        ]
        for split, names in splits.items():
            store.write_split(tmp, split, [recorder.shards[name][0] for name in names], sha256)
        shutil.rmtree(scratch)
        store.write_dataset_dict(tmp, list(splits))
        manifest_io.write(tmp, manifest_io.build(source, sha256, splits, renamed, records, index is not None))
        _install(tmp, out, overwrite)
    except OSError as err:
        # Reading errors are GenolongErrors already (fasta.read_checked); this is the output side.
        raise write_error(out, err) from None
    finally:
        if hasher is not None:
            hasher.stop()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    summary = "; ".join(
        f"{split}: {len(names)} record(s), {sum(r['length'] for r in records if r['split'] == split):,} bases"
        for split, names in splits.items()
    )
    log(f"prepared {out} ({summary}; {len(lengths) - len(split_of)} record(s) left out)")
    return out
