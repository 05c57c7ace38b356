"""Small stand-ins for the unit tests of genolong.eval: a causal GRU language model and windows.

The GRU has the interface eval scores through (`hidden_states`, `lm_head.weight`) and a long
enough memory that capped context changes its losses, which the control tests need. The real
model and prepared data are exercised end to end in test_cli.py.
"""

from __future__ import annotations

import numpy as np
import torch

from genolong.data.sampler import Window
from genolong.eval.positional import ModelScorer
from genolong.eval.run import ModelSpec
from genolong.vocab import DNA_MODEL_VOCAB_SIZE, N_ID


class GRULM(torch.nn.Module):
    def __init__(self, seed: int, hidden: int = 16, vocab: int = DNA_MODEL_VOCAB_SIZE, bias: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.rnn = torch.nn.GRU(hidden, hidden, batch_first=True)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=bias)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.7)
        self.calls = 0
        self.inputs: list[torch.Tensor] = []  # every input_ids it was run on, for tests that check them

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.inputs.append(ids.detach().cpu().clone())
        return self.rnn(self.emb(ids))[0]


def make_windows(n: int, length: int, seed: int = 0, n_run: bool = True) -> list[Window]:
    """Random DNA with a run of N in window 1 and ~30% soft-masked bases."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tokens = rng.integers(0, 4, length).astype(np.uint8)
        if n_run and i == 1:
            tokens[length // 3 : length // 3 + length // 5] = N_ID
        repeat = rng.random(length) < 0.3
        out.append(Window(tokens, repeat, "chrT", i * length))
    return out


def spec(source: str = "stand-in", **arch) -> ModelSpec:
    return ModelSpec(source, source, {"kind": "gru", **arch}, list(range(5)))


def scorer(model: torch.nn.Module, chunk_tokens: int = 64, token_map=range(5)) -> ModelScorer:
    """DNA-renormalised scoring, as eval-positional does."""
    return ModelScorer(model, np.asarray(list(token_map)), chunk_tokens=chunk_tokens)
