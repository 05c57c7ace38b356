"""The fused mHC passes on a CUDA GPU in bf16 against the reference (skipped without a GPU): outputs
and every gradient of one sublayer at glm53-mini's and GLM-5.3-Flash's width, and a glm53-mini
model's loss and gradients under the fused policy with recompute."""

import pytest
import torch

import genolong.kernels as kernels
from genolong.model import ops

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _sublayer(hc, streams, out):
    post, comb, x = hc(streams)
    return post, comb, x, hc.expand(post, comb, x * out, streams)


@pytest.mark.parametrize("hidden", [1024, 4096])
def test_fused_sublayer_in_bf16_is_as_close_to_fp32_as_the_bf16_reference(hidden):
    from genolong.model.config import MHCConfig
    from genolong.model.mhc import HyperConnection

    kernels.load()
    torch.manual_seed(0)
    tokens = 4096 + 37  # a masked tail in every token block
    hc = HyperConnection(hidden, MHCConfig(), rms_eps=1e-6).to(DEV)
    with torch.no_grad():
        hc.fn.normal_(0.0, 0.02)
        hc.base.normal_(0.0, 0.1)
    streams, out = torch.randn(1, tokens, 4, hidden, device=DEV), torch.randn(1, tokens, hidden, device=DEV)
    weights = [torch.randn(1, tokens, 4, device=DEV), torch.randn(1, tokens, 4, 4, device=DEV),
               torch.randn(1, tokens, hidden, device=DEV), torch.randn(1, tokens, 4, hidden, device=DEV)]

    def run(policy, dtype):
        hc.zero_grad()
        s, o = (t.detach().to(dtype).requires_grad_() for t in (streams, out))  # new leaves, also in fp32
        with ops.policy(policy) as p:
            outs = _sublayer(hc, s, o)
        sum((t.float() * w).sum() for t, w in zip(outs, weights)).backward()
        grads = [s.grad, o.grad, hc.fn.grad, hc.base.grad, hc.scale.grad]
        return [t.detach().float().clone() for t in (*outs, *grads)], p.audit_summary()

    truth, _ = run("reference", torch.float32)
    fused, audit = run("fused", torch.bfloat16)
    ref16, _ = run("reference", torch.bfloat16)
    assert audit == {"mhc_mix_collapse": {"triton_mhc": 1}, "mhc_expand": {"triton_mhc": 1}}
    names = ["post", "comb", "collapsed", "new", "d streams", "d out", "d fn", "d base", "d scale"]
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    for name, f, r, t in zip(names, fused, ref16, truth):
        ef, er = rel(f, t), rel(r, t)
        print(f"hidden {hidden} {name}: fused {ef:.2e}, bf16 reference {er:.2e}")
        assert ef <= 1.5 * er + 1e-4, (name, ef, er)


def test_glm53_mini_with_the_fused_mhc_trains_like_with_the_eager_mhc():
    from genolong.model import GenoLongForCausalLM, get_preset
    from genolong.train.memory import apply_memory_optimizations
    from genolong.train.options import MemoryOptions

    kernels.load()
    torch.manual_seed(0)
    cfg = get_preset("glm53-mini", num_layers=4)
    model = GenoLongForCausalLM(cfg, dtype=torch.bfloat16).to(DEV)
    memory = apply_memory_optimizations(model, MemoryOptions(offload=False))  # recompute on
    tokens = torch.randint(0, 4, (1, 8193), device=DEV)

    def step():
        model.zero_grad(set_to_none=True)
        with ops.policy("auto") as policy:
            logits = model(tokens[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0], tokens[0, 1:])
        loss.backward()
        return loss.item(), torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None]), policy

    fused_loss, fused_grad, policy = step()
    assert policy.audit_summary()["mhc_mix_collapse"] == {"triton_mhc": cfg.num_layers}
    # The same model with mHC's fused implementations taken away: "auto" runs its eager reference.
    impls = {op: ops.implementations(op)["triton_mhc"] for op in ("mhc_mix_collapse", "mhc_expand")}
    for op in impls:
        ops.unregister(op, "triton_mhc")
    try:
        eager_loss, eager_grad, policy = step()
    finally:
        for op, fn in impls.items():
            ops.register(op, "triton_mhc", fn)
        memory.remove()
    assert policy.audit_summary()["mhc_mix_collapse"] == {ops.REFERENCE: cfg.num_layers}
    rel = ((fused_grad - eager_grad).norm() / eager_grad.norm()).item()
    print(f"loss fused {fused_loss:.5f} eager {eager_loss:.5f}; gradients differ by {rel:.2e} (relative)")
    assert abs(fused_loss - eager_loss) <= 1e-2 * abs(eager_loss)
    assert rel <= 2e-2, rel  # as the compile pass's test: both bf16, the fused passes round once


def test_sinkhorn_backward_kernel_matches_fp64_autograd_on_the_gpu():
    # The O(steps) stored-sums kernel, over a masked tail.
    from genolong.kernels.mhc import sinkhorn as ms
    from genolong.model.mhc_math import sinkhorn

    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.softmax(torch.randn(70_000, 4, 4, generator=g, device=DEV) * 2, -1) + 1e-6
    dy = torch.randn(70_000, 4, 4, generator=g, device=DEV)
    ref_in = x.double().requires_grad_()
    sinkhorn(ref_in, 20, 1e-6).backward(dy.double())
    dx = ms.sinkhorn_backward(x, dy, 20, 1e-6).double()
    assert ((dx - ref_in.grad).norm() / ref_in.grad.norm()).item() < 1e-5
