#!/bin/bash
# Device call 22 (sixth session): the wgmma configuration of the mma16 kernel for 17+ rows (NT 2, MG <= 16, row
# blocks in grid z; the split-2 serialization fixed): GPU tests of the kernel, then a sweep at 16-512 rows.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout ${T_T:-200} python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -x ${T_K:+-k "$T_K"} 2>&1 | grep -v "^$" | tail -15
timeout ${T_SWEEP:-300} python3 bench/mma16_sweep.py --rows ${ROWS:-16,32,64,128,256,512} \
  --variants ${VARIANTS:-auto,wide,wide+s1,wide+s2,wide+s4,wide+nt1,wide+d3} \
  --shapes ${SHAPES:-14336x4096,4096x14336,4096x4096,24576x4096} --out $OUT/sweep22.json 2>&1 | grep -v "^\[" | cut -c1-150
