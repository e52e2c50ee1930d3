#!/bin/bash
# Fiftieth session, last call: every GPU-marked test of the suite on one card (CI has no GPU): failures, errors and
# the slowest tests; then bench/attention_bf16.py's interleaved timing. Up to ~600 s (T_T: the suite's limit).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout ${T_T:-530} python3 -m pytest -q -p no:cacheprovider -m gpu tests/ -rfEs --durations=12 \
    > $OUT/gpu_suite.log 2>&1
echo "pytest exit $? at ${SECONDS}s"
grep -E "passed|failed|error|FAILED|ERROR|SKIPPED|s call|s setup" $OUT/gpu_suite.log | tail -40
# bench/attention_bf16.py's interleaved timing (the first variant timed ~1 us low at batch 1 before): default
# and the same split counts by hand should now agree
timeout 60 python3 bench/attention_bf16.py --kv fp8 --heads 32,8 --batch 1 --context 1024,4096 \
    --variants default,sp8,sp16,sp32 --rounds 7 --out $OUT/attn162_fp8.json 2>&1 | grep "^| [0-9]\|MISMATCH\|rror"
