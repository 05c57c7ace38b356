#!/usr/bin/env bash
# The original genome experiment, end to end: hg38, train on chr1+chr2, hold out chr22, fine-tune
# at 512k tokens per sequence for 80 steps, then held-out loss by position in 32k buckets, before vs
# after, with the 32k-context control. Needs one H200-class GPU (141 GB) and ~128 GB of host RAM.
# Documented and checked for syntax in CI; not run there.
#
#   bash pipelines/hg38_512k.sh                          # glm53-mini, two stages (see below)
#   GLM_CKPT=/models/my-glm5-next bash pipelines/hg38_512k.sh   # fine-tune a transformers glm5_next checkpoint that fits
#                                    # one GPU (`genolong plan`; glm-5.3-flash itself needs many: docs/parallel.md)
#
# Every stage is skipped when its output is already complete, so rerunning after an interruption
# continues (finetune with --resume, or --overwrite when it stopped before its first checkpoint;
# eval-positional from its partial file). Raised STAGE1_STEPS retrains stage 2 from the new stage-1
# model and evaluates again (pipelines/lib.sh).
#
# Settings (environment): FASTA (default data/hg38.fa.gz, downloaded from UCSC if missing: the
# soft-masked assembly, so repeats are kept as a mask), GLM_CKPT, STEPS (80), STAGE1_STEPS (400),
# STAGE1_SEQ (32k), MAX_WINDOWS (empty = every usable chr22 window, ~75), OUT_TAG (hg38-512k).
set -euo pipefail
cd "$(dirname "$0")/.."

FASTA=${FASTA:-data/hg38.fa.gz}
GLM_CKPT=${GLM_CKPT:-}
STEPS=${STEPS:-80}
STAGE1_STEPS=${STAGE1_STEPS:-400}
STAGE1_SEQ=${STAGE1_SEQ:-32k}
MAX_WINDOWS=${MAX_WINDOWS:-}
TAG=${OUT_TAG:-hg38-512k}
DATA=data/hg38
RUN=runs/$TAG
EVAL=eval/$TAG

source pipelines/lib.sh

# 1. Data: chr1, chr2 for training, chr22 held out (whole chromosomes: interval splits leak at 512k).
if [ ! -f "$FASTA" ]; then
    mkdir -p "$(dirname "$FASTA")"
    curl -fL -o "$FASTA.part" https://hgdownload.soe.ucsc.edu/goldenPath/hg38/bigZips/hg38.fa.gz
    mv "$FASTA.part" "$FASTA"
fi
$G prepare --fasta "$FASTA" --train chr1,chr2 --holdout chr22 --out "$DATA" --reuse   # kept if already made from this FASTA

# 2. The model before long-context fine-tuning (the baseline of the evaluation).
if [ -n "$GLM_CKPT" ]; then
    BASELINE=$GLM_CKPT
    START=(--model "$GLM_CKPT")
else
    # glm53-mini has no pretrained weights: train it first at a short context (stage 1), then extend
    # the context (stage 2), as Evo 2 does. The evaluation then asks what the 512k stage added.
    STAGE1=runs/$TAG-stage1
    finetune_or_resume "$STAGE1" "$STAGE1_STEPS" --preset glm53-mini --seq "$STAGE1_SEQ" --lr 3e-4 --warmup 20 --save-every 20
    BASELINE=$STAGE1/start-model
    model_of "$STAGE1" "$STAGE1_STEPS" "$BASELINE"
    START=(--model "$BASELINE")
fi

# 3. Long-context fine-tuning at 512k (recompute, pinned offload, MoE chunking: the defaults).
finetune_or_resume "$RUN" "$STEPS" "${START[@]}" --seq 512k --lr 1e-4 --warmup 10 --save-every 20

# 4. Held-out loss by position: chr22 tiled into 512k windows, 32k buckets, 32k control.
$G eval-positional $(overwrite_if_changed) --data "$DATA" --checkpoint "$RUN" --baseline "$BASELINE" \
    --seq 512k --bucket 32k --control-context 32k --bootstrap 1000 --seed 0 \
    ${MAX_WINDOWS:+--max-windows "$MAX_WINDOWS"} --out "$EVAL"

echo "plot: $EVAL/positional.png  tables: $EVAL/positional.csv, $EVAL/positional.json"
echo "notebook: GENOLONG_RUNS=$RUN GENOLONG_EVALS=$EVAL .venv/bin/jupyter execute notebooks/analysis.ipynb --output=analysis-$TAG"
