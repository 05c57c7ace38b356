"""FSDP2 (`--parallel fsdp=N`, genolong.parallel.fsdp) on gloo, fp32, against one process.

The training loop at fsdp=2 takes the one-process run's losses and gradient norms step for step
(the same windows: fsdp ranks are data parallel), its DCP checkpoint resumes in one process with
the uninterrupted run's next loss, and a one-process checkpoint resumes at fsdp=2 likewise. At
the level of one step: every parameter's summed gradient equals one process's, each rank holds
half of the weights and of the optimizer state, and a DCP checkpoint of the sharded model and
optimizer loads whole into one process.
"""

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from genolong.train.loop import load_run_options, train
from genolong.train.options import MemoryOptions
from tests.parallel.test_train_parallel import _close, _options, _train_rank  # the same small runs
from tests.parallel.harness import run_ranks
from tests.train._helpers import prepared_genome

pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_genome(tmp_path_factory.mktemp("genome"))


@pytest.mark.slow  # three launches of two gloo processes: ~45 s on the shared 2-core machine
def test_fsdp2_trains_what_one_process_trains_and_resumes_across_layouts(data, tmp_path):
    single = train(_options(data, tmp_path / "single", save_every=2))
    run = tmp_path / "fsdp2"
    first = run_ranks(_train_rank, 2, _options(data, run, stop_after=2, parallel="fsdp=2").to_dict())
    assert [r["loss"] for r in first[0]] == [r["loss"] for r in first[1]]
    assert _close([r["loss"] for r in first[0]], [r["loss"] for r in single[:2]]), (first[0], single)
    assert _close([r["grad_norm"] for r in first[0]], [r["grad_norm"] for r in single[:2]])
    assert [r["tokens"] for r in first[0]] == [2 * 64] * 2
    state = json.loads((run / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    assert state["layout"] == "dp=1,fsdp=2,cp=1,tp=1,ep=1"
    # fsdp=2 -> one process: the uninterrupted run's third loss.
    rest = train(load_run_options(run, progress=False, stop_after=None, parallel=None))
    assert [r["step"] for r in rest] == [3]
    assert _close([r["loss"] for r in rest], [single[2]["loss"]]), (rest, single)
    # One process (its own checkpoint format) -> fsdp=2: the same third step.
    resumed = tmp_path / "single_to_fsdp2"
    shutil.copytree(tmp_path / "single", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000003")
    (third,) = run_ranks(_train_rank, 2, load_run_options(resumed, progress=False, stop_after=None, parallel="fsdp=2").to_dict())[0]
    assert third["step"] == 3 and _close([third["loss"], third["grad_norm"]], [single[2]["loss"], single[2]["grad_norm"]]), (third, single[2])
    assert len({r["loss"] for r in single}) == 3  # the losses move: a wrong update would show


def _reference(seed_ids):
    from genolong.model import GenoLongForCausalLM, get_preset

    torch.manual_seed(0)
    model = GenoLongForCausalLM(get_preset("tiny"))
    ids, targets = seed_ids
    loss = F.cross_entropy(model(ids).logits.flatten(0, 1), targets.flatten(), reduction="sum") / targets.numel()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, {k: v.clone() for k, v in model.state_dict().items()}


def _one_step(rank, world, seed_ids, ckpt):
    from genolong.model import GenoLongForCausalLM, get_preset
    from genolong.parallel import checkpoint as dist_ckpt
    from genolong.parallel.layout import parse_layout
    from genolong.parallel.mesh import build_mesh
    from genolong.train.optim import MasterAdamW
    from genolong.train.options import TrainOptions
    from genolong.train.passes import parallelize

    torch.manual_seed(0)
    model = GenoLongForCausalLM(get_preset("tiny"))
    whole = sum(p.numel() for p in model.parameters())
    pmesh = build_mesh(parse_layout("fsdp=2"), "cpu")
    options = TrainOptions(memory=MemoryOptions(offload=False, moe_chunk_tokens=48), compile=False)
    parallel = parallelize(model, options, pmesh)
    optimizer = MasterAdamW(list(model.named_parameters()), lr=1e-3)
    ids, targets = seed_ids
    mine = slice(rank, rank + 1)  # fsdp ranks are data parallel: one sequence each
    hidden = model.hidden_states(ids[mine])
    logits = hidden @ model.lm_head.weight.t()
    loss = F.cross_entropy(logits.flatten(0, 1), targets[mine].flatten(), reduction="sum") / targets.numel()
    loss.backward()
    parallel.grads.reduce()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    # numpy: tensors would travel through shared memory that a finished rank has already freed
    grads = {n: p.grad.full_tensor().numpy() for n, p in model.named_parameters() if p.grad is not None}
    held = sum(p.to_local().numel() for p in model.parameters())
    state_held = sum(t.to_local().numel() for k, t in optimizer.state_dict().items() if k.startswith("exp_avg."))
    dist_ckpt.save(ckpt, 0, model=model, optimizer=optimizer, trainer_state={"step": 0}, pmesh=pmesh, keep_last=1)
    return {"loss": float(total), "grads": grads, "held": held, "state_held": state_held, "whole": whole,
            "norm": parallel.grads.grad_norm(optimizer.grad_norm)}


def test_fsdp2_gradients_sharded_state_and_checkpoint_equal_one_process(tmp_path):
    from genolong.parallel import checkpoint as dist_ckpt

    g = torch.Generator().manual_seed(3)
    seed_ids = (torch.randint(0, 5, (2, 64), generator=g), torch.randint(0, 5, (2, 64), generator=g))
    loss, grads, weights = _reference(seed_ids)
    ranks = run_ranks(_one_step, 2, seed_ids, str(tmp_path))
    for r in ranks:
        assert math.isclose(r["loss"], loss, rel_tol=1e-6)
        assert r["grads"].keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(torch.from_numpy(r["grads"][name]), grad, rtol=1e-5, atol=1e-7, msg=name)
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
        assert math.isclose(r["norm"], norm, rel_tol=1e-5)
        # Each rank keeps about half: dim-0 chunks (an odd row count leaves one rank a row more).
        assert 0.45 * r["whole"] < r["held"] < 0.55 * r["whole"] and r["state_held"] == r["held"]
    assert ranks[0]["held"] + ranks[1]["held"] == ranks[0]["whole"]
    ckpt = tmp_path / "checkpoints" / "step_00000000"
    model = dist_ckpt.build_model(ckpt, torch.float32, "cpu")
    dist_ckpt.load(ckpt, model=model)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def test_fsdp2_trains_the_indexer_as_one_process_does(data, tmp_path):
    """The indexer's parameters stay out of FSDP while it trains (genolong/parallel/fsdp.py): the
    loop's dense warm-up step and the sparse step after it give one process's losses and norms."""
    trained = {"seq_len": 128, "steps": 2, "indexer_loss_coeff": 1.0, "indexer_warmup_steps": 1}
    single = train(_options(data, tmp_path / "single", **trained))
    first, second = run_ranks(_train_rank, 2, _options(data, tmp_path / "fsdp2", parallel="fsdp=2", **trained).to_dict())[0]
    # The warm-up's norm is the indexer's gradient alone (a lost one reads 0).
    assert single[0]["grad_norm"] > 0 and math.isclose(first["grad_norm"], single[0]["grad_norm"], rel_tol=1e-5), (first, single[0])
    assert math.isclose(first["indexer_loss"], single[0]["indexer_loss"], rel_tol=1e-5)
    assert math.isclose(second["loss"], single[1]["loss"], rel_tol=1e-5), (second, single[1])
    assert math.isclose(second["grad_norm"], single[1]["grad_norm"], rel_tol=1e-5)
    # (a near-zero KL after Adam's sign-sized first step: its rounding shows more)
    assert math.isclose(second["indexer_loss"], single[1]["indexer_loss"], rel_tol=1e-3)


def test_fsdp_is_a_data_parallel_dimension_of_the_layout():
    from genolong.errors import GenolongError
    from genolong.model import get_preset
    from genolong.parallel.layout import check_layout, parse_layout
    from genolong.parallel.tensor_plan import grad_reduce_group

    layout = parse_layout("tp=2,fsdp=4")
    assert (layout.world_size, layout.data_parallel, str(layout)) == (8, 4, "dp=1,fsdp=4,cp=1,tp=2,ep=1")
    assert str(parse_layout("dp=2")) == "dp=2,cp=1,tp=1,ep=1"  # as earlier checkpoints recorded it
    with pytest.raises(GenolongError, match=r"do not split over 8 data-parallel rank\(s\) \(dp x fsdp x ep\)"):
        check_layout(parse_layout("fsdp=4,ep=2"), get_preset("tiny"), seq_len=256, batch=4)
    # After FSDP's reduce-scatter: replicated weights still sum over tp, tp-split ones over nothing more.
    assert grad_reduce_group("model.layers.0.input_layernorm.weight", layout, sharded=True) == "grad_sp_shard"
    assert grad_reduce_group("model.layers.0.self_attn.o_proj.weight", layout, sharded=True) is None
    assert grad_reduce_group("model.layers.0.self_attn.o_proj.weight", layout) == "grad"
