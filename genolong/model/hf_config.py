"""transformers `glm5_next` config.json <-> genolong `ModelConfig`.

A checkpoint's config.json holds the text tower's fields either under `text_config` (the
multimodal `Glm5NextConfig` that transformers writes) or at the top level (flat, text-only
releases). Every field that transformers' model reads must be representable in ModelConfig;
one that is not (a RoPE part, another activation, tied embeddings, ...) is refused with the
field's name and its value, because loading it anyway would compute something else than the
checkpoint was trained to compute, with no error.

Fields are in three groups: mapped (become ModelConfig fields), fixed (genolong implements
exactly one value: anything else is refused), and ignored (inference or bookkeeping settings
that do not change the forward pass: cache, token ids, aux-loss coefficient, ...). A field in
none of the groups is reported as a warning: transformers' model does not read it either.
"""

from __future__ import annotations

import logging
from typing import Any

from genolong.errors import GenolongError
from genolong.model.config import (
    HF_LAYER_TYPES,
    HF_MLP_TYPES,
    INDEXER_FULL,
    INDEXER_SHARED,
    TO_HF_LAYER_TYPES,
    TO_HF_MLP_TYPES,
    DenseMLPConfig,
    DSAConfig,
    IndexerConfig,
    KDAConfig,
    MHCConfig,
    ModelConfig,
    MoEConfig,
    default_layer_types,
    default_mlp_types,
)

log = logging.getLogger(__name__)

MODEL_TYPE = "glm5_next"
TEXT_MODEL_TYPE = "glm5_next_text"
ARCHITECTURE = "Glm5NextForConditionalGeneration"

# transformers' Glm5NextTextConfig defaults, for fields a config.json may leave out. They are
# the published GLM-5.3-Flash values except index_kpool, whose library default (16) is not
# what GLM-5.3-Flash uses (4): a config that omits it gets 16, as transformers would.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 154880,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 45,
    "num_attention_heads": 64,
    "n_shared_experts": 1,
    "n_routed_experts": 288,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 0,
    "v_head_dim": 256,
    "qk_nope_head_dim": 256,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "swiglu_limit": 10.0,
    "linear_head_dim": 128,
    "linear_num_heads": 64,
    "linear_conv_kernel_dim": 4,
    "linear_lower_bound": -5.0,
    "hc_mult": 4,
    "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 20,
    "index_kpool": 16,
    "index_kpool_always_select_tail": True,
}

# Fields whose only representable value is given; `None` in a config means the library default.
FIXED: dict[str, Any] = {
    "qk_rope_head_dim": 0,  # genolong's DSA is NoPE MLA: there is no rotary part
    "hidden_act": "silu",
    "tie_word_embeddings": False,  # lm_head is its own matrix
    "attention_dropout": 0.0,  # no dropout anywhere in genolong
    "topk_method": "noaux_tc",  # DeepSeek-style configs: the sigmoid + correction-bias router
    "scoring_func": "sigmoid",
}

# Read by transformers for inference, training losses or bookkeeping; not by the forward pass.
IGNORED = frozenset(
    {
        "model_type", "architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
        "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "max_position_embeddings",
        "output_router_logits", "router_aux_loss_coef", "head_dim", "qk_head_dim", "quantization_config",
        "num_nextn_predict_layers", "generation_config", "return_dict", "output_hidden_states",
        "output_attentions", "chunk_size_feed_forward", "problem_type", "tokenizer_class", "id2label",
        "label2id", "is_encoder_decoder", "num_key_value_heads", "index_topk_pattern", "index_topk_freq",
        "index_skip_topk_offset", "linear_attn_config", "text_config", "vision_config",
    }
)
# Top-level fields of the multimodal Glm5NextConfig (vision token ids): not the text tower's business.
MULTIMODAL_TOP_LEVEL = frozenset(
    {
        "image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
        "video_start_token_id", "video_end_token_id", "vision_config",
    }
)
MAPPED = frozenset(HF_DEFAULTS) - frozenset(FIXED) | {"layer_types", "mlp_layer_types", "indexer_types", "num_local_experts"}


def text_fields(raw: dict) -> dict:
    """The text tower's fields of a config.json: `text_config` if present, else the flat top level."""
    text = raw.get("text_config")
    if text is None:
        return {k: v for k, v in raw.items() if k not in MULTIMODAL_TOP_LEVEL}
    if not isinstance(text, dict):
        raise GenolongError(f"config.json text_config is a {type(text).__name__}, not an object; the file is corrupt")
    return text


def _refuse(field: str, value: Any, expected: str) -> None:
    raise GenolongError(
        f"checkpoint config field {field} = {value!r} cannot be represented by genolong ({expected}); "
        "genolong loads GLM-5.3-Flash-architecture (glm5_next) checkpoints only"
    )


def _schedule(value: Any, field: str, mapping: dict[str, str], n: int) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        _refuse(field, value, "a list with one entry per layer")
    if len(value) != n:
        _refuse(field, f"{len(value)} entries", f"num_hidden_layers = {n} entries")
    out = []
    for i, entry in enumerate(value):
        if entry not in mapping:
            _refuse(f"{field}[{i}]", entry, f"one of {sorted(mapping)}")
        out.append(mapping[entry])
    return tuple(out)


def _indexer_types(t: dict, n: int) -> tuple[str, ...]:
    """transformers' rule: explicit list, else a 'F'/'S' pattern, else a frequency/offset schedule."""
    kinds = {"full": INDEXER_FULL, "shared": INDEXER_SHARED}
    if t.get("indexer_types") is not None:
        return _schedule(t["indexer_types"], "indexer_types", kinds, n)
    pattern = t.get("index_topk_pattern")
    if pattern is not None:
        letters = {"F": "full", "S": "shared"}
        if isinstance(pattern, str):
            if any(c not in letters for c in pattern):
                _refuse("index_topk_pattern", pattern, "a string of 'F' and 'S'")
            pattern = [letters[c] for c in pattern]
        return _schedule(list(pattern), "index_topk_pattern", kinds, n)
    freq = max(int(t.get("index_topk_freq", 1)), 1)
    offset = int(t.get("index_skip_topk_offset", 2))
    return tuple(INDEXER_FULL if max(i - offset + 1, 0) % freq == 0 else INDEXER_SHARED for i in range(n))


def from_hf(raw: dict, name: str = "checkpoint") -> ModelConfig:
    """ModelConfig of a transformers glm5_next config.json (as a dict), validated."""
    t = text_fields(raw)
    mt = t.get("model_type", raw.get("model_type"))
    if mt is not None and mt not in (MODEL_TYPE, TEXT_MODEL_TYPE):
        _refuse("model_type", mt, f"'{MODEL_TYPE}' or '{TEXT_MODEL_TYPE}'")

    def get(key: str) -> Any:
        value = t.get(key)
        return HF_DEFAULTS[key] if value is None and key in HF_DEFAULTS else value

    for key, want in FIXED.items():
        # The composite model (a text_config inside) ties its lm_head by the top-level flag, as
        # transformers' Glm5NextForConditionalGeneration does; text_config's own flag is unused.
        value = raw.get(key) if key == "tie_word_embeddings" and raw.get("text_config") is not None else t.get(key)
        if value is not None and value != want:
            _refuse(key, value, f"only {want!r}")
    if t.get("num_local_experts") is not None:
        # transformers' alias (attribute_map) of n_routed_experts.
        if t.get("n_routed_experts") is not None and t["n_routed_experts"] != t["num_local_experts"]:
            _refuse("num_local_experts", t["num_local_experts"], f"the same as n_routed_experts = {t['n_routed_experts']} (its alias)")
        t = {**t, "n_routed_experts": t["num_local_experts"]}
    heads = get("num_attention_heads")
    kv_heads = t.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        _refuse("num_key_value_heads", kv_heads, f"MLA has one kv head per query head: num_attention_heads = {heads}")
    if "q_lora_rank" in t and t["q_lora_rank"] is None:
        _refuse("q_lora_rank", None, "DSA needs a low-rank query projection: a positive integer")
    unknown = sorted(k for k in t if k not in MAPPED and k not in FIXED and k not in IGNORED and not k.startswith("_"))
    if unknown:
        log.warning("config.json fields not used by glm5_next (ignored): %s", ", ".join(unknown))

    # Kimi-Linear-style nested KDA fields, as transformers accepts them.
    lin = dict(t.get("linear_attn_config") or {})
    lower = lin.get("gate_lower_bound", t.get("linear_lower_bound", HF_DEFAULTS["linear_lower_bound"]))
    # transformers: with a linear_attn_config (even an empty one), safe_gate defaults to true and a
    # missing lower bound becomes -5.0; without one, linear_lower_bound = null means unbounded.
    if lower is None and t.get("linear_attn_config") is not None and lin.get("safe_gate", True):
        lower = -5.0
    kda = KDAConfig(
        num_heads=int(lin.get("num_heads", get("linear_num_heads"))),
        head_dim=int(lin.get("head_dim", get("linear_head_dim"))),
        conv_kernel=int(lin.get("short_conv_kernel_size", get("linear_conv_kernel_dim"))),
        lower_bound=None if lower is None else float(lower),
    )
    n = int(get("num_hidden_layers"))
    layer_types = (
        default_layer_types(n)
        if t.get("layer_types") is None
        else _schedule(t["layer_types"], "layer_types", HF_LAYER_TYPES, n)
    )
    mlp_types = (
        default_mlp_types(n)
        if t.get("mlp_layer_types") is None
        else _schedule(t["mlp_layer_types"], "mlp_layer_types", HF_MLP_TYPES, n)
    )
    swiglu_limit = float(get("swiglu_limit"))
    config = ModelConfig(
        name=name,
        num_layers=n,
        hidden=int(get("hidden_size")),
        vocab_size=int(get("vocab_size")),
        kda=kda,
        dsa=DSAConfig(
            num_heads=int(heads),
            q_lora_rank=int(get("q_lora_rank")),
            kv_lora_rank=int(get("kv_lora_rank")),
            qk_head_dim=int(get("qk_nope_head_dim")),
            v_head_dim=int(get("v_head_dim")),
            attention_bias=bool(get("attention_bias")),
            indexer=IndexerConfig(
                n_heads=int(get("index_n_heads")),
                head_dim=int(get("index_head_dim")),
                topk=int(get("index_topk")),
                kpool=int(get("index_kpool")),
                always_select_tail=bool(get("index_kpool_always_select_tail")),
            ),
        ),
        moe=MoEConfig(
            num_experts=int(get("n_routed_experts")),
            top_k=int(get("num_experts_per_tok")),
            expert_dim=int(get("moe_intermediate_size")),
            num_shared_experts=int(get("n_shared_experts")),
            routed_scaling_factor=float(get("routed_scaling_factor")),
            norm_topk_prob=bool(get("norm_topk_prob")),
            n_group=int(get("n_group")),
            topk_group=int(get("topk_group")),
            swiglu_limit=swiglu_limit,
        ),
        dense_mlp=DenseMLPConfig(intermediate_size=int(get("intermediate_size")), swiglu_limit=swiglu_limit),
        mhc=MHCConfig(
            num_streams=int(get("hc_mult")),
            sinkhorn_iters=int(get("hc_sinkhorn_iters")),
            eps=float(get("hc_eps")),
        ),
        layer_types=layer_types,
        mlp_types=mlp_types,
        indexer_types=_indexer_types(t, n),
        rms_eps=float(get("rms_norm_eps")),
        initializer_range=float(get("initializer_range")),
    )
    return config.validate()


def to_hf_text(config: ModelConfig) -> dict:
    """Glm5NextTextConfig fields (a dict) that transformers builds the same text tower from."""
    if config.dense_mlp.swiglu_limit != config.moe.swiglu_limit:
        raise GenolongError(
            f"dense_mlp.swiglu_limit ({config.dense_mlp.swiglu_limit}) != "
            f"moe.swiglu_limit ({config.moe.swiglu_limit}); "
            "transformers' glm5_next has one swiglu_limit: make them equal to save in its format"
        )
    d, ix, k, m = config.dsa, config.dsa.indexer, config.kda, config.moe
    return {
        "model_type": TEXT_MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden,
        "intermediate_size": config.dense_mlp.intermediate_size,
        "moe_intermediate_size": m.expert_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": d.num_heads,
        "num_key_value_heads": d.num_heads,
        "n_shared_experts": m.num_shared_experts,
        "n_routed_experts": m.num_experts,
        "routed_scaling_factor": m.routed_scaling_factor,
        "kv_lora_rank": d.kv_lora_rank,
        "q_lora_rank": d.q_lora_rank,
        "qk_rope_head_dim": 0,
        "qk_nope_head_dim": d.qk_head_dim,
        "v_head_dim": d.v_head_dim,
        "n_group": m.n_group,
        "topk_group": m.topk_group,
        "num_experts_per_tok": m.top_k,
        "norm_topk_prob": m.norm_topk_prob,
        "hidden_act": "silu",
        "initializer_range": config.initializer_range,
        "rms_norm_eps": config.rms_eps,
        "tie_word_embeddings": False,
        "attention_bias": d.attention_bias,
        "attention_dropout": 0.0,
        "index_topk": ix.topk,
        "index_head_dim": ix.head_dim,
        "index_n_heads": ix.n_heads,
        "index_kpool": ix.kpool,
        "index_kpool_always_select_tail": ix.always_select_tail,
        "swiglu_limit": m.swiglu_limit,
        "linear_head_dim": k.head_dim,
        "linear_num_heads": k.num_heads,
        "linear_conv_kernel_dim": k.conv_kernel,
        "linear_lower_bound": k.lower_bound,
        "hc_mult": config.mhc.num_streams,
        "hc_eps": config.mhc.eps,
        "hc_sinkhorn_iters": config.mhc.sinkhorn_iters,
        "layer_types": [TO_HF_LAYER_TYPES[x] for x in config.layer_types],
        "mlp_layer_types": [TO_HF_MLP_TYPES[x] for x in config.mlp_types],
        "indexer_types": list(config.indexer_types),
        # transformers' default pad id (154820) is outside a DNA vocabulary; genolong never pads.
        "pad_token_id": None,
    }


def to_hf(config: ModelConfig, dtype: str | None = None, source: dict | None = None) -> dict:
    """A complete config.json (multimodal Glm5NextConfig layout, text tower under text_config).

    `source` is the config.json the model was loaded from, if any: its fields that genolong does
    not model (token ids, vision config, ...) are kept so that a fine-tuned checkpoint still
    works with the tools of the original; every architecture field is rewritten from `config`,
    and quantization_config is dropped because genolong saves dequantized weights.
    """
    text = {}
    out = {}
    if source is not None:
        out = {k: v for k, v in source.items() if k not in ("text_config", "quantization_config")}
        text = {k: v for k, v in text_fields(source).items() if k not in ("quantization_config", "linear_attn_config")}
        for stale in ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset"):
            text.pop(stale, None)
        if "text_config" not in source:  # a flat config: its text fields move under text_config
            out = {k: v for k, v in out.items() if k in MULTIMODAL_TOP_LEVEL}
    generated = to_hf_text(config)
    if source is not None and "pad_token_id" in text:
        generated.pop("pad_token_id")
    text.update(generated)
    if dtype is not None:
        for fields in (text, out):
            fields.pop("torch_dtype", None)  # transformers' older name for dtype; would contradict it
            fields["dtype"] = dtype
    out.update({"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "text_config": text})
    out["tie_word_embeddings"] = False
    return out
