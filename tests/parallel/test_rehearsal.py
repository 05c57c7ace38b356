"""The 8-process rehearsal on the CPU: GLM-5.3-Flash's layer pattern and head ratios at toy width,
fine-tuned from a transformers checkpoint at fsdp=2 x cp=2 x ep=2 (8 gloo processes), against one process.

The model: glm-5.3-flash's preset cut to 8 layers (layers 0-2 dense MLP, 3 and 7 DSA, MoE from
layer 3, the shared indexer schedule) with its head ratios at toy width: 8 KDA heads (64), 8 DSA
heads with 4 indexer heads (64 / 32), 8 experts top-2 (288 top-8) and a shared expert, mHC with
4 streams. Each rank builds it on the meta device and reads only its slices of the checkpoint
(genolong.parallel.sharded_load), then every pass runs: expert parallel, context parallel (KDA by
Ulysses), MoE chunks, full-layer recompute, FSDP (over fsdp x cp: each weight in 4 chunks, the
experts' ep halves in 4). Compared with one process, fp32:

- one step's loss and the summed gradient of every parameter (1e-5 relative over the model, 1e-4
  per tensor);
- the training loop's losses and gradient norms for two steps, its DCP checkpoint exported to one
  transformers checkpoint (the one-process weights after two steps) and resumed at another
  layout, fsdp=2 x cp=2 x tp=2 (8 processes), with the uninterrupted run's third loss.

The indexer's top-k is the sequence length (selection is dense), so rounding cannot flip a
near-tie selection between layouts (tests/parallel/test_context.py pins selections instead).
8 processes hold three of the four dimensions at 2: the first run has ep, the resume tp (with cp).
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from genolong.model import GenoLongForCausalLM, get_preset
from genolong.model.checkpoint import from_pretrained, save_pretrained
from genolong.train.loop import load_run_options, train
from genolong.train.options import MemoryOptions
from genolong.vocab import DNA_MODEL_VOCAB_SIZE
from tests.parallel.harness import run_ranks
from tests.train._helpers import prepared_genome, tiny_options

# Eight gloo processes on a shared 2-core machine: ~45 s alone, more beside other tests.
pytestmark = [pytest.mark.slow(seconds=50), pytest.mark.usefixtures("one_thread")]

SEQ = 256  # cp x tp (the resume) needs whole 64-token KDA chunks on each of 2 x 2 ranks
BATCH = 4  # one sequence per batch rank (dp x fsdp x ep = 4), each split over cp = 2
LAYOUT = "fsdp=2,cp=2,ep=2"
RESUME_LAYOUT = "fsdp=2,cp=2,tp=2"
FLASH_TOY = {
    "num_layers": 8,
    "hidden": 64,
    "vocab_size": DNA_MODEL_VOCAB_SIZE,
    "kda": {"num_heads": 8, "head_dim": 8},
    "dsa": {"num_heads": 8, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_head_dim": 16, "v_head_dim": 16,
            "indexer": {"n_heads": 4, "head_dim": 16, "topk": SEQ, "kpool": 4}},
    "moe": {"num_experts": 8, "top_k": 2, "expert_dim": 32},
    "dense_mlp": {"intermediate_size": 128},
}
MEMORY = MemoryOptions(offload=False, moe_chunk_tokens=48)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("flash_toy")
    torch.manual_seed(0)
    config = get_preset("glm-5.3-flash", **FLASH_TOY)
    assert config.layer_types[3] == config.layer_types[7] == "dsa" and config.mlp_types[:4] == ("dense",) * 3 + ("moe",)
    save_pretrained(GenoLongForCausalLM(config), root / "ckpt", max_shard_bytes=200_000)
    return root / "ckpt"


def _tokens():
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 5, (BATCH, SEQ), generator=g), torch.randint(0, 5, (BATCH, SEQ), generator=g)


def _one_step_gradients(path: str):
    """This rank's share of one step through every pass; the summed gradients, whole (collective)."""
    from genolong.model.checkpoint import read_config
    from genolong.model.hf_config import from_hf
    from genolong.parallel.layout import parse_layout
    from genolong.parallel.mesh import build_mesh
    from genolong.parallel.sharded_load import build_meta, load_pretrained_sharded, materialise
    from genolong.parallel.tensor_state import full_state_dict
    from genolong.train.options import TrainOptions
    from genolong.train.passes import parallelize

    pmesh = build_mesh(parse_layout(LAYOUT), "cpu")
    model = build_meta(from_hf(read_config(path)), torch.float32)
    parallel = parallelize(model, TrainOptions(memory=MEMORY, compile=False), pmesh)
    materialise(model, "cpu")
    load_pretrained_sharded(model, path, pmesh)
    from genolong.parallel.grad_sync import GradientSync

    grads = GradientSync(model, pmesh)
    ids, targets = _tokens()
    b, (c, cp) = pmesh.rank("batch"), (pmesh.rank("cp"), pmesh.size("cp"))
    shard = slice(c * SEQ // cp, (c + 1) * SEQ // cp)
    model.train()
    hidden = model.hidden_states(ids[b : b + 1, shard])
    logits = hidden @ model.lm_head.weight.t()
    loss = F.cross_entropy(logits.flatten(0, 1), targets[b : b + 1, shard].flatten(), reduction="sum") / targets.numel()
    loss.backward()
    grads.reduce()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total, group=pmesh.group("loss"))
    whole = full_state_dict({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, pmesh)
    del parallel
    return float(total), {n: g.numpy() for n, g in whole.items()} if torch.distributed.get_rank() == 0 else None


def _rehearse(rank, world, path, options_dict):
    from genolong.train.options import TrainOptions

    loss, grads = _one_step_gradients(path)
    return loss, grads, train(TrainOptions.from_dict(options_dict))


def _resume(rank, world, options_dict):
    from genolong.train.options import TrainOptions

    return train(TrainOptions.from_dict(options_dict))


def _close(a, b, rtol=2e-5):
    return all(math.isclose(x, y, rel_tol=rtol, abs_tol=1e-7) for x, y in zip(a, b, strict=True))


def test_eight_processes_fsdp_cp_ep_equal_one_process_and_resume_at_fsdp_cp_tp(checkpoint, tmp_path):
    (tmp_path / "genome").mkdir()
    data = prepared_genome(tmp_path / "genome")

    def options(out, **changes):
        fields = {"model_path": str(checkpoint), "preset": None, "seq_len": SEQ, "batch": BATCH, "steps": 3, "warmup": 1,
                  "memory": MEMORY}
        return tiny_options(data, out, **{**fields, **changes})

    reference = from_pretrained(checkpoint, dtype=torch.float32)
    reference.train()
    ids, targets = _tokens()
    ref_loss = F.cross_entropy(reference(ids).logits.flatten(0, 1), targets.flatten(), reduction="sum") / targets.numel()
    ref_loss.backward()
    single = train(options(tmp_path / "single", save_every=2))

    run = tmp_path / "rehearsal"
    ranks = run_ranks(_rehearse, 8, str(checkpoint), options(run, stop_after=2, parallel=LAYOUT).to_dict(), timeout=900)
    for loss, _, _ in ranks:
        assert math.isclose(loss, float(ref_loss), rel_tol=1e-5), (loss, float(ref_loss))
    grads = ranks[0][1]
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys()
    # fp32 sums in another order: 1e-5 relative over the model (as tests/parallel/test_context.py),
    # 1e-4 for each tensor (the small mHC gradients carry the largest relative rounding).
    error = sum(float((torch.from_numpy(grads[n]) - g).square().sum()) for n, g in expected.items())
    assert math.sqrt(error / sum(float(g.square().sum()) for g in expected.values())) <= 1e-5
    for name, grad in expected.items():
        got = torch.from_numpy(grads[name])
        assert (got - grad).norm() <= 1e-4 * grad.norm() + 1e-9, name
    records = ranks[0][2]
    assert [r["loss"] for r in records] == [r["loss"] for r in ranks[7][2]]
    assert _close([r["loss"] for r in records], [r["loss"] for r in single[:2]]), (records, single)
    assert _close([r["grad_norm"] for r in records], [r["grad_norm"] for r in single[:2]], rtol=1e-4)
    assert [r["tokens"] for r in records] == [BATCH * SEQ] * 2
    state = json.loads((run / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    assert state["layout"] == "dp=1,fsdp=2,cp=2,tp=1,ep=2"

    # `genolong export` of the 8-process checkpoint (experts saved as FSDP chunks of ep parts) is one
    # transformers checkpoint with the one-process run's weights after two steps (Adam's first steps
    # are sign-sized, so a near-zero gradient's rounding shows: 5% of each tensor's norm, where a
    # misplaced chunk would be ~100%).
    from genolong.train.export import export

    exported = from_pretrained(export(run, tmp_path / "hf", step=2), dtype=torch.float32).state_dict()
    after_two = from_pretrained(tmp_path / "single" / "checkpoints" / "step_00000002" / "model", dtype=torch.float32).state_dict()
    worst = max(float((exported[n] - t).norm() / t.norm().clamp_min(1e-12)) for n, t in after_two.items())
    print(f"export: largest relative difference from the one-process weights after two steps {worst:.2e}")
    for name, tensor in after_two.items():
        assert (exported[name] - tensor).norm() <= 0.05 * tensor.norm() + 1e-6, name

    (third,) = run_ranks(_resume, 8, load_run_options(run, progress=False, stop_after=None, parallel=RESUME_LAYOUT).to_dict(),
                         timeout=600)[0]
    assert third["step"] == 3 and _close([third["loss"]], [single[2]["loss"]]), (third, single[2])
    assert len({r["loss"] for r in single}) == 3
