"""The shipped autotuning choices (genolong/kernels/autotune_seeds.py) and the script that makes
them from a device call (benchmarks/device/autotune_seeds.py): recordings survive the round trip
byte for byte, land where Triton's own cache manager looks, never overwrite a machine's own
choice, and malformed input is refused before anything is written."""

import base64
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from genolong.kernels import autotune_seeds

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "device" / "autotune_seeds.py"
KEY_A, KEY_B = "a" * 64, "0123456789abcdef" * 4


def _directory(key: str) -> str:
    """Triton's cache directory name for a key (its 32 bytes in base32), written out here by hand."""
    return base64.b32encode(bytes.fromhex(key)).decode().rstrip("=")


def _recording(bv: int) -> str:
    best = {"kwargs": {"BV": bv}, "num_warps": 4, "num_ctas": 1, "num_stages": 2, "maxnreg": None, "ir_override": None}
    other = dict(best, num_warps=8)
    return json.dumps({"key": [4, 128, 128, 64, "torch.bfloat16"], "configs_timings": [[best, [0.5]], [other, [0.7]]]})


def _tarball(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _convert(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=ROOT)


@pytest.fixture
def triton_cache(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    return cache


def test_recordings_round_trip_into_the_triton_cache(tmp_path, triton_cache):
    from triton.runtime.cache import get_cache_manager

    recorded = {KEY_A: ("chunk_fwd_kernel_h.autotune.json", _recording(32)),
                KEY_B: ("causal_conv1d_fwd_kernel.autotune.json", _recording(64))}
    tarball = _tarball(tmp_path / "autotune.tar.gz", {
        **{f"./{_directory(k)}/{name}": text for k, (name, text) in recorded.items()},
        f"./{_directory(KEY_A)}/chunk_fwd_kernel_h.cubin": "binary, not a recording",
    })
    seeds = tmp_path / "seeds" / "hopper.json"
    done = _convert(tarball, "--into", seeds)
    assert done.returncode == 0, done.stderr
    assert "2 autotuning choices (2 added or replaced)" in done.stdout
    assert len(autotune_seeds.read(seeds)) == 2

    assert autotune_seeds.seed(seeds.parent) == 2
    for key, (name, text) in recorded.items():
        found = get_cache_manager(key).get_file(name)  # the lookup Triton's autotuner makes
        assert found is not None and Path(found).read_text() == text
        assert Path(found).parent.name == _directory(key)  # the directory the recording came from
    assert autotune_seeds.seed(seeds.parent) == 0  # already there


def test_a_machines_own_choice_is_kept(tmp_path, triton_cache):
    from triton.runtime.cache import get_cache_manager

    name = "chunk_fwd_kernel_h.autotune.json"
    own = _recording(128)
    get_cache_manager(KEY_A).put(own, name, binary=False)
    seeds = tmp_path / "hopper.json"
    seeds.write_text(json.dumps({"entries": [{"key": KEY_A, "file": name, "content": _recording(32)}]}))
    assert autotune_seeds.seed(tmp_path) == 0
    assert Path(get_cache_manager(KEY_A).get_file(name)).read_text() == own


def test_merging_replaces_the_same_key_and_keeps_the_others(tmp_path):
    seeds = tmp_path / "hopper.json"
    name = "k.autotune.json"
    assert _convert(_tarball(tmp_path / "a.tar.gz", {f"{_directory(KEY_A)}/{name}": _recording(32), f"{_directory(KEY_B)}/{name}": _recording(32)}),
                    "--into", seeds).returncode == 0
    done = _convert(_tarball(tmp_path / "b.tar.gz", {f"{_directory(KEY_A)}/{name}": _recording(64)}), "--into", seeds)
    assert "2 autotuning choices (1 added or replaced)" in done.stdout
    by_key = {e["key"]: json.loads(e["content"]) for e in autotune_seeds.read(seeds)}
    assert by_key[KEY_A]["configs_timings"][0][0]["kwargs"] == {"BV": 64}
    assert by_key[KEY_B]["configs_timings"][0][0]["kwargs"] == {"BV": 32}


def test_a_truncated_recording_writes_nothing(tmp_path):
    seeds = tmp_path / "hopper.json"
    done = _convert(_tarball(tmp_path / "bad.tar.gz", {f"{_directory(KEY_A)}/k.autotune.json": _recording(32)[:40]}), "--into", seeds)
    assert done.returncode != 0 and not seeds.exists()
    done = _convert(tmp_path / "missing.tar.gz", "--into", seeds)
    assert done.returncode != 0 and "no such file" in done.stderr


@pytest.mark.parametrize("entry, problem", [
    ({"key": "xyz", "file": "k.autotune.json", "content": _recording(32)}, "malformed entry"),
    ({"key": KEY_A, "file": "../k.autotune.json", "content": _recording(32)}, "malformed entry"),
    ({"key": KEY_A, "file": "k.autotune.json", "content": json.dumps({"key": [1]})}, "no timings"),
])
def test_malformed_seeds_are_refused(tmp_path, entry, problem):
    seeds = tmp_path / "hopper.json"
    seeds.write_text(json.dumps({"entries": [entry]}))
    with pytest.raises(ValueError, match=problem):
        autotune_seeds.read(seeds)


def test_the_shipped_seeds_are_well_formed():
    shipped = sorted(autotune_seeds.SEEDS.glob("*.json"))
    if not shipped:
        pytest.skip("no autotuning choices shipped")
    for path in shipped:
        entries = autotune_seeds.read(path)
        assert entries and len({(e["key"], e["file"]) for e in entries}) == len(entries)
