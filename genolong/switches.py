"""The environment switches: every `GENOLONG_*` variable the package reads, read here and nowhere else.

Each selects between two maintained implementations of one piece of a step: the fused kernel (the
default on CUDA) and the plain one it is tested against, so that a suspect result can be re-run on
the other without a code change. Speed and memory knobs are not switches: they are arguments or
options. `python -m genolong.switches` prints the table (docs/kernels.md holds the same table; a
test keeps the two equal).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from genolong.errors import GenolongError


@dataclass(frozen=True)
class Switch:
    default: str
    values: dict[str, str]  # value -> what runs with it
    what: str  # the piece of the step it selects for


SWITCHES = {
    "GENOLONG_SPARSE_MLA": Switch(
        "on", {"on": "genolong's few-head Triton sparse MLA",
               "off": "it declines, so megatron-core's TileLang kernel runs"},
        "the dsa_sparse_attention op's first implementation"),
    "GENOLONG_KEPT_SELECTION": Switch(
        "triton", {"triton": "one Triton pass each", "torch": "the PyTorch passes"},
        "the kept selection's pack check and expansion on CUDA"),
    "GENOLONG_MOE_SWIGLU": Switch(
        "triton", {"triton": "one Triton pass each way", "eager": "the PyTorch expression"},
        "the MoE experts' clamped SwiGLU"),
    "GENOLONG_MOE_COMBINE": Switch(
        "triton", {"triton": "a read-side weighted sum", "index_add": "a bf16 index_add"},
        "the MoE experts' outputs added back to their tokens"),
    "GENOLONG_MOE_DISPATCH": Switch(
        "triton", {"triton": "its backward as a read-side sum",
                   "index": "advanced indexing, autograd's index backward"},
        "the tokens' rows gathered in expert order"),
    "GENOLONG_ROUTER_TOPK": Switch(
        "triton", {"triton": "the router's top-k kernel, on CUDA", "torch": "torch.topk"},
        "the compiled router's expert choice, read at each call"),
}


def get(name: str) -> str:
    """The setting of switch `name` (its default when unset); any other value is a one-line error."""
    switch = SWITCHES[name]
    value = os.environ.get(name, switch.default)
    if value not in switch.values:
        raise GenolongError(f"{name}={value!r} is not a setting; set it to one of {', '.join(switch.values)}, or unset it")
    return value


def table() -> str:
    """The switches as a markdown table: name, default, values, what each selects."""
    lines = ["| switch | selects | values (default first) |", "|---|---|---|"]
    for name, s in SWITCHES.items():
        values = [s.default, *(v for v in s.values if v != s.default)]
        lines.append(f"| `{name}` | {s.what} | " + "; ".join(f"`{v}`: {s.values[v]}" for v in values) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
