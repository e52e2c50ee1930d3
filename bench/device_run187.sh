#!/bin/bash
# Fifty-seventh session, first: 1) the mma.sync WARPS 4 GPU bit test (never run on a GPU); 2) whether the wgmma
# build with the one-row split of K gives the one-row path's bits at 2-64 rows (bench/wgmma_bits.py), and its
# time against the mma.sync rule (auto) and the wgmma rule (wide). Up to ~200 s.
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 120 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -k four_warps -p no:cacheprovider > $OUT/test187.log 2>&1
echo "test exit $? at ${SECONDS}s"; tail -3 $OUT/test187.log
timeout 300 python3 bench/wgmma_bits.py --out $OUT/bits187.json > $OUT/bits187.log 2>&1
echo "bits exit $? at ${SECONDS}s"; grep -c ' us ' $OUT/bits187.log; grep FAILED $OUT/bits187.log | head -5
