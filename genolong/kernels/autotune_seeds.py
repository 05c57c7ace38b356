"""Autotuning choices shipped with genolong: on a fresh GPU machine, the kernels at the shapes they
were recorded for compile only their chosen configuration instead of timing every candidate.

fla's KDA kernels (and any other `triton.autotune` kernel) compile and time every candidate
configuration at their first launch on a machine, for each tuning key (head counts, head dims,
chunk size, dtypes): on a fresh machine most of the first training step. With
`cache_results` (fla's default) Triton stores the timings beside its binaries as
`<cache key>/<kernel>.autotune.json` and, when that file exists, compiles only the fastest
configuration. The cache key hashes Triton's own build, the GPU target, the kernel's source
and the tuning key, so a file recorded on one machine is read only by the same kernel, package
versions and GPU architecture on another, and is inert anywhere else.

`autotuned/*.json` holds such files recorded on the device machine (made by
benchmarks/device/autotune_seeds.py from a call's `autotune.tar.gz`); `seed()` writes the ones
not yet present into the Triton cache (TRITON_CACHE_DIR or Triton's default) through Triton's
own cache manager. `genolong.kernels.load()` calls it once a process when CUDA is available.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

SEEDS = Path(__file__).parent / "autotuned"
_KEY = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_]+\.autotune\.json")


def read(path: Path) -> list[dict]:
    """The entries of one seeds file, checked: [{"key", "file", "content"}]."""
    data = json.loads(Path(path).read_text())
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected {{'entries': [...]}}")
    for e in entries:
        if not (isinstance(e, dict) and _KEY.fullmatch(str(e.get("key"))) and _NAME.fullmatch(str(e.get("file")))):
            raise ValueError(f"{path}: malformed entry {str(e)[:120]}")
        content = json.loads(e["content"])
        if not (isinstance(content.get("key"), list) and content.get("configs_timings")):
            raise ValueError(f"{path}: entry {e['key']}/{e['file']} has no tuning key or no timings")
    return entries


def seed(folder: Path = SEEDS) -> int:
    """Write every shipped autotuning file that the Triton cache lacks; returns how many were
    written (0 without triton). A file already cached (a choice this machine made) is kept."""
    try:
        from triton.runtime.cache import get_cache_manager
    except ImportError:
        return 0
    written = 0
    for path in sorted(Path(folder).glob("*.json")):
        for e in read(path):
            cache = get_cache_manager(e["key"])
            if cache.get_file(e["file"]) is None:
                cache.put(e["content"], e["file"], binary=False)
                written += 1
    return written


_seeded = False


def seed_once() -> None:
    """seed() the first time a process asks with CUDA available."""
    global _seeded
    if _seeded:
        return
    import torch

    if torch.cuda.is_available():
        try:
            seed()
        except OSError as why:  # an unwritable cache costs the first step time, not the run
            import warnings

            warnings.warn(f"could not seed the Triton cache with genolong's autotuning choices ({why}); kernels will autotune")
    _seeded = True
