"""The planted-repeat recall experiment on one H200: glm53-mini (8 layers) at 64k, copies up to 48k back.

One arm per 10-minute device call (a fresh machine each time), in one process so the kernels
compile once; bulky files (data, initial model, checkpoints) go to --work, results to --out:

    source .device/activate.sh && python3 benchmarks/recall_gpu.py --work /tmp/w --out $OUT --arm frozen
    source .device/activate.sh && python3 benchmarks/recall_gpu.py --work /tmp/w --out $OUT --arm trained --indexer-loss-coeff 0.1

then, on any machine, one figure and table for both arms:

    python benchmarks/recall_combine.py FROZEN_OUT/eval/recall.json TRAINED_OUT/eval/recall.json --out benchmarks/recall_gpu

Defaults and the time budget (docs/recall.md, "The GPU experiment"): glm53-mini keeps its
45-layer pattern at 8 layers (6 KDA, 2 DSA with the full 2048-key selection), so a 10-minute
call trains ~150 steps at 64k (about 1.2 s per step estimated from benchmarks/RESULTS.md, 8 of
45 layers of the measured 32k-128k steps, without recompute) after ~100-240 s of start-up and
kernel compilation. --budget-s 540 trains in checkpointed chunks and stops early (recorded in
arm.json) rather than lose the evaluation to the call's time limit. Data: E. coli 536 with its
last 1.34 Mb held out (20 windows of 64k; lambda is shorter than one window).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recall_experiment import main, parser  # noqa: E402

GPU_DEFAULTS = {
    "preset": "glm53-mini",
    "preset_overrides": '{"num_layers": 8}',
    "holdout_cut": 3_600_000,
    "seq": "64k",
    "length": 64,
    "min_dist": "64",
    "max_dist": "48k",
    "per_window": 128,
    "steps": 150,
    "lr": 1e-3,
    "warmup": 10,
    "memory": '{"recompute": false, "offload": false}',
    "eval_distances": "256,1k,4k,16k,48k",
    "eval_windows": 16,
    "budget_s": 540,
    "chunk_steps": 50,
    "eval_reserve_s": 100,
}

if __name__ == "__main__":
    sys.exit(main(parser(__doc__.splitlines()[0], **GPU_DEFAULTS).parse_args()))
