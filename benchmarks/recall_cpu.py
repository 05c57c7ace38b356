"""The planted-repeat recall experiment on the CPU: tiny preset, 2k windows, copies up to 1.9k back.

One arm per invocation (benchmarks/recall_experiment.py explains the layout); run the frozen arm,
then the trained one, into the same --out, and the second invocation's eval compares both:

    python benchmarks/recall_cpu.py --out bench/recall_cpu --arm frozen
    python benchmarks/recall_cpu.py --out bench/recall_cpu --arm trained --indexer-loss-coeff 0.1 [--indexer-warmup-steps 50]

Why these defaults (docs/recall.md, "The CPU experiment"): the tiny model's one DSA layer
selects 8 pools of 4 keys plus its tail (35 keys) per query; copies 64..1900 bases back are far
outside what a random selection covers, so only a selection that finds the first occurrence can
use them, while the three KDA layers can recall short distances through their recurrent state.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recall_experiment import main, parser  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(parser(__doc__.splitlines()[0], threads=1, short_steps=1500, steps=300, lr=1e-3, warmup=20).parse_args()))
