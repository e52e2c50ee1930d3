#!/bin/bash
# Forty-second session, first of two calls on one machine (the second: END=560 PREFIX=sampler132_30b bash
# bench/device_run128.sh --no-tests, the 30B at batch 1 with the record after the graph and the two-kernel
# sampling head, BF16 / defaults / NVFP4 lm_head, each a fresh process). 1) The 16x16 quantize's new kernel
# on CUDA: its tests (bytes against the reference, large shapes too), then bench/quant_tile16.py (against the
# tiles kernel it replaces). 2) bench/graph_tail.py: does a small Triton node after a cuBLAS GEMM at the end
# of a graph cost tens of microseconds of replay (f541a46's routing record inside the 30B's graph cost 36 us)?
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
SECONDS=0
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_triton_quantize.py \
    -k "16x16 or gpu_large or matches or nonfinite or imposed" 2>&1 | tail -3
echo "tests at ${SECONDS}s"
timeout 90 python3 bench/quant_tile16.py --out $OUT/quant_tile16.json 2>&1 | grep -v Warn
echo "quant_tile16 at ${SECONDS}s"
timeout 80 python3 bench/graph_tail.py --out $OUT/graph_tail.json 2>&1 | grep -v Warn
echo "graph_tail at ${SECONDS}s"
