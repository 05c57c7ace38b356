#!/usr/bin/env bash
# The indexer arms from a GPU stage-A copier (benchmarks/device/copychain.sh), three processes side by side:
#   long1088  the arms at 1,088 tokens (top-k 32 and 64) with 5x the indexer training of copychain's
#   long64k   the arms at 64k tokens, top-k 2048 (3% of the keys), copies 256-49k back (the issue's H200 shape)
#   dense4k   the copier trained on with every key at 4k windows, then scored at 64k (does the copying transfer?)
#   bash benchmarks/device/copylong.sh OUTDIR SECONDS MODEL       # MODEL: a copychain dense1088 model (call.sh: COPY_MODEL, default the committed chain-C model)
# COPYLONG_PARTS picks some of the three (e.g. "long64k"); COPYLONG_SHARE64 the 64k arms' share per phase.
# COPYLONG_ARGS: more options for the 64k arms (e.g. "--dna /tmp/bundled --dna-eval-split train --window 65536": real DNA, copies anywhere).
# Three at once share the GPU: the 64k warm-up step took ~7 s there (2026-12-02).
set -u
out=$1; total=$2; model=$3
dev=${COPYCHAIN_DEVICE:-cuda}
parts=${COPYLONG_PARTS:-long1088 long64k dense4k}  # which of the three to run
share64=${COPYLONG_SHARE64:-30}  # the 64k arms' phase budget, percent of SECONDS
has() { case " $parts " in *" $1 "*) return 0 ;; esac; return 1; }
mkdir -p "$out/long1088" "$out/long64k" "$out/dense4k"
A="python3 benchmarks/copy_indexer_arms.py --device $dev"
G64=65408  # 2 x 64 + G = 65,536 tokens
GAPS64=192,960,3968,16256,49088  # distances 256, 1,024, 4,032, 16,320, 49,152
has long1088 && { for k in 32 64; do $A --model "$model" --topk $k --max-gap 960 --gaps 0,192,448,960 --warmup-steps 1500 --sparse-steps 500 \
    --batch 8 --eval-batches 4 --phase-budget-s $(( total * 35 / 100 )) --out "$out/long1088/arms-k$k.json" > "$out/long1088/arms-k$k.log" 2>&1; done; } &
has long64k && $A --model "$model" --topk 2048 --max-gap $G64 --gaps $GAPS64 --warmup-steps 400 --sparse-steps 100 --batch 1 --eval-batches 1 \
  --eval-rows 2 --every 10 --phase-budget-s $(( total * share64 / 100 )) ${COPYLONG_ARGS:-} --out "$out/long64k/arms.json" > "$out/long64k/arms.log" 2>&1 &
has dense4k && { python3 benchmarks/copy_task_probe.py --model tiny --device "$dev" --hold-dsa-post --loss-on copy --every 50 --steps 1000000 \
    --budget-s $(( total * 55 / 100 )) --init-from "$model" --overrides '{"hidden": 128, "dsa": {"num_heads": 4, "kv_lora_rank": 64}}' \
    --max-gap 3968 --batch 8 --lr 1e-3 --seed 9 --save "$out/dense4k/model" --out "$out/dense4k/dense4k.json" > "$out/dense4k/dense4k.log" 2>&1 &&
  $A --model "$out/dense4k/model" --topk 2048 --max-gap $G64 --gaps $GAPS64 --warmup-steps 0 --sparse-steps 0 --eval-batches 1 \
    --eval-rows 2 --out "$out/dense4k/eval64k.json" > "$out/dense4k/eval64k.log" 2>&1; } &
wait
for f in "$out"/*/*.log; do echo "$f: $(tail -n 2 "$f" | tr '\n' ' ' | cut -c1-300)"; done
