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
