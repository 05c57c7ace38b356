"""Models are identified by content: the same under a copy, different after a one-byte change."""

import shutil

import pytest
import torch

from genolong.eval import fingerprint
from genolong.eval.fingerprint import model_fingerprint
from genolong.model import GenoLongForCausalLM, get_preset, save_pretrained


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    return save_pretrained(GenoLongForCausalLM(get_preset("tiny")), tmp_path_factory.mktemp("fp") / "m")


def flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_stable_under_copy_and_touch(model_dir, tmp_path):
    copy = tmp_path / "elsewhere" / "copied"
    shutil.copytree(model_dir, copy)  # new path; copy2 keeps mtimes, so touch them too
    for p in copy.iterdir():
        p.touch()
    assert model_fingerprint(copy) == model_fingerprint(model_dir)
    assert model_fingerprint(model_dir).startswith("sha256:")


@pytest.mark.parametrize("where", ["first data byte", "middle", "last byte"])
def test_one_byte_weight_change_changes_it(model_dir, tmp_path, where):
    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    weights = copy / "model.safetensors"
    size = weights.stat().st_size
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    flip_byte(weights, {"first data byte": header, "middle": (header + size) // 2, "last byte": size - 1}[where])
    assert model_fingerprint(copy) != model_fingerprint(model_dir)


def test_config_change_changes_it(model_dir, tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("}", ' }', 1))
    assert model_fingerprint(copy) != model_fingerprint(model_dir)


def test_big_files_are_sampled_header_and_strided_bytes(model_dir, tmp_path, monkeypatch):
    """Above FULL_HASH_BYTES only the header and strided samples are read: stable under copy,
    and a change in the header or in a sampled byte is seen."""
    monkeypatch.setattr(fingerprint, "FULL_HASH_BYTES", 1024)
    monkeypatch.setattr(fingerprint, "SAMPLE_BYTES", 64)
    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    base = model_fingerprint(model_dir)
    assert model_fingerprint(copy) == base
    weights = copy / "model.safetensors"
    header_len = int.from_bytes(weights.read_bytes()[:8], "little")
    flip_byte(weights, 8 + header_len // 2)  # a byte of the JSON header (a tensor's offsets or name)
    assert model_fingerprint(copy) != base
    shutil.copy(model_dir / "model.safetensors", weights)
    assert model_fingerprint(copy) == base
    flip_byte(weights, weights.stat().st_size - 1)  # the last bytes are always sampled
    assert model_fingerprint(copy) != base
