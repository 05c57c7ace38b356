#!/usr/bin/env bash
# The CPU indexer experiment, fourth attempt (docs/recall.md, "CPU, fourth attempt"): a DSA layer
# that copies from what it is given, then the indexer arms.
#
#     bash benchmarks/recall_cpu_oracle.sh WORK OUT A1D      # A1D: the third attempt's KDA copier
#
# A1D is recall_cpu_indexer.sh's stage A continued 2000 steps at lr 1e-3 (its KDA layers copy up to
# ~80 bases back; its DSA layer's mHC gate is closed), made with
#     copy_task_probe.py --model tiny --overrides '{"hidden": 128, "dsa": {"num_heads": 4, "kv_lora_rank": 64}}' \
#         --init-from WORK3/A --lr 1e-3 --steps 2000 --every 100 --loss-on copy --max-gap 16 --seed 2 --save A1D
# Stage A here: the DSA gate held open
# (--hold-dsa-post) and the indexer replaced by an oracle that always selects the pool a copy query
# needs plus one random pool (--oracle-selection, top-k 8 = two pools of 4 + the tail), on copies
# 64-256 back in 320-token windows (beyond the KDA layers' reach): the DSA layer learns to copy from
# a handful of keys; then the oracle's selection is widened to 128 keys and finally to every key, so
# that the layer copies with the whole window in view. Its own indexer is never trained there.
# copy_indexer_arms.py trains only the indexer at each stage (the arms that answer the question).
# Stage B (DNA) runs the model with that
# indexer (top-k 8: <= 11 of up to 320 keys) on E. coli windows of 320 with one planted copy of
# 64 bases 128-256 back:
#   frozen-0   the stage-A model, its indexer as initialised                       (baseline)
#   warmup     + 300 steps of the indexer's dense warm-up (only the indexer moves)
# so the two differ only in the indexer's weights.
# eval-recall on 64 held-out lambda windows of 320, copies of 32 bases at 128 and 256 (after 8).
set -euo pipefail
WORK=${1:?usage: recall_cpu_oracle.sh WORK OUT A1D}
OUT=${2:?usage: recall_cpu_oracle.sh WORK OUT A1D}
A1D=${3:?usage: recall_cpu_oracle.sh WORK OUT A1D}
PY=${PY:-.venv/bin/python}
GENOLONG=${GENOLONG:-.venv/bin/genolong}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$WORK" "$OUT"
SPARSE8='{"hidden": 128, "dsa": {"num_heads": 4, "kv_lora_rank": 64, "indexer": {"topk": 8}}}'

if [ ! -e "$OUT/stageA-oracle.json" ] || [ ! -e "$WORK/A4/config.json" ]; then
  "$PY" benchmarks/copy_task_probe.py --model tiny --overrides "$SPARSE8" --init-from "$A1D" --hold-dsa-post \
    --oracle-selection --lr 2e-3 --steps 2500 --every 50 --loss-on copy --max-gap 192 --seed 5 \
    --save "$WORK/A4" --out "$OUT/stageA-oracle.json.tmp"
  mv "$OUT/stageA-oracle.json.tmp" "$OUT/stageA-oracle.json"
fi

# The curriculum towards a dense copier: the oracle's selection widened to 128 keys (the needed pool
# + 31 random ones), then every key (no oracle), 1200 steps each.
WIDE128='{"hidden": 128, "dsa": {"num_heads": 4, "kv_lora_rank": 64, "indexer": {"topk": 128}}}'
WIDE='{"hidden": 128, "dsa": {"num_heads": 4, "kv_lora_rank": 64}}'
if [ ! -e "$OUT/stageA-oracle-k128.json" ] || [ ! -e "$WORK/A5/config.json" ]; then
  "$PY" benchmarks/copy_task_probe.py --model tiny --overrides "$WIDE128" --init-from "$WORK/A4" --hold-dsa-post \
    --oracle-selection --lr 2e-3 --steps 1200 --every 50 --loss-on copy --max-gap 192 --seed 6 \
    --save "$WORK/A5" --out "$OUT/stageA-oracle-k128.json.tmp"
  mv "$OUT/stageA-oracle-k128.json.tmp" "$OUT/stageA-oracle-k128.json"
fi
if [ ! -e "$OUT/stageA-dense.json" ] || [ ! -e "$WORK/A6/config.json" ]; then
  "$PY" benchmarks/copy_task_probe.py --model tiny --overrides "$WIDE" --init-from "$WORK/A5" --hold-dsa-post \
    --lr 2e-3 --steps 1200 --every 50 --loss-on copy --max-gap 192 --seed 7 --save "$WORK/A6" --out "$OUT/stageA-dense.json.tmp"
  mv "$OUT/stageA-dense.json.tmp" "$OUT/stageA-dense.json"
fi
# The indexer-only arms on the copy task, at each stage of the curriculum (top-k 8 for all).
for m in A4 A5 A6; do
  "$PY" benchmarks/copy_indexer_arms.py --model "$WORK/$m" --topk 8 --warmup-steps 300 --sparse-steps 300 \
    --eval-batches 8 --gaps 0,64,128,192 --out "$OUT/copy_indexer_arms_$m.json"
  "$PY" benchmarks/copy_mechanism_probe.py --model "$WORK/$m" --gaps 64,192 --batches 4 --out "$OUT/copy_mechanism_$m.json"
done

# eval-recall on DNA (meaningless for a copy-only model at late positions: see docs/recall.md).
PLANT=(--seq 320 --len 64 --min-dist 128 --max-dist 256 --per-window 1 --batch 8 --short-steps 0 --no-eval
       --train-option indexer_recall_every=25)
B="$WORK/B"
"$PY" benchmarks/recall_cpu.py --work "$B" --out "$OUT/arms" --arm warmup --init-from "$WORK/A4" "${PLANT[@]}" \
  --steps 300 --lr 3e-3 --warmup 10 --indexer-loss-coeff 1 --indexer-warmup-steps 300

"$GENOLONG" eval-recall --data "$B/data" --baseline "$WORK/A4" --checkpoint "$B/warmup" --seq 320 --len 32 --skip 8 \
  --distances 128,256 --windows 64 --bootstrap 1000 --no-progress --out "$OUT/eval" --overwrite
echo "done: $OUT/copy_indexer_arms_A{4,5,6}.json, $OUT/eval/summary.txt"
