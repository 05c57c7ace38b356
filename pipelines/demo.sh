#!/usr/bin/env bash
# The README's main job, on the CPU, in a few minutes, from a fresh clone: install, prepare the
# bundled genome, train a tiny model, extend its context, and plot held-out loss by position.
#
#   bash pipelines/demo.sh          -> eval/demo/positional.png (+ .csv, .json, summary on stdout)
#
# The same shape as the hg38 recipe (pipelines/hg38_512k.sh), scaled down:
#   1. prepare  E. coli 536 (training) + phage lambda (held out), bundled in genolong/data/genomes
#   2. stage 1  a `tiny` model from scratch at a short context (SHORT_SEQ bases per sequence)
#   3. stage 2  fine-tune that model at a longer context (LONG_SEQ)
#   4. eval     lambda tiled into LONG_SEQ windows: stage 2 vs stage 1, loss by position, with the
#               short-context control; the question is whether stage 2 gained more at late positions
# A tiny model trained for a minute or two is not a good DNA model; the point is the pipeline
# and a plot that reads like the real one. Each stage is skipped when its output exists.
set -euo pipefail
cd "$(dirname "$0")/.."

SHORT_SEQ=${SHORT_SEQ:-512}
SHORT_STEPS=${SHORT_STEPS:-100}
LONG_SEQ=${LONG_SEQ:-4k}
LONG_STEPS=${LONG_STEPS:-30}
BUCKET=${BUCKET:-512}
MAX_WINDOWS=${MAX_WINDOWS:-16}

[ -x .venv/bin/genolong ] || bash scripts/install.sh
G=.venv/bin/genolong
# The 2-core demo machine: one intra-op pool sized to it, no oversubscription.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}

DATA=data/bundled
SHORT=runs/demo-short
BASE=runs/demo-stage1
LONG=runs/demo
EVAL=eval/demo

# 1. Prepare the bundled genome: E. coli 536 (NC_008253.1) to train on, phage lambda (NC_001416.1)
#    held out (genolong/data/genomes/README.md).
[ -f "$DATA/manifest.json" ] || $G prepare --fasta "$(.venv/bin/python -c 'from genolong.data import bundled_genome_path as p; print(p())')" \
    --train NC_008253.1 --holdout NC_001416.1 --out "$DATA"

# 2. Stage 1: from scratch at the short context. CPU: no recompute or offload (nothing to save).
if [ ! -d "$SHORT/checkpoints" ]; then
    $G finetune --data "$DATA" --preset tiny --seq "$SHORT_SEQ" --batch 4 --steps "$SHORT_STEPS" \
        --lr 3e-3 --warmup 5 --no-recompute --no-offload --no-progress --out "$SHORT"
fi

# The stage-1 model as a model directory that `finetune --model` and `eval-positional --baseline`
# take (a transformers-format checkpoint; its tokenizer.json maps bases to genolong's DNA ids).
if [ ! -f "$BASE/config.json" ]; then
    rm -rf "$BASE.tmp"
    cp -r "$(ls -d "$SHORT"/checkpoints/step_* | tail -n 1)/model" "$BASE.tmp"
    mv "$BASE.tmp" "$BASE"
fi

# 3. Stage 2: the same model at the long context.
if [ ! -d "$LONG/checkpoints" ]; then
    $G finetune --data "$DATA" --model "$BASE" --seq "$LONG_SEQ" --steps "$LONG_STEPS" \
        --lr 1e-3 --warmup 2 --no-recompute --no-offload --no-progress --out "$LONG"
fi

# 4. Held-out loss by position, stage 2 vs stage 1 (resumable: rerunning skips scored windows).
$G eval-positional --data "$DATA" --checkpoint "$LONG" --baseline "$BASE" \
    --seq "$LONG_SEQ" --bucket "$BUCKET" --max-windows "$MAX_WINDOWS" --bootstrap 1000 --out "$EVAL" --no-progress

echo "plot: $EVAL/positional.png"
echo "tables: $EVAL/positional.csv $EVAL/positional.json; notebook: notebooks/analysis.ipynb (reads $LONG and $EVAL)"
