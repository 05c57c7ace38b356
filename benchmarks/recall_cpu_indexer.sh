#!/usr/bin/env bash
# The CPU indexer experiment, third attempt (docs/recall.md, "CPU, third attempt"): does training
# the DSA indexer make a sparse model find what its dense attention would have used?
#
#     bash benchmarks/recall_cpu_indexer.sh WORK OUT          # ~45 min on one core of the 2-core VM
#
# Stage A teaches copying with the DSA layer dense (the copy probe's top-k covers the sequence):
# the wide tiny of the second attempt, a random 64-mer, U[0, 16] random bases, the 64-mer again
# (144 tokens, the copy 64-80 bases after its source), loss on the copy only; 5000 steps, then
# 3000 more with fresh optimizer moments. Stage B runs that model sparse (indexer top-k 8: two
# pools of 4 plus its tail, <= 11 of up to 144 keys) on windows of real DNA (E. coli 536) with
# one planted copy of 64 bases 64-80 back, in four arms that share the stage-A weights:
#   frozen-0     the stage-A model with its (never trained) indexer, no step   (baseline)
#   warmup       + 300 steps of the indexer's dense warm-up: only the indexer moves
#   frozen       + 300 steps of LM training with the indexer frozen
#   trained      warmup + the same 300 LM steps with the indexer's sparse KL loss
# and the stage-A model itself (dense selection) as the upper bound. eval-recall scores them on
# held-out phage lambda, one copy of 32 bases per window at d = 64 and at d = 79 (eval-recall
# refuses sources and copies filling over half a window: one copy of 64 needs 256 tokens), scored
# after its first 8 bases, 64 windows each. Then the diagnosis of 2026-12-02: which mixers copy
# (copy_mechanism_probe.py) and whether the DSA layer's output still reaches the logits
# (mhc_gate_probe.py).
set -euo pipefail
WORK=${1:?usage: recall_cpu_indexer.sh WORK OUT}
OUT=${2:?usage: recall_cpu_indexer.sh WORK OUT}
PY=${PY:-.venv/bin/python}
GENOLONG=${GENOLONG:-.venv/bin/genolong}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$WORK" "$OUT"
WIDE='{"hidden": 128, "dsa": {"num_heads": 4, "kv_lora_rank": 64}}'
SPARSE='{"dsa": {"indexer": {"topk": 8}}}'

# Stage A (the probe saves the model at every print; a finished stage is not run again).
if [ ! -e "$OUT/stageA1.json" ] || [ ! -e "$WORK/A1/config.json" ]; then
  "$PY" benchmarks/copy_task_probe.py --model tiny --overrides "$WIDE" --lr 3e-3 --steps 5000 --every 250 \
    --loss-on copy --max-gap 16 --save "$WORK/A1" --out "$OUT/stageA1.json.tmp"
  mv "$OUT/stageA1.json.tmp" "$OUT/stageA1.json"
fi
if [ ! -e "$OUT/stageA2.json" ] || [ ! -e "$WORK/A/config.json" ]; then
  "$PY" benchmarks/copy_task_probe.py --model tiny --overrides "$WIDE" --init-from "$WORK/A1" --lr 3e-3 --steps 3000 \
    --every 100 --loss-on copy --max-gap 16 --seed 1 --save "$WORK/A" --out "$OUT/stageA2.json.tmp"
  mv "$OUT/stageA2.json.tmp" "$OUT/stageA2.json"
fi

# Stage B: the arms (recall_experiment.py records each one: options, losses, timing, metrics.jsonl).
PLANT=(--seq 144 --len 64 --min-dist 64 --max-dist 79 --per-window 1 --batch 8 --short-steps 0 --no-eval
       --train-option indexer_recall_every=25)
B="$WORK/B"
"$PY" benchmarks/recall_cpu.py --work "$B" --out "$OUT/arms" --arm warmup --init-from "$WORK/A" --init-overrides "$SPARSE" \
  "${PLANT[@]}" --steps 300 --lr 3e-3 --warmup 10 --indexer-loss-coeff 1 --indexer-warmup-steps 300
"$PY" benchmarks/recall_cpu.py --work "$B" --out "$OUT/arms" --arm frozen --init-from "$WORK/A" --init-overrides "$SPARSE" \
  "${PLANT[@]}" --steps 300 --lr 1e-3 --warmup 10
# The trained arm's LM steps start from the warm-up's indexer (its own WORK: its start is another model).
"$PY" benchmarks/recall_cpu.py --work "$WORK/B-trained" --out "$OUT/arms-trained" --arm trained --data "$B/data" \
  --init-from "$B/warmup" "${PLANT[@]}" --steps 300 --lr 1e-3 --warmup 10 --indexer-loss-coeff 1

for d in 64 79; do
  "$GENOLONG" eval-recall --data "$B/data" --baseline "$B/init-retargeted" --checkpoint "$B/warmup" --checkpoint "$B/frozen" \
    --checkpoint "$WORK/B-trained/trained" --checkpoint "$WORK/A" --seq 144 --len 32 --skip 8 --distances "$d" \
    --windows 64 --bootstrap 1000 --no-progress --out "$OUT/eval-d$d" --overwrite
done
"$PY" benchmarks/copy_mechanism_probe.py --model "$WORK/A" --gaps 16,64,128,384 --batches 4 --out "$OUT/copy_mechanism.json"
"$PY" benchmarks/mhc_gate_probe.py --data "$B/data" --seq 512 --windows 2 "$WORK/A" --out "$OUT/mhc_gates.json"
echo "done: $OUT/eval-d64/summary.txt, $OUT/eval-d79/summary.txt, $OUT/copy_mechanism.json, $OUT/mhc_gates.json"
