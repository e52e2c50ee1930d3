#!/bin/bash
# Forty-fifth session, last call: the defaults as they now stand (16x16 rule 6 on the strip kernel; 16x16 4/6
# decided per tile on the tile kernel at 2 pairs a warp, staged through shared memory). 1) bench/quant_tile16.py
# with its interleaved repeats (medians of 3). 2) The tile / strip GPU tests (tests/test_quant_cuda.py -k
# tile16: the decide46 half at the defaults).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
SECONDS=0
timeout 170 python3 bench/quant_tile16.py --repeats 3 --out $OUT/quant_tile16_defaults.json 2>&1 | grep -v Warn
echo "quant_tile16 at ${SECONDS}s"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_quant_cuda.py \
    -k "tile16" 2>&1 | tail -15
echo "tests at ${SECONDS}s"
