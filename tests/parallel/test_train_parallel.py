"""The training loop across processes on gloo (CPU, fp32): dp=2 trains exactly what one process with
both sequences trains, one rank through the multi-process path is the one-process loop bit for bit,
a checkpoint saved at dp=2 resumes in one process and exports to a transformers checkpoint, the
gradient sync equals the per-parameter reference, and a layout that needs a missing pass fails in one line."""

import json
import math

import pytest
import torch

from genolong.errors import GenolongError
from genolong.train.loop import load_run_options, train
from genolong.train.metrics import read_jsonl
from genolong.train.options import MemoryOptions
from tests.parallel.harness import run_ranks
from tests.train._helpers import prepared_genome, tiny_options

pytestmark = pytest.mark.usefixtures("one_thread")

LOSS_RTOL = 2e-5  # fp32: a sum over two ranks rounds differently from the sum over one batch


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_genome(tmp_path_factory.mktemp("genome"))


def _options(data, out, **changes):
    fields = {"seq_len": 64, "steps": 3, "batch": 2, "warmup": 1, "memory": MemoryOptions(offload=False, moe_chunk_tokens=48)}
    fields.update(changes)
    return tiny_options(data, out, **fields)


def _train_rank(rank, world, options_dict):
    from genolong.train.options import TrainOptions

    return train(TrainOptions.from_dict(options_dict))


def _close(a, b, rtol=LOSS_RTOL):
    return all(math.isclose(x, y, rel_tol=rtol, abs_tol=1e-7) for x, y in zip(a, b, strict=True))


def test_dp2_trains_what_one_process_with_both_sequences_trains(data, tmp_path):
    single = train(_options(data, tmp_path / "single"))
    ranks = run_ranks(_train_rank, 2, _options(data, tmp_path / "dp2", parallel="dp=2").to_dict())
    assert [r["step"] for r in ranks[0]] == [1, 2, 3]
    # Every rank returns the same global numbers; rank 0 alone wrote the log.
    assert [r["loss"] for r in ranks[0]] == [r["loss"] for r in ranks[1]]
    assert [r["grad_norm"] for r in ranks[0]] == [r["grad_norm"] for r in ranks[1]]
    assert [r["loss"] for r in read_jsonl(tmp_path / "dp2" / "metrics.jsonl")] == [r["loss"] for r in ranks[0]]
    # Same windows, same global valid count, gradients summed: the same losses after every update.
    assert [r["valid_tokens"] for r in ranks[0]] == [r["valid_tokens"] for r in single]
    assert [r["tokens"] for r in ranks[0]] == [2 * 64] * 3  # every token once, not once per rank
    assert _close([r["loss"] for r in ranks[0]], [r["loss"] for r in single]), (ranks[0], single)
    assert _close([r["grad_norm"] for r in ranks[0]], [r["grad_norm"] for r in single])
    assert len({r["loss"] for r in single}) == 3  # the losses move: a wrong update would show


def test_one_rank_through_the_multi_process_path_is_the_one_process_loop_bit_for_bit(data, tmp_path):
    plain = train(_options(data, tmp_path / "plain", batch=1, memory=MemoryOptions(offload_layers=2, offload_pinned=False, moe_chunk_tokens=48)))
    (ranked,) = run_ranks(_train_rank, 1, _options(data, tmp_path / "ranked", batch=1, parallel="dp=1",
                                                   memory=MemoryOptions(offload_layers=2, offload_pinned=False, moe_chunk_tokens=48)).to_dict())
    for key in ("loss", "grad_norm", "valid_tokens", "lr"):
        assert [r[key] for r in ranked] == [r[key] for r in plain], key
    assert (tmp_path / "ranked" / "checkpoints" / "step_00000003" / "dcp").is_dir()  # it did go through the new path
    assert (tmp_path / "plain" / "checkpoints" / "step_00000003" / "model").is_dir()


def test_dp2_checkpoint_resumes_in_one_process_and_exports(data, tmp_path):
    from genolong.model import from_pretrained
    from genolong.parallel import checkpoint as dist_ckpt
    from genolong.train.export import export

    single = train(_options(data, tmp_path / "single", steps=4, save_every=2))
    run = tmp_path / "dp2"
    first = run_ranks(_train_rank, 2, _options(data, run, steps=4, stop_after=2, parallel="dp=2").to_dict())[0]
    ckpt = run / "checkpoints" / "step_00000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["layout"] == "dp=2,cp=1,tp=1,ep=1" and state["sampler"]["world_size"] == 1
    assert state["sampler"]["windows_yielded"] == 4  # two steps of two windows, layout-free
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank_00000.json", "rank_00001.json"]

    rest = train(load_run_options(run, progress=False, stop_after=None, parallel=None))
    assert [r["step"] for r in rest] == [3, 4]
    assert _close([r["loss"] for r in first + rest], [r["loss"] for r in single])
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]

    exported = export(run, tmp_path / "hf", step=2)
    model = from_pretrained(exported, dtype=torch.float32)
    # The weights the resumed run started from (its losses above match the uninterrupted run's).
    resumed = dist_ckpt.build_model(ckpt, torch.float32, "cpu")
    dist_ckpt.load(ckpt, model=resumed)
    fresh = from_pretrained(tmp_path / "single" / "checkpoints" / "step_00000002" / "model", dtype=torch.float32)
    assert model.state_dict().keys() == resumed.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
        # Adam's first steps are sign(gradient)-sized, so a dp=1 run's weights agree only loosely.
        torch.testing.assert_close(tensor, fresh.state_dict()[name], rtol=0, atol=0.05, msg=name)
    with pytest.raises(GenolongError, match="no complete checkpoint of that step"):
        export(run, tmp_path / "hf3", step=3)


def test_cp2_trains_what_one_process_trains_and_resumes_in_one_process(data, tmp_path):
    """One sequence split over two cp ranks (the context-parallel pass inside the loop, recompute on):
    the one-process losses and norms, its tokens counted once, and a checkpoint saved at cp=2 that
    one process resumes with the uninterrupted run's next loss."""
    single = train(_options(data, tmp_path / "single", seq_len=128, batch=1, steps=3, memory=MemoryOptions(offload=False, moe_chunk_tokens=48)))
    run = tmp_path / "cp2"
    ranks = run_ranks(_train_rank, 2, _options(data, run, seq_len=128, batch=1, steps=3, stop_after=2, parallel="cp=2").to_dict())
    first = ranks[0]
    assert [r["loss"] for r in ranks[0]] == [r["loss"] for r in ranks[1]]
    assert [r["tokens"] for r in first] == [128, 128] and [r["valid_tokens"] for r in first] == [r["valid_tokens"] for r in single[:2]]
    assert _close([r["loss"] for r in first], [r["loss"] for r in single[:2]]), (first, single)
    assert _close([r["grad_norm"] for r in first], [r["grad_norm"] for r in single[:2]], rtol=1e-4)
    state = json.loads((run / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    assert state["layout"] == "dp=1,cp=2,tp=1,ep=1"
    rest = train(load_run_options(run, progress=False, stop_after=None, parallel=None))
    assert [r["step"] for r in rest] == [3]
    assert _close([r["loss"] for r in rest], [single[2]["loss"]]), (rest, single)
    assert len({r["loss"] for r in single}) == 3


def test_cp2_trains_the_indexer_as_one_process_does(data, tmp_path):
    """The indexer's KL is the whole sequence's on every cp rank: its gradient and the logged loss
    and recall are one process's (a weight of 1/cp too many halves the warm-up's gradient norm)."""
    trained = {"seq_len": 128, "batch": 1, "steps": 2, "indexer_loss_coeff": 1.0, "indexer_warmup_steps": 1,
               "indexer_recall_every": 1, "indexer_recall_queries": 32}
    single = train(_options(data, tmp_path / "single", **trained))
    (first, second), _ = run_ranks(_train_rank, 2, _options(data, tmp_path / "cp2", parallel="cp=2", **trained).to_dict())
    # Step 1 is the dense warm-up (the indexer alone, from the same weights): equal up to fp32 sums.
    assert math.isclose(first["grad_norm"], single[0]["grad_norm"], rel_tol=1e-5), (first, single[0])
    assert math.isclose(first["indexer_loss"], single[0]["indexer_loss"], rel_tol=1e-4)
    assert math.isclose(first["indexer_recall"], single[0]["indexer_recall"], rel_tol=1e-5)
    # Adam's first step moves every weight by about lr * sign(gradient), so rounding in a near-zero
    # indexer gradient shows after it: the next step agrees more loosely.
    assert math.isclose(second["loss"], single[1]["loss"], rel_tol=1e-4)
    assert math.isclose(second["indexer_loss"], single[1]["indexer_loss"], rel_tol=1e-2)


@pytest.mark.slow  # four processes on two cores: ~45 s
def test_ep2_cp2_with_the_indexer_trains_what_one_process_trains(data, tmp_path):
    """Expert parallelism (a batch dimension: each ep rank its own sequence) with each sequence
    split over cp, the indexer training too: one process's losses, norms and token counts."""
    fields = {"seq_len": 128, "batch": 2, "steps": 2, "indexer_loss_coeff": 1.0}
    single = train(_options(data, tmp_path / "single", **fields))
    split = run_ranks(_train_rank, 4, _options(data, tmp_path / "epcp", parallel="ep=2,cp=2", **fields).to_dict())[0]
    assert [r["tokens"] for r in split] == [256, 256] and [r["valid_tokens"] for r in split] == [r["valid_tokens"] for r in single]
    # Step 1 (the same weights): fp32 rounding of the split sums can flip a near-tied expert choice
    # of a token, which moves the norm by ~1e-4 here; a wrong reduction would move it by far more.
    assert math.isclose(split[0]["loss"], single[0]["loss"], rel_tol=2e-5), (split, single)
    assert math.isclose(split[0]["grad_norm"], single[0]["grad_norm"], rel_tol=1e-3), (split, single)
    assert math.isclose(split[1]["loss"], single[1]["loss"], rel_tol=1e-3), (split, single)
    assert _close([r["indexer_loss"] for r in split], [r["indexer_loss"] for r in single], rtol=2e-3)


def test_dp2_on_planted_repeats_trains_what_one_process_trains_and_resumes_in_one_process(data, tmp_path):
    """Each batch rank plants its own windows (planting depends on the window, not the rank): the
    one-process losses, and the dp=2 checkpoint resumes in one process on the same planted windows."""
    planted = {"steps": 3, "seq_len": 128, "planted_repeats": "len=16,max-dist=100,per-window=2"}
    single = train(_options(data, tmp_path / "single", **planted))
    run = tmp_path / "dp2"
    first = run_ranks(_train_rank, 2, _options(data, run, stop_after=2, parallel="dp=2", **planted).to_dict())[0]
    rest = train(load_run_options(run, progress=False, stop_after=None, parallel=None))
    assert _close([r["loss"] for r in first + rest], [r["loss"] for r in single]), (first, rest, single)
    plain = train(_options(data, tmp_path / "plain", **{**planted, "planted_repeats": None}))
    assert [r["loss"] for r in plain] != [r["loss"] for r in single]  # the planting changed what was trained on


def test_cp2_with_repeat_weights_trains_what_one_process_trains(data, tmp_path):
    """--repeat-weight under cp: the weights are sharded with their targets and the step's total
    weight (the loss's denominator) is summed over the ranks: one process's losses and norms.
    (These windows of the test genome may hold few soft-masked targets: the path, not the weighting's size.)"""
    fields = {"seq_len": 128, "batch": 1, "steps": 3, "repeat_weight": 0.1}
    single = train(_options(data, tmp_path / "single", **fields))
    split = run_ranks(_train_rank, 2, _options(data, tmp_path / "cp2", parallel="cp=2", **fields).to_dict())[0]
    assert _close([r["loss"] for r in split], [r["loss"] for r in single]), (split, single)
    assert _close([r["grad_norm"] for r in split], [r["grad_norm"] for r in single], rtol=1e-5)


@pytest.mark.parametrize("layout", ["cp=2", "tp=2"])  # both split the sequence the loss is computed over
def test_aux_loss_with_a_split_sequence_is_refused_in_one_line(data, tmp_path, layout):
    with pytest.raises(GenolongError, match=rf"--aux-loss-coeff 0.01 with --parallel .*{layout}.*use --aux-loss-coeff 0") as err:
        train(_options(data, tmp_path / "run", seq_len=128, batch=1, parallel=layout, launcher="ray", aux_loss_coeff=0.01))
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


def test_dp2_logs_the_whole_steps_balance_loss(data, tmp_path):
    # Each rank's share of the sequence-wise balance loss is its own sequences': the logged value is their sum.
    fields = {"seq_len": 128, "batch": 2, "steps": 1, "aux_loss_coeff": 0.1}
    single = train(_options(data, tmp_path / "single", **fields))
    split = run_ranks(_train_rank, 2, _options(data, tmp_path / "dp2", parallel="dp=2", **fields).to_dict())[0]
    # (the first step: later ones follow weights and expert biases that differ in their last bits)
    assert math.isclose(split[0]["aux_loss"], single[0]["aux_loss"], rel_tol=1e-4), (split[0], single[0])


def _idle_expert_slice(rank, world):
    from genolong.model import GenoLongForCausalLM, get_preset
    from genolong.parallel.grad_sync import GradientSync
    from genolong.parallel.layout import ParallelLayout
    from genolong.parallel.mesh import build_mesh
    from genolong.parallel.tensor_grads import reduce_gradients

    from genolong.parallel.tensor_plan import ensure_reduce_groups

    pmesh = build_mesh(ParallelLayout(ep=world), "cpu")
    ensure_reduce_groups(pmesh)  # what apply_expert_parallel creates: the experts' own reduce group
    torch.manual_seed(0)
    found = []
    for reducer in ("sync", "reference"):
        model = GenoLongForCausalLM(get_preset("tiny"))
        model(torch.randint(0, 5, (1, 48))).logits.square().mean().backward()
        experts = [p for n, p in model.named_parameters() if ".experts." in n]
        if rank == 1:  # this ep rank's experts got no token this step; rank 0's did
            for p in experts:
                p.grad = None
        GradientSync(model, pmesh).reduce() if reducer == "sync" else reduce_gradients(model, pmesh)
        found.append(all(p.grad is not None for p in experts))
    return found


def test_an_expert_slice_without_tokens_joins_the_step_as_zero_gradients():
    # One process updates every expert (weight decay, the moments) every step; under ep a rank whose
    # experts got no token must too, or its experts drift from the one-process run.
    for found in run_ranks(_idle_expert_slice, 2):
        assert found == [True, True]


def _gradient_sync(rank, world, bucket):
    import torch.distributed as dist

    from genolong.model import GenoLongForCausalLM, get_preset
    from genolong.parallel.grad_sync import GradientSync
    from genolong.parallel.layout import ParallelLayout
    from genolong.parallel.mesh import build_mesh
    from genolong.parallel.tensor_grads import global_grad_norm, reduce_gradients

    pmesh = build_mesh(ParallelLayout(dp=world), "cpu")
    torch.manual_seed(0)
    models = [GenoLongForCausalLM(get_preset("tiny")) for _ in range(2)]
    ids = torch.randint(0, 5, (1, 48), generator=torch.Generator().manual_seed(rank))
    for model in models:
        model.load_state_dict(models[0].state_dict())
        model(ids).logits.square().mean().backward()
        if rank == 1:  # a parameter with no gradient on one rank (an expert without tokens) joins as zeros
            model.lm_head.weight.grad = None
    sync = GradientSync(models[0], pmesh, bucket_elements=bucket)
    sync.reduce()
    reduce_gradients(models[1], pmesh)
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True) if a.grad is not None)
    dist.barrier()
    def whole():
        return float(torch.sqrt(sum(p.grad.double().square().sum() for p in models[0].parameters() if p.grad is not None)))

    return same, sync.grad_norm(whole), global_grad_norm(models[1], pmesh), float(models[0].lm_head.weight.grad.abs().sum())


def test_gradient_sync_equals_the_per_parameter_reference():
    # 1000 elements per bucket: the embedding and lm_head are cut into pieces, many parameters share one.
    for same, norm, reference, lm_head in run_ranks(_gradient_sync, 2, 1000):
        assert same and math.isclose(norm, reference, rel_tol=1e-6) and lm_head > 0


def test_a_layout_whose_pass_is_missing_fails_in_one_line(data, tmp_path, monkeypatch):
    import genolong.train.passes as passes

    real = passes.importlib.import_module

    def without_context(name):
        if name == "genolong.parallel.context":
            raise ModuleNotFoundError(name=name)
        return real(name)

    monkeypatch.setattr(passes.importlib, "import_module", without_context)
    with pytest.raises(GenolongError, match=r"--parallel cp=2 needs genolong.parallel.context.apply_context_parallel") as err:
        passes._parallel_pass("context", "apply_context_parallel", "cp=2")
    assert "\n" not in str(err.value)


def test_parallel_without_a_launcher_is_refused_before_anything_starts(data, tmp_path):
    with pytest.raises(GenolongError, match=r"torchrun --standalone --nproc_per_node=2"):
        train(_options(data, tmp_path / "run", parallel="dp=2"))
    assert not (tmp_path / "run").exists()
    with pytest.raises(GenolongError, match=r"--grad-accum 2 does not divide"):
        train(_options(data, tmp_path / "run", parallel="dp=2", launcher="ray", grad_accum=2))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # four processes on two cores
def test_cp2_tp2_trains_what_one_process_trains_and_resumes_in_one_process(data, tmp_path):
    """tp inside each cp shard (genolong/parallel/context_tensor.py) through the loop, recompute on:
    one process's losses and norms, and its checkpoint (tp-split tensors, cp replicas) resumes in
    one process with the uninterrupted run's next loss."""
    fields = {"seq_len": 256, "batch": 1, "steps": 3}
    single = train(_options(data, tmp_path / "single", **fields))
    run = tmp_path / "cptp"
    first = run_ranks(_train_rank, 4, _options(data, run, stop_after=2, parallel="cp=2,tp=2", **fields).to_dict())[0]
    assert [r["tokens"] for r in first] == [256, 256] and [r["valid_tokens"] for r in first] == [r["valid_tokens"] for r in single[:2]]
    assert _close([r["loss"] for r in first], [r["loss"] for r in single[:2]]), (first, single)
    assert _close([r["grad_norm"] for r in first], [r["grad_norm"] for r in single[:2]], rtol=1e-4)
    rest = train(load_run_options(run, progress=False, stop_after=None, parallel=None))
    assert [r["step"] for r in rest] == [3]
    assert _close([r["loss"] for r in rest], [single[2]["loss"]]), (rest, single)
    assert len({r["loss"] for r in single}) == 3


@pytest.mark.slow  # four processes on two cores: ~60 s
def test_tp2_ep2_trains_what_one_process_trains_and_resumes_in_one_process(data, tmp_path):
    """The tensor/expert-parallel passes inside the loop: the same losses and norms as one process,
    and a checkpoint whose tensors are split over tp and ep loads whole in one process."""
    single = train(_options(data, tmp_path / "single", seq_len=128, steps=3))
    run = tmp_path / "tpep"
    first = run_ranks(_train_rank, 4, _options(data, run, seq_len=128, steps=3, stop_after=2, parallel="tp=2,ep=2").to_dict())[0]
    assert _close([r["loss"] for r in first], [r["loss"] for r in single[:2]])
    assert _close([r["grad_norm"] for r in first], [r["grad_norm"] for r in single[:2]], rtol=1e-5)
    rest = train(load_run_options(run, progress=False, stop_after=None, parallel=None))
    assert _close([r["loss"] for r in rest], [single[2]["loss"]])
