#!/bin/bash
# Twenty-fourth session. Mode a: the GPU tests after the twenty-third session's module splits (tuner, dense and
# decode copies, grouped experts) and of TRACE on the kernel engine (tests/test_gpu_trace.py: graph replays
# record the eager steps' guidance); then what a guided generate costs the engine (bench/trace_gpu.py: engine
# unguided / guided / the eager sampler guided, Qwen3-8B and Qwen3-30B-A3B shapes at 8 layers).
# Mode b: device_run70.sh a's GEMM / experts tables, then its mode b (64-row chunks against Triton).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "${1:-a}" in
a)
  timeout 270 python3 -m pytest -q -m "gpu or not slow" tests/test_gpu_trace.py tests/test_triton_gemm.py \
    tests/test_tune_cache.py tests/test_gemv_cuda.py tests/test_gemv_cuda_grouped.py tests/test_gpu_decode.py \
    -k "trace or record or tuner or dense_copy or decode_copy or keeps_its_picks or grouped or wide" \
    > $OUT/tests71a.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests71a.log | tail -12
  timeout 270 python3 bench/trace_gpu.py --shapes qwen3-8b:8,qwen3-30b-a3b:8 --batch 1,8,32 --tokens 40 \
    --repeats 3 --eager-tokens 12 --out $OUT/trace71a.json > $OUT/trace71a.log 2>&1
  echo "trace exit $?"; cut -c1-300 $OUT/trace71a.log | tail -20
  ;;
t)  # the trace bench alone (call a's first run had no sys.path entry for fp4rl)
  timeout 400 python3 bench/trace_gpu.py --shapes qwen3-8b:8,qwen3-30b-a3b:8 --batch 1,8,32 --tokens 40 \
    --repeats 3 --eager-tokens 12 --out $OUT/trace71t.json > $OUT/trace71t.log 2>&1
  echo "trace exit $?"; cut -c1-300 $OUT/trace71t.log | tail -24
  ;;
c)  # after packing each step's guidance into one host copy and the record kernel split over columns
  timeout 150 python3 -m pytest -q -m "gpu or not slow" tests/test_gpu_trace.py > $OUT/tests71c.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests71c.log | tail -6
  timeout 400 python3 bench/trace_gpu.py --shapes qwen3-8b:8,qwen3-30b-a3b:8 --batch 1,8,32 --tokens 40 \
    --repeats 3 --eager-tokens 0 --out $OUT/trace71c.json > $OUT/trace71c.log 2>&1
  echo "trace exit $?"; cut -c1-250 $OUT/trace71c.log | tail -24
  ;;
b)
  export FP4RL_TUNE_CACHE=/tmp/fp4rl_tune71b
  timeout 250 python3 -m fp4rl.benchmarks.gpu_kernels --sections moe --rows 1,16,64,128,256,512 \
    --out $OUT/kernels71b.json > $OUT/kernels71b.log 2>&1
  echo "kernels exit $?"; grep -v '^\[' $OUT/kernels71b.log | cut -c1-220 | tail -20
  timeout 300 python3 bench/grouped_sweep.py --tokens 512,1024 --variants auto,mg4,mg8+s2x,triton \
    --out $OUT/grouped71b.json > $OUT/grouped71b.log 2>&1
  echo "sweep exit $?"; grep -v '^\[' $OUT/grouped71b.log | cut -c1-170 | tail -30
  ;;
esac
# (mode s, for the next session, no device time was left in this one: the record kernels on a side stream of the
# graph against the default, Qwen3-8B shape, batch 1 and 8, after the GPU tests of TRACE on the engine (the
# twenty-fourth session's review fixes ran on CPU only) with it)
if [ "$1" = s ]; then
  timeout 200 python3 -m pytest -q -m "gpu or not slow" tests/test_gpu_trace.py > $OUT/tests71s.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests71s.log | tail -6
  timeout 150 python3 bench/trace_gpu.py --shapes qwen3-8b:8 --batch 1,8 --tokens 40 --repeats 3 \
    --eager-tokens 0 --side-stream 0,1 --out $OUT/trace71s.json > $OUT/trace71s.log 2>&1
  echo "side exit $?"; python3 -c "
import json; d = json.load(open('$OUT/trace71s.json'))
print([(r['batch'], r['guidance'], r['side_stream'], round(r.get('step_ms', 0), 3), r.get('error')) for r in d['rows']])"
fi
