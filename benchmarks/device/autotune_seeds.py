"""Turn the autotuning results a device call brought back into genolong's shipped seeds.

    python benchmarks/device/autotune_seeds.py OUT/autotune.tar.gz [more.tar.gz or Triton cache dirs] \
        --into genolong/kernels/autotuned/hopper.json

call.sh packs every `<cache key>/<kernel>.autotune.json` of the device's Triton cache into
$OUT/autotune.tar.gz (TRITON_CACHE_AUTOTUNING=1 makes every autotuned kernel write one).
This merges them into one seeds file (genolong/kernels/autotune_seeds.py explains how they are
used); an entry already in the file is replaced by the newer recording of the same key.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from genolong.kernels.autotune_seeds import _KEY, _NAME, read  # noqa: E402


_BASE32 = re.compile(r"[A-Z2-7]{52}")


def _hex_key(directory: str) -> str:
    """The cache key Triton hashed (64 hex digits) from its cache directory's name (the key's 32
    bytes in base32, triton.runtime.cache._base32); a name that is neither is returned as it is."""
    if _BASE32.fullmatch(directory):
        return base64.b32decode(directory + "====").hex()
    return directory


def _recordings(source: Path):
    """(cache key, file name, text) of every autotuning file in a tarball or a Triton cache dir."""
    if source.is_dir():
        for p in sorted(source.glob("*/*.autotune.json")):
            yield _hex_key(p.parent.name), p.name, p.read_text()
        return
    with tarfile.open(source) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            parts = Path(m.name).parts
            if m.isfile() and len(parts) >= 2 and parts[-1].endswith(".autotune.json"):
                yield _hex_key(parts[-2]), parts[-1], tar.extractfile(m).read().decode()


def merge(sources: list[Path], into: Path) -> tuple[int, int]:
    """Merge the recordings into the seeds file `into`; returns (entries now, entries added or replaced)."""
    before = {(e["key"], e["file"]): e["content"] for e in read(into)} if into.exists() else {}
    entries = dict(before)
    for source in sources:
        for key, name, text in _recordings(source):
            if not (_KEY.fullmatch(key) and _NAME.fullmatch(name)):
                raise SystemExit(f"{source}: {key}/{name} is not a Triton autotuning file (<cache key>/<kernel>.autotune.json)")
            json.loads(text)  # a truncated recording stops here, before anything is written
            entries[(key, name)] = text
    out = {"entries": [{"key": k, "file": f, "content": entries[(k, f)]} for k, f in sorted(entries)]}
    into.parent.mkdir(parents=True, exist_ok=True)
    tmp = into.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(out, indent=1) + "\n")
        read(tmp)
        tmp.replace(into)
    finally:
        tmp.unlink(missing_ok=True)
    return len(entries), sum(before.get(k) != text for k, text in entries.items())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", type=Path, help="autotune.tar.gz files or Triton cache directories")
    parser.add_argument("--into", type=Path, required=True, help="the seeds file to create or extend")
    args = parser.parse_args(argv)
    for s in args.sources:
        if not s.exists():
            raise SystemExit(f"{s}: no such file or directory")
    total, changed = merge(args.sources, args.into)
    print(f"{args.into}: {total} autotuning choices ({changed} added or replaced)")


if __name__ == "__main__":
    main()
