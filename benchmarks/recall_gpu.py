"""The planted-repeat recall experiment on one H200: glm53-mini (8 layers) at 64k, copies up to 48k back.

One arm per 10-minute device call (a fresh machine each time), in one process so the kernels
compile once; bulky files (data, initial model, checkpoints) go to --work, results to --out:

    source .device/activate.sh && python3 benchmarks/recall_gpu.py --work /tmp/w --out $OUT --arm frozen
    source .device/activate.sh && python3 benchmarks/recall_gpu.py --work /tmp/w --out $OUT --arm trained --indexer-loss-coeff 1

then, on any machine, one figure and table for both arms:

    python benchmarks/recall_combine.py FROZEN_OUT/eval/recall.json TRAINED_OUT/eval/recall.json --out benchmarks/recall_gpu

Defaults and the time budget (docs/recall.md, "The GPU experiment"): glm53-mini keeps its
45-layer pattern at 8 layers (6 KDA, 2 DSA selecting 2048 keys per query). Each arm first trains
60 steps on 2k windows (32 per step), where sparse attention is dense (a window is no longer than
the selection), so it can learn to find a copy's first occurrence anywhere (and a trained indexer
learns where it looks); then on 64k windows with copies up to 48k back (one window per step),
where the selection holds 3% of the keys. Estimated from benchmarks/RESULTS.md (45 layers: 4.1 s
per 32k step, 14.3 s per 128k step, full recompute), a 64k-token step of 8 layers without
recompute takes ~1.2 s, so 60 + 120 steps are ~220 s after ~100-240 s of start-up and kernel
compilation (and ~35 s more for the second length).
--budget-s 540 trains the 64k stage in checkpointed chunks and stops early (recorded in
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
    "steps": 120,
    "lr": 1e-3,
    "warmup": 5,
    "short_steps": 60,
    "short_seq": "2k",
    "short_batch": 32,
    "short_len": 64,
    "short_min_dist": "64",
    "short_max_dist": "1900",
    "short_per_window": 8,
    "short_lr": 1e-3,
    "short_warmup": 10,
    "memory": '{"recompute": false, "offload": false}',
    "eval_distances": "256,1k,4k,16k,48k",
    "eval_windows": 16,
    "budget_s": 540,
    "chunk_steps": 50,
    "eval_reserve_s": 120,
    # The share of dense attention that the selection holds, logged per DSA layer (frozen or trained indexer).
    "train_option": ["indexer_recall_every=25"],
}

if __name__ == "__main__":
    sys.exit(main(parser(__doc__.splitlines()[0], **GPU_DEFAULTS).parse_args()))
