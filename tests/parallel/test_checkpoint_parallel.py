"""Multi-process checkpoints (genolong.parallel.checkpoint) on gloo: a rank that dies in the middle of a
save leaves no checkpoint directory (and rank 0 cleans up its temporary one); a complete one holds
every rank's RNG and the layout-free state."""

import os
import queue as queue_module
import traceback

import pytest

from tests.parallel.harness import context, free_port, run_ranks


def _save_rank(rank, world, port, root, die, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from genolong.model import GenoLongForCausalLM, get_preset
    from genolong.parallel import checkpoint as dist_ckpt
    from genolong.parallel.layout import ParallelLayout
    from genolong.parallel.mesh import build_mesh
    from genolong.train.optim import MasterAdamW

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        pmesh = build_mesh(ParallelLayout(dp=world), "cpu")
        torch.manual_seed(0)
        model = GenoLongForCausalLM(get_preset("tiny"))
        optimizer = MasterAdamW(list(model.named_parameters()), lr=1e-3)
        if rank == 1 and die == "inside_dcp":
            dist_ckpt.dcp.save = lambda *a, **k: os._exit(9)
        if rank == 1 and die == "after_dcp":
            dist_ckpt.checkpoint_dir.fsync_file = lambda *a, **k: os._exit(9)
        dist_ckpt.save(root, 3, model=model, optimizer=optimizer, trainer_state={"step": 3}, pmesh=pmesh, keep_last=2)
        results.put((rank, "ok", None))
    except BaseException as err:  # noqa: BLE001  (the parent checks what rank 0 saw)
        results.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


@pytest.mark.parametrize("die", ["inside_dcp", "after_dcp"])
def test_a_rank_dying_mid_save_leaves_no_checkpoint(tmp_path, die):
    ctx = context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_save_rank, args=(r, 2, port, str(tmp_path), die, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, status, message = results.get(timeout=180)
    except queue_module.Empty:
        pytest.fail("rank 0 did not return within 180 s: a save waiting forever for a dead rank")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert (rank, status) == (0, "error"), message
    assert procs[1].exitcode == 9
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == [], left  # neither step_00000003 nor the temporary directory


def _save_and_describe(rank, world, root):
    import json
    from pathlib import Path

    import torch

    from genolong.model import GenoLongForCausalLM, get_preset
    from genolong.parallel import checkpoint as dist_ckpt
    from genolong.parallel.layout import ParallelLayout
    from genolong.parallel.mesh import build_mesh
    from genolong import checkpoint_dir
    from genolong.train import checkpoint as ckpt_io
    from genolong.train.optim import MasterAdamW

    pmesh = build_mesh(ParallelLayout(dp=world), "cpu")
    torch.manual_seed(rank)  # different RNG states per rank, to see each rank's own file
    model = GenoLongForCausalLM(get_preset("tiny"))
    optimizer = MasterAdamW(list(model.named_parameters()), lr=1e-3)
    final = dist_ckpt.save(root, 5, model=model, optimizer=optimizer, trainer_state={"step": 5}, pmesh=pmesh, keep_last=2)
    state = json.loads((Path(final) / ckpt_io.STATE_FILE).read_text())
    return checkpoint_dir.is_complete(Path(final)), state["format"], state["optimizer_steps"], sorted(p.name for p in (Path(final) / "rng").iterdir())


def test_a_complete_save_holds_every_rank_and_the_manifest(tmp_path):
    for complete, fmt, steps, rng in run_ranks(_save_and_describe, 2, str(tmp_path)):
        assert complete and fmt == "dcp" and steps == {"step": 0}
        assert rng == ["rank_00000.json", "rank_00001.json"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000005"]
