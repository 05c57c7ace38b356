"""manifest.json: what was prepared, from what, and how; read back and checked by open_prepared."""

import json
from pathlib import Path

import genolong
from genolong.errors import GenolongError
from genolong.vocab import DNA_VOCAB
from genolong.invocation import command

FORMAT = "genolong-prepared"
FORMAT_VERSION = 1
FILENAME = "manifest.json"


def record_entry(name: str, description: str, length: int, split: str | None, stats=None) -> dict:
    """One record's line in the manifest; `stats` (encode.RecordStats) only for records that were read."""
    entry = {"name": name, "description": description, "length": length, "split": split}
    if stats is not None:
        entry.update(
            n_count=stats.n_count,
            n_fraction=stats.n_count / length if length else 0.0,
            repeat_count=stats.repeat_count,
            repeat_fraction=stats.repeat_count / length if length else 0.0,
            iupac_to_n=stats.iupac_to_n,
            iupac_to_n_by_code=dict(sorted(stats.iupac.items())),
        )
    return entry


def build(
    source,
    sha256: str,
    splits: dict[str, list[str]],
    renamed: list[tuple[str, str]],
    records: list[dict],
    index_used: bool,
) -> dict:
    in_split = [r for r in records if r["split"] is not None]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "genolong_version": genolong.__version__,
        "source": {
            "path": str(Path(source.path).resolve()),
            "filename": Path(source.path).name,
            "size_bytes": source.size,
            "compression": source.compression,
            "sha256": sha256,
            "read_with_index": index_used,
        },
        "vocabulary": dict(DNA_VOCAB),
        "tokenization": "one token per base; lowercase (soft-masked repeats) -> repeat_mask 1; "
        "IUPAC ambiguity codes -> N, counted in iupac_to_n",
        "splits": splits,
        "aliases": [{"requested": asked, "used": used} for asked, used in renamed],
        "records": records,
        "left_out": [r["name"] for r in records if r["split"] is None],
        "totals": {
            split: {
                "records": len(names),
                "bases": sum(r["length"] for r in in_split if r["split"] == split),
                "n_count": sum(r["n_count"] for r in in_split if r["split"] == split),
                "iupac_to_n": sum(r["iupac_to_n"] for r in in_split if r["split"] == split),
            }
            for split, names in splits.items()
        },
    }


def write(root: Path, manifest: dict) -> None:
    (root / FILENAME).write_text(json.dumps(manifest, indent=2) + "\n")


def read(root: Path) -> dict:
    """The manifest of a prepared directory, or a GenolongError saying how to make one."""
    redo = f"run `{command()} prepare --fasta GENOME.fa --out {root}` (add --overwrite to replace it)"
    if not root.is_dir():
        raise GenolongError(f"prepared data directory {str(root)!r} does not exist: {redo}")
    path = root / FILENAME
    if not path.is_file():
        raise GenolongError(f"{str(root)!r} has no {FILENAME}, so it is not a complete genolong prepare output: {redo}")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise GenolongError(f"{str(path)!r} is not valid JSON ({err.__class__.__name__}): {redo}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise GenolongError(f"{str(path)!r} is not a genolong prepare manifest: {redo}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise GenolongError(
            f"{str(root)!r} has data format version {manifest.get('format_version')}, this genolong reads "
            f"version {FORMAT_VERSION}: {redo}"
        )
    for key in ("splits", "records", "vocabulary"):
        if key not in manifest:
            raise GenolongError(f"{str(path)!r} lacks the {key!r} field: {redo}")
    if manifest["vocabulary"] != DNA_VOCAB:
        raise GenolongError(f"{str(root)!r} was tokenized with another vocabulary {manifest['vocabulary']}: {redo}")
    return manifest
