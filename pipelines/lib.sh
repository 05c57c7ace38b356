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

# finetune_or_resume RUN STEPS ARGS...: run `genolong finetune ... --steps STEPS --out RUN ARGS`,
# or, after an interruption, continue it: resume from its last complete checkpoint (the run keeps
# its own options; --steps may raise its length), start it again with --overwrite when it stopped
# before its first checkpoint, or skip it when it has finished. Needs DATA.
finetune_or_resume() {
    local run=$1 steps=$2
    shift 2
    if [ -f "$run/checkpoints/$(printf 'step_%08d' "$steps")/COMPLETE" ]; then
        echo "$run: finished ($steps steps), skipped"
    elif compgen -G "$run/checkpoints/step_*/COMPLETE" > /dev/null; then
        echo "$run: interrupted earlier; continuing from its last complete checkpoint"
        $G finetune --resume "$run" --steps "$steps"
    elif [ -f "$run/options.json" ]; then
        echo "$run: interrupted before its first checkpoint; starting it again"
        $G finetune --data "$DATA" --steps "$steps" --out "$run" --overwrite "$@"
    else
        $G finetune --data "$DATA" --steps "$steps" --out "$run" "$@"
    fi
}

# model_of RUN STEPS DEST: the run's final model as a model directory (what `finetune --model` and
# `eval-positional --baseline` take), copied whole or not at all.
model_of() {
    local run=$1 steps=$2 dest=$3
    if [ ! -f "$dest/config.json" ]; then
        rm -rf "$dest.tmp"
        cp -r "$run/checkpoints/$(printf 'step_%08d' "$steps")/model" "$dest.tmp"
        mv "$dest.tmp" "$dest"
    fi
}
