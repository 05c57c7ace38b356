"""Expert balance: the bias rule balances a skewed router, tokens are counted once under
recompute and MoE chunking, the balance loss's gradient is the direct one, the bias is saved."""

import pytest
import torch

from genolong.errors import GenolongError
from genolong.model import GenoLongForCausalLM, from_pretrained, get_preset, save_pretrained
from genolong.model.config import MoEConfig
from genolong.model.moe import MoE
from genolong.train.balance import ExpertBalancer, sequence_balance_loss
from genolong.train.loss import chunked_lm_loss
from genolong.train.memory import apply_memory_optimizations
from genolong.train.options import MemoryOptions

pytestmark = pytest.mark.usefixtures("one_thread")


def _skewed_moe(num_experts=8, top_k=2, hidden=16):
    """A router whose correction bias favours experts 0 and 1 so much that every token picks them."""
    torch.manual_seed(0)
    moe = MoE(hidden, MoEConfig(num_experts=num_experts, top_k=top_k, expert_dim=4), layer_idx=0)
    x = torch.randn(1024, hidden)
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.5)
        moe.gate.e_score_correction_bias[:2] = 1.0
    return moe, x


def test_skewed_router_becomes_balanced_under_the_bias_rule():
    moe, x = _skewed_moe()
    balancer = ExpertBalancer(moe, rate=0.01)
    history = []
    for _ in range(100):
        balancer.begin_step(x.shape[0], x.shape[0])
        with torch.no_grad():
            moe.gate(x)
        history.append(balancer.finish_step().load_max[0])
    # Top-2 of 8 with two favoured experts: each of them gets every token, 4x the mean.
    assert history[0] == pytest.approx(4.0)
    assert max(history[-20:]) < 1.1, history[-20:]
    bias = moe.gate.e_score_correction_bias
    assert bias[:2].max() < 1.0 - 0.3  # the favoured experts were pushed down


def test_rate_zero_leaves_the_bias_alone_but_still_reports_loads():
    moe, x = _skewed_moe()
    balancer = ExpertBalancer(moe, rate=0.0)
    balancer.begin_step(x.shape[0], x.shape[0])
    with torch.no_grad():
        moe.gate(x)
    stats = balancer.finish_step()
    assert stats.load_max[0] == pytest.approx(4.0) and stats.load_min[0] == 0.0 and stats.aux_loss is None
    assert moe.gate.e_score_correction_bias[:2].tolist() == [1.0, 1.0]


def test_the_update_is_the_sign_of_the_load_error():
    moe, x = _skewed_moe(num_experts=4, top_k=1)
    balancer = ExpertBalancer(moe, rate=0.5)
    balancer.begin_step(4, 4)
    moe.gate(x[:4])  # a forward with grad enabled counts too
    balancer.counts[0].copy_(torch.tensor([3, 1, 0, 0]))  # mean 1: over, exact, under, under
    balancer.finish_step()
    assert moe.gate.e_score_correction_bias.tolist() == [1.0 - 0.5, 1.0, 0.5, 0.5]


def _tiny(seed=0):
    torch.manual_seed(seed)
    return GenoLongForCausalLM(get_preset("tiny", num_layers=8))  # MoE in layers 3-7


def _step(model, tokens, balancer, memory=None):
    handle = apply_memory_optimizations(model, memory) if memory is not None else None
    balancer.begin_step(tokens.numel(), tokens.shape[1])
    hidden = model.hidden_states(tokens)
    valid = torch.ones_like(tokens, dtype=torch.bool)
    chunked_lm_loss(hidden, model.lm_head.weight, tokens, valid, 64).backward()
    stats = balancer.finish_step(update_bias=False)
    counts = {i: c.clone() for i, c in balancer.counts.items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    if handle is not None:
        handle.remove()
    return counts, grads, stats


# Chunks of 40 cut the sequences of 48 (the counts must not care); with the balance loss, chunks
# of one sequence keep its segments (a chunk inside a sequence is balanced on its own, by design).
# keep_moe: the forward's run of the MoE is the counted one, its recompute is skipped, its run in
# backward builds the balance loss's gradient (genolong.train.keep_moe).
@pytest.mark.parametrize(("aux", "moe_chunk", "keep_moe"), [(0.0, 40, False), (0.1, 48, False), (0.0, 40, True), (0.1, 48, True)])
def test_tokens_are_counted_once_under_recompute_and_moe_chunking(aux, moe_chunk, keep_moe):
    model = _tiny()
    tokens = torch.randint(0, 4, (2, 48))
    balancer = ExpertBalancer(model, aux_loss_coeff=aux)
    plain, plain_grads, plain_stats = _step(model, tokens, balancer)
    # Full recompute plus MoE chunks, each under its own checkpoint: the router runs three times.
    stacked = MemoryOptions(offload=False, moe_chunk_tokens=moe_chunk, keep_moe=keep_moe)
    again, again_grads, again_stats = _step(model, tokens, balancer, stacked)
    assert sorted(plain) == [3, 4, 5, 6, 7]
    for layer, counts in plain.items():
        assert int(counts.sum()) == tokens.numel() * model.config.moe.top_k
        assert torch.equal(again[layer], counts)
    assert again_stats.load_max == plain_stats.load_max
    if aux:
        assert again_stats.aux_loss == pytest.approx(plain_stats.aux_loss, rel=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(again_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _direct_balance_loss(scores, topk_idx, num_experts, seq_len):
    """DeepSeek-V3 eq. 17-20 written out per sequence, averaged over the sequences."""
    losses = []
    k = topk_idx.shape[1]
    for s in range(0, scores.shape[0], seq_len):
        sc, idx = scores[s : s + seq_len], topk_idx[s : s + seq_len]
        chosen = torch.zeros_like(sc).scatter_(1, idx, 1.0)
        f = chosen.sum(0) * num_experts / (k * seq_len)
        p = (sc / sc.sum(-1, keepdim=True)).mean(0)
        losses.append((f * p).sum())
    return torch.stack(losses).mean()


@pytest.mark.parametrize("recompute", [False, True])
def test_balance_loss_gradient_equals_the_direct_computation(recompute):
    coeff = 0.05
    tokens = torch.randint(0, 4, (2, 40))
    valid = torch.ones_like(tokens, dtype=torch.bool)

    # Direct: record each router's input and choice, add the loss explicitly, one backward.
    model = _tiny()
    seen = []
    hooks = [m.gate.register_forward_hook(lambda mod, inp, out: seen.append((mod, inp[0], out[0]))) for m in model.modules() if isinstance(m, MoE)]
    lm = chunked_lm_loss(model.hidden_states(tokens), model.lm_head.weight, tokens, valid, 64)
    aux = sum(
        coeff * _direct_balance_loss(torch.sigmoid(x.float() @ mod.weight.float().t()), idx, mod.cfg.num_experts, tokens.shape[1])
        for mod, x, idx in seen
    )
    (lm + aux).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for h in hooks:
        h.remove()

    model = _tiny()
    balancer = ExpertBalancer(model, aux_loss_coeff=coeff)
    _, got, stats = _step(model, tokens, balancer, MemoryOptions(offload=False, moe_chunking=False) if recompute else None)
    assert stats.aux_loss == pytest.approx(float(aux.detach()), rel=1e-5)
    assert set(got) == set(want)
    routers = [n for n in want if n.endswith("mlp.gate.weight")]
    assert routers and all(want[n].abs().sum() > 0 for n in routers)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-7, msg=name)


def test_balanced_segment_loss_is_one_and_a_skewed_one_is_larger():
    num_experts, t = 4, 8  # top-1 routing (one expert column per token)
    uniform = torch.full((t, num_experts), 0.5)
    round_robin = torch.arange(t).remainder(num_experts).unsqueeze(1)
    assert float(sequence_balance_loss(uniform, round_robin, num_experts, t)) == pytest.approx(1.0)
    # Everything to expert 0, which also holds most of the affinity: f_0 = 4, P_0 = 0.7.
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).expand(t, -1)
    assert float(sequence_balance_loss(skewed, torch.zeros(t, 1, dtype=torch.long), num_experts, t)) == pytest.approx(2.8)


def test_bias_survives_save_and_load(tmp_path):
    model = _tiny()
    with torch.no_grad():
        for i, m in enumerate(m for m in model.modules() if isinstance(m, MoE)):
            m.gate.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, m.gate.cfg.num_experts) * (i + 1))
    loaded = from_pretrained(save_pretrained(model, tmp_path / "ckpt"), dtype=torch.float32)
    biases = {n: b for n, b in model.state_dict().items() if n.endswith("e_score_correction_bias")}
    assert len(biases) == 5
    for name, bias in biases.items():
        assert torch.equal(loaded.state_dict()[name], bias)


def test_negative_rates_are_refused():
    with pytest.raises(GenolongError, match="must be >= 0"):
        ExpertBalancer(_tiny(), rate=-1e-3)


# ------------------------------------------------------------------------------ in the training loop


def test_a_run_logs_loads_and_resumes_exactly_with_its_bias(data, tmp_path):
    from genolong import checkpoint_dir
    from genolong.train import checkpoint as ck
    from genolong.train import loop
    from genolong.train.metrics import read_jsonl
    from tests.train._helpers import tiny_options

    common = {"steps": 4, "seq_len": 64, "balance_rate": 0.05, "aux_loss_coeff": 0.01}
    straight = loop.train(tiny_options(data, tmp_path / "a", **common))
    first = loop.train(tiny_options(data, tmp_path / "b", stop_after=2, **common))
    second = loop.train(loop.load_run_options(tmp_path / "b", stop_after=None, progress=False))
    assert [r["loss"] for r in first + second] == [r["loss"] for r in straight]
    assert [r["aux_loss"] for r in first + second] == [r["aux_loss"] for r in straight]
    for r in read_jsonl(tmp_path / "b" / ck.METRICS_FILE):
        assert set(r["expert_load_max"]) == set(r["expert_load_min"]) == {"3"}  # tiny: layer 3 is the MoE
        assert r["expert_load_min"]["3"] <= 1.0 <= r["expert_load_max"]["3"] and r["aux_loss"] > 0
    # After 2 steps at rate 0.05 every bias is a sum of two signed steps, and the run moved them.
    from safetensors.torch import load_file

    saved = checkpoint_dir.complete_checkpoints(tmp_path / "b")[0] / ck.MODEL_DIR
    bias = next(t for k, t in load_file(next(saved.glob("*.safetensors"))).items() if k.endswith("e_score_correction_bias"))
    assert bias.abs().max() > 0 and all(round(float(b) / 0.05) in (-2, -1, 0, 1, 2) for b in bias)


def test_loads_and_balance_loss_reach_tensorboard_and_the_jsonl_line():
    from genolong.train.metrics import StepRecord, TensorBoardLog

    record = StepRecord(
        step=7, loss=1.3, lr=1e-3, grad_norm=0.5, skipped=False, tokens=64, valid_tokens=64, step_time_s=1.0,
        tokens_per_s=64.0, model_tflops=1.0, hardware_tflops=1.0, mfu=None, hfu=None, peak_gpu_gib=None,
        reserved_gpu_gib=None, pinned_host_gib=None, nonfinite_total=0, aux_loss=0.02,
        expert_load_max={"3": 1.5, "7": 2.5}, expert_load_min={"3": 0.5, "7": 0.0},
    )
    scalars = {}

    class Writer:
        def add_scalar(self, tag, value, step):
            scalars[tag] = (value, step)

    log = TensorBoardLog.__new__(TensorBoardLog)
    log.writer = Writer()
    log.write(record)
    assert scalars["train/aux_loss"] == (0.02, 7)
    assert scalars["experts/load_max/layer_07"] == (2.5, 7) and scalars["experts/load_min/layer_03"] == (0.5, 7)
    assert '"expert_load_max": {"3": 1.5, "7": 2.5}' in record.to_json()


def _from_scratch_loads(genome, rate: float, steps: int = 120) -> list[float]:
    """tiny trained from scratch on real DNA (2 x 256 bases per step, lr 2e-3, warmup 10): the MoE
    layer's busiest expert over the mean after every step, balanced by the bias rule at `rate`."""
    import numpy as np

    from genolong.data import WindowSampler
    from genolong.train.loss import chunked_lm_loss
    from genolong.train.optim import MasterAdamW, clip_scale, lr_at
    from genolong.vocab import N_ID

    torch.manual_seed(0)
    model = GenoLongForCausalLM(get_preset("tiny"))
    opt = MasterAdamW(list(model.named_parameters()), lr=2e-3)
    balancer = ExpertBalancer(model, rate=rate)
    windows = iter(WindowSampler(genome, "train", 257, seed=0))
    loads = []
    for step in range(steps):
        ids = torch.from_numpy(np.stack([next(windows).tokens for _ in range(2)]).astype(np.int64))
        balancer.begin_step(2 * 256, 256)
        loss = chunked_lm_loss(model.hidden_states(ids[:, :-1]), model.lm_head.weight, ids[:, 1:], ids[:, 1:] != N_ID, 4096)
        loss.backward()
        opt.step(lr_at(step, 2e-3, 10, steps, 0.1), clip_scale(opt.grad_norm(), 1.0))
        opt.zero_grad()
        loads.append(balancer.finish_step().load_max[3])
    return loads


@pytest.mark.slow(seconds=35)
def test_from_scratch_the_routing_collapses_early_and_the_bias_rule_undoes_it(ecoli_dna):
    """Early in a from-scratch run every token looks alike to the routers (the model has only
    learnt base frequencies and their inputs share one direction), so all tokens pick the same
    top-2: 4x the mean, the most top-2 of 8 allows, whatever the router weights do. The bias rule
    brings the loads back as the inputs come to differ; without it the collapse stays
    (docs/training.md, "Expert balance"; measured 2026-12-01 over 200 steps: at rate 1e-2, 4.0 at
    steps 10-20, 1.35-2.0 over steps 100-200; at rate 0, 4.0 from step 10 to 200). 120 steps keep
    both ends at 0.6x the cost: 2026-12-06, at rate 1e-2 the median of steps 70-120 is 1.62, at rate
    0 every step of 70-120 is 4.0."""
    balanced = _from_scratch_loads(ecoli_dna, rate=1e-2)
    unbalanced = _from_scratch_loads(ecoli_dna, rate=0.0)
    assert max(balanced[:40]) > 3.5 and max(unbalanced[:40]) > 3.5  # the collapse this test is about happens
    late = sorted(balanced[-50:])
    assert late[25] < 2.0, late  # the median of the last 50 steps (one step's 512 tokens make a noisy count)
    assert min(unbalanced[-50:]) > 3.5, unbalanced[-50:]
