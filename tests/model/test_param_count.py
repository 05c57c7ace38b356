"""Architecture arithmetic (param_count) against built models: genolong's and transformers'."""

import re

import pytest
import torch

from genolong.model import hf_config
from genolong.model.config import LAYER_DSA, MLP_DENSE
from genolong.model.model import GenoLongForCausalLM
from genolong.model.param_count import COMPONENTS, param_count
from genolong.model.presets import get_preset


def _component(name: str, config) -> str:
    """Which param_count component a state-dict key belongs to (by transformers' key names)."""
    if name.startswith("model.embed_tokens."):
        return "embedding"
    if name == "lm_head.weight":
        return "lm_head"
    if name == "model.norm.weight":
        return "final norm"
    layer = int(re.match(r"model\.layers\.(\d+)\.", name)[1])
    if "_hc." in name:
        return "mhc"
    if "layernorm" in name and ".self_attn." not in name:
        return "layer norms"
    if ".self_attn.indexer." in name:
        return "dsa indexer"
    if ".self_attn." in name:
        return "dsa attention" if config.layer_types[layer] == LAYER_DSA else "kda attention"
    if ".mlp.experts." in name:
        return "moe routed experts"
    if ".mlp.shared_experts." in name:
        return "moe shared experts"
    if ".mlp.gate." in name:
        return "moe router"
    assert config.mlp_types[layer] == MLP_DENSE, name
    return "dense mlp"


def _built_counts(model, config) -> dict[str, int]:
    counts = {c: 0 for c in COMPONENTS}
    for name, p in model.named_parameters():
        counts[_component(name, config)] += p.numel()
    return counts


@pytest.mark.parametrize("preset,device", [("tiny", "cpu"), ("glm53-mini", "meta"), ("glm-5.3-flash", "meta")])
def test_param_count_matches_built_model(preset, device):
    config = get_preset(preset)
    with torch.device(device):
        model = GenoLongForCausalLM(config, init=device != "meta")
    count = param_count(config)
    assert count.components == _built_counts(model, config)
    assert count.total == sum(p.numel() for p in model.parameters())
    assert count.buffers == sum(b.numel() for b in model.buffers())


def test_flash_total_matches_transformers():
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    config = get_preset("glm-5.3-flash")
    fields = {k: v for k, v in hf_config.to_hf_text(config).items() if k != "model_type"}
    with torch.device("meta"):
        reference = Glm5NextTextModel(Glm5NextTextConfig(**fields))
    count = param_count(config)
    # Glm5NextTextModel has no lm_head (it lives on the multimodal wrapper).
    assert count.total - count.components["lm_head"] == sum(p.numel() for p in reference.parameters())
    assert count.buffers == sum(b.numel() for b in reference.buffers())


def test_flash_numbers():
    """The published GLM-5.3-Flash shape, by hand: routed experts dominate; ~17.4B active."""
    count = param_count(get_preset("glm-5.3-flash"))
    assert count.components["moe routed experts"] == 42 * 288 * 3 * 4096 * 2048
    assert count.components["embedding"] == count.components["lm_head"] == 154_880 * 4096
    assert count.total == 313_326_799_870
    assert count.active == count.total - 42 * (288 - 8) * 3 * 4096 * 2048
    assert count.bytes_bf16 == 2 * (count.total + 42 * 288)


def test_shared_indexer_layers_have_no_indexer():
    config = get_preset("tiny", num_layers=8, indexer_types=["full"] * 7 + ["shared"])
    with_shared = param_count(config).components["dsa indexer"]
    assert with_shared == param_count(get_preset("tiny", num_layers=8)).components["dsa indexer"] // 2


def test_model_info_cli_prints_the_table():
    import typer
    from typer.testing import CliRunner

    from genolong.model.cli import model_info

    # The command alone (genolong.cli mounts every subpackage's commands; this test is the model's).
    app = typer.Typer()
    app.command()(model_info)
    result = CliRunner().invoke(app, ["--preset", "glm-5.3-flash"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "313,326,799,870" in result.output and "17,376,709,630" in result.output
    assert "moe routed experts" in result.output and "GiB" in result.output
    result = CliRunner().invoke(app, [])
    assert result.exit_code != 0 and "exactly one of --preset" in str(result.exception)
