#!/bin/bash
# Forty-fourth session, run at fd991c4 (TMODE 3 was reverted after this run: no faster). The 16x16 quantize's tile reductions by warp shuffles (TMODE 3: tile-major blocks, a
# tile's 16 rows in one warp's lanes, shfl.sync.bfly 16/8/4/2; 12 barriers in the sm_90 build against 57).
# 1) Its tests on CUDA: bytes against the reference in modes 1 / 2 / 3 (program shapes, the tree-order tile,
# large shapes on the dispatcher's choice), the probe's choice by dtype and alignment. 2) bench/quant_tile16.py:
# every mode timed in one process, bytes compared with mode 1's.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
SECONDS=0
timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_triton_quantize.py \
    -k "16x16 or tile16 or gpu_large or matches" 2>&1 | tail -15
echo "tests at ${SECONDS}s"
timeout 150 python3 bench/quant_tile16.py --out $OUT/quant_tile16.json 2>&1 | grep -v Warn
echo "quant_tile16 at ${SECONDS}s"
