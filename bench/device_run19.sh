#!/bin/bash
# Device call 19 (fifth session): grouped mma16 experts in 8-row chunks (any rows per expert, batches up to 64
# tokens): their GPU tests, then Qwen3-30B-A3B (12 of 48 layers) at batch 1, 8, 32.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout ${T_T:-100} python3 -m pytest -q -m gpu tests/test_gemv_cuda.py tests/test_gpu_decode.py -k "grouped or cuda_graphs_replay" -x \
  2>&1 | tee $OUT/gputests20.log | grep -v "^$" | tail -8
echo "tests exit ${PIPESTATUS[0]}"
timeout ${T_C:-170} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:12 --batch 1,8,32 --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch '' --fusion on --pdl on --out $OUT/sampler20_30b.json \
  > $OUT/sampler20_30b.log 2>&1
echo "exit $?"; grep '^|\|Traceback\|Error' $OUT/sampler20_30b.log | cut -c1-300 | tail -12
