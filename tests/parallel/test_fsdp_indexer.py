"""FSDP2 with the indexer's KL loss (genolong/train/indexer.py) on gloo, fp32, against one process.

The indexer's gradient does not come from the LM loss's backward: the dense warm-up applies it
inside a forward that runs under no_grad, and the sparse stage adds it during the layer's
backward through a function of its own. At fsdp=2 both stages' summed indexer gradients (and the
sparse step's every other gradient) equal one process's running the same two sequences as two
micro-batches (the per-rank computation exactly, so the selections cannot differ).
"""

import pytest
import torch

from genolong.train.options import MemoryOptions
from tests.parallel.harness import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")


def _sequences():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 4, (2, 65), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _steps(model, ids, targets, count, weight):
    """A warm-up step, then a sparse step, over this process's sequences (one micro-batch each, of
    weight `weight`, as the training loop runs them); yields each step's phase once its backward
    is done, and clears the gradients after the caller has read them."""
    import torch.nn.functional as F

    from genolong.train.indexer import WARMUP, IndexerTraining

    indexer = IndexerTraining(model, coeff=0.5, warmup_steps=1)
    for step in (0, 1):
        phase = indexer.begin_step(step)
        for row in range(ids.shape[0]):
            indexer.micro_batch(weight)
            with indexer.forward_context():
                hidden = model.hidden_states(ids[row : row + 1])
                loss = F.cross_entropy((hidden @ model.lm_head.weight.t()).flatten(0, 1), targets[row], reduction="sum") / count
            if indexer.backward_lm_loss():
                loss.backward()
        yield phase
        indexer.end_step()
        for p in model.parameters():
            p.grad = None
        assert (phase == WARMUP) == (step == 0)


def _reference():
    from genolong.model import GenoLongForCausalLM, get_preset

    torch.manual_seed(0)
    model = GenoLongForCausalLM(get_preset("tiny"))
    ids, targets = _sequences()
    out = {}
    for phase in _steps(model, ids, targets, targets.numel(), 0.5):
        out[phase] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out


def _fsdp_rank(rank, world):
    from genolong.model import GenoLongForCausalLM, get_preset
    from genolong.parallel.layout import parse_layout
    from genolong.parallel.mesh import build_mesh
    from genolong.train.options import TrainOptions
    from genolong.train.passes import parallelize

    torch.manual_seed(0)
    model = GenoLongForCausalLM(get_preset("tiny"))
    pmesh = build_mesh(parse_layout("fsdp=2"), "cpu")
    parallel = parallelize(model, TrainOptions(memory=MemoryOptions(offload=False, moe_chunk_tokens=48), compile=False, indexer_loss_coeff=0.5), pmesh)
    ids, targets = _sequences()
    mine = slice(rank, rank + 1)  # fsdp ranks are data parallel: one sequence each
    out = {}
    for phase in _steps(model, ids[mine], targets[mine], targets.numel(), 0.5):
        parallel.grads.reduce()
        full = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g  # noqa: E731
        out[phase] = {n: full(p.grad).numpy() for n, p in model.named_parameters() if p.grad is not None}
    return out


def test_fsdp2_trains_the_indexer_as_one_process_in_both_stages():
    ref = _reference()
    ranks = run_ranks(_fsdp_rank, 2)
    for phase in ("warmup", "sparse"):
        assert any(".indexer." in n for n in ref[phase]), phase
        for got in ranks:
            assert got[phase].keys() == ref[phase].keys(), phase
            # (relative to each tensor's largest element: the warm-up's gradients are small)
            errors = {name: float((torch.from_numpy(got[phase][name]) - grad).abs().max() / grad.abs().max().clamp_min(1e-12))
                      for name, grad in ref[phase].items()}
            assert max(errors.values()) < 1e-5, (phase, {n: e for n, e in errors.items() if e >= 1e-5})
    assert set(ref["warmup"]) == {n for n in ref["warmup"] if ".indexer." in n}  # the warm-up trains the indexer alone
    assert any(float(ref["warmup"][n].abs().max()) > 1e-6 for n in ref["warmup"])
