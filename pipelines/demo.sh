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
# and a plot that reads like the real one.
#
# Interrupted (Ctrl-C, a closed laptop, out of memory)? Run it again: finished stages are skipped,
# a stopped training stage continues from its last checkpoint (or starts again if it had none),
# and the evaluation continues from its partial results. Run again with more SHORT_STEPS, stage 1
# trains on, stage 2 starts again from the new model and the evaluation is redone.
set -euo pipefail
cd "$(dirname "$0")/.."

SHORT_SEQ=${SHORT_SEQ:-512}
SHORT_STEPS=${SHORT_STEPS:-100}
LONG_SEQ=${LONG_SEQ:-4k}
LONG_STEPS=${LONG_STEPS:-30}
BUCKET=${BUCKET:-512}
MAX_WINDOWS=${MAX_WINDOWS:-16}

source pipelines/lib.sh
# One intra-op thread: the tiny model's ops are too small for a second one to gain anything, and
# on a machine whose cores are busy OpenMP threads spin-waiting on each other made a step ~10x
# slower (30 s instead of 3 s at 4 x 512 bases, 2026-12-01). Set OMP_NUM_THREADS to override.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

DATA=data/bundled
SHORT=runs/demo-short
BASE=runs/demo-stage1
LONG=runs/demo
EVAL=eval/demo

stage "1/4 prepare: E. coli 536 (NC_008253.1) to train on, phage lambda (NC_001416.1) held out -> $DATA"
$G prepare --fasta bundled --train NC_008253.1 --holdout NC_001416.1 --out "$DATA" --reuse

# CPU: no recompute or offload (nothing to save at these lengths). Checkpoints every 25 steps, so
# an interrupted stage loses little.
stage "2/4 stage 1: a tiny model from scratch, $SHORT_STEPS steps of 4 x $SHORT_SEQ bases -> $SHORT"
finetune_or_resume "$SHORT" "$SHORT_STEPS" --preset tiny --seq "$SHORT_SEQ" --batch 4 \
    --lr 3e-3 --warmup 5 --save-every 25 --no-recompute --no-offload
model_of "$SHORT" "$SHORT_STEPS" "$BASE"

stage "3/4 stage 2: the same model at $LONG_SEQ bases per sequence, $LONG_STEPS steps -> $LONG"
finetune_or_resume "$LONG" "$LONG_STEPS" --model "$BASE" --seq "$LONG_SEQ" \
    --lr 1e-3 --warmup 2 --save-every 10 --no-recompute --no-offload

stage "4/4 held-out loss by position on lambda, stage 2 vs stage 1 (up to $MAX_WINDOWS windows of $LONG_SEQ) -> $EVAL"
$G eval-positional $(overwrite_if_changed) --data "$DATA" --checkpoint "$LONG" --baseline "$BASE" \
    --seq "$LONG_SEQ" --bucket "$BUCKET" --max-windows "$MAX_WINDOWS" --bootstrap 1000 --out "$EVAL"

stage "done"
echo "plot: $EVAL/positional.png"
echo "tables: $EVAL/positional.csv $EVAL/positional.json; notebook: notebooks/analysis.ipynb (reads $LONG and $EVAL)"
echo "genolong itself: $G --help (or \`source .venv/bin/activate\`, then plain genolong)"
