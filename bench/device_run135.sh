#!/bin/bash
# Forty-fourth session (for the next one): the 16x16 4/6 quantize decided per tile (quant.cu tile46_decide:
# lean46's cheap errors and bounds summed over the tile; cuda.TILE16_FAST46, off by default until this runs).
# 1) bench/quant_tile16.py: the tile kernel with and without it against Triton, bytes compared. 2) Its GPU
# tests (tests/test_quant_cuda.py -k tile16: both settings, every rule and scale source against the reference).
# If it is faster with the same bytes, TILE16_FAST46 becomes the default.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
SECONDS=0
timeout 100 python3 bench/quant_tile16.py --out $OUT/quant_tile16_decide46.json 2>&1 | grep -v Warn
echo "quant_tile16 at ${SECONDS}s"
timeout 170 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_quant_cuda.py \
    tests/test_triton_quantize.py -k "tile16 or tree_order or by_program_shape" 2>&1 | tail -15
echo "tests at ${SECONDS}s"
