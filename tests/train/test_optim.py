"""MasterAdamW's multi-tensor update: the bucketing changes nothing, bf16 parameters follow their masters."""

import torch

from genolong.model import GenoLongForCausalLM, get_preset
from genolong.train import optim
from genolong.train.optim import MasterAdamW


def _trained(dtype, steps=3):
    torch.manual_seed(0)
    model = GenoLongForCausalLM(get_preset("tiny", num_layers=2), dtype=dtype)
    opt = MasterAdamW(list(model.named_parameters()), lr=1e-2)
    ids = torch.randint(0, 5, (1, 33))
    norms = []
    for _ in range(steps):
        model(ids[:, :-1]).logits.float().logsumexp(-1).mean().backward()
        norms.append(opt.grad_norm())
        opt.step(lr=1e-2, grad_scale=0.5)
        opt.zero_grad()
    return model, opt, norms


def test_bucketing_changes_nothing(monkeypatch):
    for dtype in (torch.float32, torch.bfloat16):
        whole, whole_opt, whole_norms = _trained(dtype)
        monkeypatch.setattr(optim, "_BUCKET_BYTES", 1)  # every parameter its own bucket
        single, single_opt, single_norms = _trained(dtype)
        monkeypatch.undo()
        assert single_opt._buckets(list(single_opt.params)) == []  # no gradients left after zero_grad
        assert whole_norms == single_norms
        for (name, a), (_, b) in zip(whole.named_parameters(), single.named_parameters()):
            assert torch.equal(a, b), (dtype, name)
        for name in whole_opt.params:
            assert torch.equal(whole_opt.exp_avg_sq[name], single_opt.exp_avg_sq[name]), (dtype, name)


def test_grad_norm_is_the_global_norm():
    _, opt, _ = _trained(torch.float32, steps=0)
    for i, p in enumerate(opt.params.values()):
        p.grad = torch.full_like(p, float(i % 3))
    expected = torch.cat([p.grad.flatten() for p in opt.params.values()]).double().norm().item()
    assert abs(opt.grad_norm() - expected) <= 1e-6 * expected


def test_bf16_parameters_are_rounded_masters_after_each_step():
    model, opt, _ = _trained(torch.bfloat16)
    bf16 = [(n, p) for n, p in model.named_parameters() if p.dtype == torch.bfloat16 and n in opt.master]
    assert bf16
    for name, p in bf16:
        assert opt.master[name].dtype == torch.float32
        assert torch.equal(p, opt.master[name].to(torch.bfloat16)), name


def test_buckets_split_by_size_and_decay(monkeypatch):
    ps = [("w1", torch.nn.Parameter(torch.zeros(4, 4))), ("w2", torch.nn.Parameter(torch.zeros(4, 4))), ("b", torch.nn.Parameter(torch.zeros(4)))]
    opt = MasterAdamW(ps, lr=1.0)
    for _, p in ps:
        p.grad = torch.ones_like(p)
    assert sorted(opt._buckets(["w1", "w2", "b"])) == [((False, 0), ["b"]), ((True, 0), ["w1", "w2"])]
    monkeypatch.setattr(optim, "_BUCKET_BYTES", 4 * 16)
    assert sorted(opt._buckets(["w1", "w2", "b"])) == [((False, 0), ["b"]), ((True, 0), ["w1"]), ((True, 0), ["w2"])]
    opt.param_steps["w2"] = 3  # updated in other steps than w1 (a partial warm-up): its own bias correction
    monkeypatch.setattr(optim, "_BUCKET_BYTES", 1 << 20)
    assert sorted(opt._buckets(["w1", "w2", "b"])) == [((False, 0), ["b"]), ((True, 0), ["w1"]), ((True, 3), ["w2"])]
