"""`genolong model-info`: parameters per component, total, active per token, bytes in bf16.

Counts come from genolong.model.param_count (architecture arithmetic), so the command needs
neither torch allocations nor weights: `--checkpoint` reads only the directory's config.json.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from genolong.errors import GenolongError
from genolong.model.config import LAYER_DSA, LAYER_KDA, MLP_DENSE, MLP_MOE, ModelConfig


def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def _layers_note(config: ModelConfig) -> dict[str, str]:
    kda = sum(t == LAYER_KDA for t in config.layer_types)
    dsa = sum(t == LAYER_DSA for t in config.layer_types)
    dense = sum(t == MLP_DENSE for t in config.mlp_types)
    moe = sum(t == MLP_MOE for t in config.mlp_types)
    indexers = sum(config.indexer_runs(i) for i in config.dsa_layers)
    m = config.moe
    return {
        "kda attention": f"{kda} layers, {config.kda.num_heads} heads x {config.kda.head_dim}",
        "dsa attention": f"{dsa} layers, {config.dsa.num_heads} heads",
        "dsa indexer": f"{indexers} layers, {config.dsa.indexer.n_heads} heads x {config.dsa.indexer.head_dim}",
        "dense mlp": f"{dense} layers, width {config.dense_mlp.intermediate_size}",
        "moe routed experts": f"{moe} layers, {m.num_experts} experts x {m.expert_dim}, top-{m.top_k}",
        "moe shared experts": f"{moe} layers, {config.moe.num_shared_experts} shared",
        "moe router": f"{moe} layers",
        "mhc": f"{config.num_layers} layers x 2, {config.mhc.num_streams} streams",
        "layer norms": f"{config.num_layers} layers x 2",
        "embedding": f"vocab {config.vocab_size:,} x hidden {config.hidden}",
        "lm_head": "untied",
    }


def model_info(
    preset: str = typer.Option(None, "--preset", help="Preset name: glm-5.3-flash, glm53-mini or tiny."),
    checkpoint: Path = typer.Option(
        None, "--checkpoint", help="A transformers glm5_next checkpoint directory (reads config.json only)."
    ),
) -> None:
    """Print the parameter count of a model per component, its total, active per token and bf16 bytes."""
    from genolong.model.param_count import param_count

    if (preset is None) == (checkpoint is None):
        raise GenolongError("model-info needs exactly one of --preset NAME or --checkpoint DIR")
    if preset is not None:
        from genolong.model.presets import get_preset

        config = get_preset(preset)
        title = f"{config.name} (preset)"
    else:
        from genolong.model import hf_config
        from genolong.model.checkpoint import read_config

        config = hf_config.from_hf(read_config(checkpoint), name=checkpoint.name)
        title = f"{checkpoint} (checkpoint config)"
    count = param_count(config)
    notes = _layers_note(config)

    table = Table(title=f"{title}: {config.num_layers} layers, hidden {config.hidden}")
    table.add_column("component")
    table.add_column("parameters", justify="right")
    table.add_column("", justify="right")
    table.add_column("share", justify="right")
    table.add_column("shape")
    for name, n in count.components.items():
        if n:
            table.add_row(name, f"{n:,}", _human(n), f"{100 * n / count.total:.2f}%", notes.get(name, ""))
    table.add_section()
    table.add_row("total", f"{count.total:,}", _human(count.total), "100%", "")
    active_share = f"{100 * count.active / count.total:.2f}%"
    experts = f"top-{config.moe.top_k} of {config.moe.num_experts} routed experts"
    table.add_row("active per token", f"{count.active:,}", _human(count.active), active_share, experts)
    table.add_row("buffers", f"{count.buffers:,}", _human(count.buffers), "", "router correction biases")
    gib = f"{count.bytes_bf16 / 1024**3:.2f} GiB"
    table.add_row("bytes (bf16)", f"{count.bytes_bf16:,}", gib, "", "parameters + buffers")
    Console().print(table)
