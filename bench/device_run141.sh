#!/bin/bash
# Forty-sixth session: 1) bench/quant_strip46_diag.py (the strip kernel's 4/6: the share of warps that take the
# exact errors and the time without that path, mse and mae, imposed g). 2) Every GPU test of the CUDA quantizer
# at the new defaults (tests/test_quant_cuda.py: 16x16 4/6 on the strip kernel for bfloat16).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
SECONDS=0
timeout 120 python3 bench/quant_strip46_diag.py --repeats 3 --out $OUT/quant_strip46_diag.json 2>&1 | grep -v Warn
echo "diag at ${SECONDS}s"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_quant_cuda.py 2>&1 | tail -15
echo "tests at ${SECONDS}s"
