#!/bin/bash
# Fourteenth session. `sweep`: the four GEMMs of a Qwen3-30B-A3B layer at 1 and 8 tokens (q|k|v 5120x2048 and o
# 2048x4096 dense; the routed experts' gate|up 1536x2048 with the gather and down 2048x768 with SiLU, grouped over
# a 128-expert stack) across ring depth, split and PDL, to see whether the batch-1 step's ~7 us per GEMM call is
# the configuration (chosen on Qwen3-8B shapes) or the kernel; then where Qwen3-8B's W4A16 step goes at batch 8
# and 32 (its step doubles from batch 1 to 32 while BF16's barely grows).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ "$1" = sweep ]; then
  timeout 170 python3 bench/mma16_sweep.py --shapes 5120x2048,2048x4096 --rows 1,8 \
    --variants auto,d3,d4,d6,s2x,sh,t3,pdl,pdl+d3,pdl+d4,pdl+d6,pdl+tr1,pdl+s2x \
    --out $OUT/mma16_30b_s14.json > $OUT/mma16_30b_s14.log 2>&1
  echo "dense exit $?"; grep -v '^{' $OUT/mma16_30b_s14.log | cut -c1-200 | tail -40
  timeout 170 python3 bench/grouped_sweep.py --tokens 1,8 \
    --variants auto,d3,d4,d6,s2x,sh,t3,pdl,pdl+d3,pdl+d4,pdl+s2x,pdl+tr1 \
    --out $OUT/grouped_30b_s14.json > $OUT/grouped_30b_s14.log 2>&1
  echo "grouped exit $?"; grep -v '^{' $OUT/grouped_30b_s14.log | cut -c1-200 | tail -40
  timeout 200 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 \
    --batch 8,32 --kv bf16 --repeats 1 --tokens 8,24 --profile-batch 8,32 \
    --out $OUT/sampler53_8b_prof.json > $OUT/sampler53_8b_prof.log 2>&1
  echo "8b exit $?"; grep -v '^{' $OUT/sampler53_8b_prof.log | cut -c1-200 | tail -60
  exit 0
fi
if [ "$1" = sweep2 ]; then  # the rows the first call's variant-name bug cut, a small-stream reference, 8B PDL A/B
  timeout 60 python3 bench/small_stream.py --out $OUT/small_stream_s14.json > $OUT/small_stream_s14.log 2>&1
  echo "stream exit $?"; cat $OUT/small_stream_s14.log | tail -8
  timeout 150 python3 bench/mma16_sweep.py --shapes 2048x4096,5120x2048 --rows 1,8 \
    --variants auto,d3,d4,s2x,sh,t3,pdl,pdl+d3,pdl+tr1 \
    --out $OUT/mma16_30b_s14b.json > $OUT/mma16_30b_s14b.log 2>&1
  echo "dense exit $?"; grep -v '^{' $OUT/mma16_30b_s14b.log | cut -c1-200 | grep -v '^5120x2048 m  1' | tail -40
  timeout 150 python3 bench/grouped_sweep.py --tokens 1,8 --variants auto,d3,d4,s2x,sh,t3,pdl,pdl+d3,pdl+tr1,pdl+s4 \
    --out $OUT/grouped_30b_s14b.json > $OUT/grouped_30b_s14b.log 2>&1
  echo "grouped exit $?"; grep -v '^{' $OUT/grouped_30b_s14b.log | cut -c1-200 | tail -40
  timeout 170 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets nvfp4-w4a16 \
    --batch 8,32 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' --pdl on,off \
    --out $OUT/sampler53_8b_pdl.json > $OUT/sampler53_8b_pdl.log 2>&1
  echo "8b pdl exit $?"; grep '^|\|rror' $OUT/sampler53_8b_pdl.log | cut -c1-300 | tail -8
  exit 0
fi
if [ "$1" = pdl ]; then  # which PDL edges cost Qwen3-8B's batch-32 step 0.7 ms (sweep2: 4.59 ms off, 5.26 on)
  timeout 40 python3 bench/small_stream.py --out $OUT/small_stream_s14.json > $OUT/small_stream_s14.log 2>&1
  echo "stream exit $?"; cat $OUT/small_stream_s14.log | tail -6
  timeout 150 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets nvfp4-w4a16 \
    --batch 8,32 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' --pdl on,off,no-wide,no-triton,no-mma \
    --out $OUT/sampler53_8b_pdlk.json > $OUT/sampler53_8b_pdlk.log 2>&1
  echo "8b exit $?"; grep '^|\|rror' $OUT/sampler53_8b_pdlk.log | cut -c1-300 | tail -12
  timeout 280 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets nvfp4-w4a16 \
    --batch 1,8,32 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' --pdl on,off,no-triton \
    --out $OUT/sampler53_30b_pdlk.json > $OUT/sampler53_30b_pdlk.log 2>&1
  echo "30b exit $?"; grep '^|\|rror' $OUT/sampler53_30b_pdlk.log | cut -c1-300 | tail -12
  exit 0
fi
if [ "$1" = final ]; then  # the new default (PDL off for the dense CUDA GEMM) against every kind on, and BF16
  timeout 180 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 --batch 1,8,32 \
    --kv bf16 --repeats 3 --tokens 8,72 --profile-batch '' --pdl on,all \
    --out $OUT/sampler53_8b_final.json > $OUT/sampler53_8b_final.log 2>&1
  echo "8b exit $?"; grep '^|\|rror' $OUT/sampler53_8b_final.log | cut -c1-300 | tail -14
  timeout 330 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0 --batch 1,8,32 --kv bf16 --repeats 3 --tokens 8,72 --profile-batch '' --pdl on,all \
    --out $OUT/sampler53_30b_final.json > $OUT/sampler53_30b_final.log 2>&1
  echo "30b exit $?"; grep '^|\|rror' $OUT/sampler53_30b_final.log | cut -c1-300 | tail -14
  exit 0
fi
if [ "$1" = final2 ]; then  # the default after `final`: PDL also on the 1-row dense launches ("gemv"); GPU tests
  timeout 260 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0,0.15 --batch 1,8,32 --kv bf16 --repeats 3 --tokens 8,72 --profile-batch '' \
    --out $OUT/sampler53_30b_final2.json > $OUT/sampler53_30b_final2.log 2>&1
  echo "30b exit $?"; grep '^|\|rror' $OUT/sampler53_30b_final2.log | cut -c1-300 | tail -14
  timeout 110 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 --batch 1,8,32 \
    --kv bf16 --repeats 3 --tokens 8,72 --profile-batch '' \
    --out $OUT/sampler53_8b_final2.json > $OUT/sampler53_8b_final2.log 2>&1
  echo "8b exit $?"; grep '^|\|rror' $OUT/sampler53_8b_final2.log | cut -c1-300 | tail -14
  timeout 100 python3 -m pytest -q -m gpu tests/test_gpu_decode.py tests/test_pdl.py -rf -x 2>&1 | tail -8
  exit 0
fi
echo "usage: bash bench/device_run53.sh sweep|sweep2|pdl|final|final2"; exit 2
