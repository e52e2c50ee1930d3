#!/bin/bash
# Forty-sixth session: the strip kernel's 16x16 4/6 with its codes from the decide pass, lean candidate scales
# and the exact path's rolled tree (spill-free at 128 registers). 1) The tile / strip GPU tests
# (tests/test_quant_cuda.py -k tile16). 2) bench/quant_tile16.py, 4/6 decided per tile on both kernels (mse,
# mae, imposed g) and 1x16 4/6, 32768x4096 and 8192x14336, interleaved repeats (medians of 3).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
SECONDS=0
timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_quant_cuda.py \
    -k "tile16" 2>&1 | tail -15
echo "tests at ${SECONDS}s"
cases="16x16 4/6 mse, decide46 per tile, strip|16x16 4/6 mae, decide46 per tile|1x16 4/6"
cases="$cases|16x16 4/6 mse, decide46 per tile, imposed|16x16 4/6 mse, decide46 per tile, 2 pairs a warp, staged"
for shape in "32768 4096" "8192 14336"; do
  set -- $shape
  timeout 150 python3 bench/quant_tile16.py --rows $1 --cols $2 --repeats 3 --cases "$cases" \
      --out $OUT/quant_tile16_strip46_${1}x${2}.json 2>&1 | grep -v Warn | grep "CUDA"
  echo "quant_tile16 ${1}x${2} at ${SECONDS}s"
done
