"""The chunked LM loss: same values and gradients as plain cross-entropy, memory independent of T x V."""

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from genolong.train.loss import (
    IGNORE,
    auto_chunk_tokens,
    chunked_lm_loss,
    chunked_token_loss,
    full_lm_loss,
    repeat_target_weight,
)
from genolong.vocab import N_ID


def _inputs(b=2, t=37, d=16, v=11, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, d, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, d, generator=g, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, v, (b, t), generator=g)
    return hidden, weight, targets


def _reference_token_loss(hidden, weight, targets):
    logits = (hidden @ weight.t()).float() if hidden.dtype != torch.float64 else hidden @ weight.t()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=IGNORE).view(targets.shape)


def test_token_loss_and_grads_match_cross_entropy_for_any_chunking():
    for chunk in (1, 5, 37, 74, 1000):  # chunk boundaries inside a sequence, across the batch, one chunk
        hidden, weight, targets = _inputs()
        targets[0, 3] = IGNORE
        up = torch.randn(targets.shape, dtype=torch.float64)
        got = chunked_token_loss(hidden, weight, targets, chunk)
        assert got.dtype == torch.float32 and got.shape == targets.shape
        (got.double() * up).sum().backward()
        gh, gw = hidden.grad.clone(), weight.grad.clone()
        hidden.grad = weight.grad = None
        want = _reference_token_loss(hidden, weight, targets)
        (want * up).sum().backward()
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
        assert got[0, 3] == 0
        torch.testing.assert_close(gh, hidden.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(gw, weight.grad, rtol=1e-6, atol=1e-6)


def test_bf16_grads_close_to_fp32_reference():
    hidden, weight, targets = _inputs(t=64, d=32, v=50, dtype=torch.float32)
    hb = hidden.detach().bfloat16().requires_grad_()
    wb = weight.detach().bfloat16().requires_grad_()
    chunked_token_loss(hb, wb, targets, 16).sum().backward()
    _reference_token_loss(hb.detach().float().requires_grad_(), wb.detach().float(), targets)
    ref_h = hb.detach().float().requires_grad_()
    ref_w = wb.detach().float().requires_grad_()
    _reference_token_loss(ref_h, ref_w, targets).sum().backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(hb.grad.float(), ref_h.grad, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(wb.grad.float(), ref_w.grad, rtol=3e-2, atol=3e-2)


def test_lm_loss_masks_n_and_divides_by_valid_count():
    hidden, weight, targets = _inputs()
    valid = targets != N_ID
    assert 0 < valid.sum() < valid.numel()
    got = chunked_lm_loss(hidden, weight, targets, valid, chunk_tokens=8)
    per_token = _reference_token_loss(hidden, weight, targets)
    want = per_token[valid].sum() / valid.sum()
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(full_lm_loss(hidden, weight, targets, valid).double(), want.double(), rtol=1e-6, atol=1e-6)


def test_global_count_makes_split_gradients_sum_to_the_whole_step():
    """Shards with very uneven masks: summing shard grads (each / global count) == the unsplit step."""
    hidden, weight, targets = _inputs(b=2, t=40)
    valid = torch.ones_like(targets, dtype=torch.bool)
    valid[0, :35] = False  # shard 0 has 5 valid targets, shard 1 has 40
    chunked_lm_loss(hidden, weight, targets, valid, 7).backward()
    whole_h, whole_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    count = int(valid.sum())
    for i in range(2):
        chunked_lm_loss(hidden[i : i + 1], weight, targets[i : i + 1], valid[i : i + 1], 7, global_valid_count=count).backward()
    torch.testing.assert_close(hidden.grad, whole_h, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(weight.grad, whole_w, rtol=1e-9, atol=1e-12)

    # The per-shard mean (the bug the global count prevents) gives a different gradient.
    hidden.grad = weight.grad = None
    for i in range(2):
        (chunked_lm_loss(hidden[i : i + 1], weight, targets[i : i + 1], valid[i : i + 1], 7) / 2).backward()
    assert not torch.allclose(weight.grad, whole_w)


def test_all_n_window_gives_zero_loss_not_nan():
    hidden, weight, targets = _inputs()
    valid = torch.zeros_like(targets, dtype=torch.bool)
    loss = chunked_lm_loss(hidden, weight, targets, valid, 8)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() == 0


def _repeat_case(seed=3):
    hidden, weight, targets = _inputs(b=2, t=41, v=8, seed=seed)
    targets = targets.remainder(5)  # DNA ids: A C G T N
    valid = targets != N_ID
    repeats = torch.rand(targets.shape, generator=torch.Generator().manual_seed(seed)) < 0.4
    assert (valid & repeats).any() and (valid & ~repeats).any() and (~valid).any()
    return hidden, weight, targets, valid, repeats


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


def test_repeat_weight_one_is_exactly_the_unweighted_loss():
    hidden, weight, targets, valid, repeats = _repeat_case()
    ones = repeat_target_weight(valid, repeats, 1.0)
    count = int(valid.sum())
    plain = chunked_lm_loss(hidden, weight, targets, valid, 16, count)
    weighted = chunked_lm_loss(hidden, weight, targets, valid, 16, float(ones.sum()), ones)
    assert torch.equal(plain, weighted)
    for a, b in zip(_grads(plain, hidden, weight), _grads(weighted, hidden, weight)):
        assert torch.equal(a, b)
    # The full-logits path sums the per-token losses in another order than cross_entropy's own sum.
    plain = full_lm_loss(hidden, weight, targets, valid, count)
    weighted = full_lm_loss(hidden, weight, targets, valid, float(ones.sum()), ones)
    torch.testing.assert_close(plain, weighted, rtol=1e-6, atol=0)


def test_repeat_weight_zero_is_the_loss_over_non_repeat_bases():
    hidden, weight, targets, valid, repeats = _repeat_case()
    zero = repeat_target_weight(valid, repeats, 0.0)
    assert zero[~valid].abs().sum() == 0 and zero[repeats].abs().sum() == 0
    for loss in (chunked_lm_loss, lambda *a, **k: full_lm_loss(*a[:4], **k)):
        got = loss(hidden, weight, targets, valid, 16, target_weight=zero)
        want = loss(hidden, weight, targets, valid & ~repeats, 16)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for a, b in zip(_grads(got, hidden, weight), _grads(want, hidden, weight)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_weighted_loss_and_gradients_match_a_direct_computation_and_split_by_the_global_total():
    hidden, weight, targets, valid, repeats = _repeat_case()
    w = repeat_target_weight(valid, repeats, 0.1)
    per_token = _reference_token_loss(hidden, weight, torch.where(valid, targets, IGNORE))
    want = (per_token * w.double()).sum() / w.double().sum()
    want_grads = _grads(want, hidden, weight)
    got = chunked_lm_loss(hidden, weight, targets, valid, 7, target_weight=w)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-9)
    for a, b in zip(_grads(got, hidden, weight), want_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    # Micro-batches that each divide by the step's total weight add up to the whole step.
    total = float(w.sum(dtype=torch.float64))
    split = sum(chunked_lm_loss(hidden[i : i + 1], weight, targets[i : i + 1], valid[i : i + 1], 7, total, w[i : i + 1]) for i in range(2))
    for a, b in zip(_grads(split, hidden, weight), want_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_all_weights_zero_gives_zero_loss_not_nan():
    hidden, weight, targets, valid, repeats = _repeat_case()
    loss = chunked_lm_loss(hidden, weight, targets, valid, 8, target_weight=torch.zeros(targets.shape))
    assert loss.item() == 0.0 and all(torch.isfinite(g).all() for g in _grads(loss, hidden, weight))


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward): a peak-memory proxy on CPU."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _saved_and_largest(t, v, chunk, d=8):
    hidden = torch.randn(1, t, d, requires_grad=True)
    weight = torch.randn(v, d, requires_grad=True)
    targets = torch.randint(0, v, (1, t))
    saved = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel() * x.element_size()) or x, lambda x: x)
    with hooks, _LargestTensor() as mode:
        loss = chunked_lm_loss(hidden, weight, targets, torch.ones_like(targets, dtype=torch.bool), chunk)
        loss.backward()
    return sum(saved), mode.largest


def test_memory_does_not_scale_with_tokens_times_vocab():
    t, v, chunk = 4096, 2048, 128
    full_logits = t * v * 4
    saved, largest = _saved_and_largest(t, v, chunk)
    # Saved for backward: hidden, weight, targets, one fp32 lse per token; never [T, V].
    assert saved <= t * 8 * 4 + v * 8 * 4 + t * 8 + t * 4 + 1024
    assert largest <= max(chunk * v * 4, v * 8 * 4)  # one chunk of logits or the weight grad
    assert largest * 16 <= full_logits
    # Doubling T doubles the saved bytes (linear), and the largest tensor stays one chunk.
    saved2, largest2 = _saved_and_largest(2 * t, v, chunk)
    assert saved2 < 2.1 * saved and largest2 == largest


def test_auto_chunk_size_bounds_logit_bytes():
    assert auto_chunk_tokens(154880) * 154880 * 4 <= 1 << 30
    assert auto_chunk_tokens(8) >= 1 << 20  # DNA vocab: a whole 512k sequence in one chunk
