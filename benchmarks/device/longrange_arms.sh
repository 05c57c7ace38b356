#!/usr/bin/env bash
# The long-range experiment's two arms on one GPU (call.sh's `longrange` stage): the trained-indexer
# arm and the frozen-indexer comparison arm (pipelines/longrange.sh) train side by side, each its
# own process (the short stages leave most of an H200 idle; their 512k stages fit together), then
# the trained arm's eval-positional scores both models on the held-out chromosome.
#   bash benchmarks/device/longrange_arms.sh SECONDS    # interrupts the pipelines SECONDS from now
# Restartable like the pipeline: the next call on a warm machine continues where this one stopped.
# LONGRANGE_ENV: settings of both arms (e.g. "COPY_STEPS=300"); FROZEN_ENV: the comparison arm's
# (default "INDEXER_COEFF=0 TAG=longrange-frozen"; empty: no comparison arm, the positional
# baseline is the trained arm's own-stage model).
set -u
budget=$1
deadline=$(( $(date +%s) + budget ))
FROZEN_ENV=${FROZEN_ENV-INDEXER_COEFF=0 TAG=longrange-frozen}
flags=--no-progress
if [ -n "$FROZEN_ENV" ] && command -v nvidia-smi > /dev/null; then
    # Two trainings on one GPU: each plans its memory (offload, recompute) for half of the GPU and
    # of the host's RAM, so that their 512k stages fit side by side.
    gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
    ram_kib=$(awk '/MemTotal/ {print $2}' /proc/meminfo)
    flags="$flags --gpu-budget-gib $(( gpu_mib * 45 / 100 / 1024 )) --host-budget-gib $(( ram_kib * 35 / 100 / 1048576 ))"
fi
common="GENOLONG='python3 -m genolong' FASTA=.lrdata/arenosa.fna.gz TRAIN=LR999451.1 HOLDOUT=LR999452.1 FINETUNE_FLAGS='$flags' ${LONGRANGE_ENV:-}"
left() { echo $(( deadline - $(date +%s) )); }
arm() {  # arm LOG SETTINGS...: the pipeline with these settings, interrupted (Ctrl-C) at the deadline
    local log=$1; shift
    if [ "$(left)" -lt 20 ]; then echo "no time left for $*" >> "$log"; return 1; fi
    eval "$common $* timeout -s INT $(left) bash pipelines/longrange.sh" >> "$log" 2>&1
}
report() { for f in "$OUT"/arm-*.log; do echo "--- $f"; tail -n 30 "$f"; done; }
trap report EXIT
# Both arms read one prepared genome: prepare it once, before they start.
python3 -m genolong prepare --fasta .lrdata/arenosa.fna.gz --train LR999451.1 --holdout LR999452.1 --out data/arenosa --reuse \
    >> "$OUT/arm-trained.log" 2>&1 || exit 1
rc_frozen=0
if [ -n "$FROZEN_ENV" ]; then
    arm "$OUT/arm-frozen.log" "$FROZEN_ENV UNTIL=long" &
    frozen=$!
fi
arm "$OUT/arm-trained.log" UNTIL=long
rc=$?
if [ -n "$FROZEN_ENV" ]; then wait "$frozen"; rc_frozen=$?; fi
echo "trained arm rc=$rc, frozen arm rc=$rc_frozen, $(left) s left"
[ "$rc" = 0 ] && [ "$rc_frozen" = 0 ] || exit 1
baseline=""
if [ -n "$FROZEN_ENV" ]; then
    tag=$(eval "$FROZEN_ENV; echo \${TAG:-longrange}")
    baseline="BASELINE=runs/$tag-long"
fi
arm "$OUT/arm-trained.log" $baseline
