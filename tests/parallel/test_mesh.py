"""The mesh of a layout on gloo: group sizes and that the flattened groups reduce over the right ranks."""

import torch
import torch.distributed as dist

from genolong.parallel.layout import ParallelLayout
from genolong.parallel.mesh import build_mesh
from tests.parallel.harness import run_ranks


def _groups(rank, world_size):
    mesh = build_mesh(ParallelLayout(dp=2, cp=2), "cpu")
    out = {}
    for name in ("dp", "cp", "tp", "ep", "batch", "loss"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mesh.group(name))
        out[name] = (mesh.size(name), mesh.rank(name), float(t))
    return out


def test_dp2_cp2_groups_reduce_over_the_right_ranks():
    res = run_ranks(_groups, 4)
    # Ranks are laid out (dp, ep, cp, tp) with tp innermost: rank = dp * 2 + cp here.
    for rank, got in enumerate(res):
        dp, cp = divmod(rank, 2)
        assert got["cp"] == (2, cp, float(dp * 2 + dp * 2 + 1))
        assert got["dp"] == (2, dp, float(cp + cp + 2))
        assert got["tp"] == (1, 0, float(rank))
        assert got["batch"][0] == 2 and got["batch"][2] == got["dp"][2]
        assert got["loss"] == (4, rank, 6.0)



def _leave_after_rank0_writes(rank, world_size, marker):
    import time
    import weakref
    from pathlib import Path

    from genolong.parallel.mesh import leave_together

    mesh = build_mesh(ParallelLayout(dp=2), "cpu")
    dp_group = weakref.ref(mesh.group("dp"))
    del mesh  # the caller's part: its own references go first
    if rank == 0:
        time.sleep(1.0)  # rank 0 still writing the run's outputs
        Path(marker).write_text("written")
    leave_together()
    return Path(marker).exists(), dist.is_initialized(), dp_group() is None


def test_leave_together_waits_for_the_slowest_rank_and_frees_the_mesh_groups(tmp_path):
    # Every rank leaves only once rank 0 has written, with no group left to be freed at interpreter
    # exit (where a gloo group has aborted its process: genolong/parallel/mesh.py).
    assert run_ranks(_leave_after_rank0_writes, 2, str(tmp_path / "outputs")) == [(True, False, True)] * 2


def _init_kwargs(monkeypatch, device_type, local_rank):
    """The keyword arguments init_distributed hands to init_process_group as a torchrun rank."""
    import genolong.parallel.mesh as mesh_module

    calls = []
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(mesh_module.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(mesh_module.dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.setattr(mesh_module.torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(mesh_module.torch.cuda, "set_device", lambda d: None)
    assert mesh_module.init_distributed(device_type, timeout_s=60) == (local_rank, 4)
    assert len(calls) == 1
    return calls[0]


def test_nccl_init_binds_the_group_to_the_local_rank_gpu(monkeypatch):
    # Without device_id NCCL guesses each collective's device and warns that a wrong guess hangs.
    kw = _init_kwargs(monkeypatch, "cuda", 3)
    assert kw["backend"] == "nccl"
    assert kw["device_id"] == torch.device("cuda", 3)
    assert kw["timeout"].total_seconds() == 60


def test_gloo_init_gets_no_device_id(monkeypatch):
    kw = _init_kwargs(monkeypatch, "cpu", 1)
    assert kw["backend"] == "gloo" and "device_id" not in kw
