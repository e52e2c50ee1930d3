#!/bin/bash
# Forty-fourth session: 16x16 tiles on the CUDA C++ quantize kernel (quant.cu nvfp4_quant_tile16: a half-warp a
# tile, the tile's max and 4/6 error tree by xor shuffles 8/4/2/1). 1) bench/quant_tile16.py: CUDA C++ against
# Triton, 16x16 and 1x16, bytes compared. 2) The tests on CUDA (bytes against the reference in every rule and
# scale source, odd block columns, the IEEE 4/6 path, NaN / Inf, the tree-order tile; the Triton file's 16x16
# tests run with the CUDA kernels on and off).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
SECONDS=0
timeout 100 python3 bench/quant_tile16.py --out $OUT/quant_tile16_cuda.json 2>&1 | grep -v Warn
echo "quant_tile16 at ${SECONDS}s"
timeout 170 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_quant_cuda.py \
    tests/test_triton_quantize.py -k "tile16 or tree_order or by_program_shape" 2>&1 | tail -15
echo "tests at ${SECONDS}s"
