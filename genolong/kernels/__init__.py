"""Fused GPU implementations of the model's hot ops (docs/kernels.md, contract in docs/ops.md).

`load()` registers every fused implementation with genolong.model.ops. Registering needs no
GPU package: each implementation imports its package (fla, tilelang via megatron-core,
triton) when called and raises `KernelUnsupported` with the reason when it cannot run its
inputs, so on a CPU machine the "fused" policy fails loudly and "auto" runs the references.
Within an op, implementations are tried in the order below.
"""

from __future__ import annotations

import importlib

# op -> [(implementation name, module, function)], in order of preference.
FUSED = {
    # The few-head Triton kernel first; megatron-core's padded TileLang kernel stays selectable
    # (and is the benchmarks' baseline).
    "dsa_sparse_attention": [("triton_sparse_mla", "genolong.kernels.sparse_mla.op", "dsa_sparse_attention"),
                             ("tilelang_sparse_mla", "genolong.kernels.sparse_mla.tilelang", "dsa_sparse_attention")],
    # indexer_topk.dsa_indexer_topk_chunked (plain PyTorch) is deliberately not registered: a
    # Triton failure must show up as a fallback, not as a silent 10x slower path.
    # v2 (in-kernel selections) first again, awaiting its GPU proof: on the H200 (2026-12-01,
    # the indexer-loss stage's log) its pass 1 asked for 291 KiB of shared memory;
    # it now fits in the JIT-specialised sm_90 build (164 KiB at 4 heads, 80.5 KiB at 32,
    # tests/kernels/test_compile.py). v1 stays behind it and selectable by name.
    "dsa_indexer_topk": [
        ("triton_fused_select", "genolong.kernels.indexer.topk", "dsa_indexer_topk_fused_select"),
        ("triton_two_pass", "genolong.kernels.indexer.topk", "dsa_indexer_topk_fused"),
    ],
    "kda": [("fla_chunk_kda", "genolong.kernels.kda.fla_chunk", "kda_fla")],
    "kda_short_conv": [("fla_causal_conv1d", "genolong.kernels.kda.fla_conv", "short_conv_fla")],
    "moe_experts": [("torch_grouped_mm", "genolong.kernels.moe.grouped", "moe_experts_grouped")],
    "dsa_indexer_loss": [("triton_pool_kl", "genolong.kernels.indexer.loss", "dsa_indexer_loss_fused")],
    "mhc_mix_collapse": [("triton_mhc", "genolong.kernels.mhc.fused", "mhc_mix_collapse_fused")],
    "mhc_expand": [("triton_mhc", "genolong.kernels.mhc.fused", "mhc_expand_fused")],
}

# Implementations a recompute can replay from their forward's kept result (genolong.train.keep):
# (op, implementation) -> (module, function). The megatron-core TileLang kernel has none (its
# backward needs its own padded copies), so under it the sparse attention is simply recomputed.
REPLAYS = {
    ("dsa_sparse_attention", "triton_sparse_mla"): ("genolong.kernels.sparse_mla.op", "replay_dsa_sparse_attention"),
}

# The references live beside the layers that use them; importing those modules registers them.
_REFERENCE_MODULES = ("genolong.model.dsa", "genolong.model.indexer", "genolong.model.kda", "genolong.model.moe",
                      "genolong.model.mhc")


def load() -> dict[str, list[str]]:
    """Register the references and every fused implementation; returns {op: [implementation names]}."""
    from genolong.model import frames, ops

    for name in _REFERENCE_MODULES:
        importlib.import_module(name)
    for op, impls in FUSED.items():
        for impl, module, fn in impls:
            ops.register(op, impl, getattr(importlib.import_module(module), fn))
    for (op, impl), (module, fn) in REPLAYS.items():
        frames.register_replay(op, impl, getattr(importlib.import_module(module), fn))
    _use_fused_kept_selection()
    from genolong.kernels.autotune_seeds import seed_once

    seed_once()
    return {op: list(ops.implementations(op)) for op in FUSED}


def _use_fused_kept_selection() -> None:
    """The kept selection's pack check and expansion as one Triton pass each, where triton imports
    (indexer/kept_selection.py decides per tensor: CUDA or the interpreter, int32, pools of 2^n)."""
    from genolong.model import kept_selection

    try:
        from genolong.kernels.indexer import kept_selection as fused
    except ImportError:  # no triton: the PyTorch passes
        return
    kept_selection.FUSED.update(enabled=fused.enabled, pack=fused.pack, expand=fused.expand)


def available() -> dict[str, str]:
    """{package: version or the import error}: what the fused implementations can use here."""
    found = {}
    for pkg, mod in (("triton", "triton"), ("tilelang", "tilelang"), ("flash-linear-attention", "fla"), ("megatron-core", "megatron.core")):
        try:
            found[pkg] = getattr(importlib.import_module(mod), "__version__", "installed")
        except Exception as why:  # a broken install is as unavailable as a missing one
            found[pkg] = f"unavailable ({type(why).__name__}: {why})"
    return found
