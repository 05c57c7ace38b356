"""The GLM-5.3-Flash architecture in plain PyTorch (see docs/model.md).

The configuration names import without torch; the model and the checkpoint functions are
loaded on first use so that `genolong.model.config` stays cheap for the CLI and the planner.
"""

from genolong.model.config import ModelConfig
from genolong.model.presets import PRESETS, get_preset

_LAZY = {
    "GenoLongForCausalLM": "genolong.model.model",
    "GenoLongModel": "genolong.model.model",
    "init_weights": "genolong.model.init",
    "from_pretrained": "genolong.model.checkpoint",
    "save_pretrained": "genolong.model.checkpoint",
}

__all__ = ["ModelConfig", "PRESETS", "get_preset", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'genolong.model' has no attribute {name!r}")
