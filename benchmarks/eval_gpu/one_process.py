"""eval-positional on real DNA in ONE process: init -> short fine-tune -> score 128k windows.

Why one process: on a fresh GPU machine the first step compiles and autotunes every kernel
(~200 s for glm53-mini, benchmarks/RESULTS.md "## finetune"); separate `finetune` and
`eval-positional` processes pay it again each time, which does not fit one device call.
Data: E. coli 536 from the bundled genome, its first 3.8 Mb to train on and
the remaining 1.14 Mb held out (real DNA; an interval split, acceptable for a tool check).

    source .device/activate.sh && python3 benchmarks/eval_gpu/one_process.py WORK_DIR OUT_DIR
Knobs (env): PRESET (glm53-mini), TRAIN_SEQ (32k), STEPS (20), SEQ (128k), BUCKET (8k),
CONTROL (32k), MAX_WINDOWS (4), LR (1e-3).
"""

import gzip
import json
import os
import sys
import time
from pathlib import Path

import torch

from genolong.cli import app
from genolong.data import bundled_genome_path
from genolong.data.prepare import prepare
from genolong.model import GenoLongForCausalLM, get_preset
from genolong.model.checkpoint import save_pretrained
from genolong.train.loop import train
from genolong.train.options import TrainOptions
from genolong.units import parse_length

work, out = Path(sys.argv[1]), Path(sys.argv[2])
work.mkdir(parents=True, exist_ok=True)
out.mkdir(parents=True, exist_ok=True)
env = os.environ.get
preset, steps = env("PRESET", "glm53-mini"), int(env("STEPS", "20"))
t0 = time.time()


def stamp(msg):
    line = f"[{time.time() - t0:6.1f} s] {msg}"
    print(line, flush=True)
    with open(out / "timeline.txt", "a") as f:
        f.write(line + "\n")


seqs, name = {}, None
with gzip.open(bundled_genome_path(), "rt") as f:
    for line in f:
        if line.startswith(">"):
            name = line[1:].split()[0]
            seqs[name] = []
        else:
            seqs[name].append(line.strip())
ecoli = "".join(seqs["NC_008253.1"])
cut = int(env("CUT", "3800000"))
fa = work / "ecoli_split.fa"
with open(fa, "w") as f:
    for rec, s in (("ecoli536_train", ecoli[:cut]), ("ecoli536_holdout", ecoli[cut:])):
        f.write(f">{rec}\n" + "\n".join(s[i : i + 80] for i in range(0, len(s), 80)) + "\n")
data = work / "data"
if not (data / "manifest.json").exists():
    prepare(fa, data, train="ecoli536_train", holdout="ecoli536_holdout", progress=False)
stamp(f"prepared {data}")

init = work / "init"
if not (init / "config.json").exists():
    torch.manual_seed(0)
    save_pretrained(GenoLongForCausalLM(get_preset(preset)), init)
stamp(f"initial {preset} saved: {init}")

records = train(TrainOptions(data=str(data), out=str(work / "run"), seq_len=parse_length(env("TRAIN_SEQ", "32k")),
                             preset=None, model_path=str(init), steps=steps, lr=float(env("LR", "1e-3")), warmup=2,
                             keep_last=1, progress=False, tensorboard=False))
with open(out / "train_metrics.jsonl", "w") as f:
    for r in records:
        f.write(json.dumps(r) + "\n")
stamp(f"fine-tuned {steps} steps: loss {records[0].get('loss')} -> {records[-1].get('loss')}")

app(["eval-positional", "--data", str(data), "--checkpoint", str(work / "run"), "--baseline", str(init),
     "--seq", env("SEQ", "128k"), "--bucket", env("BUCKET", "8k"), "--control-context", env("CONTROL", "32k"),
     "--max-windows", env("MAX_WINDOWS", "4"), "--bootstrap", "1000", "--seed", "0", "--out", str(out / "eval"),
     "--no-progress"], standalone_mode=False)
stamp("eval-positional done")
if torch.cuda.is_available():
    stamp(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
