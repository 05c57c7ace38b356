"""Checkpoint interoperability with transformers' glm5_next: load, FP8, shards, round trip, refusals.

Every checkpoint here is built by transformers itself (random weights, saved with its own
save_pretrained), so the on-disk layout is the one real checkpoints have, not genolong's idea
of it. Bad checkpoints are made by editing a good one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration  # noqa: E402

from genolong.errors import GenolongError  # noqa: E402
from genolong.model import fp8, hf_config  # noqa: E402
from genolong.model.checkpoint import from_pretrained, save_pretrained  # noqa: E402
from genolong.model.vocab import dna_to_checkpoint_ids  # noqa: E402

# Eight layers: KDA at 0-2 and 4-6, DSA at 3 and 7; dense MLP at 0-2, MoE after. index_topk 8
# in pools of 4, so at 64 tokens each DSA query attends to at most 11 keys: truly sparse.
TEXT = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=8,
    num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
    kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, v_head_dim=8, index_topk=8, index_head_dim=8,
    index_n_heads=2, linear_head_dim=8, linear_num_heads=2, index_kpool=4, pad_token_id=0,
)
VISION = dict(
    depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
    projection_intermediate_size=16, patch_size=2, image_size=4,
)
SEQ = 64


def _read_all(directory) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(directory / name, "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _rewrite(src, dst, tensors=None, config=None):
    """Copy checkpoint `src` to `dst` as one safetensors file, editing its tensors and/or config."""
    dst.mkdir()
    tensors = _read_all(src) if tensors is None else tensors
    raw = json.loads((src / "config.json").read_text())
    if config is not None:
        config(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(transformers model in fp32, its checkpoint directory with an MTP layer appended)."""
    torch.manual_seed(0)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=TEXT, vision_config=VISION)).eval()
    saved = tmp_path_factory.mktemp("hf") / "saved"
    model.save_pretrained(saved)
    # Real GLM releases append multi-token-prediction weights as an extra layer past
    # num_hidden_layers (and DeepSeek-style ones under `mtp.`): add both kinds.
    tensors = _read_all(saved)
    tensors["model.language_model.layers.8.eh_proj.weight"] = torch.randn(32, 64)
    tensors["model.language_model.layers.8.shared_head.norm.weight"] = torch.ones(32)
    tensors["mtp.0.enorm.weight"] = torch.ones(32)
    directory = _rewrite(saved, tmp_path_factory.mktemp("hf") / "ckpt", tensors)
    return model, directory


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, TEXT["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def reference_logits(reference, input_ids):
    with torch.no_grad():
        return reference[0](input_ids=input_ids).logits


def _logprobs(logits):
    return logits.float().log_softmax(-1)


def test_loads_transformers_checkpoint_with_matching_logits(reference, input_ids, reference_logits, caplog):
    model, directory = reference
    with caplog.at_level(logging.INFO, logger="genolong.model.checkpoint"):
        ours = from_pretrained(directory, dtype=torch.float32)
    summary = [r.getMessage() for r in caplog.records if "loaded" in r.getMessage()]
    assert len(summary) == 1 and "skipped 3 mtp, 25 vision" in summary[0], summary
    assert ours.config == hf_config.from_hf(model.config.to_dict())
    with torch.no_grad():
        got = ours(input_ids).logits
    want = reference_logits
    assert got.shape == (2, SEQ, TEXT["vocab_size"])
    diff = (_logprobs(got) - _logprobs(want)).abs().max().item()
    assert diff < 1e-4, diff


def test_bf16_load_keeps_the_reference_fp32_parameters(reference):
    _, directory = reference
    ours = from_pretrained(directory, dtype=torch.bfloat16)
    dtypes = {name: p.dtype for name, p in ours.state_dict().items()}
    assert dtypes["model.layers.3.mlp.gate.weight"] == torch.float32
    assert dtypes["model.layers.0.self_attn.conv1d.weight"] == torch.float32
    assert dtypes["model.layers.4.attn_hc.base"] == torch.float32
    assert dtypes["model.layers.4.mlp.experts.gate_up_proj"] == torch.bfloat16
    assert dtypes["lm_head.weight"] == torch.bfloat16


def test_sharded_checkpoint_loads_like_the_single_file(reference, tmp_path):
    model, directory = reference
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len([n for n in os.listdir(tmp_path / "sharded") if n.endswith(".safetensors")]) > 3
    single = from_pretrained(directory, dtype=torch.float32).state_dict()
    sharded = from_pretrained(tmp_path / "sharded", dtype=torch.float32).state_dict()
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)


def _quantize_checkpoint(src, dst, block):
    """FP8 copy of a checkpoint as GLM/DeepSeek publish it: every 2-D projection weight (not
    embeddings, norms, router or lm_head) in e4m3 with a float32 `weight_scale_inv` grid."""
    tensors = _read_all(src)
    originals = {}
    for key in list(tensors):
        t = tensors[key]
        if (
            t.dim() == 2
            and key.endswith("proj.weight")
            and key.startswith("model.language_model.")
        ):
            originals[key] = t
            tensors[key], tensors[fp8.scale_key(key)] = fp8.quantize(t, block)

    def add_quant(raw):
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}

    return _rewrite(src, dst, tensors, add_quant), originals, tensors


@pytest.mark.parametrize("block", [(128, 128), (16, 8)])
def test_fp8_checkpoint_is_dequantized_on_load(reference, tmp_path, block):
    _, directory = reference
    fp8_dir, originals, stored = _quantize_checkpoint(directory, tmp_path / "fp8", block)
    assert len(originals) > 50
    ours = from_pretrained(fp8_dir, dtype=torch.float32)
    # The loaded values, found through the on-disk names of the fused and renamed tensors.
    on_disk = _disk_view(ours)
    b0, b1 = block
    for key, original in originals.items():
        if ".layers.8." in key:  # the MTP layer, quantized too as in real releases, is skipped
            assert key not in on_disk
            continue
        q, scale = stored[key], stored[fp8.scale_key(key)]
        rows = torch.arange(q.shape[0])[:, None] // b0
        cols = torch.arange(q.shape[1])[None, :] // b1
        want = q.float() * scale[rows, cols]  # the published formula, by index arithmetic
        got = on_disk[key]
        assert torch.equal(got, want), key
        tile = scale[rows, cols]
        assert ((got - original).abs() <= original.abs() / 16 + tile * 2.0**-9).all(), key
    # Unquantized tensors (norms, router, mHC, embedding) load bit-exactly.
    embed = "model.language_model.embed_tokens.weight"
    assert torch.equal(on_disk[embed], stored[embed])


def _disk_view(model) -> dict[str, torch.Tensor]:
    from genolong.model.checkpoint import disk_tensors

    return dict(disk_tensors(model))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_exact_and_transformers_reads_it(reference, tmp_path, input_ids, reference_logits, dtype):
    _, directory = reference
    first = from_pretrained(directory, dtype=dtype)
    # Small shards so that the sharded writer and index are part of the round trip.
    save_pretrained(first, tmp_path / "out", max_shard_bytes=64 * 1024)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary leftovers
    second = from_pretrained(tmp_path / "out", dtype=dtype)
    assert second.config == first.config
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    if dtype == torch.float32:
        # transformers loads genolong's save (its vision tower is absent: random, unused here).
        theirs = Glm5NextForConditionalGeneration.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
        with torch.no_grad():
            diff = (theirs(input_ids=input_ids).logits - reference_logits).abs().max()
        assert diff == 0


def test_save_replaces_an_existing_checkpoint(reference, tmp_path):
    _, directory = reference
    model = from_pretrained(directory, dtype=torch.float32)
    target = tmp_path / "out"
    target.mkdir()
    (target / "stale.safetensors").write_bytes(b"old")
    save_pretrained(model, target)
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors"]
    assert os.listdir(tmp_path) == ["out"]


# ----------------------------------------------------------------------------- refusals


def test_missing_config_json(reference, tmp_path):
    _, directory = reference
    shutil.copytree(directory, tmp_path / "c")
    (tmp_path / "c" / "config.json").unlink()
    with pytest.raises(GenolongError, match="no config.json"):
        from_pretrained(tmp_path / "c")
    with pytest.raises(GenolongError, match="does not exist"):
        from_pretrained(tmp_path / "nowhere")


def test_missing_weights_file(reference, tmp_path):
    _, directory = reference
    (tmp_path / "c").mkdir()
    shutil.copy(directory / "config.json", tmp_path / "c")
    with pytest.raises(GenolongError, match="no model.safetensors"):
        from_pretrained(tmp_path / "c")


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.update(qk_rope_head_dim=64), "qk_rope_head_dim = 64 cannot be represented"),
        (lambda t: t["layer_types"].__setitem__(2, "sliding_attention"), "layer_types\\[2\\] = 'sliding_attention'"),
        (lambda t: t["mlp_layer_types"].__setitem__(5, "mixture"), "mlp_layer_types\\[5\\] = 'mixture'"),
        (lambda t: t.update(hidden_act="gelu"), "hidden_act = 'gelu'"),
        (lambda t: t.update(num_key_value_heads=1), "num_key_value_heads = 1"),
        (lambda t: t.update(model_type="llama"), "model_type = 'llama'"),
    ],
)
def test_unrepresentable_config_names_the_field(reference, tmp_path, edit, message):
    _, directory = reference
    bad = _rewrite(directory, tmp_path / "c", config=lambda raw: edit(raw["text_config"]))
    with pytest.raises(GenolongError, match=message):
        from_pretrained(bad)


def test_tied_embeddings_are_read_where_transformers_reads_them(reference, tmp_path):
    # The composite model ties lm_head by the top-level flag; text_config's own flag is not used.
    _, directory = reference
    tied = _rewrite(directory, tmp_path / "tied", config=lambda raw: raw.update(tie_word_embeddings=True))
    with pytest.raises(GenolongError, match="tie_word_embeddings = True cannot be represented"):
        from_pretrained(tied)
    inner = _rewrite(directory, tmp_path / "inner", config=lambda raw: raw["text_config"].update(tie_word_embeddings=True))
    theirs = Glm5NextForConditionalGeneration.from_pretrained(inner)
    assert theirs.lm_head.weight is not theirs.model.language_model.embed_tokens.weight
    from_pretrained(inner, dtype=torch.float32)  # loads: transformers does not tie this one either
    flat = {"model_type": "glm5_next_text", **TEXT, "tie_word_embeddings": True}  # a text-only config's own flag counts
    with pytest.raises(GenolongError, match="tie_word_embeddings = True"):
        hf_config.from_hf(flat)


@pytest.mark.parametrize(
    "fields",
    [
        {"linear_attn_config": {"num_heads": 2, "head_dim": 8, "gate_lower_bound": None}},
        {"linear_attn_config": {"num_heads": 2, "head_dim": 8}, "linear_lower_bound": None},
        {"linear_attn_config": {}, "linear_lower_bound": None},
        {"linear_attn_config": {"safe_gate": False, "gate_lower_bound": None}},
        {"linear_attn_config": {"gate_lower_bound": -12.0}},
        {"linear_lower_bound": None},
        {"linear_lower_bound": -3.0},
        {},
    ],
)
def test_kda_gate_bound_is_what_transformers_builds(fields):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    text = dict(TEXT, **fields)
    want = Glm5NextTextConfig(**text).linear_lower_bound
    assert hf_config.from_hf({"model_type": "glm5_next_text", **text}).kda.lower_bound == want


def test_num_local_experts_is_read_as_n_routed_experts(reference, tmp_path, input_ids, reference_logits):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    _, directory = reference

    def rename(raw):
        raw["text_config"]["num_local_experts"] = raw["text_config"].pop("n_routed_experts")

    renamed = _rewrite(directory, tmp_path / "c", config=rename)
    model = from_pretrained(renamed, dtype=torch.float32)
    assert model.config.moe.num_experts == TEXT["n_routed_experts"] == Glm5NextTextConfig(num_local_experts=4).n_routed_experts
    with torch.no_grad():
        assert torch.allclose(_logprobs(model(input_ids).logits), _logprobs(reference_logits), atol=1e-4)
    both = dict(TEXT, num_local_experts=8)
    with pytest.raises(GenolongError, match="num_local_experts = 8 .*n_routed_experts = 4"):
        hf_config.from_hf({"model_type": "glm5_next_text", **both})


def test_zero_shared_experts_checkpoint_loads_with_matching_logits(tmp_path, input_ids):
    # transformers builds (and saves) a zero-width shared expert; genolong builds none.
    torch.manual_seed(2)
    theirs = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=dict(TEXT, n_shared_experts=0), vision_config=VISION)).eval()
    theirs.save_pretrained(tmp_path / "z")
    ours = from_pretrained(tmp_path / "z", dtype=torch.float32)
    assert ours.config.moe.num_shared_experts == 0
    with torch.no_grad():
        assert torch.allclose(_logprobs(ours(input_ids).logits), _logprobs(theirs(input_ids=input_ids).logits), atol=1e-4)


def test_a_loaded_tokenizer_is_saved_with_the_weights(reference, tmp_path):
    # The base-to-id mapping the weights were trained with travels with them through genolong.
    _, directory = reference
    src = _rewrite(directory, tmp_path / "src")
    tokenizer = {"model": {"type": "WordLevel", "vocab": {"T": 0, "G": 1, "C": 2, "A": 3, "N": 4}}}
    (src / "tokenizer.json").write_text(json.dumps(tokenizer))
    save_pretrained(from_pretrained(src, dtype=torch.float32), tmp_path / "out")
    assert dna_to_checkpoint_ids(tmp_path / "out").tolist() == [3, 2, 1, 0, 4]


def test_missing_tensor_is_named(reference, tmp_path):
    _, directory = reference
    tensors = _read_all(directory)
    del tensors["model.language_model.layers.5.mlp.experts.2.up_proj.weight"]
    del tensors["model.language_model.layers.3.self_attn.indexer.wk.weight"]
    message = r"lacks 2 tensor.*layers.3.self_attn.indexer.wk.weight, layers.5.mlp.experts.2.up_proj.weight"
    with pytest.raises(GenolongError, match=message):
        from_pretrained(_rewrite(directory, tmp_path / "c", tensors))


def test_unexpected_tensor_is_named(reference, tmp_path):
    _, directory = reference
    tensors = _read_all(directory)
    tensors["model.language_model.layers.1.self_attn.rotary.inv_freq"] = torch.ones(4)
    tensors["model.language_model.layers.4.mlp.experts.9.down_proj.weight"] = torch.ones(32, 16)
    message = r"2 tensor.*not have: .*layers.1.self_attn.rotary.inv_freq, .*layers.4.mlp.experts.9.down_proj.weight"
    with pytest.raises(GenolongError, match=message):
        from_pretrained(_rewrite(directory, tmp_path / "c", tensors))


def test_wrong_shape_is_named(reference, tmp_path):
    _, directory = reference
    tensors = _read_all(directory)
    tensors["model.language_model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(32, 17)
    with pytest.raises(GenolongError, match=r"layers.3.self_attn.kv_b_proj.weight has shape \(32, 17\).*\(32, 16\)"):
        from_pretrained(_rewrite(directory, tmp_path / "c", tensors))


def test_fp8_weight_without_scale_is_refused(reference, tmp_path):
    _, directory = reference
    fp8_dir, _, stored = _quantize_checkpoint(directory, tmp_path / "fp8", (128, 128))
    del stored["model.language_model.layers.0.mlp.up_proj.weight_scale_inv"]
    with pytest.raises(GenolongError, match="layers.0.mlp.up_proj.weight is FP8 but has no .*weight_scale_inv"):
        from_pretrained(_rewrite(fp8_dir, tmp_path / "c", stored))


def test_tokenizer_missing_a_base_is_refused(reference, tmp_path):
    _, directory = reference
    shutil.copytree(directory, tmp_path / "c")
    vocab = {"A": 10, "C": 11, "G": 12, "N": 13, "AC": 14}
    (tmp_path / "c" / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []}}))
    with pytest.raises(GenolongError, match="base\\(s\\) T"):
        dna_to_checkpoint_ids(tmp_path / "c", vocab_size=TEXT["vocab_size"])
    vocab["T"] = 15
    (tmp_path / "c" / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []}}))
    assert dna_to_checkpoint_ids(tmp_path / "c", vocab_size=TEXT["vocab_size"]).tolist() == [10, 11, 12, 15, 13]


def test_model_info_reads_a_checkpoint_config(reference):
    import typer
    from typer.testing import CliRunner

    from genolong.model.cli import model_info

    _, directory = reference
    app = typer.Typer()
    app.command()(model_info)
    result = CliRunner().invoke(app, ["--checkpoint", str(directory)], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    total = sum(p.numel() for p in from_pretrained(directory, dtype=torch.float32).parameters())
    assert f"{total:,}" in result.output


def test_flat_text_only_layout_loads(reference, tmp_path):
    """Text-only releases: config fields at the top level, keys under `model.` not `model.language_model.`."""
    _, directory = reference
    tensors = {k.replace("model.language_model.", "model."): v for k, v in _read_all(directory).items()}
    tensors = {k: v for k, v in tensors.items() if not k.startswith("model.visual.")}

    def flatten(raw):
        text = raw.pop("text_config")
        raw.pop("vision_config")
        raw.update(text)

    flat = from_pretrained(_rewrite(directory, tmp_path / "flat", tensors, flatten), dtype=torch.float32)
    nested = from_pretrained(directory, dtype=torch.float32)
    assert flat.config == nested.config
    a, b = flat.state_dict(), nested.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_module_layout_checkpoint_loads(reference, tmp_path):
    """transformers can also save its module names (fused experts, one conv1d): same weights."""
    model, directory = reference
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    with safe_open(tmp_path / "fused" / "model.safetensors", "pt") as f:
        assert "model.language_model.layers.4.mlp.experts.gate_up_proj" in f.keys()
    a = from_pretrained(directory, dtype=torch.float32).state_dict()
    b = from_pretrained(tmp_path / "fused", dtype=torch.float32).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("preset", ["tiny", "glm53-mini", "glm-5.3-flash"])
def test_preset_configs_survive_the_transformers_format(preset):
    from genolong.model.presets import get_preset

    config = get_preset(preset)
    assert hf_config.from_hf(hf_config.to_hf(config), name=config.name) == config


def test_kimi_style_linear_attn_config_and_index_pattern():
    text = dict(TEXT, linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 3})
    text.pop("linear_head_dim")
    text.pop("linear_num_heads")
    text["index_topk_pattern"] = "FFFFFFFS"
    text["num_hidden_layers"] = 8
    # Every layer DSA so that the shared indexer of layer 7 follows a full one.
    text["layer_types"] = ["indexed_attention"] * 8
    config = hf_config.from_hf({"model_type": "glm5_next", "text_config": text})
    assert (config.kda.head_dim, config.kda.num_heads, config.kda.conv_kernel) == (16, 4, 3)
    assert config.indexer_types == ("full",) * 7 + ("shared",)
    assert config.dsa.indexer.kpool == 4 and config.dsa.indexer.topk == 8


def test_fields_the_model_does_not_read_are_warned_about_not_refused(reference, tmp_path, caplog):
    _, directory = reference
    edited = _rewrite(directory, tmp_path / "c", config=lambda raw: raw["text_config"].update(rope_theta=1e6))
    with caplog.at_level(logging.WARNING, logger="genolong.model.hf_config"):
        from_pretrained(edited, dtype=torch.float32)
    assert any("rope_theta" in r.getMessage() for r in caplog.records)


def test_fp8_scale_grid_not_matching_the_block_size_is_refused(reference, tmp_path):
    _, directory = reference
    fp8_dir, _, stored = _quantize_checkpoint(directory, tmp_path / "fp8", (128, 128))

    def wrong_block(raw):
        raw["quantization_config"]["weight_block_size"] = [16, 16]

    with pytest.raises(GenolongError, match=r"weight_scale_inv has shape \(1, 1\) but .*16x16 blocks needs"):
        from_pretrained(_rewrite(fp8_dir, tmp_path / "c", config=wrong_block))
    # A scale next to a weight that is not FP8: the file is inconsistent.
    key = "model.language_model.layers.0.mlp.up_proj.weight"
    stored[key] = stored[key].float()
    with pytest.raises(GenolongError, match="up_proj.weight has dtype torch.float32, not float8_e4m3fn"):
        from_pretrained(_rewrite(fp8_dir, tmp_path / "d", stored))
