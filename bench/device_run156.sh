#!/bin/bash
# Forty-ninth session: the wave check of the NVFP4 and FP8 caches' decode attention at batch 32-128
# (bench/gpu_kernels.md, forty-eighth session, Next item 3). 1) The NVFP4 Gluon kernel (4 warps at 168
# registers: three CTAs a multiprocessor): `_splits_gluon`'s choice against 1-4 splits and 2 / 8 warps a CTA
# (bench/attn_splits.py, WARPS), each output checked first. 2) The FP8 path (Triton, 128-token tiles x 3
# stages: 75776 B a CTA, three resident a multiprocessor): device_run155.sh's launch-settings sweep on the
# 8B's heads (its 30B half left out). Up to ~350 s.
export PYTHONUNBUFFERED=1
SECONDS=0
CASES="32:8:1024,32:8:4096,64:8:1024,64:8:4096,16:8:4096,64:4:2048,128:4:2048,128:8:1024" SPLITS=1,2,3,4 \
    WARPS=4,2,8 ROUNDS=3 timeout 170 python3 bench/attn_splits.py 2>&1 | grep "^b \|copy\|rror\|total"
mv -f attn_splits.json $OUT/attn156_nvfp4.json 2>/dev/null || mv -f $OUT/attn_splits.json $OUT/attn156_nvfp4.json
echo "nvfp4 at ${SECONDS}s"
V=default,sp1,sp2,bt64,bt32,s2,bt64-sp1
timeout 170 python3 bench/attention_bf16.py --kv fp8 --heads 32,8 --batch 8,32,64 --context 192,1024,4096 \
    --variants $V --rounds 5 --kernel-info --out $OUT/attn156_fp8_8b.json 2>&1 | grep "^|\|MISMATCH\|rror"
echo "fp8 at ${SECONDS}s"
