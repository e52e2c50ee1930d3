#!/bin/bash
# Forty-sixth session: 16x16 rule 4/6 decided per tile on the strip kernel (quant.cu strip_decide46: each
# lane's cheap errors over its 16 rows' halves and a Cauchy-Schwarz bound, the exact errors only for a warp
# with a tile the bound leaves; cuda.STRIP16_46, off until timed). 1) The tile / strip GPU tests
# (tests/test_quant_cuda.py -k tile16: strip 4/6 against the reference at every size, NaN / Inf, TE's tree
# order). 2) bench/quant_tile16.py, the 4/6 cases decided per tile on both kernels (mse, mae, imposed g) and
# 1x16 4/6, interleaved repeats (medians of 3).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
SECONDS=0
timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_quant_cuda.py \
    -k "tile16" 2>&1 | tail -15
echo "tests at ${SECONDS}s"
timeout 200 python3 bench/quant_tile16.py --repeats 3 --out $OUT/quant_tile16_strip46.json \
    --cases "4/6 mse, decide46 per tile|4/6 mae, decide46 per tile|1x16 4/6" 2>&1 | grep -v Warn
echo "quant_tile16 at ${SECONDS}s"
