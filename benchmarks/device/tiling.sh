#!/usr/bin/env bash
# Sequence tiling measured through the CLI on one GPU (call.sh's `tiling` stage; docs/memory.md,
# "Sequence tiling"): glm53-mini on real DNA (the bundled E. coli), every hot op fused, in priority
# order, each sub-run under its own share of the stage's time so that a cut still returns what finished:
#   1m          finetune --seq 1M, 3 steps, the CLI's defaults (--tile auto: the pre-flight picks the tile)
#   512k-tiled  finetune --seq 512k --tile $TILE_512K (128k: 5 layers offloaded by the plan, not 15)
#   512k-whole  the same with --tile off
#   128k-tiled  finetune --seq 128k --tile $TILE_128K (32k: the tile the 1M run uses, its kernels built)
#   128k-whole  the same with --tile off
#   eval1m      eval-positional --seq 1M on the 1m run's checkpoint, 2 windows, no controls
# The four arms take ARM_STEPS (3) steps and are stopped in the step after (no checkpoint is written);
# the first of each pair gets half of the time left (at least 240 s), so that its partner runs too.
#   OUT=DIR bash benchmarks/device/tiling.sh SECONDS
# Each sub-run leaves $OUT/tiling/NAME/: the run's small files (metrics.jsonl, options.json, plan.json,
# memory.json, kernels.json, compile.json; eval: summary.txt, positional.json, partial.jsonl), run.log,
# info.json (command, exit code, wall seconds, why it stopped) and samples.tsv (nvidia-smi's memory.used
# and the host's MemAvailable every 2 s). `python3 benchmarks/device/tiling_summary.py tiling.tar.gz`
# turns them into docs/memory.md's rows.
# Runs live under /tmp/tiling (kept by a warm machine): the next call skips the sub-runs that finished
# (TILING_REDO=1 runs them again). TILING_RUNS picks and orders the sub-runs; TILING_ARGS is added to
# every finetune, FT1M_ARGS to the 1M one. The plan's 1M needs 100 GiB of pinned memory, 80% of a
# 125 GiB machine: where the pre-flight refuses 1M for pinned host memory alone, it runs once more with
# --host-budget-gib 101 (the refusal kept as refused.log). TILING_DRY=1 prints each sub-run's command and runs nothing;
# GENOLONG (default `python3 -m genolong`), TILING_DATA / TILING_EVAL_DATA, TILING_MIN_S, TILING_STOP_S,
# TILING_PAIR_S and TILING_POLL_S are for the script's own test (tests/benchmarks/test_tiling_stage.py).
# eval1m scores E. coli windows (the only record >= 1M of the bundled genome, which the 1m run trained
# on) with that checkpoint as its own baseline: it measures that a 1M window scores, its time and memory.
set -u
budget=${1:?usage: tiling.sh SECONDS}
deadline=$(( $(date +%s) + budget ))
R=${TILING_DIR:-/tmp/tiling}
D=${OUT:-/tmp/tiling-out}/tiling
DATA=${TILING_DATA:-/tmp/bundled}
EVALDATA=${TILING_EVAL_DATA:-/tmp/bundled-swap}
G=${GENOLONG:-python3 -m genolong}
TILE_512K=${TILE_512K:-128k}
TILE_128K=${TILE_128K:-32k}
ARM_STEPS=${ARM_STEPS:-3}
RUNS=${TILING_RUNS:-1m 512k-tiled 512k-whole 128k-tiled 128k-whole eval1m}
MIN_S=${TILING_MIN_S:-60}  # no sub-run starts with less: a model build and a first step do not fit in less
STOP_S=${TILING_STOP_S:-30}  # what stopping a sub-run may take (escalate): kept out of every limit
POLL_S=${TILING_POLL_S:-2}
PAIR_S=${TILING_PAIR_S:-240}  # a warm machine's 512k arm: ~20 s start, ~100-150 s first step, 2 x ~27 s
FT="$G finetune"
EXTRA=${TILING_ARGS:-}

command_of() {
    local arm="--warmup 0 --preset glm53-mini --steps $(( ARM_STEPS + 1 )) --out $R/$1 --overwrite $EXTRA"
    case $1 in
        1m) echo "$FT --data $DATA --seq 1M --steps 3 --warmup 0 --preset glm53-mini --out $R/1m --overwrite $EXTRA ${FT1M_ARGS:-}" ;;
        512k-tiled) echo "$FT --data $DATA --seq 512k --tile $TILE_512K $arm" ;;
        512k-whole) echo "$FT --data $DATA --seq 512k --tile off $arm" ;;
        128k-tiled) echo "$FT --data $DATA --seq 128k --tile $TILE_128K $arm" ;;
        128k-whole) echo "$FT --data $DATA --seq 128k --tile off $arm" ;;
        eval1m) echo "$G eval-positional --data $EVALDATA --checkpoint $R/1m --baseline $R/1m --seq 1M --max-windows 2 --controls none --bootstrap 100 --no-progress --out $R/eval1m --overwrite" ;;
        *) return 1 ;;
    esac
}

# Records a finetune sub-run must reach to count as finished (the eval: its exit code alone).
wanted() { case $1 in 1m) echo 3 ;; eval1m) echo 0 ;; *) echo "$ARM_STEPS" ;; esac; }

if [ -n "${TILING_DRY:-}" ]; then
    for name in $RUNS; do echo "$name: $(command_of "$name" || echo "unknown sub-run")"; done
    exit 0
fi

left() { echo $(( deadline - $(date +%s) )); }
records() { local n=0; [ -f "$1/metrics.jsonl" ] && n=$(grep -c '"step"' "$1/metrics.jsonl"); echo "${n:-0}"; }

# The time a sub-run may take, less what stopping it may take: all that is left, or, when its partner
# (same length) follows, half of it but at least PAIR_S (one arm measured beats two arms cut).
limit_for() {
    local name=$1 rest=$2 n half
    n=$(left)
    case " $rest " in *" ${name%%-*}-"*)
        half=$(( n / 2 ))
        n=$(( half > PAIR_S ? half : (n < PAIR_S ? n : PAIR_S) )) ;;
    esac
    echo $(( n - STOP_S ))
}

info() {  # info DIR key value ...: info.json (all values strings)
    local dir=$1; shift
    python3 -c 'import json, sys; json.dump(dict(zip(sys.argv[2::2], sys.argv[3::2])), open(sys.argv[1], "w"), indent=1)' "$dir/info.json" "$@"
}

start_sampler() {
    { echo "# t_s gpu_used_mib host_available_kib; MemTotal $(awk '/MemTotal/ {print $2}' /proc/meminfo) kiB"
      while :; do
          g=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n 1)
          echo "$(date +%s) ${g:-NA} $(awk '/MemAvailable/ {print $2}' /proc/meminfo)"
          sleep "$POLL_S"
      done; } > "$1" &
    SAMPLER=$!
}

# Stop the sub-run whose process is $1: SIGTERM (the CLI stops its worker at a safe point, finishing a
# checkpoint being written), a second one at 2/3 of STOP_S (abandons it), then SIGKILL for it and its children.
escalate() {
    local pid=$1 since=$2 kids=$3 now=$(date +%s)
    if [ $(( now - since )) -ge "$STOP_S" ]; then
        kill -KILL "$pid" $kids 2>/dev/null
    elif [ $(( now - since )) -ge $(( STOP_S * 2 / 3 )) ] && [ -z "${SECOND_SENT:-}" ]; then
        kill -TERM "$pid" 2>/dev/null; SECOND_SENT=1
    fi
}

collect() {  # collect RUN DIR: the run's small files
    for f in metrics.jsonl options.json plan.json memory.json kernels.json compile.json summary.txt positional.json partial.jsonl; do
        [ -f "$1/$f" ] && cp "$1/$f" "$2/"
    done
}

run_one() {
    local name=$1 rest=$2 dir=$D/$1 run=$R/$1 cmd limit want pid kids="" t0 stopped="" since=0 rc
    mkdir -p "$dir"
    cmd=$(command_of "$name") || { echo "unknown sub-run $name"; return; }
    want=$(wanted "$name")
    limit=$(limit_for "$name" "$rest")
    if [ -f "$R/done/$name" ] && [ -z "${TILING_REDO:-}" ]; then
        info "$dir" name "$name" command "$cmd" stopped "finished in an earlier call on this machine (its files came back then)"
        echo "$name: finished in an earlier call"; return
    fi
    if [ "$name" = eval1m ] && ! ls "$R"/1m/checkpoints/step_*/COMPLETE > /dev/null 2>&1; then
        info "$dir" name "$name" command "$cmd" stopped "skipped: the 1m run has no complete checkpoint"
        echo "$name: skipped (no 1M checkpoint)"; return
    fi
    if [ "$limit" -lt "$MIN_S" ]; then
        info "$dir" name "$name" command "$cmd" stopped "skipped: ${limit} s left"
        echo "$name: skipped (${limit} s left)"; return
    fi
    # Prepared aside and moved into place: a cut prepare leaves nothing a later call would take as done.
    [ "$name" = eval1m ] && { [ -d "$EVALDATA" ] || { rm -rf "$EVALDATA.part" && $G prepare --fasta bundled --train NC_001416.1 \
        --holdout NC_008253.1 --out "$EVALDATA.part" > "$dir/prepare.log" 2>&1 && mv "$EVALDATA.part" "$EVALDATA"; }; }
    [ "$name" = 1m ] && rm -f "$R/done/eval1m"  # a new 1M checkpoint: evaluate it again
    echo "$name: limit ${limit} s: $cmd"
    start_sampler "$dir/samples.tsv"
    t0=$(date +%s)
    SECOND_SENT=""
    $cmd > "$dir/run.log" 2>&1 &
    pid=$!; CHILD=$pid
    while kill -0 "$pid" 2>/dev/null; do
        sleep "$POLL_S"
        if [ -z "$stopped" ]; then
            if [ "$want" -gt 0 ] && [ "$name" != 1m ] && [ "$(records "$run")" -ge "$want" ]; then
                stopped="after $want steps"
            elif [ $(( $(date +%s) - t0 )) -ge "$limit" ]; then
                stopped="cut at its limit of ${limit} s"
            fi
            if [ -n "$stopped" ]; then
                # Stop first (a step or a save must not slip in meanwhile), then what finished comes
                # back at once, even if the stop outlasts the stage.
                kids=$(pgrep -P "$pid" | tr '\n' ' ')
                kill -TERM "$pid" 2>/dev/null; since=$(date +%s)
                collect "$run" "$dir"
                info "$dir" name "$name" command "$cmd" rc "stopping" wall_s "$(( $(date +%s) - t0 ))" limit_s "$limit" \
                    stopped "$stopped" date "$(date -u +%F)" gpu "$GPU"
            fi
        else
            escalate "$pid" "$since" "$kids"
        fi
    done
    wait "$pid"; rc=$?
    # The worker follows the CLI out (genolong.lifeline); one still there after 20 s is killed.
    local alive=""
    for _ in $(seq 10); do
        alive=""; for k in $kids; do kill -0 "$k" 2>/dev/null && alive="$alive $k"; done
        [ -z "$alive" ] && break; sleep 2
    done
    [ -n "$alive" ] && kill -KILL $alive 2>/dev/null
    kill "$SAMPLER" 2>/dev/null; wait "$SAMPLER" 2>/dev/null
    collect "$run" "$dir"
    local got; got=$(records "$run")
    info "$dir" name "$name" command "$cmd" rc "$rc" wall_s "$(( $(date +%s) - t0 ))" limit_s "$limit" \
        stopped "${stopped:-exited}" date "$(date -u +%F)" gpu "$GPU"
    mkdir -p "$R/done"
    # Finished: the steps it was for are recorded (a 1M run cut in its save leaves eval1m no checkpoint:
    # TILING_REDO=1 TILING_RUNS="1m eval1m" runs both again).
    if { [ "$name" = eval1m ] && [ "$rc" = 0 ]; } || { [ "$want" -gt 0 ] && [ "$got" -ge "$want" ]; }; then
        touch "$R/done/$name"
    fi
    [ "$name" != 1m ] && [ "$name" != eval1m ] && rm -rf "$run"  # the arms' runs are not needed again
    echo "$name: rc=$rc, $(( $(date +%s) - t0 )) s, ${got} step record(s), ${stopped:-exited}"
    tail -n 4 "$dir/run.log"
}

# Stopped from outside (call.sh's limit sends SIGINT, which the background sub-run ignores): stop the
# sub-run too, within the 20 s before call.sh's SIGKILL, so that nothing keeps the GPU after the stage.
CHILD=""; SAMPLER=""
on_signal() {
    if [ -n "$CHILD" ] && kill -0 "$CHILD" 2>/dev/null; then
        local kids; kids=$(pgrep -P "$CHILD" | tr '\n' ' ')
        kill -TERM "$CHILD" 2>/dev/null
        for _ in $(seq 15); do kill -0 "$CHILD" 2>/dev/null || break; sleep 1; done
        kill -KILL "$CHILD" $kids 2>/dev/null
    fi
    [ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null
    exit 130
}
trap on_signal INT TERM

mkdir -p "$D" "$R"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; free -g; df -h /tmp; } > "$D/machine.txt" 2>&1
queue=" $RUNS "
for name in $RUNS; do
    queue=" ${queue#* "$name" }"
    run_one "$name" "$queue"
    if [ "$name" = 1m ] && [ -z "${FT1M_ARGS:-}" ] && [ "$(records "$R/1m")" = 0 ] \
        && grep -q "pinned host memory short" "$D/1m/run.log" 2>/dev/null && ! grep -q "GPU memory short" "$D/1m/run.log"; then
        mv "$D/1m/run.log" "$D/1m/refused.log"
        FT1M_ARGS="--host-budget-gib 101"
        run_one 1m "$queue"
    fi
done
