#!/bin/bash
# Thirty-first session. One kernel-to-kernel hand-off in a CUDA graph: plain, PDL (griddepcontrol.wait) and
# counters polled with ld.acquire (bench/handoff.py), 100-link chains at 132 and 264 CTAs, then 64 and 528.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 200 python3 bench/handoff.py --links 100 --ctas 132,264 --out $OUT/handoff95.json
echo "exit $?"
timeout 100 python3 bench/handoff.py --links 100 --ctas 64,528 --n 8192 --out $OUT/handoff95b.json
echo "exit $?"
