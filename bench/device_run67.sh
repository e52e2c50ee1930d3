#!/bin/bash
# Twenty-first session. Mode a: the tuner's disk cache and the twentieth session's review changes on the GPU
# (tuner tests, the wide / ASH bit tests after the swz_desc refactor); the skip the disk cache buys a restarted
# sampler (Qwen3-8B shapes, 4 layers, --tune: a cold run that fills the cache, a run that reads it, a run with
# the cache off but the compile cache warm).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "${1:-a}" in
a)
  timeout 200 python3 -m pytest -q -m gpu tests/test_triton_gemm.py tests/test_gemv_cuda.py \
    -k "tuner or wide or a_in_shared or decode_copy" > $OUT/tests67a.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests67a.log | tail -12
  for run in cold cached off; do
    if [ $run = off ]; then export FP4RL_TUNE_CACHE=0; else export FP4RL_TUNE_CACHE=/tmp/fp4rl_tune; fi
    timeout 150 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:4 --presets nvfp4-w4a16 --tune \
      --w4a16-last 0 --batch 64,128 --kv bf16 --repeats 1 --tokens 8,24 --profile-batch '' \
      --out $OUT/sampler67a_$run.json > $OUT/sampler67a_$run.log 2>&1
    echo "$run exit $?"; ls -la /tmp/fp4rl_tune 2>/dev/null | tail -2
    python3 -c "
import json,sys; d=json.load(open('$OUT/sampler67a_$run.json'))
print('$run', [(r['batch'], round(r['warm_s'],2), round(r['step_ms'],3)) for r in d['rows']], d['errors'][:2])"
  done
  cp -r /tmp/fp4rl_tune $OUT/ 2>/dev/null
  ;;
esac
