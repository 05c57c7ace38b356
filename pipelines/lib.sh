# Shared by the pipeline scripts (sourced, not run): the genolong command, stage headings, and
# the one rule that makes every training stage restartable.
#
#   GENOLONG   the genolong command (default: .venv/bin/genolong, installed by scripts/install.sh
#              when missing); e.g. GENOLONG="python -m genolong" for an environment of your own

if [ -n "${GENOLONG:-}" ]; then
    G=$GENOLONG
else
    [ -x .venv/bin/genolong ] || bash scripts/install.sh
    G=.venv/bin/genolong
fi

# stage TEXT: a heading with the time since the script started, so a log shows where time goes.
STARTED=$(date +%s)
stage() {
    echo "== [$(($(date +%s) - STARTED)) s] $*"
}

# Set to 1 when this invocation wrote a new model (a training stage ran, or a model copy was
# refreshed): an evaluation of the stages then starts over instead of continuing earlier results.
CHANGED=0

# finetune_or_resume RUN STEPS ARGS...: run `genolong finetune ... --steps STEPS --out RUN ARGS`,
# or, after an interruption, continue it: resume from its last complete checkpoint (the run keeps
# its own options, ARGS must agree with them; --steps may raise its length), start it again with --overwrite when it stopped
# before its first checkpoint, or skip it when it has finished. A run that starts from a model_of
# copy (`--model DIR`) remembers which (DIR/SOURCE, in RUN/START_MODEL): when that copy has since
# been refreshed (an earlier stage trained further), the run starts again from the new one. Needs DATA.
finetune_or_resume() {
    local run=$1 steps=$2
    shift 2
    local start="" prev="" arg fresh=0
    for arg in "$@"; do
        if [ "$prev" = "--model" ] && [ -f "$arg/SOURCE" ]; then start=$(cat "$arg/SOURCE"); fi
        prev=$arg
    done
    if [ -n "$start" ] && [ -f "$run/START_MODEL" ] && [ "$(cat "$run/START_MODEL")" != "$start" ]; then
        echo "$run: started from $(cat "$run/START_MODEL"), but its --model is now $start; training it again"
        $G finetune --data "$DATA" --steps "$steps" --out "$run" --overwrite "$@"
        CHANGED=1 fresh=1
    elif [ -f "$run/checkpoints/$(printf 'step_%08d' "$steps")/COMPLETE" ]; then
        echo "$run: finished ($steps steps), skipped"
    elif compgen -G "$run/checkpoints/step_*/COMPLETE" > /dev/null; then
        echo "$run: not at step $steps yet (interrupted, or asked for more steps); continuing from its last complete checkpoint"
        # The stage's flags too: those of this invocation (--no-progress, --launcher, ...) apply, the
        # run's own must equal what it was started with (finetune names one that differs).
        $G finetune --resume "$run" --steps "$steps" "$@"
        CHANGED=1
    elif [ -f "$run/options.json" ]; then
        echo "$run: interrupted before its first checkpoint; starting it again"
        $G finetune --data "$DATA" --steps "$steps" --out "$run" --overwrite "$@"
        CHANGED=1 fresh=1
    else
        $G finetune --data "$DATA" --steps "$steps" --out "$run" "$@"
        CHANGED=1 fresh=1
    fi
    # Only a run started in this call knows its start (one made by an older pipeline does not).
    if [ -n "$start" ] && [ "$fresh" = 1 ] && [ -d "$run" ]; then echo "$start" > "$run/START_MODEL"; fi
}

# model_of RUN STEPS DEST: the run's model at step STEPS as a model directory (what `finetune --model`
# and `eval-positional --baseline` take), copied whole or not at all. DEST/SOURCE says which run
# and step it is; a copy of another step (the run was trained further since) is replaced.
model_of() {
    local run=$1 steps=$2 dest=$3
    local model source
    model="$run/checkpoints/$(printf 'step_%08d' "$steps")/model"
    # The weights' checksum too: a run trained again from scratch to the same step is another model.
    source="$(cd "$run" && pwd) step $steps cksum $(cat "$model"/*.safetensors | cksum | cut -d' ' -f1)"
    if [ -f "$dest/config.json" ] && [ "$(cat "$dest/SOURCE" 2>/dev/null)" = "$source" ]; then
        return
    fi
    rm -rf "$dest.tmp"
    cp -r "$model" "$dest.tmp"
    echo "$source" > "$dest.tmp/SOURCE"
    if [ -e "$dest" ]; then
        echo "$dest: replaced by $run's model at step $steps (it held $(cat "$dest/SOURCE" 2>/dev/null || echo 'an earlier copy'))"
        rm -rf "$dest"
        CHANGED=1
    fi
    mv "$dest.tmp" "$dest"
}

# overwrite_if_changed: `--overwrite` for an evaluation when this invocation wrote a new model.
overwrite_if_changed() {
    if [ "$CHANGED" = 1 ]; then echo --overwrite; fi
}
