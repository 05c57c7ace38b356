"""GenoLongModel (embedding, decoder layers, final norm) and GenoLongForCausalLM (+ lm_head).

State-dict keys are transformers' `Glm5NextTextModel` keys (`embed_tokens.weight`,
`layers.3.self_attn.indexer.wq_b.weight`, `layers.5.mlp.experts.gate_up_proj`, `norm.weight`,
...) under `model.`, plus `lm_head.weight`, so a transformers checkpoint loads by stripping its
prefix.

The layer loop is plain: recompute, offload, parallelism and compilation are applied from
outside by passes (genolong.train.passes) that wrap or switch modules and keep these keys.
`kernel_policy` (None, or the model's own genolong.model.ops.KernelPolicy set by `bind_kernel_policy`) is
put in force around the layers; print(model) shows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from genolong.model import ops
from genolong.model.config import ModelConfig
from genolong.model.layer import DecoderLayer
from genolong.model.mhc import HyperHead
from genolong.model.norms import RMSNorm

# Parameters the reference keeps in fp32 whatever the model dtype (router, KDA gate and conv,
# mHC biases and scales): they are small, and the math that reads them runs in fp32.
FP32_PARAM_SUFFIXES = (
    ".gate.weight",
    ".gate.e_score_correction_bias",
    ".conv1d.weight",
    ".dt_bias",
    ".A_log",
    "_hc.base",
    "_hc.scale",
)


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_PARAM_SUFFIXES)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor


class GenoLongModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden, config.rms_eps)
        self.hc_head = HyperHead()
        self.kernel_policy: ops.KernelPolicy | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> final normed hidden states [B, T, hidden]."""
        with ops.scoped(self.kernel_policy):
            x = self.embed_tokens(input_ids)
            streams = x.unsqueeze(-2).expand(*x.shape[:-1], self.config.mhc.num_streams, x.shape[-1]).contiguous()
            shared_topk = None
            for layer in self.layers:
                extra = (shared_topk,) if layer.reuses_topk else ()
                out = layer(streams, *extra)
                if layer.emits_topk:
                    streams, shared_topk = out
                else:
                    streams = out
            return self.norm(self.hc_head(streams))

    def extra_repr(self) -> str:
        return f"kernel_policy={self.kernel_policy.name if self.kernel_policy is not None else 'the caller context'}"


def bind_kernel_policy(model: nn.Module, name: str | ops.KernelPolicy) -> ops.KernelPolicy:
    """Give `model` (anything holding one GenoLongModel, or the GenoLongModel) its own policy; returns it."""
    chosen = name if isinstance(name, ops.KernelPolicy) else ops.KernelPolicy(name)
    bodies = [m for m in model.modules() if isinstance(m, GenoLongModel)]
    if len(bodies) != 1:
        raise ValueError(f"bind_kernel_policy() needs a model with one GenoLongModel, found {len(bodies)}")
    bodies[0].kernel_policy = chosen
    return chosen


class GenoLongForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype | None = None, init: bool = True) -> None:
        """Build (and, unless init=False, initialise for training from scratch) a model.

        Under `with torch.device("meta"):` nothing is allocated (for counting or for loading
        with `load_state_dict(..., assign=True)`).
        """
        super().__init__()
        config.validate()
        self.config = config
        self.model = GenoLongModel(config)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if init:
            from genolong.model.init import init_weights

            init_weights(self)
        if dtype is not None:
            self.to_dtype(dtype)

    def to_dtype(self, dtype: torch.dtype) -> GenoLongForCausalLM:
        """Cast floating parameters and buffers to `dtype`, keeping FP32_PARAM_SUFFIXES in fp32."""
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(torch.float32 if keeps_fp32(name) else dtype)
        return self

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states [B, T, hidden], before lm_head (for chunked losses)."""
        return self.model(input_ids)

    def forward(self, input_ids: torch.Tensor) -> CausalLMOutput:
        return CausalLMOutput(logits=self.lm_head(self.model(input_ids)))
