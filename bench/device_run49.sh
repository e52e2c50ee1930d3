#!/bin/bash
# Eleventh session, first call: the GPU runs the tenth session owed (bench/device_run48.sh without the 8B table,
# which moves to the session's last call). Runs on the committed tree: other work in progress is set aside first.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
git stash -u -q 2>/dev/null && echo "stashed work in progress"; git log --oneline | head -1
timeout 200 python3 -m pytest -q tests/test_sample_head.py tests/test_moe_route.py -rf 2>&1 | tail -3
timeout 90 python3 bench/sample_head_bench.py --batch 1,8,32 --out $OUT/sample_head49.json 2>&1 | tail -8
timeout 90 python3 bench/step_gap.py --shape qwen3-30b-a3b:12 --preset nvfp4-w4a16 --batch 1,8,32 \
  --out $OUT/step_gap49_nvfp4-w4a16.json 2>&1 | grep -v Warn | cut -c1-500
