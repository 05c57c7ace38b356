"""benchmarks/device/tiling_summary.py on a hand-written stage output (the files finetune writes, in
the shapes genolong/train writes them, and the stage's own info.json and samples.tsv)."""

import dataclasses
import json
import tarfile

import pytest

from benchmarks.device import tiling_summary as summary

GIB = 1024**3

# One step line as genolong.train.metrics.StepRecord.to_json writes it (every field, in order).
STEP = {"step": 1, "loss": 2.0, "lr": 0.0001, "grad_norm": 1.5, "skipped": False, "tokens": 1048576, "valid_tokens": 1048576,
        "step_time_s": 0.0, "tokens_per_s": 0.0, "model_tflops": 100.0, "hardware_tflops": 130.0, "mfu": 0.1, "hfu": 0.13,
        "peak_gpu_gib": 0.0, "reserved_gpu_gib": 130.0, "pinned_host_gib": 0.0, "nonfinite_total": 0, "aux_loss": None,
        "expert_load_max": {"3": 1.3}, "expert_load_min": {"3": 0.5}, "indexer_phase": None, "indexer_loss": None,
        "indexer_loss_layers": None, "indexer_recall": None, "indexer_recall_layers": None}
# plan.json as genolong.train.loop._write_plan writes it (MemoryEstimate.as_dict, bytes, plus three keys).
PLAN = {"seq_len": 1048576, "n_gpus": 1, "offload_layers": 25,
        "gpu": {"weights": int(2.15 * GIB), "stored layer inputs": 80 * GIB, "layer working set (recompute, layer 44)": int(45.94 * GIB)},
        "host": {"offloaded layer inputs (pinned)": 100 * GIB}, "transients": {"dsa attention workspace": int(2.7 * GIB)},
        "gpu_total": int(128.09 * GIB), "host_total": 100 * GIB, "gpu_bytes": int(128.6 * GIB), "host_bytes": int(100.6 * GIB),
        "device": "cuda", "fits": True, "tile_tokens": 32768, "keep_sparse": "off"}
# memory.json as genolong.train.memory.MemoryHandle.describe writes it.
MEMORY = {"recompute": True, "offload_layers": list(range(25)), "moe_chunk_tokens": None, "tile_tokens": 32768,
          "mhc_fp32_input": False, "pinned": True, "overlap": True, "keep_sparse": "off", "keep_moe": "off"}
KERNELS = {"kda": {"fla_chunk_kda": 34}, "dsa_sparse_attention": {"triton_sparse": 11}, "moe_experts": {"grouped": 42}}
INFO = {"name": "1m", "rc": "0", "wall_s": "530", "limit_s": "505", "stopped": "exited", "date": "2026-12-07", "gpu": "NVIDIA H200",
        "command": "python3 -m genolong finetune --data /tmp/bundled --seq 1M --steps 3 --warmup 0 --preset glm53-mini --out /tmp/tiling/1m --overwrite"}
SAMPLES = "# t_s gpu_used_mib host_available_kib; MemTotal 131072000 kiB\n100 1024 120000000\n102 133120 20000000\n104 NA 30000000\n"


def _steps(times, peaks, pinned):
    return "".join(json.dumps({**STEP, "step": i + 1, "loss": 2.0 - 0.1 * i, "step_time_s": t, "tokens_per_s": 1048576 / t,
                               "peak_gpu_gib": p, "pinned_host_gib": h}) + "\n"
                   for i, (t, p, h) in enumerate(zip(times, peaks, pinned, strict=True)))


def _write(root, name, files):
    d = root / "tiling" / name
    d.mkdir(parents=True)
    for fname, content in files.items():
        (d / fname).write_text(content if isinstance(content, str) else json.dumps(content))


@pytest.fixture
def stage(tmp_path):
    _write(tmp_path, "1m", {"metrics.jsonl": _steps([412.0, 58.0, 56.0], [129.5, 125.1, 126.3], [100.0, 99.0, 100.0]),
                            "plan.json": PLAN, "memory.json": MEMORY, "kernels.json": KERNELS, "info.json": INFO, "samples.tsv": SAMPLES})
    whole = {**INFO, "name": "512k-whole", "rc": "143", "stopped": "cut at its limit of 200 s",
             "command": INFO["command"].replace("--seq 1M --steps 3", "--seq 512k --tile off --steps 4")}
    _write(tmp_path, "512k-whole", {"metrics.jsonl": _steps([330.0], [104.4], [63.2]),
                                    "kernels.json": {**KERNELS, "moe_experts": {"reference": 42}}, "info.json": whole})
    _write(tmp_path, "128k-tiled", {"info.json": {"name": "128k-tiled", "command": "x", "stopped": "skipped: 12 s left"}})
    evaluation = {**INFO, "name": "eval1m", "command": "python3 -m genolong eval-positional --seq 1M --out /tmp/tiling/eval1m --overwrite"}
    partial = [{"kind": "header", "fingerprint": {}}] + [
        {"kind": "window", "model": m, "record": "r", "start": s, "reverse": False, "sums": [], "counts": [], "seconds": sec}
        for m, s, sec in (("a", 0, 20.0), ("b", 0, 22.0), ("a", 1048576, 18.0))]
    _write(tmp_path, "eval1m", {"partial.jsonl": "".join(json.dumps(x) + "\n" for x in partial) + '{"kind": "wind',
                                "info.json": evaluation})
    (tmp_path / "tiling" / "machine.txt").write_text("NVIDIA H200, 143771 MiB\n")
    return tmp_path


def test_the_fixture_has_the_shapes_genolong_writes():
    from genolong.train.metrics import StepRecord
    from genolong.train.plan import MemoryEstimate

    assert list(STEP) == [f.name for f in dataclasses.fields(StepRecord)]
    est = MemoryEstimate(seq_len=1, n_gpus=1, tokens_per_gpu=1, gpu={}, host={}, transients={}, offload_layers=0, gpu_bytes=1, host_bytes=1)
    assert set(PLAN) == set(est.as_dict()) | {"fits", "tile_tokens", "keep_sparse"}


def test_the_rows_of_the_measured_table(stage):
    table = summary.rows(summary.load(stage))
    by_cmd = {row[2]: row for row in table}
    one = by_cmd["`genolong finetune --data /tmp/bundled --seq 1M --steps 3 --warmup 0 --preset glm53-mini`"]
    # median of steps 2-3 (58, 56); the peaks of those steps, not of the compiling step 1
    assert one[:7] == ["2026-12-07", "H200", one[2], "57.00 (median of steps 2-3; step 1 412.0)", "126.30", "100.00", "GPU 128.1, pinned 100.0"]
    notes = one[7]
    for part in ("tile 32k", "25 layers offloaded (plan 25)", "keep-sparse off", "peak/plan 0.99", "every hot op fused",
                 "loss 2.0000 -> 1.9000 -> 1.8000", "nvidia-smi max 130.0 GiB", "host RAM in use max 105.9 GiB",
                 "3 step(s) recorded, exited, exit code 0, 530 s"):
        assert part in notes, (part, notes)
    whole = by_cmd["`genolong finetune --data /tmp/bundled --seq 512k --tile off --steps 4 --warmup 0 --preset glm53-mini`"]
    assert whole[3] == "step 1 only: 330.0 (kernel builds)" and whole[4:7] == ["104.40", "63.20", "-"]
    assert "reference ops: moe_experts" in whole[7] and "cut at its limit of 200 s, exit code 143" in whole[7]
    skipped = by_cmd["`x`"]
    assert skipped[3:7] == ["-"] * 4 and skipped[7].endswith("not run: skipped: 12 s left")
    ev = by_cmd["`genolong eval-positional --seq 1M`"]
    # two windows of model a, one of b; the torn last line is ignored
    assert "2 window(s) of 1M scored per model, 20.0 s per window and model" in ev[7]
    assert [row[2] for row in table][:2] == [one[2], whole[2]]  # the stage's order: 1M first


def test_the_archive_reads_as_the_directory(stage, capsys):
    with tarfile.open(stage / "tiling.tar.gz", "w:gz") as tar:
        tar.add(stage / "tiling", arcname="tiling")
    assert summary.rows(summary.load(stage / "tiling.tar.gz")) == summary.rows(summary.load(stage))
    assert summary.main([str(stage / "tiling.tar.gz")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| date | machine | command | step s | peak GPU GiB | pinned host GiB | plan GiB | notes |"
    assert len(lines) == 2 + 4


def test_bad_input_is_one_line(tmp_path, capsys):
    assert summary.main([str(tmp_path / "nothing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert summary.main([str(tmp_path)]) == 2
    assert "holds no sub-run directories" in capsys.readouterr().err
