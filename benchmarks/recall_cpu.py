"""The planted-repeat recall experiment on the CPU: tiny preset, 2k windows, copies up to 1.9k back.

One arm per invocation (benchmarks/recall_experiment.py explains the layout); run both arms into
the same --out (one after the other, or at once), and the evaluation of the last one compares all:

    python benchmarks/recall_cpu.py --out bench/recall_cpu --arm frozen
    python benchmarks/recall_cpu.py --out bench/recall_cpu --arm trained --indexer-loss-coeff 1 --indexer-warmup-steps 20

Design (docs/recall.md, "The CPU experiment"): the tiny preset with its one DSA layer selecting
32 pools of 4 keys (indexer top-k 128 instead of the preset's 32) plus its tail. Each arm first
trains 1000 steps on 128-token windows (8 per step, two copies of 32 bases each, 32-95 back):
there the selection holds every key, so the DSA layer can learn to find a copy's first occurrence
as a dense transformer does (with the preset's top-k of 32 it saw a quarter of the window, and
1500 such steps left recall at 2%). Then 300 steps on 2k windows (eight copies of 64 bases,
64-1900 back), where the selection holds 6% of the keys: a copy 1.9k back is found only by a
selection that looks for it. The three KDA layers can recall through their recurrent state,
which fades and fills with distance.

Outcome on 2026-12-01 (docs/recall.md, "CPU results"): neither arm learned to copy at any
distance within these steps, so the arms did not differ; the GPU experiment is the real test.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recall_experiment import main, parser  # noqa: E402

CPU_DEFAULTS = {
    "preset": "tiny",
    "preset_overrides": '{"dsa": {"indexer": {"topk": 128}}}',
    "threads": 1,
    "short_steps": 1000,
    "steps": 300,
    "lr": 1e-3,
    "warmup": 20,
}

if __name__ == "__main__":
    sys.exit(main(parser(__doc__.splitlines()[0], **CPU_DEFAULTS).parse_args()))
