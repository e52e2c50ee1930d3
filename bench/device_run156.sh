#!/bin/bash
# Forty-ninth session: the wave check of the FP8 and NVFP4 caches' decode attention at batch 32-128
# (bench/gpu_kernels.md, forty-eighth session, Next item 3). 1) The FP8 path (Triton, 128-token tiles x 3
# stages: 75776 B a CTA, three resident a multiprocessor): bench/device_run155.sh's launch-settings sweep. 2) The
# NVFP4 Gluon kernel (4 warps at 168 registers: three CTAs a multiprocessor): `_splits_gluon`'s choice against
# 1-4 splits and 2 / 8 warps a CTA (bench/attn_splits.py, WARPS), each output checked first. Up to ~450 s.
export PYTHONUNBUFFERED=1
SECONDS=0
CASES="32:8:1024,32:8:4096,64:8:1024,64:8:4096,16:8:4096,64:4:2048,128:4:2048,128:8:1024" SPLITS=1,2,3,4 \
    WARPS=4,2,8 ROUNDS=3 timeout 170 python3 bench/attn_splits.py 2>&1 | grep "^b \|copy\|rror\|total"
mv -f attn_splits.json $OUT/attn156_nvfp4.json 2>/dev/null || mv -f $OUT/attn_splits.json $OUT/attn156_nvfp4.json
echo "nvfp4 at ${SECONDS}s"
bash bench/device_run155.sh
echo "fp8 at ${SECONDS}s"
