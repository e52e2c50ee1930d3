#!/bin/bash
# Device call 14 (fifth session): programmatic dependent launch. Triton's PDL support on the machine, the
# mma16 GEMM with and without PDL (timed chain of GEMMs), the GPU tests of the GEMM and the decode engine
# (several never run on a GPU before), then Qwen3-8B at batch 1 and 8 with PDL on / off.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; from fp4rl.kernels import pdl; print(torch.__version__, triton.__version__, 'triton pdl', pdl.triton_supported())"
timeout ${T_SWEEP:-100} python3 bench/mma16_sweep.py --rows ${ROWS:-1,8,16} --variants auto,pdl \
    --shapes ${SHAPES:-4096x14336,14336x4096,4096x4096} --out $OUT/mma16_sweep14.json 2>&1 | tee $OUT/mma16_sweep14.log
timeout ${T_T:-240} python3 -m pytest -q -m gpu ${TESTS:-tests/test_gemv_cuda.py tests/test_gpu_decode.py} \
  2>&1 | tee $OUT/gputests14.log | grep -v "^$" | tail -25
echo "tests exit ${PIPESTATUS[0]}"
timeout ${T_B:-170} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --batch ${BATCH:-1,8} --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch '' --fusion on --pdl on,off --out $OUT/sampler14_8b.json \
  > $OUT/sampler14_8b.log 2>&1
echo "exit $?"; grep '^|\|^profile\|Traceback\|Error' $OUT/sampler14_8b.log | cut -c1-400 | tail -30
