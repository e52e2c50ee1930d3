#!/bin/bash
# For the forty-second session (written in the forty-first, not yet run): 1) bench/graph_tail.py: does a small
# Triton node after a cuBLAS GEMM at the end of a graph cost tens of microseconds of replay (f541a46's routing
# record inside the 30B's graph cost 36 us)? 2) Qwen3-30B-A3B at batch 1 with the record after the graph
# (ebb4f8f) and the two-kernel sampling head (46ec4e3), BF16 / defaults / NVFP4 lm_head, each a fresh process
# (48 layers on an H200, 24 on an H100), as long as END allows. Between them, bench/quant_tile16.py (why the
# 16x16 4/6 quantize is ~100x slower than 16x16 rule 6).
export PYTHONUNBUFFERED=1
SECONDS=0
timeout 80 python3 bench/graph_tail.py --out $OUT/graph_tail.json 2>&1 | grep -v Warn
timeout 70 python3 bench/quant_tile16.py --out $OUT/quant_tile16.json 2>&1 | grep -v Warn
END=${END:-440} PREFIX=sampler132_30b bash bench/device_run128.sh --no-tests
