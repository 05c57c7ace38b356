"""The planted-repeat recall experiment on one H200: glm53-mini (8 layers) at 64k, copies up to 48k back.

Both arms in one 10-minute device call, one stage each (benchmarks/device/call.sh; the second arm
reuses the first one's data, initial model and kernel caches on the same machine):

    bash benchmarks/device/call.sh recallfrozen:280 recalltrained:280

which runs, with OUT/recall holding both arms' records and the final evaluation of both:

    python3 benchmarks/recall_gpu.py --work /tmp/recall_gpu --out $OUT/recall --arm frozen --budget-s 265
    python3 benchmarks/recall_gpu.py --work /tmp/recall_gpu --out $OUT/recall --arm trained --indexer-loss-coeff 1 \
        --steps-like frozen --budget-s 265

Defaults and the time budget (docs/recall.md, "The GPU experiment"): glm53-mini keeps its
45-layer pattern at 8 layers (6 KDA, 2 DSA selecting 2048 keys per query). Each arm first trains
40 steps on 2k windows (32 per step), where sparse attention is dense (a window is no longer than
the selection), so it can learn to find a copy's first occurrence anywhere (and a trained indexer
learns where it looks); then 60 steps on 64k windows with copies up to 48k back (one window per
step), where the selection holds 3% of the keys. Estimated from benchmarks/RESULTS.md (45 layers:
4.1 s per 32k step, 14.3 s per 128k step, full recompute), a 64k-token step of 8 layers without
recompute takes ~1.2 s, so 40 + 60 steps are ~120 s after ~30-240 s of start-up and kernel
compilation (less with kernel caches carried in .kcache) and ~35 s more for the second length.
--budget-s trains the 64k stage in checkpointed chunks of 20 steps and stops early (recorded in
arm.json) rather than lose the evaluation (8 windows, ~75 s reserved) to the stage's time limit;
--steps-like frozen then trains the trained arm on the same schedule, cut at the same step.
Data: E. coli 536 with its last 1.34 Mb held out (20 windows of 64k; lambda is shorter than one
window).
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
    "steps": 60,
    "lr": 1e-3,
    "warmup": 5,
    "short_steps": 40,
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
    "eval_windows": 8,
    "budget_s": 270,
    "chunk_steps": 20,
    "eval_reserve_s": 75,
    "eval_short_stages": False,
    # The share of dense attention that the selection holds, logged per DSA layer (frozen or trained indexer).
    "train_option": ["indexer_recall_every=25"],
}

if __name__ == "__main__":
    sys.exit(main(parser(__doc__.splitlines()[0], **GPU_DEFAULTS).parse_args()))
