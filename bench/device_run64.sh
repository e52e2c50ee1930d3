#!/bin/bash
# Eighteenth session. Mode a: the NVFP4 decode attention at a rollout's 4096-token context (batch 1 and 8, the
# 8B's 8 and the 30B's 4 KV heads): splits, warps, and the timing-only no-stream / one-partial-merge variants
# (what the fixed cost is); the wgmma GEMM at 32 rows on the 8B shapes (ring depth, batching, split); the 8B
# W4A16 step at batch 1 and 4K profiled with the NVFP4 and the BF16 cache (--profile-kv).
# Mode b: Qwen3-30B-A3B at 4K, batch 32 with --offload-trainer on (the seventeenth session's rows that ran out
# of memory in the harness).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "${1:-a}" in
a)
  for bh in 1:8 1:4 8:8 8:4; do
    BATCH=${bh%:*} HKV=${bh#*:} ROUNDS=3 timeout 100 python3 bench/attn_s8.py 4096 \
      splits2,splits4,splits8,splits16,splits24,splits32,warps2,warps8,no_stream,merge_one \
      > $OUT/attn64_b${bh%:*}_h${bh#*:}.log 2>&1
    echo "attn b${bh%:*} hkv ${bh#*:} exit $?"; grep '^|\|context\|rror' $OUT/attn64_b${bh%:*}_h${bh#*:}.log | cut -c1-160
  done
  timeout 150 python3 bench/mma16_sweep.py --rows 32 \
    --variants wide,wide+d3,wide+d4,wide+wb2,wide+wb4,wide+s2x,wide+sh \
    --shapes 6144x4096,4096x4096,24576x4096,4096x12288 --out $OUT/sweep64.json > $OUT/sweep64.log 2>&1
  echo "sweep exit $?"; grep -v '^\[' $OUT/sweep64.log | cut -c1-160 | tail -40
  timeout 200 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets nvfp4-w4a16 \
    --w4a16-last 0 --batch 1 --kv nvfp4,bf16 --prompt 4096 --repeats 1 --tokens 8,24 --profile-batch 1 \
    --profile-kv nvfp4,bf16 --out $OUT/sampler64_8b_prof.json > $OUT/sampler64_8b_prof.log 2>&1
  echo "8b exit $?"; grep -v '^{' $OUT/sampler64_8b_prof.log | cut -c1-200 | tail -45
  ;;
b)
  timeout 500 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0 --batch 32 --kv bf16,nvfp4 --prompt 4096 --repeats 1 --tokens 8,24 --profile-batch '' \
    --offload-trainer on --out $OUT/sampler64_30b_4k.json > $OUT/sampler64_30b_4k.log 2>&1
  echo "30b exit $?"; grep '^|\|rror' $OUT/sampler64_30b_4k.log | cut -c1-300 | tail -14
  ;;
c)  # after the v heads got programs of their own in qk_norm_rope: its GPU tests; the attention's splits at
    # rollout-sized contexts (bench/attn_splits.py); ncu's stall samples of the 32-row wgmma GEMM; the 8B b1 4K
    # NVFP4-cache step profiled again
  timeout 150 python3 -m pytest -q -m "gpu or not slow" tests/test_fused_kernels.py tests/test_gpu_decode.py \
    -k "nvfp4_cache" > $OUT/tests64c.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests64c.log | tail -8
  timeout 200 python3 bench/attn_splits.py > $OUT/attn_splits.log 2>&1
  echo "splits exit $?"; grep -v '^\[' $OUT/attn_splits.log | cut -c1-220
  timeout 120 ncu --clock-control none --set full --import-source no --page source --print-source sass \
    -k regex:w4a16_mma16 -c 1 python3 bench/mma16_sweep.py --shapes 24576x4096 --rows 32 --variants wide \
    > $OUT/ncu_sass_wide32.txt 2>&1
  echo "sass exit $?"; wc -l $OUT/ncu_sass_wide32.txt
  timeout 120 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section MemoryWorkloadAnalysis -k regex:w4a16_mma16 -c 1 python3 bench/mma16_sweep.py \
    --shapes 24576x4096 --rows 32 --variants wide > $OUT/ncu_wide32.txt 2>&1
  echo "ncu exit $?"; grep -E 'Duration|Stall|Warp Cycles|Issued Warp|Achieved Occ|Memory Throughput|DRAM Th|Registers|Block Size|Grid Size|Eligible|Active Warps' \
    $OUT/ncu_wide32.txt | head -30
  timeout 150 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets nvfp4-w4a16 \
    --w4a16-last 0 --batch 1 --kv nvfp4 --prompt 4096 --repeats 1 --tokens 8,24 --profile-batch 1 \
    --profile-kv nvfp4 --out $OUT/sampler64c_8b_prof.json > $OUT/sampler64c_8b_prof.log 2>&1
  echo "8b exit $?"; grep -v '^{' $OUT/sampler64c_8b_prof.log | cut -c1-200 | tail -16
  ;;
d)  # XPRE (x's addresses computed once in the wgmma GEMM) and the new attention split rule: GPU tests; the
    # 17-64-row GEMMs with and without XPRE; Qwen3-8B at 4K (NVFP4 cache) and at batch 32 short context
  timeout 150 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py tests/test_triton_attention.py \
    -k "wide or gluon or split" > $OUT/tests64d.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests64d.log | tail -8
  timeout 120 python3 bench/mma16_sweep.py --rows 20,32,48,64 --variants wide,wide+xp0 \
    --shapes 6144x4096,4096x4096,24576x4096,4096x12288,14336x4096 --out $OUT/sweep64d.json > $OUT/sweep64d.log 2>&1
  echo "sweep exit $?"; grep -v '^\[' $OUT/sweep64d.log | cut -c1-120 | tail -42
  timeout 170 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0 --batch 1,8,32 --kv bf16,nvfp4 --prompt 4096 --repeats 2 --tokens 8,40 --profile-batch '' \
    --out $OUT/sampler64d_8b_4k.json > $OUT/sampler64d_8b_4k.log 2>&1
  echo "8b 4k exit $?"; grep '^|\|rror' $OUT/sampler64d_8b_4k.log | cut -c1-250 | tail -10
  timeout 100 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0 --batch 32 --kv bf16 --repeats 3 --tokens 8,72 --profile-batch '' \
    --out $OUT/sampler64d_8b_b32.json > $OUT/sampler64d_8b_b32.log 2>&1
  echo "8b b32 exit $?"; grep '^|\|rror' $OUT/sampler64d_8b_b32.log | cut -c1-250 | tail -6
  ;;
e)  # DESC0 (x's B descriptors from one precomputed word): GPU bit tests; the 32/64-row GEMMs with and
    # without it; Qwen3-8B at batch 32 (4K with both caches; short context)
  timeout 100 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -k "wide" > $OUT/tests64e.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests64e.log | tail -8
  timeout 90 python3 bench/mma16_sweep.py --rows 32,64 --variants wide,wide+dz0,wide+xp0+dz0 \
    --shapes 6144x4096,4096x4096,24576x4096,4096x12288,14336x4096 --out $OUT/sweep64e.json > $OUT/sweep64e.log 2>&1
  echo "sweep exit $?"; grep -v '^\[' $OUT/sweep64e.log | cut -c1-100 | tail -30
  timeout 150 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0 --batch 32 --kv bf16,nvfp4 --prompt 4096 --repeats 2 --tokens 8,40 --profile-batch '' \
    --out $OUT/sampler64e_8b_4k.json > $OUT/sampler64e_8b_4k.log 2>&1
  echo "8b 4k exit $?"; grep '^|' $OUT/sampler64e_8b_4k.log | cut -c1-200 | tail -6
  timeout 100 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0 --batch 32 --kv bf16 --repeats 3 --tokens 8,72 --profile-batch '' \
    --out $OUT/sampler64e_8b_b32.json > $OUT/sampler64e_8b_b32.log 2>&1
  echo "8b b32 exit $?"; grep '^|' $OUT/sampler64e_8b_b32.log | cut -c1-200 | tail -4
  ;;
f)  # the session's last call: the final wgmma kernel's bit test (XPRE with running pointers against the
    # per-step form); Qwen3-30B-A3B at 4K, batch 32, --offload-trainer on (out of memory in the seventeenth)
  timeout 70 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -k "precomputed" > $OUT/tests64f.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests64f.log | tail -6
  timeout 250 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0 --batch 32 --kv bf16,nvfp4 --prompt 4096 --repeats 1 --tokens 8,24 --profile-batch '' \
    --offload-trainer on --out $OUT/sampler64f_30b_4k.json > $OUT/sampler64f_30b_4k.log 2>&1
  echo "30b exit $?"; grep '^|\|rror' $OUT/sampler64f_30b_4k.log | cut -c1-250 | tail -8
  ;;
esac
