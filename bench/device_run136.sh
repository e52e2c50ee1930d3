#!/bin/bash
# Forty-fifth session: 1) bench/quant_tile16.py: 16x16 rule 6 on the new strip kernel (quant.cu
# nvfp4_quant_strip16: a warp 16 rows x 512 contiguous bytes, a lane's 16 rows held) against the tile kernel
# and Triton; 16x16 4/6 decided per tile (cuda.TILE16_FAST46, off by default) against the exact tile kernel
# (0.398 ms on an H100 in the forty-fourth session); 1x16 re-timed. Bytes compared with Triton's in every
# row. 2) The tile / strip GPU tests (tests/test_quant_cuda.py -k tile16: both settings, every rule and scale
# source against the reference, NaN / Inf). 3) The strip kernel for 4/6 (cuda.STRIP16_46, since removed) and reading its rows
# again (cuda.STRIP16_RELOAD) in the same bench and tests.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
SECONDS=0
timeout 150 python3 bench/quant_tile16.py --out $OUT/quant_tile16_strip.json 2>&1 | grep -v Warn
echo "quant_tile16 at ${SECONDS}s"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_quant_cuda.py \
    tests/test_triton_quantize.py -k "tile16 or tree_order or by_program_shape" 2>&1 | tail -15
echo "tests at ${SECONDS}s"
