#!/bin/bash
# Fifteenth session. `epi`: the fourteenth session's stream_modes answered that no way of moving the bytes beats
# per-lane cp.async (a read-only stream of a Qwen3-30B-A3B layer's GEMM geometry moves q|k|v's 6.6 MB in 3.5 us,
# a torch copy of as many bytes takes 3.0), yet the GEMM's own stream-only build (t3) took 5.0 us: what costs the
# other 1.5 us? The split-K epilogue (the GEMM's cluster reduction, or a global workspace and counter) on the
# same read-only stream, and the GEMM's t3 / full builds for the same shapes in the same call.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ "$1" = epi ]; then
  timeout 120 python3 bench/stream_modes.py --epi --out $OUT/stream_epi.json > $OUT/stream_epi.log 2>&1
  echo "epi exit $?"; cat $OUT/stream_epi.log | tail -8
  timeout 150 python3 bench/mma16_sweep.py --shapes 5120x2048,2048x4096 --rows 1 \
    --variants auto,t3,t1,s1,s1+t3,pdl,pdl+t3 \
    --out $OUT/mma16_30b_s15.json > $OUT/mma16_30b_s15.log 2>&1
  echo "dense exit $?"; grep -v '^{' $OUT/mma16_30b_s15.log | cut -c1-200 | tail -20
  timeout 150 python3 bench/grouped_sweep.py --tokens 1 --variants auto,t3,s1,pdl,pdl+t3 \
    --out $OUT/grouped_30b_s15.json > $OUT/grouped_30b_s15.log 2>&1
  echo "grouped exit $?"; grep -v '^{' $OUT/grouped_30b_s15.log | cut -c1-200 | tail -20
  exit 0
fi
if [ "$1" = kw ]; then  # K split between the warps of a CTA (KW) instead of a cluster: tests, then the GEMMs
  timeout 300 python3 -m pytest -q -m gpu -x tests/test_gemv_cuda.py tests/test_gemv_cuda_grouped.py \
    tests/test_fused_moe_fold.py > $OUT/tests_kw.log 2>&1
  echo "tests exit $?"; tail -5 $OUT/tests_kw.log
  timeout 150 python3 bench/mma16_sweep.py --shapes 5120x2048,2048x4096,6144x4096,4096x4096,24576x4096,4096x12288 \
    --rows 1,8 --variants auto,cl,pdl,pdl+cl,kw,pdl+kw --out $OUT/mma16_kw_s15.json > $OUT/mma16_kw_s15.log 2>&1
  echo "dense exit $?"; grep -v '^{' $OUT/mma16_kw_s15.log | cut -c1-200 | tail -60
  timeout 120 python3 bench/grouped_sweep.py --tokens 1,8 --variants auto,cl,pdl,pdl+cl \
    --out $OUT/grouped_kw_s15.json > $OUT/grouped_kw_s15.log 2>&1
  echo "grouped exit $?"; grep -v '^{' $OUT/grouped_kw_s15.log | cut -c1-200 | tail -20
  exit 0
fi
if [ "$1" = e2e ]; then  # the decode step with K split in the CTA and in the cluster, both shapes, BF16 alongside
  timeout 330 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0 --batch 1,8 --kv bf16 --repeats 3 --tokens 8,72 --profile-batch '' --k-split cta,cluster \
    --out $OUT/sampler56_30b_kw.json > $OUT/sampler56_30b_kw.log 2>&1
  echo "30b exit $?"; grep '^|\|rror' $OUT/sampler56_30b_kw.log | cut -c1-300 | tail -14
  timeout 200 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 --batch 1 \
    --kv bf16 --repeats 3 --tokens 8,72 --profile-batch '' --k-split cta,cluster \
    --out $OUT/sampler56_8b_kw.json > $OUT/sampler56_8b_kw.log 2>&1
  echo "8b exit $?"; grep '^|\|rror' $OUT/sampler56_8b_kw.log | cut -c1-300 | tail -10
  exit 0
fi
echo "usage: bash bench/device_run56.sh epi|kw|e2e"; exit 2
