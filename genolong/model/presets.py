"""Named model sizes as Python functions; `num_layers` is the one scale dial.

- `glm-5.3-flash`: the published architecture (fine-tuning target).
- `glm53-mini`: the benchmark model every GPU figure of this project is measured on: the same
  45-layer pattern and every component type at hidden 512, DNA vocabulary.
- `tiny`: CPU tests. Four layers (layer 3 is DSA and MoE), and an indexer top-k of 32 tokens in
  pools of 4, so DSA is really sparse at test lengths of 128-2048.

`get_preset(name, **overrides)` applies overrides after building: a top-level field
(`num_layers=12`, `vocab_size=16`), or a dict for a component (`moe={"num_experts": 4}`,
`dsa={"indexer": {"topk": 64}}`). Changing `num_layers` re-derives the per-layer schedules
unless they are overridden too. The result is validated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from genolong.errors import GenolongError
from genolong.model.config import (
    DenseMLPConfig,
    DSAConfig,
    IndexerConfig,
    KDAConfig,
    MHCConfig,
    ModelConfig,
    MoEConfig,
)
from genolong.vocab import DNA_MODEL_VOCAB_SIZE


def glm53_flash(num_layers: int = 45) -> ModelConfig:
    return ModelConfig.build(
        name="glm-5.3-flash",
        num_layers=num_layers,
        hidden=4096,
        vocab_size=154_880,
        rms_eps=1e-5,
        kda=KDAConfig(num_heads=64, head_dim=128, conv_kernel=4, lower_bound=-5.0),
        dsa=DSAConfig(
            num_heads=64,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_head_dim=256,
            v_head_dim=256,
            indexer=IndexerConfig(n_heads=32, head_dim=128, topk=2048, kpool=4, always_select_tail=True),
        ),
        moe=MoEConfig(num_experts=288, top_k=8, expert_dim=2048, num_shared_experts=1, routed_scaling_factor=2.5),
        dense_mlp=DenseMLPConfig(intermediate_size=12288),
        mhc=MHCConfig(num_streams=4, sinkhorn_iters=20, eps=1e-6),
    )


def glm53_mini(num_layers: int = 45) -> ModelConfig:
    return ModelConfig.build(
        name="glm53-mini",
        num_layers=num_layers,
        hidden=512,
        vocab_size=DNA_MODEL_VOCAB_SIZE,
        rms_eps=1e-5,
        kda=KDAConfig(num_heads=4, head_dim=128, conv_kernel=4, lower_bound=-5.0),
        dsa=DSAConfig(
            num_heads=4,
            q_lora_rank=384,
            kv_lora_rank=512,
            qk_head_dim=128,
            v_head_dim=128,
            indexer=IndexerConfig(n_heads=4, head_dim=128, topk=2048, kpool=4, always_select_tail=True),
        ),
        moe=MoEConfig(num_experts=64, top_k=4, expert_dim=256, num_shared_experts=1, routed_scaling_factor=2.5),
        dense_mlp=DenseMLPConfig(intermediate_size=1536),
        mhc=MHCConfig(num_streams=4, sinkhorn_iters=20, eps=1e-6),
    )


def tiny(num_layers: int = 4) -> ModelConfig:
    return ModelConfig.build(
        name="tiny",
        num_layers=num_layers,
        hidden=64,
        vocab_size=DNA_MODEL_VOCAB_SIZE,
        rms_eps=1e-5,
        kda=KDAConfig(num_heads=2, head_dim=32, conv_kernel=4, lower_bound=-5.0),
        dsa=DSAConfig(
            num_heads=2,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_head_dim=32,
            v_head_dim=32,
            # Eight indexer heads make exact ties in the ReLU scores (all heads zero) rare.
            indexer=IndexerConfig(n_heads=8, head_dim=16, topk=32, kpool=4, always_select_tail=True),
        ),
        moe=MoEConfig(num_experts=8, top_k=2, expert_dim=32, num_shared_experts=1, routed_scaling_factor=2.5),
        dense_mlp=DenseMLPConfig(intermediate_size=128),
        mhc=MHCConfig(num_streams=4, sinkhorn_iters=20, eps=1e-6),
    )


PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "glm-5.3-flash": glm53_flash,
    "glm53-mini": glm53_mini,
    "tiny": tiny,
}

_SCHEDULES = ("layer_types", "mlp_types", "indexer_types")
_COMPONENTS = ("kda", "dsa", "moe", "dense_mlp", "mhc")


def get_preset(name: str, **overrides) -> ModelConfig:
    """The preset `name` with `overrides` applied (see the module docstring), validated."""
    if name not in PRESETS:
        raise GenolongError(f"unknown model preset {name!r}; use one of {', '.join(PRESETS)}")
    num_layers = overrides.pop("num_layers", None)
    config = PRESETS[name]() if num_layers is None else PRESETS[name](num_layers=num_layers)
    return apply_overrides(config, overrides)


def apply_overrides(config: ModelConfig, overrides: dict) -> ModelConfig:
    """`config` with `overrides` (as get_preset takes them, `num_layers` aside) applied, validated:
    e.g. a trained model's config with a different indexer top-k (its weights still fit)."""
    changes = {}
    for key, value in overrides.items():
        if key == "num_layers":
            raise GenolongError("num_layers cannot be overridden on an existing config (it re-derives the layer schedules)")
        if key in _COMPONENTS and isinstance(value, dict):
            changes[key] = _replace_nested(getattr(config, key), value, key)
        elif key in {f.name for f in dataclasses.fields(ModelConfig)}:
            changes[key] = value
        else:
            raise GenolongError(f"unknown model config field {key!r}; fields are {', '.join(_field_names())}")
    return config.replace(**changes).validate()


def _replace_nested(obj, changes: dict, where: str):
    names = {f.name for f in dataclasses.fields(obj)}
    out = {}
    for key, value in changes.items():
        if key not in names:
            raise GenolongError(f"unknown field {where}.{key}; {where} has {', '.join(sorted(names))}")
        sub = getattr(obj, key)
        if dataclasses.is_dataclass(sub) and isinstance(value, dict):
            value = _replace_nested(sub, value, f"{where}.{key}")
        out[key] = value
    return dataclasses.replace(obj, **out)


def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(ModelConfig)]


def with_indexer_topk(config: ModelConfig, topk: int | None) -> ModelConfig:
    """`config` with its DSA indexers selecting `topk` keys (None: unchanged); the weights still fit."""
    if topk is None:
        return config
    if topk % config.dsa.indexer.kpool:
        raise GenolongError(
            f"--indexer-topk {topk} is not a multiple of the indexer's pool size {config.dsa.indexer.kpool} "
            "(it selects whole pools); pick a multiple"
        )
    return apply_overrides(config, {"dsa": {"indexer": {"topk": topk}}})


def set_indexer_topk(model, topk: int) -> None:
    """Make a built model's indexers select `topk` keys (its config too, so a save records it)."""
    config = with_indexer_topk(model.config, topk)
    model.config = config
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "config"):
        inner.config = config
    for layer in getattr(inner, "layers", []):
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None:
            indexer.cfg = config.dsa.indexer
