"""A stand-in for `python3 -m genolong` in the test of benchmarks/device/tiling.sh: the stage's
control flow (limits, stops, skips, the refusal retry, the files it collects) runs on the CPU in
seconds. It writes the run files finetune writes, in their shapes, with made-up numbers.

    FAKE_STEP_S   seconds a step takes (default 0.1)
    FAKE_FINAL_STEP_S  seconds the last step takes (default FAKE_STEP_S): a stop in the step after the
                  last one counted must land before it ends, however loaded the machine
    FAKE_SLOW     run names (--out basenames) whose steps after the first never end (cut by the limit)
    FAKE_REFUSE   "pinned": a 1M finetune without --host-budget-gib is refused as the pre-flight does
    FAKE_SLOW_SAVE  set: the final checkpoint never finishes (a run cut in its save)
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

GIB = 1024**3


def _arg(args: list[str], flag: str, default=None):
    return args[args.index(flag) + 1] if flag in args else default


def _record(step: int, seconds: float) -> dict:
    return {"step": step, "loss": 2.0 - 0.01 * step, "lr": 1e-4, "grad_norm": 1.0, "skipped": False, "tokens": 1024,
            "valid_tokens": 1024, "step_time_s": seconds, "tokens_per_s": 1024 / seconds, "model_tflops": 1.0,
            "hardware_tflops": 1.3, "mfu": 0.1, "hfu": 0.13, "peak_gpu_gib": 50.0 + step, "reserved_gpu_gib": 60.0,
            "pinned_host_gib": 8.0, "nonfinite_total": 0}


def finetune(args: list[str]) -> int:
    out, seq, steps = Path(_arg(args, "--out")), _arg(args, "--seq"), int(_arg(args, "--steps"))
    if os.environ.get("FAKE_REFUSE") == "pinned" and seq == "1M" and "--host-budget-gib" not in args:
        print("genolong: error: glm53-mini at 1M tokens does not fit: pinned host memory short: 100.0 GiB > 99.2 GiB usable per GPU",
              file=sys.stderr)
        return 2
    tile = _arg(args, "--tile", "auto")
    tile_tokens = None if tile == "off" else 32768 if tile == "auto" else int(tile.rstrip("k")) * 1024
    out.mkdir(parents=True, exist_ok=True)
    (out / "options.json").write_text(json.dumps({"seq_len": 1024, "memory": {"tile_tokens": tile_tokens}}))
    (out / "plan.json").write_text(json.dumps({"gpu_total": 60 * GIB, "host_total": 8 * GIB, "offload_layers": 2, "tile_tokens": tile_tokens}))
    slow = out.name in os.environ.get("FAKE_SLOW", "").split(",")
    with open(out / "metrics.jsonl", "w") as log:
        for step in range(1, steps + 1):
            pause = float(os.environ.get("FAKE_STEP_S", "0.1"))
            if step == steps:
                pause = float(os.environ.get("FAKE_FINAL_STEP_S", pause))
            if slow and step > 1:
                pause = 1000.0
            time.sleep(pause)
            log.write(json.dumps(_record(step, pause)) + "\n")
            log.flush()
            if step == 1:
                (out / "kernels.json").write_text(json.dumps({"kda": {"fla_chunk": 3}}))
                (out / "memory.json").write_text(json.dumps({"offload_layers": [0, 1], "tile_tokens": tile_tokens, "keep_sparse": "host"}))
    if os.environ.get("FAKE_SLOW_SAVE"):
        time.sleep(1000)
    ckpt = out / "checkpoints" / f"step_{steps:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("")
    return 0


def eval_positional(args: list[str]) -> int:
    out = Path(_arg(args, "--out"))
    out.mkdir(parents=True, exist_ok=True)
    lines = [{"kind": "header", "fingerprint": {}}] + [
        {"kind": "window", "model": role, "record": "NC_008253.1", "start": k << 20, "reverse": False, "sums": [], "counts": [], "seconds": 12.5}
        for k in range(2) for role in ("baseline", "checkpoint")
    ]
    (out / "partial.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (out / "summary.txt").write_text("held-out loss\n")
    return 0


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))
    command, args = sys.argv[1], sys.argv[2:]
    if command == "prepare":
        Path(_arg(args, "--out")).mkdir(parents=True, exist_ok=True)
        return 0
    return {"finetune": finetune, "eval-positional": eval_positional}[command](args)


if __name__ == "__main__":
    sys.exit(main())
