#!/usr/bin/env bash
# Stage A of the indexer experiment on the GPU (docs/recall.md, "Stage A on the H200, the arms on the CPU and the H200"): several
# curricula side by side on one GPU (each process is small and launch-bound), each a chain of
# benchmarks/copy_task_probe.py phases with a time budget, then benchmarks/copy_indexer_arms.py on
# its final model (indexer-only arms: frozen, dense warm-up, + sparse KL).
#   bash benchmarks/device/copychain.sh OUTDIR SECONDS
# Each chain (chainA-chainD) is a folder of OUTDIR (call.sh returns each as one archive, < 16 MiB): OUTDIR/CHAIN/PHASE.json (curve) and OUTDIR/CHAIN/PHASE/ (the model), logs
# OUTDIR/CHAIN/*.log. The phase budgets are fractions of SECONDS, so a shorter call shortens all.
# The model: the wide tiny of the CPU attempts (hidden 128, 4 DSA heads, latent 64), its DSA mHC
# post held at 1 (--hold-dsa-post), loss on the copy only, copies 64 bases long.
# On real DNA (COPYCHAIN_DNA=PREPARED, call.sh's stage copydna): every row is a window of that genome, the loss is
# the copy's plus the DNA's outside it (--loss-on mix), the arms train on its train split, are scored on its
# holdout and save each arm's model (for genolong eval-recall); chains E-G instead of A-D:
#   E  chain C's curriculum from scratch on DNA;
#   F  COPYCHAIN_INIT (a random-bases copier, default the committed chain-C model) trained on at 1,088 with every key;
#   G  the same copier: an oracle phase at 1,088 first (the copy anchored while the DNA loss moves the model), then F's;
#   H  G's model (its copies always ended the row) trained on with each copy at a uniform place in the row (--window);
#   I  the same with an oracle phase first; J  F's model as H. COPYCHAIN_CHAINS picks chains (default E F G).
set -u
out=$1; total=$2
dev=${COPYCHAIN_DEVICE:-cuda}
# the arms' training (a quick logic check on the CPU sets a few steps here)
ARMS=${COPYCHAIN_ARMS:---warmup-steps 200 --sparse-steps 100}
DNA=${COPYCHAIN_DNA:-}
INIT=${COPYCHAIN_INIT:-benchmarks/recall_cpu_indexer/gpu_stageA/C1088}
# chains F and G's models (2026-12-02 H200 call; in git at 15b5e86 (git checkout 15b5e86 -- benchmarks/recall_cpu_indexer/gpu_dna), out of the tree since: the device call carries <= 64 MiB)
DNA_F=${COPYCHAIN_DNA_F:-benchmarks/recall_cpu_indexer/gpu_dna/F1088} DNA_G=${COPYCHAIN_DNA_G:-benchmarks/recall_cpu_indexer/gpu_dna/G1088}
LOSS=(--loss-on copy); DATA=(); ARMDATA=()
[ -n "$DNA" ] && { LOSS=(--loss-on mix); DATA=(--dna "$DNA"); }
mkdir -p "$out"
WIDE='"hidden": 128, "dsa": {"num_heads": 4, "kv_lora_rank": 64'
share() { python3 -c "print(max(10, int($total * $1)))"; }

phase() {  # chain, phase name, previous phase ('' = from scratch), budget share, then copy_task_probe arguments
  local chain=$1 name=$2 prev=$3 frac=$4; shift 4
  local init=(); [ -n "$prev" ] && init=(--init-from "$out/$chain/$prev")
  [[ $prev == /* || $prev == benchmarks/* ]] && init=(--init-from "$prev")  # a model outside this call
  python3 benchmarks/copy_task_probe.py --model tiny --device "$dev" --hold-dsa-post "${LOSS[@]}" "${DATA[@]}" --every 50 \
    --steps 1000000 --budget-s "$(share "$frac")" "${init[@]}" --save "$out/$chain/$name" --out "$out/$chain/$name.json" "$@" \
    > "$out/$chain/$name.log" 2>&1
}

arms() {  # chain, phase, top-k, max gap, gaps, then copy_indexer_arms arguments
  local chain=$1 name=$2 topk=$3 gap=$4 gaps=$5; shift 5
  [ -n "$DNA" ] && ARMDATA=(--dna "$DNA" --save-arms "$out/$chain/arms-$name-k$topk")
  python3 benchmarks/copy_indexer_arms.py --device "$dev" --model "$out/$chain/$name" --topk "$topk" --max-gap "$gap" \
    --gaps "$gaps" "${ARMDATA[@]}" --out "$out/$chain/arms-$name-k$topk.json" "$@" > "$out/$chain/arms-$name-k$topk.log" 2>&1
}

# oracle (top-k 8: the needed pool + 1 random) -> oracle 128 keys -> every key (320 tokens) -> every key (1,088
# tokens), then the arms at 320 tokens with top-k 8 and at 1,088 with top-k 32.
curriculum() {  # chain, batch, lr, first phase's init ('' or a phase of this chain), budget shares x4
  local c=$1 b=$2 lr=$3 first=$4
  mkdir -p "$out/$c"
  phase "$c" oracle8 "$first" "$5" --overrides "{$WIDE, \"indexer\": {\"topk\": 8}}}" --oracle-selection --max-gap 192 --batch "$b" --lr "$lr" --seed 5 &&
  phase "$c" oracle128 oracle8 "$6" --overrides "{$WIDE, \"indexer\": {\"topk\": 128}}}" --oracle-selection --max-gap 192 --batch "$b" --lr "$lr" --seed 6 &&
  phase "$c" dense320 oracle128 "$7" --overrides "{$WIDE}}" --max-gap 192 --batch "$b" --lr "$lr" --seed 7 &&
  phase "$c" dense1088 dense320 "$8" --overrides "{$WIDE}}" --max-gap 960 --batch "$((b / 2))" --lr "$lr" --seed 8 &&
  arms "$c" dense320 8 192 0,64,128,192 $ARMS --batch 16 --eval-batches 4 &&
  arms "$c" dense1088 32 960 0,192,448,960 $ARMS --batch 8 --eval-batches 4
}

# A: the CPU curriculum at 4x its batch. B: 8x the batch, a higher lr. C: a KDA copier first (short gaps, as the
# CPU attempts' stage A), then A's curriculum. D: no oracle at all (every key from the start): the control.
if [ -z "$DNA" ]; then
curriculum chainA 32 2e-3 '' 0.30 0.14 0.12 0.14 &
curriculum chainB 64 3e-3 '' 0.30 0.14 0.12 0.14 &
{ mkdir -p "$out/chainC" && phase chainC kda '' 0.15 --overrides "{$WIDE}}" --max-gap 16 --batch 32 --lr 3e-3 --seed 4 &&
  curriculum chainC 32 2e-3 kda 0.20 0.10 0.10 0.10; } &
{ mkdir -p "$out/chainD" && phase chainD dense320 '' 0.56 --overrides "{$WIDE}}" --max-gap 192 --batch 32 --lr 2e-3 --seed 7 &&
  arms chainD dense320 8 192 0,64,128,192 $ARMS --batch 16 --eval-batches 4; } &
else
dna_arms() {  # chain [arms options]: the 1,088-token arms at top-k 32 and 64 of its dense1088 model, each arm then scored by eval-recall
  local k c=$1; shift
  for k in 32 64; do
    arms "$c" dense1088 $k 960 0,192,448,960 $ARMS --batch 8 --eval-batches 4 "$@" || return
    # genolong's own benchmark on the held-out genome: 1,088-token windows, four 64-base copies each, fp32, the
    # reference ops (the arms' path); the arms' models are then dropped (the call returns 8 files of <= 16 MiB).
    local a="$out/$c/arms-dense1088-k$k" ckpt=()
    for arm in "$a"/*/; do ckpt+=(--checkpoint "${arm%/}"); done
    python3 -m genolong eval-recall --data "$DNA" "${ckpt[@]}" --seq 1088 --len 64 --distances 128,256,512,960 --windows 44 \
      --device "$dev" --dtype float32 --kernels reference --no-progress --out "$out/$c/recall-k$k" > "$out/$c/recall-k$k.log" 2>&1
    rm -rf "$a"
  done
  local phase
  for phase in "$out/$c"/*/; do  # keep the final model and the evaluations, not the curriculum's intermediate models
    case $(basename "$phase") in dense1088|recall-*) ;; *) rm -rf "$phase" ;; esac
  done
}
WIN=(--window 1088)  # chains H-J: each row's copy at a uniform place in the 1,088-token row, as in eval-recall
chain_E() {
  phase chainE kda '' 0.13 --overrides "{$WIDE}}" --max-gap 16 --batch 32 --lr 3e-3 --seed 4 &&
  phase chainE oracle8 kda 0.17 --overrides "{$WIDE, \"indexer\": {\"topk\": 8}}}" --oracle-selection --max-gap 192 --batch 32 --lr 2e-3 --seed 5 &&
  phase chainE oracle128 oracle8 0.09 --overrides "{$WIDE, \"indexer\": {\"topk\": 128}}}" --oracle-selection --max-gap 192 --batch 32 --lr 2e-3 --seed 6 &&
  phase chainE dense320 oracle128 0.09 --overrides "{$WIDE}}" --max-gap 192 --batch 32 --lr 2e-3 --seed 7 &&
  phase chainE dense1088 dense320 0.14 --overrides "{$WIDE}}" --max-gap 960 --batch 16 --lr 2e-3 --seed 8 && dna_arms chainE
}
chain_F() { phase chainF dense1088 "$INIT" 0.55 --overrides "{$WIDE}}" --max-gap 960 --batch 16 --lr 1e-3 --seed 8 && dna_arms chainF; }
chain_G() {
  phase chainG oracle1088 "$INIT" 0.25 --overrides "{$WIDE, \"indexer\": {\"topk\": 128}}}" --oracle-selection --max-gap 960 --batch 16 --lr 1e-3 --seed 6 &&
  phase chainG dense1088 oracle1088 0.30 --overrides "{$WIDE}}" --max-gap 960 --batch 16 --lr 1e-3 --seed 8 && dna_arms chainG
}
# H-J start from the DNA copiers of F and G (whose copies always ended the row) and move the copies anywhere.
need() {  # chain, model: a missing input model is one line in the chain's log, not a traceback
  [ -f "$2/config.json" ] && return 0
  echo "copychain: $1 needs $2 (git checkout 15b5e86 -- benchmarks/recall_cpu_indexer/gpu_dna, or COPYCHAIN_DNA_F/_G)" | tee "$out/$1/missing.log"
  return 1
}
chain_H() { need chainH "$DNA_G" && phase chainH dense1088 "$DNA_G" 0.55 --overrides "{$WIDE}}" --max-gap 960 "${WIN[@]}" --batch 16 --lr 1e-3 --seed 11 && dna_arms chainH "${WIN[@]}"; }
chain_I() {
  need chainI "$DNA_G" &&
  phase chainI oracle1088 "$DNA_G" 0.20 --overrides "{$WIDE, \"indexer\": {\"topk\": 128}}}" --oracle-selection --max-gap 960 "${WIN[@]}" --batch 16 --lr 1e-3 --seed 12 &&
  phase chainI dense1088 oracle1088 0.35 --overrides "{$WIDE}}" --max-gap 960 "${WIN[@]}" --batch 16 --lr 1e-3 --seed 13 && dna_arms chainI "${WIN[@]}"
}
chain_J() { need chainJ "$DNA_F" && phase chainJ dense1088 "$DNA_F" 0.55 --overrides "{$WIDE}}" --max-gap 960 "${WIN[@]}" --batch 16 --lr 1e-3 --seed 14 && dna_arms chainJ "${WIN[@]}"; }
for c in ${COPYCHAIN_CHAINS:-chainE chainF chainG}; do
  mkdir -p "$out/$c" && "chain_${c#chain}" &
done
fi
wait
for f in "$out"/*/*.log; do echo "$f: $(tail -n 1 "$f")"; done
