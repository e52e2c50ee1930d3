#!/bin/bash
# Eighth session: the final attention kernel (vote + the merge of sessions 3-7, 168-register cap) at 32K, and
# the split counts at short contexts and batch 1 (for the dispatcher's rule); GPU tests of the attention.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
ROUNDS=7 timeout 120 python3 bench/attn_s8.py 32768 default,tile_max,no_unpack,merge_one,no_stream 2>&1 | grep "^|\|context"
for t in 2048 4096 8192 16384; do
  ROUNDS=3 timeout 90 python3 bench/attn_s8.py $t default,splits2,splits3,splits4,splits8 2>&1 | grep "^| [ds]\|context"
done
BATCH=1 ROUNDS=3 timeout 90 python3 bench/attn_s8.py 32768 default,splits16,splits24,splits32,splits48 2>&1 \
  | grep "^| [ds]\|context"
BATCH=1 ROUNDS=3 timeout 90 python3 bench/attn_s8.py 4096 default,splits4,splits8,splits16 2>&1 | grep "^| [ds]\|context"
timeout 200 python3 -m pytest -q -m gpu tests/test_triton_attention.py 2>&1 | tail -2
