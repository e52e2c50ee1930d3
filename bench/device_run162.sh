#!/bin/bash
# Fiftieth session, last call: every GPU-marked test of the suite on one card (CI has no GPU): failures, errors and
# the slowest tests. Up to ~540 s.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout ${T_T:-530} python3 -m pytest -q -p no:cacheprovider -m gpu tests/ -rfEs --durations=12 \
    > $OUT/gpu_suite.log 2>&1
echo "pytest exit $? at ${SECONDS}s"
grep -E "passed|failed|error|FAILED|ERROR|SKIPPED|s call|s setup" $OUT/gpu_suite.log | tail -40
