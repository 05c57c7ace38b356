#!/usr/bin/env bash
# How many steps each model needs before it learns to copy (benchmarks/copy_task_probe.py), several
# probes at once on one GPU (each is small and launch-bound, so they share it well): the dense
# yardstick transformer, `tiny` at three learning rates and with a 4x wider initialisation, and
# glm53-mini at 4 and 8 layers (the planted-repeat experiment's model). All DSA selections dense.
#   bash benchmarks/device/copyprobe.sh OUTDIR SECONDS      # curves: OUTDIR/*.json, logs OUTDIR/*.log
# COPYPROBE_STEPS (6000) and COPYPROBE_DEVICE (cuda) override the defaults.
set -u
out=$1; limit=$2
mkdir -p "$out"
probe() {  # name, then copy_task_probe.py arguments
    local name=$1; shift
    timeout "$limit" python3 benchmarks/copy_task_probe.py --device "${COPYPROBE_DEVICE:-cuda}" --every 50 \
        --steps "${COPYPROBE_STEPS:-6000}" --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1 &
}
probe transformer-1e-3 --model transformer --lr 1e-3
for lr in 1e-3 3e-3 1e-2; do probe "tiny-$lr" --model tiny --lr "$lr"; done
probe tiny-init08-3e-3 --model tiny --lr 3e-3 --overrides '{"initializer_range": 0.08}'
for n in 4 8; do probe "mini$n-1e-3" --model preset --preset glm53-mini --overrides "{\"num_layers\": $n}" --lr 1e-3; done
wait
for f in "$out"/*.log; do echo "$(basename "$f" .log): $(tail -n 1 "$f")"; done
