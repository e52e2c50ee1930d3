#!/bin/bash
# Device call 11 (fourth session): the CUDA mma16 W4A16 kernel: GPU tests, then the sweep.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda, hasattr(torch.cuda, '_compile_kernel'))"
timeout ${T_TEST:-150} python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -x 2>&1 | tee $OUT/mma16_tests11.log | tail -40
timeout ${T_SWEEP:-330} python3 bench/mma16_sweep.py --gluon --rows ${ROWS:-1,8,16,32,64} \
    ${SWEEP_ARGS:-} --out $OUT/mma16_sweep11_h200.json 2>&1 | tee $OUT/mma16_sweep11.log
