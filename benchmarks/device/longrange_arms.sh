#!/usr/bin/env bash
# The long-range experiment's two arms on one GPU (call.sh's `longrange` stage): the trained-indexer
# arm and the frozen-indexer comparison arm (pipelines/longrange.sh), then the trained arm's
# evaluations, eval-positional scoring both arms' long models on the held-out chromosome.
#   bash benchmarks/device/longrange_arms.sh SECONDS    # interrupts the pipelines SECONDS from now
# On a GPU of >= 120 GiB (an H200) the two arms' short-window stages (copy, widen, own: ~45 GiB each by
# `genolong plan`) train side by side, each planning its memory for half of the GPU and of the
# host's RAM; their 512k stages (~70 GiB each) always run one after the other on the whole GPU.
# Restartable like the pipeline: the next call on a warm machine continues where this one stopped.
# LONGRANGE_ENV: settings of both arms (e.g. "STEPS=12", or another assembly carried in .lrdata/:
# "ASSEMBLY=lyrata FASTA=.lrdata/lyrata.fna.gz TRAIN=CM047395.1 HOLDOUT=CM047396.1"); FROZEN_ENV: the comparison arm's
# (default "INDEXER_COEFF=0 TAG=longrange-frozen"; empty: no comparison arm, the positional
# baseline is the trained arm's own-stage model).
set -u
budget=$1
deadline=$(( $(date +%s) + budget ))
FROZEN_ENV=${FROZEN_ENV-INDEXER_COEFF=0 TAG=longrange-frozen}
base="GENOLONG='python3 -m genolong' FASTA=.lrdata/arenosa.fna.gz TRAIN=LR999451.1 HOLDOUT=LR999452.1 ${LONGRANGE_ENV:-}"
whole="FINETUNE_FLAGS=--no-progress"
half=""
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
if [ -n "$FROZEN_ENV" ] && [ "${gpu_mib:-0}" -ge 122880 ]; then
    ram_kib=$(awk '/MemTotal/ {print $2}' /proc/meminfo)
    half="FINETUNE_FLAGS='--no-progress --gpu-budget-gib $(( gpu_mib * 45 / 100 / 1024 )) --host-budget-gib $(( ram_kib * 35 / 100 / 1048576 ))'"
fi
left() { echo $(( deadline - $(date +%s) )); }
arm() {  # arm LOG SETTINGS...: the pipeline with these settings, interrupted (Ctrl-C) at the deadline
    local log=$1; shift
    if [ "$(left)" -lt 20 ]; then echo "no time left for $*" >> "$log"; return 1; fi
    eval "$base $* timeout -s INT $(left) bash pipelines/longrange.sh" >> "$log" 2>&1
}
report() { for f in "$OUT"/arm-*.log; do echo "--- $f"; grep -v TileLang "$f" | tail -n 30; done; }
trap report EXIT
# Both arms read one prepared genome: prepare it once, before they start.
arm "$OUT/arm-trained.log" UNTIL=prepare || exit 1
if [ -n "$FROZEN_ENV" ]; then
    if [ -n "$half" ]; then
        arm "$OUT/arm-frozen.log" "$FROZEN_ENV $half UNTIL=own" &
        frozen=$!
        arm "$OUT/arm-trained.log" "$half UNTIL=own" || { wait "$frozen"; exit 1; }
        wait "$frozen" || exit 1
    fi
    arm "$OUT/arm-frozen.log" "$FROZEN_ENV $whole UNTIL=long" || exit 1
    tag=$(eval "$FROZEN_ENV; echo \${TAG:-longrange}")
    arm "$OUT/arm-trained.log" "$whole BASELINE=runs/$tag-long"
else
    arm "$OUT/arm-trained.log" "$whole"
fi
