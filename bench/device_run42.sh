#!/bin/bash
# Ninth session: the Ray sampler pool on the GPU (CUDA actors at half a GPU each), if Ray is installed here.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc RAY_AUTH_MODE=disabled
python3 -c "import ray; print('ray', ray.__version__)" 2>&1 | tail -1 || exit 0
timeout 150 python3 -m pytest -q -m gpu tests/test_distributed_ray.py -rf 2>&1 | tail -4
