#!/bin/bash
# Nineteenth session. Mode a: the wgmma GEMM at 32 rows with NT 2 now that XPRE is in (the eighteenth session's
# item 1); the wgmma GEMM at 64-512 rows (where W4A16 is slower than cuBLAS BF16: the issue's "never slower to
# 512 rows") over NT, depth and split; ncu of the 128-row build (what bounds it).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "${1:-a}" in
a)
  timeout 120 python3 bench/mma16_sweep.py --rows 32 --variants wide,wide+nt2,wide+nt2+s2x,wide+nt2+sh \
    --shapes 6144x4096,4096x4096,24576x4096,4096x12288,14336x4096 --out $OUT/sweep65a32.json > $OUT/sweep65a32.log 2>&1
  echo "sweep32 exit $?"; grep -v '^\[' $OUT/sweep65a32.log | cut -c1-120 | tail -30
  timeout 200 python3 bench/mma16_sweep.py --rows 64,128,256,512 \
    --variants wide,wide+nt1,wide+nt2,wide+d3,wide+d4,wide+s2x,wide+sh \
    --shapes 14336x4096,4096x14336,4096x4096 --out $OUT/sweep65a.json > $OUT/sweep65a.log 2>&1
  echo "sweep exit $?"; grep -v '^\[' $OUT/sweep65a.log | cut -c1-120 | tail -80
  timeout 120 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis -k regex:w4a16_mma16 -c 1 \
    python3 bench/mma16_sweep.py --shapes 14336x4096 --rows 128 --variants wide > $OUT/ncu65_wide128.txt 2>&1
  echo "ncu exit $?"; grep -E 'Duration|Stall|Warp Cycles|Issued Warp|Achieved Occ|Throughput|Registers|Block Size|Grid Size|Eligible|Active Warps|Pipe|L2|L1|Busy|Shared' \
    $OUT/ncu65_wide128.txt | head -60
  ;;
b)  # the 128-row wgmma GEMM: timing-only variants (t1: no x staging), XPRE at MG 16, batches of multiplies;
    # ncu stall samples per SASS instruction
  timeout 120 python3 bench/mma16_sweep.py --rows 128 --variants wide,wide+t1,wide+xp1,wide+wb2,wide+wb4,wide+sh+t1 \
    --shapes 14336x4096,4096x14336 --out $OUT/sweep65b.json > $OUT/sweep65b.log 2>&1
  echo "sweep exit $?"; grep -v '^\[' $OUT/sweep65b.log | cut -c1-120 | tail -20
  timeout 150 ncu --clock-control none --set full --import-source no --page source --print-source sass \
    -k regex:w4a16_mma16 -c 1 python3 bench/mma16_sweep.py --shapes 14336x4096 --rows 128 --variants wide \
    > $OUT/ncu65_sass128.txt 2>&1
  echo "sass exit $?"; wc -l $OUT/ncu65_sass128.txt
  ;;
c)  # XPRE 2 (one running x pointer per thread) and XMID (the next x step issued after the first multiplies, no
    # drain at the step's start): GPU bit tests; the 32-512-row GEMMs with and without them
  timeout 150 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -k "wide" > $OUT/tests65c.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests65c.log | tail -8
  timeout 240 python3 bench/mma16_sweep.py --rows 32,64,128,256,512 \
    --variants wide,wide+xp2,wide+xm1,wide+xp2+xm1,wide+xp2+xm1+nt1,wide+xp2+xm1+sh \
    --shapes 14336x4096,4096x14336,6144x4096,24576x4096,4096x12288,4096x4096 --out $OUT/sweep65c.json > $OUT/sweep65c.log 2>&1
  echo "sweep exit $?"; grep -v '^\[' $OUT/sweep65c.log | cut -c1-100 | tail -150
  ;;
d)  # XPRE 2 the default above 32 rows, NT by fill, the wgmma configuration the tuner's first candidate at 33-512
    # rows: GPU tests; the standard GEMM table (tuned Triton vs the dispatch, cuBLAS BF16) at 32-512 rows; Qwen3-8B
    # at batch 32-128 (short context)
  timeout 170 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -k "wide or choose" > $OUT/tests65d.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests65d.log | tail -8
  timeout 240 python3 -m fp4rl.benchmarks.gpu_kernels --sections gemm --rows 32,64,128,256,512 \
    --shapes 4096x14336,14336x4096,4096x6144,6144x4096,4096x4096,24576x4096,4096x12288 \
    --out $OUT/gemm65d.json > $OUT/gemm65d.log 2>&1
  echo "gemm exit $?"; grep '^|' $OUT/gemm65d.log | cut -c1-200 | tail -45
  timeout 160 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0 --batch 32,64,128 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' \
    --out $OUT/sampler65d_8b.json > $OUT/sampler65d_8b.log 2>&1
  echo "8b exit $?"; grep '^|\|rror' $OUT/sampler65d_8b.log | cut -c1-250 | tail -8
  ;;
e)  # the sampler's linears now pass their mma16 copy up to 512 rows (the wgmma configuration first): GPU tests;
    # Qwen3-8B at batch 32-128 (short context), batch 128 profiled
  timeout 120 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -k "decode_copy or wide_matches" > $OUT/tests65e.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests65e.log | tail -8
  timeout 200 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0 --batch 32,64,128 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch 128 \
    --out $OUT/sampler65e_8b.json > $OUT/sampler65e_8b.log 2>&1
  echo "8b exit $?"; grep -v '^{' $OUT/sampler65e_8b.log | cut -c1-200 | tail -40
  ;;
f)  # the session's last call: the GPU tests of the GEMM dispatch, the decode step and the Triton GEMMs with the final
    # code; Qwen3-30B-A3B's W4A16 rows at 4K, batch 32 (the eighteenth session's call stopped before them)
  timeout 300 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py tests/test_gpu_decode.py tests/test_triton_gemm.py \
    > $OUT/tests65f.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests65f.log | tail -8
  timeout 230 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets nvfp4-w4a16 \
    --w4a16-last 0 --batch 32 --kv bf16,nvfp4 --prompt 4096 --repeats 1 --tokens 8,24 --profile-batch '' \
    --offload-trainer on --out $OUT/sampler65f_30b_4k.json > $OUT/sampler65f_30b_4k.log 2>&1
  echo "30b exit $?"; grep '^|\|rror' $OUT/sampler65f_30b_4k.log | cut -c1-250 | tail -8
  ;;
esac
