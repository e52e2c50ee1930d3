#!/bin/bash
# Fortieth session: on the H200 at full depth the NVFP4 lm_head took nothing off the 30B's batch-1 step
# (device_run123: replay 1.906 vs 1.905 ms), where at 24 layers on an H100 it took 0.106 ms (device_run121).
# 1) The head's GEMM alone (151936 x 2048, W4A16 against cuBLAS BF16, 1 and 8 rows); 2) the 30B at 8 layers
# with the NVFP4 head under the profiler: the graph replay's chain names the head's kernel and its time.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
SECONDS=0
timeout 150 python3 -m fp4rl.benchmarks.gpu_kernels --sections gemm --rows 1,8 --shapes 151936x2048 \
    --out $OUT/head_gemm.json > $OUT/head_gemm.log 2>&1
echo "gemm exit $? at ${SECONDS}s"; grep -v "^{" $OUT/head_gemm.log | tail -25 | cut -c1-220
source bench/sampler_arm.sh
ARM_SHAPE=qwen3-30b-a3b:8 ARM_PREFIX=sampler124_30b8
arm head_chain $((${END:-330} - SECONDS)) 1 "--profile-batch=1 --lm-head bf16,w4a16" X=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/${ARM_PREFIX}_head_chain.json 2>&1 | grep -v "^|" | head -60 | cut -c1-200
# 3) fp4rl.kernels.step_inputs (the step's inputs in one launch) against its torch ops on the GPU
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_step_inputs.py 2>&1 | tail -3
